//! Autocast with a chosen dtype on CPU or CUDA (`tch::autocast` is CUDA- and fp16-only).

use std::marker::PhantomData;

use tch::{Device, Kind};

use super::{check, device_type_code, ffi, kind_from_scalar_type_code, scalar_type_code};
use crate::error::Result;

/// While alive, eligible ops on this thread's `device` type run in the guard's dtype
/// (matmuls and convolutions in bf16/fp16, reductions and losses in fp32 — libtorch's
/// autocast lists). Dropping it restores the previous state, so guards nest.
///
/// Autocast state is per thread, so the guard is neither `Send` nor `Sync`.
#[derive(Debug)]
#[must_use = "autocast ends when the guard is dropped"]
pub struct AutocastGuard {
    device_type: i32,
    prev_enabled: bool,
    prev_dtype: i32,
    _per_thread: PhantomData<*const ()>,
}

/// Enters autocast for `device`'s type (CPU or CUDA) with `dtype` (`BFloat16` or `Half`).
/// With `enabled == false` the guard switches autocast off inside its scope.
pub fn autocast(device: Device, dtype: Kind, enabled: bool) -> Result<AutocastGuard> {
    let device_type = device_type_code(device)?;
    let dtype = scalar_type_code(dtype)?;
    let (mut prev_enabled, mut prev_dtype) = (false, 0);
    // SAFETY: out-pointers to locals; the shim catches every C++ exception.
    let message = unsafe {
        ffi::accel_autocast_enter(device_type, dtype, enabled, &mut prev_enabled, &mut prev_dtype)
    };
    check(message, "autocast")?;
    Ok(AutocastGuard { device_type, prev_enabled, prev_dtype, _per_thread: PhantomData })
}

/// The autocast dtype in force on this thread for `device`'s type, or `None` when off.
pub fn autocast_state(device: Device) -> Result<Option<Kind>> {
    let device_type = device_type_code(device)?;
    let (mut enabled, mut dtype) = (false, 0);
    // SAFETY: out-pointers to locals.
    let message = unsafe { ffi::accel_autocast_state(device_type, &mut enabled, &mut dtype) };
    check(message, "autocast_state")?;
    Ok(if enabled { kind_from_scalar_type_code(dtype) } else { None })
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // SAFETY: restores the state saved by `accel_autocast_enter` on this same thread.
        let message = unsafe {
            ffi::accel_autocast_exit(self.device_type, self.prev_enabled, self.prev_dtype)
        };
        // Only plain setters run here; a failure would mean a broken libtorch, and a
        // panic in drop could abort, so report it instead.
        if let Err(e) = check(message, "autocast exit") {
            eprintln!("accel: {e}");
        }
    }
}
