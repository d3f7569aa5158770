//! Reading the body before rewriting it: which values are optimizers (by how they are
//! used, not by how they are spelled), where each one is made, and whether the rewrite can
//! make it the accelerator's. Nothing here changes the body; expand.rs applies the verdicts.

use std::collections::BTreeMap;

use proc_macro2::Span;
use quote::ToTokens;
use syn::visit::Visit;
use syn::{Expr, ExprMethodCall, ItemFn, Pat};

/// Methods that only an optimizer has: calling one makes the receiver an optimizer.
const DEFINING: &[&str] = &["backward_step", "backward_step_clip", "backward_step_clip_norm"];

/// tch's `nn::Optimizer` methods that can fail under the accelerator (they get a `?`).
pub(crate) const FALLIBLE: &[&str] = &[
    "step",
    "zero_grad",
    "backward_step",
    "backward_step_clip",
    "backward_step_clip_norm",
    "clip_grad_value",
    "clip_grad_norm",
];

/// tch's `nn::Optimizer` methods that cannot fail.
pub(crate) const INFALLIBLE: &[&str] = &[
    "set_lr",
    "set_lr_group",
    "set_momentum",
    "set_momentum_group",
    "set_weight_decay",
    "set_weight_decay_group",
    "trainable_variables",
];

/// Whether `m` runs a backward pass: `x.backward()` or `opt.backward_step*(..)`.
pub(crate) fn is_backward(m: &ExprMethodCall) -> bool {
    (m.method == "backward" && m.args.is_empty()) || DEFINING.iter().any(|d| m.method == d)
}

/// What an optimizer's receiver is, as a place: `opt`, `self.opt`, `trainer.opts.d`.
/// Parentheses and derefs (`(*opt).step()`) are looked through; anything else is not a place.
pub(crate) fn place_key(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Paren(p) => place_key(&p.expr),
        Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => place_key(&u.expr),
        Expr::Path(p) if p.path.get_ident().is_some() => Some(p.path.to_token_stream().to_string()),
        Expr::Field(f) => Some(format!("{}.{}", place_key(&f.base)?, f.member.to_token_stream())),
        _ => None,
    }
}

/// Where an optimizer comes from, and so what the rewrite does with it.
#[derive(Clone)]
pub(crate) enum Source {
    /// A `let` the rewrite replaces: `config.build(vs, lr)`, accel's `Sgd/Adam/AdamW::new`,
    /// or an optimizer the body prepares with the accelerator itself. Calls on it are the
    /// prepared optimizer's.
    Made,
    /// Made where the attribute cannot see (a helper, a closure): with `model = ...` the
    /// accelerator adopts it at its `let`; without, a compile error.
    Unseen {
        what: String,
        span: Span,
        /// Which `let` of the name (counting those with an initializer) makes it: the last.
        index: usize,
    },
    /// A `&mut` argument or a by-value argument: with `model = ...` each call is driven by
    /// the accelerator; without, a compile error.
    Argument { by_ref: bool, span: Span },
    /// A struct field (`self.opt`): as for an argument.
    Field { span: Span },
    /// Bound by a pattern (`let (g, d) = ..`), or not found at all: always an error.
    Invisible { why: String, span: Span },
    /// Made here by a recognised constructor, and passed to functions the attribute cannot
    /// see into (`apply_schedule(&mut opt, ..)`): it stays the program's own type, so those
    /// functions keep compiling; the body's calls on it are driven, each lending checked.
    Lent {
        /// The model it trains: `build`'s VarStore argument, as written (`&vs`).
        vs: Option<Expr>,
    },
}

/// Every optimizer of the body, by receiver.
pub(crate) struct Optimizers {
    pub by_key: BTreeMap<String, Source>,
    /// The calls each optimizer is lent to (`apply_schedule(&mut opt, ..)`), by name.
    pub lent: BTreeMap<String, Vec<(Span, String)>>,
    /// Receivers of optimizer methods that are not places (`opts[0].step()`).
    pub not_places: Vec<(Span, String)>,
}

impl Optimizers {
    pub(crate) fn source(&self, receiver: &Expr) -> Option<&Source> {
        place_key(receiver).and_then(|k| self.by_key.get(&k))
    }
}

