//! trybuild cases of `#[accelerate]`: see tests/ui.rs.
