//! Moving whole batches to a device: [`ToDevice`] for tensors and the containers users put
//! them in; `#[derive(ToDevice)]` for their own structs.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

use tch::{Device, Tensor};

/// Something that can be placed on a device, tensor by tensor.
pub trait ToDevice: Sized {
    /// `self`, with every tensor on `device` (tensors already there are not copied).
    fn to_device(self, device: Device) -> Self;
}

impl ToDevice for Tensor {
    fn to_device(self, device: Device) -> Self {
        if self.device() == device { self } else { Tensor::to_device(&self, device) }
    }
}

impl<T: ToDevice> ToDevice for Vec<T> {
    fn to_device(self, device: Device) -> Self {
        self.into_iter().map(|t| t.to_device(device)).collect()
    }
}

impl<T: ToDevice> ToDevice for Option<T> {
    fn to_device(self, device: Device) -> Self {
        self.map(|t| t.to_device(device))
    }
}

impl<T: ToDevice, const N: usize> ToDevice for [T; N] {
    fn to_device(self, device: Device) -> Self {
        self.map(|t| t.to_device(device))
    }
}

impl<K: Eq + Hash, V: ToDevice> ToDevice for HashMap<K, V> {
    fn to_device(self, device: Device) -> Self {
        self.into_iter().map(|(k, v)| (k, v.to_device(device))).collect()
    }
}

impl<K: Ord, V: ToDevice> ToDevice for BTreeMap<K, V> {
    fn to_device(self, device: Device) -> Self {
        self.into_iter().map(|(k, v)| (k, v.to_device(device))).collect()
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
passthrough!((), bool, i32, i64, u32, u64, usize, f32, f64, String);

macro_rules! tuple_to_device {
    ($($t:ident $i:tt),+) => {
        impl<$($t: ToDevice),+> ToDevice for ($($t,)+) {
            fn to_device(self, device: Device) -> Self {
                ($(self.$i.to_device(device),)+)
            }
        }
    };
}
tuple_to_device!(A 0);
tuple_to_device!(A 0, B 1);
tuple_to_device!(A 0, B 1, C 2);
tuple_to_device!(A 0, B 1, C 2, D 3);
tuple_to_device!(A 0, B 1, C 2, D 3, E 4);
