//! Builds the libtorch shim (csrc/) and makes every binary that links libtorch see GPUs.
//!
//! With the linker's default `--as-needed`, `libtorch_cuda.so` (reached only through
//! static initialisers) is dropped and CUDA is invisible at run time. So the binaries,
//! tests and examples get `-Wl,--no-as-needed,-ltorch` plus an rpath to libtorch's lib
//! dir. A build script can only pass link arguments to its own package, so the same
//! argument is exported to dependents as `DEP_ACCEL_LINK_ARG`; a user's crate forwards it
//! with a one-line build script (see the README).

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(accel_libtorch_cuda)");
    println!("cargo::rerun-if-changed=csrc/shim.cpp");
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys exports DEP_TCH_LIBTORCH_LIB; is torch-sys a direct dependency?"),
    );
    if !lib.join("libtorch.so").exists() {
        panic!(
            "no libtorch.so in {}: run `cargo xtask setup` (installs torch 2.11.0 into .venv), \
             or set LIBTORCH to a libtorch 2.11.0",
            lib.display()
        );
    }
    let include = lib.join("../include");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/shim.cpp")
        .compile("accel_shim");

    let link_arg = format!("-Wl,--no-as-needed,-ltorch,-rpath,{}", lib.display());
    println!("cargo::rustc-link-arg={link_arg}");
    println!("cargo::metadata=link_arg={link_arg}");
    println!("cargo::metadata=libtorch_lib={}", lib.display());
    println!("cargo::rustc-env=ACCEL_LIBTORCH_LIB={}", lib.display());
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo::rustc-cfg=accel_libtorch_cuda");
    }
}
