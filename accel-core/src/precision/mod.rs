//! Mixed precision: autocast regions, fp32 outputs, and fp16 loss scaling.

pub mod fp8;
mod scaler;

use tch::{Device, Kind, Tensor};

use crate::config::Precision;
use crate::error::{Error, Result};
use crate::shim::{AutocastGuard, autocast};

pub use fp8::Float8Linear;
pub use scaler::{GradScaler, ScalerConfig, ScalerState};

/// The autocast dtype of a precision mode (`None` for fp32).
pub fn autocast_kind(precision: Precision) -> Option<Kind> {
    match precision {
        Precision::No => None,
        Precision::Fp16 => Some(Kind::Half),
        // fp8 runs everything but its fp8 matmuls under bf16, as Accelerate does.
        Precision::Bf16 | Precision::Fp8 => Some(Kind::BFloat16),
    }
}

/// Checks that `precision` can run on `device`: fp8 matmuls need compute capability 8.9
/// (Ada, Hopper and later) on a GPU; on CPU they run through libtorch's reference kernels,
/// exact but slow.
pub fn check_precision(precision: Precision, device: Device) -> Result<()> {
    if precision != Precision::Fp8 {
        return Ok(());
    }
    let Device::Cuda(index) = device else { return Ok(()) };
    let capability =
        crate::cuda::driver_info().ok().and_then(|d| d.capabilities.get(index).copied());
    match capability {
        Some(c) if c >= (8, 9) => Ok(()),
        Some((major, minor)) => Err(Error::Unsupported(format!(
            "precision fp8 needs fp8 tensor cores (compute capability 8.9 or later: Ada, \
             Hopper, Blackwell); cuda:{index} has {major}.{minor}. Use precision bf16"
        ))),
        None => Err(Error::Unsupported(format!(
            "precision fp8: the compute capability of cuda:{index} could not be read from the \
             NVIDIA driver; fp8 needs 8.9 or later. Use precision bf16"
        ))),
    }
}

/// Enters autocast for `precision` on `device`; `None` when there is nothing to do.
pub fn enter(precision: Precision, device: Device) -> Result<Option<AutocastGuard>> {
    autocast_kind(precision).map(|kind| autocast(device, kind, true)).transpose()
}

/// Switches autocast off for `device`'s type until the guard drops (a backward pass or an
/// optimizer step inside a training step's autocast region); `None` when it is off already.
pub fn suspend(device: Device) -> Result<Option<AutocastGuard>> {
    match crate::shim::autocast_state(device)? {
        Some(kind) => Ok(Some(autocast(device, kind, false)?)),
        None => Ok(None),
    }
}

/// Model outputs cast back to fp32 after an autocast region (Accelerate's
/// `convert_outputs_to_fp32`), for tensors and the usual containers of them.
pub trait ToFp32 {
    /// Half and bfloat16 tensors become fp32; everything else is unchanged.
    fn to_fp32(self) -> Self;
}

impl ToFp32 for Tensor {
    fn to_fp32(self) -> Self {
        match self.kind() {
            Kind::Half | Kind::BFloat16 => self.to_kind(Kind::Float),
            _ => self,
        }
    }
}

impl<T: ToFp32> ToFp32 for Vec<T> {
    fn to_fp32(self) -> Self {
        self.into_iter().map(ToFp32::to_fp32).collect()
    }
}

impl<T: ToFp32> ToFp32 for Option<T> {
    fn to_fp32(self) -> Self {
        self.map(ToFp32::to_fp32)
    }
}

macro_rules! tuple_to_fp32 {
    ($($t:ident $i:tt),+) => {
        impl<$($t: ToFp32),+> ToFp32 for ($($t,)+) {
            fn to_fp32(self) -> Self {
                ($(self.$i.to_fp32(),)+)
            }
        }
    };
}
tuple_to_fp32!(A 0);
tuple_to_fp32!(A 0, B 1);
tuple_to_fp32!(A 0, B 1, C 2);
tuple_to_fp32!(A 0, B 1, C 2, D 3);
