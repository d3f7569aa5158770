//! Mixed precision: autocast regions, fp32 outputs, and fp16 loss scaling.

mod scaler;

use tch::{Device, Kind, Tensor};

use crate::config::Precision;
use crate::error::{Error, Result};
use crate::shim::{AutocastGuard, autocast};

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

/// Checks that `precision` can run on `device`; fp8 needs hardware accel does not drive yet.
pub fn check_precision(precision: Precision, device: Device) -> Result<()> {
    if precision == Precision::Fp8 {
        let where_ = match device {
            Device::Cpu => "this run is on CPU".to_owned(),
            other => format!("this run is on {other:?}, and accel has no fp8 kernels yet"),
        };
        return Err(Error::Unsupported(format!(
            "precision fp8 needs an NVIDIA GPU with fp8 tensor cores (Ada or Hopper, compute \
             capability 8.9+); {where_}. Use precision bf16"
        )));
    }
    Ok(())
}

/// Enters autocast for `precision` on `device`; `None` when there is nothing to do.
pub fn enter(precision: Precision, device: Device) -> Result<Option<AutocastGuard>> {
    autocast_kind(precision).map(|kind| autocast(device, kind, true)).transpose()
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
