//! Making CUDA visible, and saying clearly why it is not.
//!
//! libtorch registers its CUDA support from static initialisers in `libtorch_cuda.so`. A
//! binary linked with `--as-needed` never loads that library and then sees no GPU, while
//! everything else works. Three things guard against it: the link argument from build.rs,
//! a `#[used]` reference to a libtorch_cuda symbol (below), and [`load_libtorch_cuda`],
//! which `dlopen`s the library before the first CUDA query.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tch::Device;

use crate::error::{Error, Result};

/// Keeps `libtorch_cuda.so` among the binary's needed libraries under `--as-needed`:
/// taking a symbol's address makes the linker record the library. Never called.
#[cfg(accel_libtorch_cuda)]
mod keep_libtorch_cuda {
    unsafe extern "C" {
        // at::cuda::warp_size(), exported by libtorch_cuda.so.
        #[link_name = "_ZN2at4cuda9warp_sizeEv"]
        fn at_cuda_warp_size() -> i32;
    }
    #[used]
    static KEEP: unsafe extern "C" fn() -> i32 = at_cuda_warp_size;
}

/// What happened to `libtorch_cuda.so` in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LibtorchCuda {
    /// Loaded with the program (the normal case for binaries linked as accel's are).
    Linked(PathBuf),
    /// Not linked; accel loaded it with `dlopen`.
    LoadedNow(PathBuf),
    /// This libtorch has no CUDA support (a CPU-only build).
    NotShipped(PathBuf),
    /// It exists but could not be loaded.
    Failed {
        /// The library.
        path: PathBuf,
        /// `dlerror()`'s text.
        error: String,
    },
}

/// The directory of the libtorch this process runs on: where `libtorch_cpu.so` is mapped
/// from, else the one accel was built against.
pub fn libtorch_lib_dir() -> PathBuf {
    mapped_library("libtorch_cpu.so")
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from(env!("ACCEL_LIBTORCH_LIB")))
}

/// The path of a shared library mapped into this process, by file name.
pub fn mapped_library(file_name: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| Path::new(path).file_name().is_some_and(|n| n == file_name))
        .map(PathBuf::from)
}

/// Loads `libtorch_cuda.so` (once, `RTLD_GLOBAL`) unless it is already there. Call before
/// any CUDA query: libtorch caches the answer of the first one.
pub fn load_libtorch_cuda() -> &'static LibtorchCuda {
    static STATE: OnceLock<LibtorchCuda> = OnceLock::new();
    STATE.get_or_init(|| {
        if let Some(path) = mapped_library("libtorch_cuda.so") {
            return LibtorchCuda::Linked(path);
        }
        let path = libtorch_lib_dir().join("libtorch_cuda.so");
        if !path.exists() {
            return LibtorchCuda::NotShipped(path);
        }
        // SAFETY: loading a library runs its initialisers; libtorch_cuda's only register
        // CUDA with the libtorch already loaded. The handle is leaked on purpose: the
        // library must stay for the life of the process.
        match unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        } {
            Ok(lib) => {
                std::mem::forget(lib);
                LibtorchCuda::LoadedNow(path)
            }
            Err(e) => LibtorchCuda::Failed { path, error: e.to_string() },
        }
    })
}

/// What the NVIDIA driver reports, read through `libcuda.so.1` directly so that it works
/// even when libtorch sees no GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// CUDA driver API version, e.g. "13.0".
    pub version: String,
    /// One entry per visible device: name and total memory in bytes.
    pub devices: Vec<(String, u64)>,
    /// Compute capability (major, minor) of each device, in the order of `devices`.
    pub capabilities: Vec<(i32, i32)>,
}