/// A closure called where it is written (`(|| { .. })()`): its body runs there, once, so
/// it is read as part of the function (other closures may run anywhere, or never).
pub(crate) fn called_in_place(call: &syn::ExprCall) -> Option<&syn::ExprClosure> {
    let mut func = &*call.func;
    while let Expr::Paren(p) = func {
        func = &p.expr;
    }
    match func {
        Expr::Closure(c) => Some(c),
        _ => None,
    }
}

/// Visits a call as the attribute reads the body: a closure called in place is read as
/// its body (other closures stay out, by the visitor's own `visit_expr_closure`).
pub(crate) fn visit_call<'a, V: Visit<'a> + ?Sized>(visitor: &mut V, call: &'a syn::ExprCall) {
    match called_in_place(call) {
        Some(closure) => visitor.visit_expr(&closure.body),
        None => visitor.visit_expr(&call.func),
    }
    call.args.iter().for_each(|a| visitor.visit_expr(a));
}

/// Method calls on each receiver, outside closures (but in closures called in place).
#[derive(Default)]
struct Uses {
    methods: BTreeMap<String, (Vec<String>, Span)>,
    not_places: Vec<(Span, String)>,
}

impl<'a> Visit<'a> for Uses {
    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        let method = m.method.to_string();
        if m.args.is_empty() && (method == "step" || method == "zero_grad")
            || DEFINING.contains(&method.as_str())
        {
            match place_key(&m.receiver) {
                Some(key) => {
                    let span = span_of(&m.receiver);
                    self.methods.entry(key).or_insert_with(|| (Vec::new(), span)).0.push(method);
                }
                None if DEFINING.contains(&method.as_str()) => self.not_places.push((
                    span_of(&m.receiver),
                    m.receiver.to_token_stream().to_string().replace(" [", "[").replace(" . ", "."),
                )),
                None => {}
            }
        }
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
        visit_call(self, c);
    }
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
}

pub(crate) fn span_of(tokens: &impl ToTokens) -> Span {
    tokens.to_token_stream().into_iter().next().map_or_else(Span::call_site, |t| t.span())
}

/// Peels what users put around an optimizer's construction: `?`, `.unwrap()`,
/// `.expect(..)`, parentheses.
pub(crate) fn peel(expr: &Expr) -> &Expr {
    match expr {
        Expr::Try(t) => peel(&t.expr),
        Expr::Paren(p) => peel(&p.expr),
        Expr::MethodCall(m)
            if (m.method == "unwrap" && m.args.is_empty())
                || (m.method == "expect" && m.args.len() == 1) =>
        {
            peel(&m.receiver)
        }
        other => other,
    }
}

/// How an optimizer's `let` initializer makes it.
pub(crate) enum Init<'e> {
    /// `config.build(vs, lr)` with any place for `vs`.
    Build(&'e ExprMethodCall),
    /// accel's `Sgd::new(..)`, `Adam::new(..)`, `AdamW::new(..)`.
    AccelNew(&'e syn::ExprCall),
    /// Already the accelerator's (`accelerator.prepare_optimizer(..)` and friends).
    Prepared,
    /// Anything else: a helper, a closure.
    Other,
}

pub(crate) fn classify<'e>(init: &'e Expr, accelerator: &syn::Ident) -> Init<'e> {
    match peel(init) {
        Expr::MethodCall(m) if m.method == "build" && m.args.len() == 2 => Init::Build(m),
        Expr::MethodCall(m) if matches!(&*m.receiver, Expr::Path(p) if p.path.is_ident(accelerator)) => {
            Init::Prepared
        }
        Expr::Call(c) if is_accel_new(c) => Init::AccelNew(c),
        _ => Init::Other,
    }
}

pub(crate) fn is_accel_new(call: &syn::ExprCall) -> bool {
    let Expr::Path(p) = &*call.func else { return false };
    let segments: Vec<String> = p.path.segments.iter().map(|s| s.ident.to_string()).collect();
    matches!(
        segments.as_slice(),
        [.., ty, new] if new == "new" && ["Sgd", "Adam", "AdamW"].contains(&ty.as_str())
    )
}

