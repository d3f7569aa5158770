//! `#[derive(ToDevice)]`.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use syn::{Data, DeriveInput, Fields, parse_quote};

pub(crate) fn expand(input: TokenStream) -> syn::Result<TokenStream> {
    let mut input: DeriveInput = syn::parse2(input)?;
    let name = &input.ident;
    for param in input.generics.type_params_mut() {
        param.bounds.push(parse_quote!(::accel_core::ToDevice));
    }
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let to_device = body(&input, &format_ident!("to_device"))?;
    let pin_memory = body(&input, &format_ident!("pin_memory"))?;
    Ok(quote! {
        impl #impl_generics ::accel_core::ToDevice for #name #ty_generics #where_clause {
            fn to_device(self, device: ::accel_core::__private::Device) -> Self {
                #to_device
            }
            fn pin_memory(self, device: ::accel_core::__private::Device) -> Self {
                #pin_memory
            }
        }
    })
}

/// The body of `method` (`to_device` or `pin_memory`): every field not skipped goes through
/// it.
fn body(input: &DeriveInput, method: &syn::Ident) -> syn::Result<TokenStream> {
    let name = &input.ident;
    Ok(match &input.data {
        Data::Struct(data) => {
            let (pattern, rebuilt) = fields(quote!(#name), &data.fields, method)?;
            quote! { let #pattern = self; #rebuilt }
        }
        Data::Enum(data) => {
            let arms = data
                .variants
                .iter()
                .map(|v| {
                    let ident = &v.ident;
                    let (pattern, rebuilt) = fields(quote!(#name::#ident), &v.fields, method)?;
                    Ok(quote! { #pattern => #rebuilt, })
                })
                .collect::<syn::Result<Vec<_>>>()?;
            quote! { match self { #(#arms)* } }
        }
        Data::Union(u) => {
            return Err(syn::Error::new(
                u.union_token.span,
                "ToDevice cannot be derived for a union: its fields cannot be moved one by one",
            ));
        }
    })
}

/// A destructuring pattern for `fields` and the expression that rebuilds them, each passed
/// through `method`.
fn fields(
    path: TokenStream,
    fields: &Fields,
    method: &syn::Ident,
) -> syn::Result<(TokenStream, TokenStream)> {
    let mut bindings = Vec::new();
    let mut moved = Vec::new();
    for (i, field) in fields.iter().enumerate() {
        let binding = format_ident!("__accel_field_{}", i);
        let skip = skipped(field)?;
        moved.push(if skip {
            quote!(#binding)
        } else {
            quote!(::accel_core::ToDevice::#method(#binding, device))
        });
        bindings.push((field.ident.clone(), binding));
    }
    Ok(match fields {
        Fields::Named(_) => {
            let names: Vec<_> = bindings.iter().map(|(n, _)| n.clone()).collect();
            let vars: Vec<_> = bindings.iter().map(|(_, b)| b).collect();
            (quote!(#path { #(#names: #vars),* }), quote!(#path { #(#names: #moved),* }))
        }
        Fields::Unnamed(_) => {
            let vars: Vec<_> = bindings.iter().map(|(_, b)| b).collect();
            (quote!(#path(#(#vars),*)), quote!(#path(#(#moved),*)))
        }
        Fields::Unit => (path.clone(), path),
    })
}

fn skipped(field: &syn::Field) -> syn::Result<bool> {
    let mut skip = false;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("to_device")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                skip = true;
                Ok(())
            } else {
                Err(meta.error("unknown to_device option; the only option is `skip`"))
            }
        })?;
    }
    Ok(skip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_fields_move_and_skipped_ones_stay() {
        let out = expand(quote! {
            struct Batch<T> { x: Tensor, #[to_device(skip)] ids: Vec<String>, extra: T }
        })
        .unwrap()
        .to_string();
        assert!(out.contains("T : :: accel_core :: ToDevice"), "{out}");
        assert!(out.contains("ids : __accel_field_1"), "{out}");
        assert!(
            out.contains("x : :: accel_core :: ToDevice :: to_device (__accel_field_0 , device)"),
            "{out}"
        );
    }

    #[test]
    fn unknown_options_and_unions_are_errors() {
        let err = expand(quote! { struct S { #[to_device(skp)] a: Tensor } }).unwrap_err();
        assert!(err.to_string().contains("the only option is `skip`"));
        let err = expand(quote! { union U { a: u32 } }).unwrap_err();
        assert!(err.to_string().contains("union"));
    }
}
