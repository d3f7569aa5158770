//! Moving whole batches to a device: [`ToDevice`] for tensors and the containers users put
//! them in; `#[derive(ToDevice)]` for their own structs.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

use tch::{Device, Tensor};

/// Something that can be placed on a device, tensor by tensor.
///
/// A borrowed batch (`&Tensor`, `&(Tensor, Tensor)`, from `batches.iter()`) is handed out
/// as it is: a borrow cannot be moved, so it stays where the program put it, as it would on
/// one device.
#[diagnostic::on_unimplemented(
    message = "#[accelerate] deals this loop's batches and moves each to the process's device, \
               but it does not know how to move a `{Self}`",
    label = "the items of this loop are `{Self}`",
    note = "derive it on your batch type: `#[derive(accel_core::ToDevice)]` (fields that hold no \
            tensor: `#[to_device(skip)]`); tensors, tuples, Vec, Option, arrays, maps and \
            borrowed values are handled already"
)]
pub trait ToDevice: Sized {
    /// `self`, with every tensor on `device` (tensors already there are not copied). A
    /// tensor in pinned host memory goes to a CUDA device with an asynchronous copy, queued
    /// on the current (compute) stream like the kernels that read it (torch's
    /// `non_blocking=True`): a program refilling its own pinned buffer in place must wait for
    /// the stream first.
    fn to_device(self, device: Device) -> Self;

    /// `self`, with every CPU tensor in page-locked (pinned) host memory when `device` is a
    /// CUDA device, so that [`to_device`](Self::to_device) can copy it asynchronously
    /// (torch's `pin_memory`). The data loader's workers call it on each batch they build.
    /// Anything else, and a tensor that cannot be pinned, is kept as it is: pinning only
    /// speeds the copy up.
    fn pin_memory(self, device: Device) -> Self {
        let _ = device;
        self
    }
}

impl ToDevice for Tensor {
    fn to_device(self, device: Device) -> Self {
        if self.device() == device {
            self
        } else if self.device() == Device::Cpu
            && device.is_cuda()
            && crate::shim::is_pinned(&self).unwrap_or(false)
        {
            // The caching host allocator records the copy's stream, so the pinned block is
            // not reused before the copy has read it.
            self.to_device_(device, self.kind(), true, false)
        } else {
            Tensor::to_device(&self, device)
        }
    }

    fn pin_memory(self, device: Device) -> Self {
        if self.device() != Device::Cpu || !device.is_cuda() {
            return self;
        }
        match crate::shim::pin_memory(&self) {
            Ok(pinned) => pinned,
            Err(e) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!(
                        "accel: batches stay in pageable memory, so their copies to {device:?} \
                         wait for the host ({e}); set LoaderOptions::pin_memory = false to \
                         silence this"
                    )
                });
                self
            }
        }
    }
}

impl<T: ToDevice> ToDevice for Vec<T> {
    fn to_device(self, device: Device) -> Self {
        self.into_iter().map(|t| t.to_device(device)).collect()
    }
    fn pin_memory(self, device: Device) -> Self {
        self.into_iter().map(|t| t.pin_memory(device)).collect()
    }
}

impl<T: ToDevice> ToDevice for Option<T> {
    fn to_device(self, device: Device) -> Self {
        self.map(|t| t.to_device(device))
    }
    fn pin_memory(self, device: Device) -> Self {
        self.map(|t| t.pin_memory(device))
    }
}

impl<K: Eq + Hash, V: ToDevice> ToDevice for HashMap<K, V> {
    fn to_device(self, device: Device) -> Self {
        self.into_iter().map(|(k, v)| (k, v.to_device(device))).collect()
    }
    fn pin_memory(self, device: Device) -> Self {
        self.into_iter().map(|(k, v)| (k, v.pin_memory(device))).collect()
    }
}

impl<K: Ord, V: ToDevice> ToDevice for BTreeMap<K, V> {
    fn to_device(self, device: Device) -> Self {
        self.into_iter().map(|(k, v)| (k, v.to_device(device))).collect()
    }
    fn pin_memory(self, device: Device) -> Self {
        self.into_iter().map(|(k, v)| (k, v.pin_memory(device))).collect()
    }
}

impl<T: ToDevice, const N: usize> ToDevice for [T; N] {
    fn to_device(self, device: Device) -> Self {
        self.map(|t| t.to_device(device))
    }
    fn pin_memory(self, device: Device) -> Self {
        self.map(|t| t.pin_memory(device))
    }
}

/// Values that carry no tensor pass through unchanged.
macro_rules! passthrough {
    ($($t:ty),*) => {$(
        impl ToDevice for $t {
            fn to_device(self, _device: Device) -> Self { self }
        }
    )*};
}
passthrough!((), bool, i8, i16, i32, i64, isize, u8, u16, u32, u64, usize, f32, f64, char, String);

impl<T: ?Sized> ToDevice for &T {
    fn to_device(self, _device: Device) -> Self {
        self
    }
}

impl<T: ?Sized> ToDevice for &mut T {
    fn to_device(self, _device: Device) -> Self {
        self
    }
}

macro_rules! tuple_to_device {
    ($($t:ident $i:tt),+) => {
        impl<$($t: ToDevice),+> ToDevice for ($($t,)+) {
            fn to_device(self, device: Device) -> Self {
                ($(self.$i.to_device(device),)+)
            }
            fn pin_memory(self, device: Device) -> Self {
                ($(self.$i.pin_memory(device),)+)
            }
        }
    };
}
tuple_to_device!(A 0);
tuple_to_device!(A 0, B 1);
tuple_to_device!(A 0, B 1, C 2);
tuple_to_device!(A 0, B 1, C 2, D 3);
tuple_to_device!(A 0, B 1, C 2, D 3, E 4);

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, accel_core::ToDevice)]
    struct Batch<T> {
        x: Tensor,
        pair: (Tensor, Option<Tensor>),
        #[to_device(skip)]
        ids: Vec<&'static str>,
        extra: T,
    }

    #[derive(accel_core::ToDevice)]
    enum Input {
        Image(Tensor),
        Text { tokens: Tensor },
        Empty,
    }

    #[test]
    fn derived_and_built_in_impls_reach_every_tensor() {
        let t = || Tensor::ones([2], (tch::Kind::Float, Device::Cpu));
        let batch = Batch { x: t(), pair: (t(), Some(t())), ids: vec!["a"], extra: vec![t()] };
        let moved = batch.to_device(Device::Cpu);
        assert_eq!(moved.ids, ["a"]);
        assert_eq!(moved.extra.len(), 1);
        let map: BTreeMap<&str, Tensor> = [("k", t())].into_iter().collect();
        assert_eq!(map.to_device(Device::Cpu)["k"].size(), [2]);
        assert!(matches!(Input::Text { tokens: t() }.to_device(Device::Cpu), Input::Text { .. }));
        assert!(matches!(Input::Image(t()).to_device(Device::Cpu), Input::Image(_)));
        assert!(matches!(Input::Empty.to_device(Device::Cpu), Input::Empty));
    }
}
