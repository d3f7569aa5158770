//! `#[accelerate(...)]`: parse (attr.rs) → check (check.rs, and lint.rs for collectives
//! that only some processes would reach) → read the body (body.rs: which values are
//! optimizers and where they are made) → expand (expand.rs).
//!
//! On any error the user's function is still emitted unchanged, followed by every error
//! as `compile_error!`, so that editors keep working inside the body.

mod attr;
mod body;
mod check;
mod expand;
mod index;
mod lint;
mod loops;
mod summon;

use proc_macro2::TokenStream;
use quote::{ToTokens, quote};
use syn::parse_quote;

/// The attribute on `item`, with arguments `args`.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors: Vec<syn::Error> = Vec::new();
    let (raw, parse_error) = attr::parse(args);
    errors.extend(parse_error);
    errors.extend(check::args(&raw));

    let function = match syn::parse2::<syn::ItemFn>(item.clone()) {
        Ok(f) => f,
        Err(_) => {
            let what = describe_item(&item);
            let message = format!(
                "#[accelerate] goes on a training function with a body (`fn train(..) {{ .. }}`); \
                 this is {what}"
            );
            errors.push(syn::Error::new_spanned(first_token(&item), message));
            return with_errors(item, errors);
        }
    };
    let (returns, shape_errors) = check::function(&function);
    errors.extend(shape_errors);
    // Emitted as written on error, but without `const`/`async`, which would bury our
    // message under errors about the body.
    let item = {
        let mut plain = function.clone();
        plain.sig.constness = None;
        plain.sig.asyncness = None;
        plain.into_token_stream()
    };

    let accelerator = raw
        .name
        .clone()
        .unwrap_or_else(|| syn::Ident::new("accelerator", proc_macro2::Span::call_site()));
    let lent = body::lent_optimizers(&function, &accelerator);
    if let (false, Some((opt, calls))) = (has_any_backward(&function), lent.iter().next()) {
        let (span, what) = &calls[0];
        errors.push(syn::Error::new(
            *span,
            format!(
                "the training step runs in {what}, which is given the optimizer `{opt}` and which \
                 #[accelerate] cannot see into: its backward pass and optimizer step would not be \
                 the accelerator's (no gradients averaged across processes, no autocast, no \
                 accumulation). Write the loop's `loss.backward()` and `{opt}.step()` in this \
                 function (the helper may still compute the loss), or put #[accelerate] on the \
                 function that runs the loop"
            ),
        ));
    } else if !has_any_backward(&function) {
        errors.push(syn::Error::new(
            check::name_span(&function),
            "#[accelerate] found no `loss.backward()` (or `opt.backward_step(&loss)`) in this \
             function: it rewrites the loop that computes a loss and calls `.backward()` on it \
             (wrapping the loop's data, running its forward pass under autocast and syncing \
             gradients), so the training loop must be written in the function itself",
        ));
    }
    errors.extend(lint::collectives_in_rank_branches(&function));
    if !errors.is_empty() {
        return with_errors(item, errors);
    }
    let Some(returns) = returns else { return with_errors(item, errors) };
    let context = expand::Context {
        krate: raw.krate.clone().unwrap_or_else(|| parse_quote!(::accel_core)),
        name: raw
            .name
            .clone()
            .unwrap_or_else(|| syn::Ident::new("accelerator", proc_macro2::Span::call_site())),
        model: raw.model.clone(),
        fp8: raw
            .setting::<accel_choices::Precision>("precision")
            .is_some_and(|p| p.value == accel_choices::Precision::Fp8),
        mode: loops::Mode::of(raw.data.as_ref().map(|d| d.value)),
        sync_batchnorm: raw.sync_batchnorm.as_ref().is_some_and(|s| s.value),
    };
    match expand::function(function, &raw, context, returns) {
        Ok(tokens) => tokens,
        Err(e) => with_errors(item, vec![e]),
    }
}

fn has_any_backward(f: &syn::ItemFn) -> bool {
    struct Finder(bool);
    impl<'a> syn::visit::Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, m: &'a syn::ExprMethodCall) {
            self.0 |= body::is_backward(m);
            syn::visit::visit_expr_method_call(self, m);
        }
    }
    let mut finder = Finder(false);
    syn::visit::Visit::visit_block(&mut finder, &f.block);
    finder.0
}

fn first_token(item: &TokenStream) -> TokenStream {
    item.clone().into_iter().take(1).collect()
}

/// "a struct", "a trait method without a body", ... for the error on non-functions.
fn describe_item(item: &TokenStream) -> String {
    if let Ok(f) = syn::parse2::<syn::TraitItemFn>(item.clone()) {
        if f.default.is_none() {
            return "a function without a body (a trait method declaration)".into();
        }
    }
    match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Struct(_)) => "a struct".into(),
        Ok(syn::Item::Enum(_)) => "an enum".into(),
        Ok(syn::Item::Impl(_)) => "an impl block (put the attribute on the method instead)".into(),
        Ok(syn::Item::Mod(_)) => "a module".into(),
        Ok(syn::Item::Trait(_)) => "a trait".into(),
        Ok(syn::Item::Const(_) | syn::Item::Static(_)) => "a constant or static".into(),
        Ok(syn::Item::Type(_)) => "a type alias".into(),
        _ => "not a function".into(),
    }
}

fn with_errors(item: TokenStream, errors: Vec<syn::Error>) -> TokenStream {
    let errors = errors.into_iter().map(|e| e.to_compile_error());
    let mut out = item.into_token_stream();
    out.extend(quote!(#(#errors)*));
    out
}

#[cfg(test)]
mod tests;