/// Queries the NVIDIA driver; `Err` says why it could not be reached.
pub fn driver_info() -> std::result::Result<DriverInfo, String> {
    type Init = unsafe extern "C" fn(u32) -> c_int;
    type GetInt = unsafe extern "C" fn(*mut c_int) -> c_int;
    type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type DeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    type DeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
    type DeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
    // CUdevice_attribute values from cuda.h.
    const COMPUTE_CAPABILITY_MAJOR: c_int = 75;
    const COMPUTE_CAPABILITY_MINOR: c_int = 76;

    // SAFETY: libcuda's initialisers have no preconditions.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }
        .map_err(|e| format!("the NVIDIA driver library libcuda.so.1 cannot be loaded ({e})"))?;
    // SAFETY: the symbol types are the driver API's documented C signatures; every
    // out-pointer is a local that outlives the call.
    unsafe {
        let sym = |name: &[u8]| -> std::result::Result<*const c_void, String> {
            lib.get::<*const c_void>(name)
                .map(|s| *s)
                .map_err(|e| format!("libcuda.so.1 lacks {}: {e}", String::from_utf8_lossy(name)))
        };
        let init: Init = std::mem::transmute(sym(b"cuInit\0")?);
        let driver_version: GetInt = std::mem::transmute(sym(b"cuDriverGetVersion\0")?);
        let device_count: GetInt = std::mem::transmute(sym(b"cuDeviceGetCount\0")?);
        let device_get: DeviceGet = std::mem::transmute(sym(b"cuDeviceGet\0")?);
        let device_name: DeviceGetName = std::mem::transmute(sym(b"cuDeviceGetName\0")?);
        let total_mem: DeviceTotalMem = std::mem::transmute(sym(b"cuDeviceTotalMem_v2\0")?);
        let attribute: DeviceGetAttribute = std::mem::transmute(sym(b"cuDeviceGetAttribute\0")?);

        let mut version = 0;
        driver_version(&mut version);
        let version = format!("{}.{}", version / 1000, (version % 1000) / 10);
        let status = init(0);
        if status != 0 {
            return Err(format!("driver {version} present, cuInit failed with CUresult {status}"));
        }
        let mut count = 0;
        device_count(&mut count);
        let mut devices = Vec::new();
        let mut capabilities = Vec::new();
        for i in 0..count {
            let mut device = 0;
            device_get(&mut device, i);
            let mut name = [0 as c_char; 256];
            device_name(name.as_mut_ptr(), name.len() as c_int, device);
            let mut bytes = 0usize;
            total_mem(&mut bytes, device);
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            devices.push((name, bytes as u64));
            let (mut major, mut minor) = (0, 0);
            attribute(&mut major, COMPUTE_CAPABILITY_MAJOR, device);
            attribute(&mut minor, COMPUTE_CAPABILITY_MINOR, device);
            capabilities.push((major, minor));
        }
        Ok(DriverInfo { version, devices, capabilities })
    }
}

/// The NCCL library torch ships with, and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclInfo {
    /// Where it was found.
    pub path: PathBuf,
    /// `ncclGetVersion`, e.g. "2.28.9".
    pub version: String,
}

/// Where NCCL is looked for: `NCCL_LIBRARY`, else the copy in the torch wheel
/// (`site-packages/nvidia/nccl/lib/libnccl.so.2`, beside `torch/lib`).
pub fn nccl_library_path() -> PathBuf {
    if let Some(path) = std::env::var_os("NCCL_LIBRARY") {
        return PathBuf::from(path);
    }
    mapped_library("libnccl.so.2")
        .unwrap_or_else(|| libtorch_lib_dir().join("../../nvidia/nccl/lib/libnccl.so.2"))
}

