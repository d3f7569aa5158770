//! `#[accelerate]` compile errors (`fail/<topic>/*.rs`, each with the `.stderr` it must
//! produce) and programs that must compile and run (`pass/*.rs`). After an intended change
//! of messages: `TRYBUILD=overwrite cargo test -p accel-ui-tests`, then review the diff.

#[test]
fn ui() {
    // The pass cases run; their binaries find libtorch through the library path.
    let lib = accel_core::cuda::libtorch_lib_dir();
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => format!("{}:{}", lib.display(), old.to_string_lossy()),
        None => lib.display().to_string(),
    };
    // SAFETY: set before any thread of this test starts; trybuild's children inherit it.
    unsafe { std::env::set_var("LD_LIBRARY_PATH", path) };
    let t = trybuild::TestCases::new();
    t.compile_fail("fail/*/*.rs");
    t.pass("pass/*.rs");
}
