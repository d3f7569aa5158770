//! Procedural macros of accel: the `#[accelerate(...)]` attribute (issue #7) and
//! `#[derive(ToDevice)]` arrive here. Use them through `accel-core`, which re-exports them.