/// Loads NCCL (see [`nccl_library_path`]) and asks its version.
pub fn nccl_info() -> std::result::Result<NcclInfo, String> {
    let path = nccl_library_path();
    if !path.exists() {
        return Err(format!(
            "{} does not exist (set NCCL_LIBRARY to a libnccl.so.2)",
            path.display()
        ));
    }
    let path = path.canonicalize().unwrap_or(path);
    // SAFETY: NCCL's initialisers have no preconditions.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    // SAFETY: `ncclResult_t ncclGetVersion(int*)`; the out-pointer is a local.
    let code = unsafe {
        let get_version = lib
            .get::<unsafe extern "C" fn(*mut c_int) -> c_int>(b"ncclGetVersion\0")
            .map_err(|e| format!("{} lacks ncclGetVersion: {e}", path.display()))?;
        let mut code = 0;
        let status = get_version(&mut code);
        if status != 0 {
            return Err(format!("ncclGetVersion failed with ncclResult_t {status}"));
        }
        code
    };
    // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
    let version = format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100);
    Ok(NcclInfo { path, version })
}

/// Whether a driver of CUDA API version `version` ("12.8") predates the CUDA 13 that the
/// torch 2.11.0 wheel is built for.
fn driver_too_old(version: &str) -> bool {
    version.split('.').next().and_then(|major| major.parse::<u32>().ok()).is_some_and(|m| m < 13)
}

/// Returns `device` if this process can use it; for a CUDA device that it cannot, an error
/// that names the first missing link (libtorch build, driver, device count) and the way out.
pub fn check_device(device: Device) -> Result<Device> {
    let Device::Cuda(index) = device else { return Ok(device) };
    let unavailable = |diagnosis: String| Error::CudaUnavailable {
        requested: format!("device cuda:{index}"),
        diagnosis,
    };
    match load_libtorch_cuda() {
        LibtorchCuda::NotShipped(path) => {
            return Err(unavailable(format!(
                "this libtorch is CPU-only ({} does not exist); install the CUDA build of \
                 torch==2.11.0 and point LIBTORCH at it",
                path.display()
            )));
        }
        LibtorchCuda::Failed { path, error } => {
            return Err(unavailable(format!(
                "{} could not be loaded: {error}; check that the nvidia-* libraries of the torch \
                 wheel are installed beside it",
                path.display()
            )));
        }
        LibtorchCuda::Linked(_) | LibtorchCuda::LoadedNow(_) => {}
    }
    if !tch::Cuda::is_available() {
        let diagnosis = match driver_info() {
            Err(why) => format!("{why}; is this a machine with an NVIDIA GPU and driver?"),
            Ok(info) if info.devices.is_empty() => format!(
                "driver {} sees no GPU (CUDA_VISIBLE_DEVICES={:?})",
                info.version,
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
            ),
            Ok(info) if driver_too_old(&info.version) => format!(
                "the NVIDIA driver supports CUDA up to {} and sees {} GPU(s), but torch 2.11.0's \
                 CUDA 13 wheel needs a driver for CUDA 13.0 or newer (NVIDIA driver 580 or \
                 newer): update the driver, or install the CPU-only wheel of torch==2.11.0 \
                 (docs/installation.md)",
                info.version,
                info.devices.len()
            ),
            Ok(info) => format!(
                "driver {} sees {} GPU(s) but libtorch does not (CUDA_VISIBLE_DEVICES={:?}); \
                 `accel env` shows what each library found",
                info.version,
                info.devices.len(),
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
            ),
        };
        return Err(unavailable(diagnosis));
    }
    let count = tch::Cuda::device_count();
    if index >= count as usize {
        return Err(unavailable(format!(
            "only {count} CUDA device(s) are visible (cuda:0..cuda:{})",
            count - 1
        )));
    }
    Ok(device)
}

#[cfg(test)]
mod tests {
    /// The driver's CUDA version decides the message: below 13 it names the driver to get.
    #[test]
    fn drivers_before_cuda_13_are_too_old_for_the_wheel() {
        for (version, old) in [("12.8", true), ("11.4", true), ("13.0", false), ("13.1", false)] {
            assert_eq!(super::driver_too_old(version), old, "{version}");
        }
        assert!(!super::driver_too_old("unknown"), "an unreadable version is not blamed");
    }
}