/// The `let` statements that bind `name` (outside closures), with their patterns' shapes.
fn lets_of<'a>(f: &'a ItemFn, name: &str) -> Vec<&'a syn::Local> {
    struct Finder<'a, 'n>(&'n str, Vec<&'a syn::Local>);
    impl<'a> Visit<'a> for Finder<'a, '_> {
        fn visit_local(&mut self, local: &'a syn::Local) {
            if binds(&local.pat, self.0) {
                self.1.push(local);
            }
            syn::visit::visit_local(self, local);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    }
    let mut finder = Finder(name, Vec::new());
    finder.visit_block(&f.block);
    finder.1
}

/// Whether `pat` binds `name` anywhere.
fn binds(pat: &Pat, name: &str) -> bool {
    struct Finder<'n>(&'n str, bool);
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_pat_ident(&mut self, p: &'a syn::PatIdent) {
            self.1 |= p.ident == self.0;
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut finder = Finder(name, false);
    finder.visit_pat(pat);
    finder.1
}

/// The identifier a `let` pattern binds directly (`opt`, `mut opt`, `opt: T`).
pub(crate) fn simple_binding(pat: &Pat) -> Option<&syn::Ident> {
    match pat {
        Pat::Ident(p) if p.subpat.is_none() => Some(&p.ident),
        Pat::Type(t) => simple_binding(&t.pat),
        _ => None,
    }
}

/// Finds the optimizers: receivers of `backward_step*`, and receivers of both `step()`
/// and `zero_grad()` (or of `step()` alone when made by a recognised constructor), so that
/// a scheduler's or an environment's `step()` is not mistaken for one.
pub(crate) fn optimizers(f: &ItemFn, accelerator: &syn::Ident) -> Optimizers {
    let mut uses = Uses::default();
    uses.visit_block(&f.block);
    let lent = lent_optimizers(f, accelerator);
    let mut by_key = BTreeMap::new();
    for key in lent.keys() {
        let vs = lets_of(f, key).iter().rev().find_map(|l| {
            match classify(&l.init.as_ref()?.expr, accelerator) {
                Init::Build(m) => Some(Some(m.args[0].clone())),
                Init::AccelNew(_) => Some(None),
                _ => None,
            }
        });
        if let Some(vs) = vs {
            by_key.insert(key.clone(), Source::Lent { vs });
        }
    }
    for (key, (methods, use_span)) in uses.methods {
        if by_key.contains_key(&key) {
            continue;
        }
        let has = |m: &str| methods.iter().any(|x| x == m);
        let defining = methods.iter().any(|m| DEFINING.contains(&m.as_str()));
        let source = source_of(f, &key, use_span, accelerator);
        let made = matches!(source, Source::Made);
        if defining || (has("step") && has("zero_grad")) || (has("step") && made) {
            by_key.insert(key, source);
        }
    }
    let lent = lent.into_iter().filter(|(k, _)| by_key.contains_key(k)).collect();
    Optimizers { by_key, lent, not_places: uses.not_places }
}

/// Optimizers made in the body by a recognised constructor (`config.build(..)`, accel's
/// `Adam::new(..)`) and passed to a function or method as an argument, with those calls.
pub(crate) fn lent_optimizers(
    f: &ItemFn,
    accelerator: &syn::Ident,
) -> BTreeMap<String, Vec<(Span, String)>> {
    struct Made<'a>(&'a syn::Ident, Vec<String>);
    impl<'a> Visit<'a> for Made<'_> {
        fn visit_local(&mut self, local: &'a syn::Local) {
            if let (Some(ident), Some(init)) = (simple_binding(&local.pat), &local.init) {
                if matches!(classify(&init.expr, self.0), Init::Build(_) | Init::AccelNew(_)) {
                    self.1.push(ident.to_string());
                }
            }
            syn::visit::visit_local(self, local);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    }
    let mut made = Made(accelerator, Vec::new());
    made.visit_block(&f.block);
    struct Calls<'a> {
        made: &'a [String],
        accelerator: &'a syn::Ident,
        found: BTreeMap<String, Vec<(Span, String)>>,
    }
    impl Calls<'_> {
        fn args<'e>(&mut self, args: impl Iterator<Item = &'e Expr>, span: Span, what: String) {
            for arg in args {
                let mut e = arg;
                while let Expr::Reference(r) = e {
                    e = &r.expr;
                }
                if let Expr::Path(p) = e {
                    if let Some(name) = p.path.get_ident().map(|i| i.to_string()) {
                        if self.made.contains(&name) {
                            self.found.entry(name).or_default().push((span, what.clone()));
                        }
                    }
                }
            }
        }
    }
    impl<'a> Visit<'a> for Calls<'_> {
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            if called_in_place(c).is_none() {
                let name = match &*c.func {
                    Expr::Path(p) => p.path.to_token_stream().to_string().replace(' ', ""),
                    _ => "a closure".into(),
                };
                self.args(c.args.iter(), span_of(c), format!("`{name}(..)`"));
            }
            visit_call(self, c);
        }
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            let ours = matches!(&*m.receiver, Expr::Path(p) if p.path.is_ident(self.accelerator));
            if !ours {
                let what = format!("`.{}(..)`", m.method);
                self.args(m.args.iter(), span_of(m), what);
            }
            syn::visit::visit_expr_method_call(self, m);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    }
    let mut calls = Calls { made: &made.1, accelerator, found: BTreeMap::new() };
    calls.visit_block(&f.block);
    calls.found
}

