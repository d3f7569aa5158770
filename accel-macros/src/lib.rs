//! Procedural macros of accel, used through `accel-core` (which re-exports them):
//! `#[derive(ToDevice)]` now; the `#[accelerate(...)]` attribute is being built.
//!
//! Each macro is a thin entry that forwards to an `expand` function over
//! `proc_macro2::TokenStream`, so the logic can be unit-tested.

mod to_device;

use proc_macro::TokenStream;

/// Implements `accel_core::ToDevice` for a struct or enum by moving every field to the
/// device. Fields marked `#[to_device(skip)]` are kept as they are (for fields that hold
/// no tensor and do not implement `ToDevice`). Type parameters get a `ToDevice` bound.
///
/// ```text
/// #[derive(ToDevice)]
/// struct Batch { images: Tensor, labels: Tensor, #[to_device(skip)] ids: Vec<String> }
/// ```
#[proc_macro_derive(ToDevice, attributes(to_device))]
pub fn derive_to_device(input: TokenStream) -> TokenStream {
    to_device::expand(input.into()).unwrap_or_else(syn::Error::into_compile_error).into()
}
