//! Generating the rewritten function. Knows nothing of parsing: it gets checked arguments,
//! the body's optimizers (body.rs) and a parsed function, and applies the rules of
//! DESIGN.md, "The attribute".

use std::collections::HashMap;

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::visit_mut::VisitMut;
use syn::{Block, Expr, ExprMethodCall, ItemFn, Stmt, parse_quote};

use super::attr::RawArgs;
use super::body::{self, FALLIBLE, INFALLIBLE, Init, Optimizers, Source, span_of};
use super::check::Returns;

/// Names the rewrite needs.
pub(crate) struct Context {
    /// The crate path (`::accel_core` unless overridden).
    pub krate: syn::Path,
    /// The binding through which the body reaches the accelerator.
    pub name: syn::Ident,
    /// The model's VarStore as the `model` key names it (a variable or a field).
    pub model: Option<Expr>,
    /// `precision = "fp8"`: the body's `nn::linear(..)` become the accelerator's fp8 layers.
    pub fp8: bool,
    /// How loops' data is decided (the `data` key); under `manual` loops are put under
    /// autocast but their data is not dealt.
    pub mode: super::loops::Mode,
    /// `sync_batchnorm = true`: the body's `nn::batch_norm*d(..)` become the accelerator's,
    /// whose statistics span the data-parallel processes.
    pub sync_batchnorm: bool,
}

/// The items of accel-core that generated code names, each under the crate path
/// (`::accel_core`, or the `crate = ..` key's): the one list of the runtime's paths the
/// expansion spells (everything else it calls is a method of the accelerator). The values
/// of settings name their types under `config` (`config::Precision::Bf16`), as the
/// settings' table writes them.
const RUNTIME: &[&str] = &[
    "Accelerator",
    "config",
    "Strategy",
    "DataSharding",
    "Error",
    "precision::Float8Linear",
    "nn::SyncBatchNorm",
];