fn source_of(f: &ItemFn, key: &str, use_span: Span, accelerator: &syn::Ident) -> Source {
    if key.contains('.') {
        return Source::Field { span: use_span };
    }
    let lets = lets_of(f, key);
    let mut last_other = None;
    let mut index = 0;
    for local in &lets {
        let Some(init) = &local.init else { continue };
        index += 1;
        if simple_binding(&local.pat).is_none() {
            return Source::Invisible {
                why: format!(
                    "`{key}` is bound by a pattern (`let {} = ..`); bind each optimizer with its \
                     own `let`, so that #[accelerate] can prepare it",
                    local.pat.to_token_stream()
                ),
                span: span_of(&local.pat),
            };
        }
        match classify(&init.expr, accelerator) {
            Init::Build(_) | Init::AccelNew(_) | Init::Prepared => return Source::Made,
            Init::Other => last_other = Some((&init.expr, index - 1)),
        }
    }
    if let Some((init, index)) = last_other {
        return Source::Unseen { what: describe(init), span: span_of(init), index };
    }
    for input in &f.sig.inputs {
        if let syn::FnArg::Typed(t) = input {
            if binds(&t.pat, key) {
                let by_ref = matches!(&*t.ty, syn::Type::Reference(_));
                return Source::Argument { by_ref, span: span_of(&t.pat) };
            }
        }
    }
    Source::Invisible {
        why: format!(
            "#[accelerate] cannot see where the optimizer `{key}` is made (it is not a `let` of \
             this function, nor an argument); make it with a `let` here, e.g. `let mut {key} = \
             nn::Adam::default().build(&vs, 1e-3)?;`"
        ),
        span: use_span,
    }
}

/// "`make_opt(..)`" for messages.
fn describe(init: &Expr) -> String {
    match peel(init) {
        Expr::Call(c) => match &*c.func {
            Expr::Path(p) => format!("`{}(..)`", p.to_token_stream().to_string().replace(' ', "")),
            _ => "a closure".into(),
        },
        Expr::MethodCall(m) => format!("`.{}(..)`", m.method),
        Expr::Closure(_) => "a closure".into(),
        other => format!("`{}`", other.to_token_stream()),
    }
}

/// Whether `expr` builds on an `nn::seq()` / `nn::seq_t()`: that call itself, a chain of
/// `.add(..)`/`.add_fn(..)` on one, or a variable in `bound` (bound to one).
pub(crate) fn is_sequential(expr: &Expr, bound: &[syn::Ident]) -> bool {
    match peel(expr) {
        Expr::MethodCall(m) if ["add", "add_fn", "add_fn_t"].iter().any(|a| m.method == a) => {
            is_sequential(&m.receiver, bound)
        }
        Expr::Call(c) => match &*c.func {
            Expr::Path(p) => {
                p.path.segments.last().is_some_and(|s| s.ident == "seq" || s.ident == "seq_t")
                    && (p.path.segments.len() == 1
                        || p.path.segments[p.path.segments.len() - 2].ident == "nn")
            }
            _ => false,
        },
        Expr::Path(p) => p.path.get_ident().is_some_and(|i| bound.contains(i)),
        _ => false,
    }
}

