//! rpath and --no-as-needed for this crate's test binaries; see accel-core/build.rs.
fn main() {
    println!("cargo::rustc-link-arg={}", std::env::var("DEP_ACCEL_LINK_ARG").unwrap());
}