/// `item` of [`RUNTIME`] under the crate path `krate`.
fn runtime(krate: &syn::Path, item: &str) -> syn::Path {
    assert!(RUNTIME.contains(&item), "`{item}` is not in the runtime's list");
    let item: syn::Path = syn::parse_str(item).expect("a path");
    parse_quote!(#krate::#item)
}

/// The builder chain the arguments ask for; `loops` is how many data loops the rewrite
/// prepared (the run's first line says it).
pub(crate) fn builder(
    raw: &RawArgs,
    krate: &syn::Path,
    (loops, drawn): (usize, usize),
    function: &syn::Ident,
) -> TokenStream {
    let mut calls = TokenStream::new();
    let ident = |name: &str| syn::Ident::new(name, Span::call_site());
    if let Some(s) = raw.strategy().map(|s| s.value) {
        let v = ident(s.variant_name());
        let t = runtime(krate, "Strategy");
        calls.extend(quote!(.strategy(#t::#v)));
    }
    // The table's settings, in the table's order (the strategy resolved above).
    let config = runtime(krate, "config");
    let config = quote!(#config).to_string();
    for setting in accel_choices::SETTINGS.iter().filter(|s| s.name != "strategy") {
        let Some(arg) = raw.settings.iter().find(|a| a.setting.name == setting.name) else {
            continue;
        };
        let method = ident(setting.name);
        let value: TokenStream =
            arg.rust.replace("$config", &config).parse().expect("the table writes Rust");
        calls.extend(quote!(.#method(#value)));
    }
    if let Some(d) = &raw.data {
        let v = ident(d.value.variant_name());
        let t = runtime(krate, "DataSharding");
        calls.extend(quote!(.data(#t::#v)));
    }
    if let Some(b) = &raw.broadcast_buffers {
        let b = b.value;
        calls.extend(quote!(.broadcast_buffers(#b)));
    }
    if let Some(s) = &raw.sync_batchnorm {
        let s = s.value;
        calls.extend(quote!(.sync_batchnorm(#s)));
    }
    if let Some(f) = &raw.fp32_gathers {
        let f = f.value;
        calls.extend(quote!(.fp32_gathers(#f)));
    }
    if let Some(c) = &raw.config {
        let c = &c.value;
        calls.extend(quote!(.config_file(#c)));
    }
    calls.extend(quote!(.attribute_data_loops(#loops)));
    if drawn > 0 {
        calls.extend(quote!(.attribute_drawn_loops(#drawn)));
    }
    let call = format!("`{function}`");
    calls.extend(quote!(.attribute_call(concat!(#call, " at ", file!(), ":", line!()))));
    let accelerator = runtime(krate, "Accelerator");
    quote!(#accelerator::builder() #calls .build())
}

fn is_call_to(expr: &Expr, tail: &[&str]) -> bool {
    let Expr::Call(call) = expr else { return false };
    let Expr::Path(p) = &*call.func else { return false };
    let segs: Vec<String> = p.path.segments.iter().map(|s| s.ident.to_string()).collect();
    segs.len() >= tail.len() && segs[segs.len() - tail.len()..] == *tail
}

/// tch's layers (`nn::linear(path, ..)`, ...) that an `nn::seq()` takes as modules and that
/// the attribute makes units of: their first argument is the path of their variables.
const LAYERS: &[&str] = &[
    "linear",
    "conv",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "embedding",
    "layer_norm",
    "group_norm",
];

/// The rewrite of the body (its loops are prepared first, by loops.rs).
pub(super) struct Rewriter<'c> {
    pub(super) cx: &'c Context,
    optimizers: &'c Optimizers,
    varstores: &'c [syn::Ident],
    /// Those of `varstores` that are parameters taken by reference.
    varstore_refs: &'c [syn::Ident],
    /// Data loops prepared so far.
    pub(super) loops: usize,
    /// Of those, loops that count and draw their own batches.
    pub(super) drawn: usize,
    unit: bool,
    pub(super) errors: Vec<syn::Error>,
    in_closure: usize,
    rewrote_build: bool,
    /// A `Device::..` call (through the user's import of `Device`) became the accelerator's.
    rewrote_device: bool,
    /// `let`s of each optimizer seen so far (to find the one an `Unseen` source names).
    lets_seen: HashMap<String, usize>,
    /// Variables bound to an `nn::seq()` chain.
    sequentials: Vec<syn::Ident>,
}

impl Rewriter<'_> {
    /// Before the first statement that runs backward (looking into plain blocks), the model
    /// named by `model = ..` is prepared, so that driven optimizers step a prepared model.
    pub(super) fn prepare_model_before_training(&self, block: &mut Block) {
        let (Some(model), name) = (&self.cx.model, &self.cx.name) else { return };
        let Some(i) = block.stmts.iter().position(super::loops::runs_backward) else { return };
        if let Stmt::Expr(Expr::Block(inner), _) = &mut block.stmts[i] {
            return self.prepare_model_before_training(&mut inner.block);
        }
        block.stmts.insert(i, parse_quote!(#name.prepare_model_once(&#model)?;));
    }

    /// A model for accel's own `Sgd/Adam/AdamW::new(..)`: the `model` key, else the
    /// VarStore its arguments name, else the function's only VarStore.
    fn model_for(&mut self, call: &syn::ExprCall) -> Option<Expr> {
        if let Some(model) = &self.cx.model {
            return Some(model.clone());
        }
        if let Some(vs) = body::varstore_in_args(call) {
            return Some(vs);
        }
        if let [only] = self.varstores {
            return Some(parse_quote!(#only));
        }
        self.errors.push(syn::Error::new(
            span_of(call),
            "#[accelerate] cannot tell which model this optimizer trains: pass the parameters as \
             `named_params(&vs)` (or `accelerator.params(&vs)`), or name the model's VarStore: \
             #[accelerate(model = vs)]",
        ));
        None
    }

    /// The model when the attribute names it or the function has one VarStore.
    fn single_model(&self) -> Option<Expr> {
        if let Some(model) = &self.cx.model {
            return Some(model.clone());
        }
        match self.varstores {
            [only] => Some(parse_quote!(#only)),
            _ => None,
        }
    }

    /// A call that lends an optimizer to a function the attribute cannot see into
    /// (`apply_schedule(&mut opt, epoch)`), checked around the call.
    fn lend(&self, expr: &Expr) -> Option<Expr> {
        let args = match expr {
            Expr::Call(c) if body::called_in_place(c).is_none() => &c.args,
            Expr::MethodCall(m) => &m.args,
            _ => return None,
        };
        let lent = args.iter().find_map(|arg| {
            let mut e = arg;
            while let Expr::Reference(r) = e {
                e = &r.expr;
            }
            let key = body::place_key(e)?;
            self.optimizers.lent.contains_key(&key).then_some(e.clone())
        })?;
        let (name, span) = (&self.cx.name, span_of(expr));
        let what = match expr {
            Expr::Call(c) => {
                let func = &c.func;
                format!("`{}(..)`", quote!(#func).to_string().replace(' ', ""))
            }
            Expr::MethodCall(m) => format!("`.{}(..)`", m.method),
            _ => unreachable!("matched above"),
        };
        let lend = parse_quote_spanned_expr(span, quote!(#name.lend(&#lent, #what)?));
        Some(parse_quote!({
            let __accel_lent = #lend;
            let __accel_value = #expr;
            __accel_lent.returned()?;
            __accel_value
        }))
    }

    /// A layer added to an `nn::seq()` (`nn::linear(path, ..)`, or the accelerator's fp8
    /// `linear`), made a unit of the accelerator: under zero3/fsdp its parameters are then
    /// sharded at rest, gathered around its forward and backward.
    fn unit_around(&self, layer: &Expr) -> Option<Expr> {
        let name = &self.cx.name;
        let (first, rest, make) = match layer {
            Expr::Call(c) if LAYERS.iter().any(|l| is_call_to(layer, &["nn", l])) => {
                let func = &c.func;
                let (first, rest) = (c.args.first()?, c.args.iter().skip(1));
                (first, rest.collect::<Vec<_>>(), quote!(#func))
            }
            Expr::MethodCall(m)
                if m.method == "linear"
                    && matches!(&*m.receiver, Expr::Path(p) if p.path.is_ident(name)) =>
            {
                let (first, rest) = (m.args.first()?, m.args.iter().skip(1));
                (first, rest.collect::<Vec<_>>(), quote!(#name.linear))
            }
            _ => return None,
        };
        let span = span_of(layer);
        Some(parse_quote_spanned_expr(
            span,
            quote!(#name.unit(#first, |__accel_path| #make(__accel_path, #(#rest),*))),
        ))
    }

    /// The name to suggest in messages for the model's VarStore.
    fn suggested_model(&self, field: bool) -> String {
        match self.varstores {
            [only] => only.to_string(),
            _ if field => "self.vs".into(),
            _ => "vs".into(),
        }
    }

    /// An optimizer's `let`: replaced by the accelerator's, adopted, or left (and refused).
    fn rewrite_optimizer_let(&mut self, key: &str, index: usize, init: &mut Expr) {
        let name = self.cx.name.clone();
        match self.optimizers.by_key.get(key).cloned() {
            Some(Source::Lent { vs }) => {
                let vs = match vs {
                    Some(vs) => Some(vs),
                    None => self.single_model().map(|m| parse_quote!(&#m)),
                };
                match vs {
                    Some(vs) => {
                        let (e, span) = (&*init, span_of(&*init));
                        *init =
                            parse_quote_spanned_expr(span, quote!(#name.keep_optimizer(#vs, #e)?));
                    }
                    None => self.errors.push(syn::Error::new(
                        span_of(&*init),
                        format!(
                            "`{key}` is passed to a function #[accelerate] cannot see into, so it \
                             stays the program's own optimizer; name the model it trains: \
                             #[accelerate(model = {})]",
                            self.suggested_model(false)
                        ),
                    )),
                }
            }
            Some(Source::Made) => {
                let target = peel_mut(init);
                let replacement = match body::classify(target, &name) {
                    Init::Build(m) => {
                        let (config, vs, lr) = (&m.receiver, &m.args[0], &m.args[1]);
                        self.rewrote_build = true;
                        Some(quote!(#name.build_optimizer(#config, #vs, #lr)))
                    }
                    // A method of accel's `Optimizer` trait, so that the user's import of it
                    // (which `opt.step()` needed) stays in use.
                    Init::AccelNew(call) => self
                        .model_for(call)
                        .map(|model| quote!(#call?.into_prepared(&#name, &#model))),
                    Init::Prepared | Init::Other => None,
                };
                if let Some(tokens) = replacement {
                    let span = span_of(target);
                    *target = parse_quote_spanned_expr(span, tokens);
                }
            }
            Some(Source::Unseen { what, span, index: last }) if index == last => {
                // The model: named by the attribute, else the VarStore the helper is given
                // (`make_opt(&vs)`), else the function's only one.
                let given: Vec<_> = self
                    .varstores
                    .iter()
                    .filter(|v| super::loops::mentions(&quote!(#init), v))
                    .collect();
                let model = match (&self.cx.model, given.as_slice()) {
                    (Some(model), _) => Some(model.clone()),
                    (None, [vs]) => Some(parse_quote!(#vs)),
                    (None, []) => self.single_model(),
                    (None, _) => None,
                };
                match &model {
                    Some(model) => {
                        let e = &*init;
                        *init = parse_quote_spanned_expr(
                            span,
                            quote!(#name.adopt_optimizer(&#model, #e)?),
                        );
                    }
                    None => self.errors.push(syn::Error::new(
                        span,
                        format!(
                            "`{key}` is stepped in the training loop, but it is made by {what}, \
                             which #[accelerate] cannot see into: it cannot tell which model \
                             that optimizer trains, so the model would not be prepared and each \
                             process would train a copy of its own. Build the optimizer here \
                             (e.g. `let mut {key} = nn::Adam::default().build(&vs, 1e-3)?;`), or \
                             name the model's VarStore: #[accelerate(model = {})]",
                            self.suggested_model(false)
                        ),
                    )),
                }
            }
            _ => {}
        }
    }

    /// A method call on an optimizer, as the accelerator's; `question` adds the `?` that
    /// fallible calls need (not when the user wrote one already: `opt.step()?`).
    fn rewrite_optimizer_call(
        &mut self,
        m: &ExprMethodCall,
        question: bool,
    ) -> Option<TokenStream> {
        let source = self.optimizers.source(&m.receiver)?;
        let method = m.method.to_string();
        let fallible = FALLIBLE.contains(&method.as_str());
        if !fallible && !INFALLIBLE.contains(&method.as_str()) {
            return None;
        }
        let name = &self.cx.name;
        let receiver = place(&m.receiver);
        let (method_ident, args) = (&m.method, &m.args);
        let driven = match source {
            Source::Made | Source::Unseen { .. } => None,
            Source::Argument { by_ref: true, .. } => Some(quote!(&mut *#receiver)),
            Source::Argument { by_ref: false, .. } | Source::Field { .. } | Source::Lent { .. } => {
                Some(quote!(&mut #receiver))
            }
            Source::Invisible { .. } => return None,
        };
        let question = (fallible && question).then(|| quote!(?));
        Some(match driven {
            None if question.is_some() => quote!(#receiver.#method_ident(#args)?),
            None => return None,
            Some(target) => quote!(#name.drive(#target).#method_ident(#args) #question),
        })
    }

    /// The model's VarStore saved or loaded by tch's methods (`vs.save(p)`, `vs.load(p)`,
    /// `vs.load_partial(p)`) becomes the accelerator's: one whole copy written by the main
    /// process, atomically; every process loading into its prepared (sharded) model. Its
    /// `vs.variables()` checks that no parameter is released. The results keep tch's
    /// shapes, so the user's `?`, `unwrap` or `match` stay as they were.
    fn rewrite_varstore_call(&self, expr: &Expr) -> Option<TokenStream> {
        let Expr::MethodCall(m) = expr else { return None };
        let key = body::place_key(&m.receiver)?;
        let is_model = self.cx.model.as_ref().and_then(body::place_key).is_some_and(|k| k == key);
        if !is_model && !self.varstores.iter().any(|v| *v == key) {
            return None;
        }
        let (name, receiver, args) = (&self.cx.name, place(&m.receiver), &m.args);
        let mutable = if self.varstore_refs.iter().any(|v| *v == key) {
            quote!(&mut *#receiver)
        } else {
            quote!(&mut #receiver)
        };
        Some(match (m.method.to_string().as_str(), args.len()) {
            ("save", 1) => quote!(#name.save_varstore(&#receiver, #args)),
            ("load", 1) => quote!(#name.load_varstore(#mutable, #args)),
            ("load_partial", 1) => quote!(#name.load_varstore_partial(#mutable, #args)),
            ("variables", 0) => quote!(#name.variables(&#receiver)),
            _ => return None,
        })
    }

    /// Errors for optimizers that can be neither replaced nor driven.
    fn refuse_unreachable_optimizers(&mut self) {
        for (span, receiver) in &self.optimizers.not_places {
            self.errors.push(syn::Error::new(
                *span,
                format!(
                    "the optimizer is reached through `{receiver}`, which #[accelerate] cannot \
                     follow; call it through a variable or a field (`opt.step()`, \
                     `self.opt.step()`)"
                ),
            ));
        }
        for (key, source) in &self.optimizers.by_key {
            let message = match source {
                Source::Invisible { why, span } => Some((*span, why.clone())),
                Source::Argument { span, .. } if self.cx.model.is_none() => Some((
                    *span,
                    format!(
                        "`{key}` is stepped in the training loop, but it is passed in, so \
                         #[accelerate] cannot see which model it trains: build the optimizer in \
                         this function, or name the model's VarStore: #[accelerate(model = {})]",
                        self.suggested_model(false)
                    ),
                )),
                Source::Field { span } if self.cx.model.is_none() => Some((
                    *span,
                    format!(
                        "`{key}` is stepped in the training loop, but it is kept in a field, so \
                         #[accelerate] cannot see which model it trains: build the optimizer in \
                         this function, or name the model's VarStore: #[accelerate(model = {})]",
                        self.suggested_model(true)
                    ),
                )),
                _ => None,
            };
            if let Some((span, message)) = message {
                self.errors.push(syn::Error::new(span, message));
            }
        }
    }
}

/// `receiver` as written, minus parentheses and derefs (`(*opt)` is `opt`).
fn place(expr: &Expr) -> &Expr {
    match expr {
        Expr::Paren(p) => place(&p.expr),
        Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => place(&u.expr),
        other => other,
    }
}

fn peel_mut(expr: &mut Expr) -> &mut Expr {
    let peelable = match expr {
        Expr::Try(_) | Expr::Paren(_) => true,
        Expr::MethodCall(m) => {
            (m.method == "unwrap" && m.args.is_empty())
                || (m.method == "expect" && m.args.len() == 1)
        }
        _ => false,
    };
    if !peelable {
        return expr;
    }
    match expr {
        Expr::Try(t) => peel_mut(&mut t.expr),
        Expr::Paren(p) => peel_mut(&mut p.expr),
        Expr::MethodCall(m) => peel_mut(&mut m.receiver),
        _ => unreachable!("checked above"),
    }
}

impl VisitMut for Rewriter<'_> {
    fn visit_local_mut(&mut self, local: &mut syn::Local) {
        // Counted before the initializer is visited, in the order body.rs saw them.
        let optimizer = match (body::simple_binding(&local.pat), &local.init) {
            (Some(ident), Some(_)) if self.in_closure == 0 => {
                let key = ident.to_string();
                self.optimizers.by_key.contains_key(&key).then(|| {
                    let seen = self.lets_seen.entry(key.clone()).or_insert(0);
                    *seen += 1;
                    (key, *seen - 1)
                })
            }
            _ => None,
        };
        syn::visit_mut::visit_local_mut(self, local);
        if let (Some((key, index)), Some(init)) = (optimizer, &mut local.init) {
            self.rewrite_optimizer_let(&key, index, &mut init.expr);
        }
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        // `opt.step()?` as written by users of accel's own optimizers keeps its one `?`.
        if let Expr::Try(t) = expr {
            if let Expr::MethodCall(m) = &mut *t.expr {
                if self.optimizers.source(&m.receiver).is_some() {
                    syn::visit_mut::visit_expr_method_call_mut(self, m);
                    let span = span_of(&*m);
                    if let Some(tokens) = self.rewrite_optimizer_call(m, false) {
                        *t.expr = parse_quote_spanned_expr(span, tokens);
                    }
                    return;
                }
            }
        }
        syn::visit_mut::visit_expr_mut(self, expr);
        if self.in_closure == 0 {
            if let Some(checked) = self.lend(expr) {
                *expr = checked;
                return;
            }
        }
        // Each layer of an `nn::seq()` built here becomes a unit, so that zero3/fsdp shards
        // unchanged code (under other strategies a unit is its layer).
        if let Expr::MethodCall(m) = expr {
            if m.method == "add"
                && m.args.len() == 1
                && body::is_sequential(&m.receiver, &self.sequentials)
            {
                if let Some(unit) = self.unit_around(&m.args[0]) {
                    m.args[0] = unit;
                    return;
                }
            }
        }
        let name = self.cx.name.clone();
        let span = span_of(expr);
        // Where the function's loops draw their own batches, each process seeds its own
        // stream (seed + rank; nanoGPT's `seed_offset`).
        if self.drawn > 0 && self.drawn == self.loops && is_call_to(expr, &["manual_seed"]) {
            if let Expr::Call(call) = &*expr {
                if call.args.len() == 1 {
                    let seed = &call.args[0];
                    *expr = parse_quote_spanned_expr(
                        span,
                        quote!(#name.set_seed((#seed) as u64, true)),
                    );
                    return;
                }
            }
        }
        // Hard-coded accelerator devices become the process's device.
        if is_call_to(expr, &["Device", "cuda_if_available"])
            || is_call_to(expr, &["Device", "Cuda"])
        {
            if let Expr::Call(c) = &*expr {
                self.rewrote_device |=
                    matches!(&*c.func, Expr::Path(p) if p.path.segments.len() == 2);
            }
            *expr = parse_quote_spanned_expr(span, quote!(#name.device()));
            return;
        }
        // fp8 is a layer swap (torchao's `convert_to_float8_training`), done here at compile
        // time: tch's linear layers become the accelerator's, whose matmuls run in fp8.
        if self.cx.fp8 && is_call_to(expr, &["nn", "linear"]) {
            if let Expr::Call(call) = &*expr {
                let args = &call.args;
                *expr = parse_quote_spanned_expr(span, quote!(#name.linear(#args)));
            }
            return;
        }
        // Batch norm whose statistics span the processes (`SyncBatchNorm`), by the same swap.
        if self.cx.sync_batchnorm {
            for tail in ["batch_norm1d", "batch_norm2d", "batch_norm3d"] {
                if is_call_to(expr, &["nn", tail]) {
                    if let Expr::Call(call) = &*expr {
                        let (args, method) = (&call.args, syn::Ident::new(tail, span));
                        *expr = parse_quote_spanned_expr(span, quote!(#name.#method(#args)));
                    }
                    return;
                }
            }
        }
        if let Some(tokens) = self.rewrite_varstore_call(expr) {
            *expr = parse_quote_spanned_expr(span, tokens);
            return;
        }
        let Expr::MethodCall(m) = &*expr else {
            if self.unit && self.in_closure == 0 {
                if let Expr::Return(r) = expr {
                    if r.expr.is_none() {
                        r.expr = Some(Box::new(parse_quote!(::core::result::Result::Ok(()))));
                    }
                }
            }
            return;
        };
        let replacement = if m.method == "backward" && m.args.is_empty() {
            let receiver = &m.receiver;
            Some(quote!(#name.backward(&#receiver)?))
        } else {
            self.rewrite_optimizer_call(m, true)
        };
        if let Some(tokens) = replacement {
            *expr = parse_quote_spanned_expr(span, tokens);
        }
    }

    fn visit_type_path_mut(&mut self, t: &mut syn::TypePath) {
        syn::visit_mut::visit_type_path_mut(self, t);
        // The swapped layers' type, where the body names it (`let l: nn::Linear = ..`).
        let segs: Vec<String> = t.path.segments.iter().map(|s| s.ident.to_string()).collect();
        let krate = &self.cx.krate;
        if self.cx.fp8 && segs.len() >= 2 && segs[segs.len() - 2..] == ["nn", "Linear"] {
            let path = runtime(krate, "precision::Float8Linear");
            *t = parse_quote!(#path);
        }
        if self.cx.sync_batchnorm
            && segs.len() >= 2
            && segs[segs.len() - 2..] == ["nn", "BatchNorm"]
        {
            let path = runtime(krate, "nn::SyncBatchNorm");
            *t = parse_quote!(#path);
        }
    }

    fn visit_expr_closure_mut(&mut self, c: &mut syn::ExprClosure) {
        self.in_closure += 1;
        syn::visit_mut::visit_expr_closure_mut(self, c);
        self.in_closure -= 1;
    }
}

pub(super) fn parse_quote_spanned_expr(span: Span, tokens: TokenStream) -> Expr {
    let tokens = quote_spanned!(span=> #tokens);
    syn::parse2(tokens).expect("generated expressions parse")
}

/// `accumulate = k` over a loop that already accumulates by hand (`if (i + 1) % 4 == 0 {
/// opt.step(); }`): both would divide the loss and decide the steps.
fn hand_written_accumulation(
    block: &Block,
    optimizers: &body::Optimizers,
    raw: &RawArgs,
) -> Vec<syn::Error> {
    let Some(accumulate) = raw.setting::<u64>("accumulate").filter(|a| a.value > 1) else {
        return Vec::new();
    };
    struct Finder<'o> {
        optimizers: &'o body::Optimizers,
        /// The `%` conditions around the point visited.
        conditions: Vec<(Span, String)>,
        found: Vec<(Span, String)>,
    }
    fn has_remainder(e: &Expr) -> bool {
        struct R(bool);
        impl<'a> syn::visit::Visit<'a> for R {
            fn visit_bin_op(&mut self, op: &'a syn::BinOp) {
                self.0 |= matches!(op, syn::BinOp::Rem(_));
            }
        }
        let mut r = R(false);
        syn::visit::Visit::visit_expr(&mut r, e);
        r.0
    }
    impl<'a> syn::visit::Visit<'a> for Finder<'_> {
        fn visit_expr_if(&mut self, e: &'a syn::ExprIf) {
            self.visit_expr(&e.cond);
            let pushed = has_remainder(&e.cond);
            if pushed {
                let cond = &e.cond;
                self.conditions.push((span_of(&e.if_token), quote!(#cond).to_string()));
            }
            self.visit_block(&e.then_branch);
            if pushed {
                self.conditions.pop();
            }
            if let Some((_, other)) = &e.else_branch {
                self.visit_expr(other);
            }
        }
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            let steps = m.method == "step" || m.method.to_string().starts_with("backward_step");
            if steps && self.optimizers.source(&m.receiver).is_some() {
                if let Some(c) = self.conditions.last() {
                    self.found.push(c.clone());
                }
            }
            syn::visit::visit_expr_method_call(self, m);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    }
    let mut finder = Finder { optimizers, conditions: Vec::new(), found: Vec::new() };
    syn::visit::Visit::visit_block(&mut finder, block);
    finder.found.dedup_by(|a, b| a.1 == b.1);
    finder
        .found
        .into_iter()
        .map(|(span, cond)| {
            let mut e = syn::Error::new(
                span,
                format!(
                    "this `if {}` steps the optimizer every few batches by hand, and \
                     `accumulate = {}` accumulates gradients as well: the loss would be divided \
                     twice and the steps taken at other batches than either asks. Keep one: step \
                     every batch and let `accumulate` decide (it also skips the gradient \
                     exchange between steps), or remove `accumulate`",
                    cond.replace(" (", "(").replace("( ", "(").replace(" )", ")"),
                    accumulate.value
                ),
            );
            e.combine(syn::Error::new(accumulate.span, "`accumulate` is set here"));
            e
        })
        .collect()
}

/// The whole rewritten function.
pub(crate) fn function(
    mut f: ItemFn,
    raw: &RawArgs,
    cx: Context,
    returns: Returns,
) -> syn::Result<TokenStream> {
    let optimizers = body::optimizers(&f, &cx.name);
    let varstores = body::varstores(&f);
    let varstore_refs = body::varstore_references(&f);
    let unit = matches!(returns, Returns::Unit);
    let mut rewriter = Rewriter {
        cx: &cx,
        optimizers: &optimizers,
        varstores: &varstores,
        varstore_refs: &varstore_refs,
        loops: 0,
        drawn: 0,
        unit,
        errors: Vec::new(),
        in_closure: 0,
        rewrote_build: false,
        rewrote_device: false,
        lets_seen: HashMap::new(),
        sequentials: body::sequentials(&f),
    };
    rewriter.refuse_unreachable_optimizers();
    rewriter.errors.extend(hand_written_accumulation(&f.block, &optimizers, raw));
    let mut body = (*f.block).clone();
    let driven = optimizers
        .by_key
        .values()
        .any(|s| matches!(s, Source::Argument { .. } | Source::Field { .. }));
    if driven {
        rewriter.prepare_model_before_training(&mut body);
    }
    // Before the loops are wrapped, which would hide them from the search for the statements
    // after them.
    let model_names = super::summon::model_names(&f);
    super::summon::insert(&mut body, &model_names, &cx.name);
    let summon_at_return = super::summon::leaves_function(&f, &model_names);
    let prepared = super::loops::prepare(&mut body, cx.mode, &cx.name);
    (rewriter.loops, rewriter.drawn) = (prepared.loops, prepared.drawn);
    rewriter.errors.extend(prepared.errors);
    let manual = cx.mode == super::loops::Mode::Manual;
    let uncovered = super::loops::coverage(&body, manual);
    rewriter.errors.extend(uncovered);
    rewriter.visit_block_mut(&mut body);
    if let Some(mut first) = rewriter.errors.first().cloned() {
        for e in rewriter.errors.into_iter().skip(1) {
            first.combine(e);
        }
        return Err(first);
    }
    if rewriter.rewrote_build {
        // `config.build(..)` became the accelerator's; keep the user's import of tch's
        // OptimizerConfig (which that call needed) from turning into an unused import.
        body.stmts.insert(
            0,
            parse_quote!(
                use OptimizerConfig as _;
            ),
        );
    }
    if rewriter.rewrote_device {
        // Likewise for the import of `Device`, when `Device::cuda_if_available()` was its use.
        body.stmts.insert(
            0,
            parse_quote!(
                use Device as _;
            ),
        );
    }
    let name = &cx.name;
    let krate = &cx.krate;
    let build = builder(raw, krate, (rewriter.loops, rewriter.drawn), &f.sig.ident);
    let error = runtime(krate, "Error");
    let stmts = &body.stmts;
    // The model leaves the function: the caller reads it whole.
    let finish = if summon_at_return {
        quote!(#name.attribute_summon().and_then(|_| __accel_exit.finish()))
    } else {
        quote!(__accel_exit.finish())
    };
    let new_body: Block = match returns {
        Returns::Result(ty) => parse_quote!({
            let #name = #build?;
            let __accel_exit = #name.exit_guard();
            // The body runs in a closure so that every exit (`return`, `?`, the end) passes
            // here: success waits for the other processes; failure or panic aborts the group.
            let __accel_result: #ty = (|| { #(#stmts)* })();
            if __accel_result.is_ok() {
                #finish?;
            }
            __accel_result
        }),
        Returns::Unit => {
            let mut stmts = stmts.clone();
            if let Some(Stmt::Expr(e, semi @ None)) = stmts.last_mut() {
                if !matches!(
                    e,
                    Expr::ForLoop(_)
                        | Expr::While(_)
                        | Expr::Loop(_)
                        | Expr::If(_)
                        | Expr::Block(_)
                        | Expr::Match(_)
                ) {
                    *semi = Some(Default::default());
                }
            }
            parse_quote!({
                let #name = #build.unwrap_or_else(|e| panic!("accel: {e}"));
                let __accel_exit = #name.exit_guard();
                // As for a `Result` function; here a failure ends in a panic with its message.
                let __accel_result: ::core::result::Result<(), #error> = (|| {
                    #(#stmts)*
                    ::core::result::Result::Ok(())
                })();
                if let Err(e) = __accel_result.and_then(|()| #finish) {
                    panic!("accel: {e}");
                }
            })
        }
    };
    f.block = Box::new(new_body);
    Ok(f.into_token_stream())
}