/// Variables bound in the body to an `nn::seq()` chain (`let mut net = nn::seq();`), whose
/// later `.add(..)`s build the same model.
pub(crate) fn sequentials(f: &ItemFn) -> Vec<syn::Ident> {
    struct Finder(Vec<syn::Ident>);
    impl<'a> Visit<'a> for Finder {
        fn visit_local(&mut self, local: &'a syn::Local) {
            if let (Some(ident), Some(init)) = (simple_binding(&local.pat), &local.init) {
                if is_sequential(&init.expr, &self.0) {
                    self.0.push(ident.clone());
                }
            }
            syn::visit::visit_local(self, local);
        }
    }
    let mut finder = Finder(Vec::new());
    finder.visit_block(&f.block);
    finder.0
}

/// VarStores created in the body (`let vs = ...VarStore::new(..)`) and taken as parameters.
pub(crate) fn varstores(f: &ItemFn) -> Vec<syn::Ident> {
    struct Finder(Vec<syn::Ident>);
    impl<'a> Visit<'a> for Finder {
        fn visit_local(&mut self, local: &'a syn::Local) {
            if let (Some(ident), Some(init)) = (simple_binding(&local.pat), &local.init) {
                let mut calls = NewFinder(false);
                calls.visit_expr(&init.expr);
                if calls.0 {
                    self.0.push(ident.clone());
                }
            }
            syn::visit::visit_local(self, local);
        }
    }
    struct NewFinder(bool);
    impl<'a> Visit<'a> for NewFinder {
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            if let Expr::Path(p) = &*c.func {
                let n = p.path.segments.len();
                self.0 |= n >= 2
                    && p.path.segments[n - 2].ident == "VarStore"
                    && p.path.segments[n - 1].ident == "new";
            }
            syn::visit::visit_expr_call(self, c);
        }
    }
    let mut found = Vec::new();
    for input in &f.sig.inputs {
        if let syn::FnArg::Typed(t) = input {
            let mut ty = &*t.ty;
            while let syn::Type::Reference(r) = ty {
                ty = &r.elem;
            }
            if let (syn::Type::Path(p), Pat::Ident(id)) = (ty, &*t.pat) {
                if p.path.segments.last().is_some_and(|s| s.ident == "VarStore") {
                    found.push(id.ident.clone());
                }
            }
        }
    }
    let mut finder = Finder(Vec::new());
    finder.visit_block(&f.block);
    found.extend(finder.0);
    found
}

/// The VarStore parameters taken by reference (`vs: &mut VarStore`), which a rewritten
/// `vs.load(..)` reborrows as `&mut *vs`.
pub(crate) fn varstore_references(f: &ItemFn) -> Vec<syn::Ident> {
    f.sig
        .inputs
        .iter()
        .filter_map(|input| match input {
            syn::FnArg::Typed(t) => match (&*t.ty, &*t.pat) {
                (syn::Type::Reference(r), Pat::Ident(id)) => {
                    let syn::Type::Path(p) = &*r.elem else { return None };
                    p.path
                        .segments
                        .last()
                        .is_some_and(|s| s.ident == "VarStore")
                        .then(|| id.ident.clone())
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// The VarStore an accel optimizer's arguments name: `named_params(&vs)`,
/// `accelerator.params(&vs)`, `vs.trainable_variables()`.
pub(crate) fn varstore_in_args(call: &syn::ExprCall) -> Option<Expr> {
    struct Finder(Option<Expr>);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            let named = matches!(&*c.func, Expr::Path(p)
                if p.path.segments.last().is_some_and(|s| s.ident == "named_params"));
            if named && c.args.len() == 1 && self.0.is_none() {
                self.0 = Some(strip_ref(&c.args[0]).clone());
            }
            syn::visit::visit_expr_call(self, c);
        }
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            if self.0.is_none() {
                if m.method == "params" && m.args.len() == 1 {
                    self.0 = Some(strip_ref(&m.args[0]).clone());
                } else if m.method == "trainable_variables" && m.args.is_empty() {
                    self.0 = Some((*m.receiver).clone());
                }
            }
            syn::visit::visit_expr_method_call(self, m);
        }
    }
    let mut finder = Finder(None);
    for arg in &call.args {
        finder.visit_expr(arg);
    }
    finder.0.filter(|e| place_key(e).is_some())
}

fn strip_ref(expr: &Expr) -> &Expr {
    match expr {
        Expr::Reference(r) => strip_ref(&r.expr),
        Expr::Paren(p) => strip_ref(&p.expr),
        other => other,
    }
}
