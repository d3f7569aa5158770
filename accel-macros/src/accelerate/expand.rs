//! Generating the rewritten function. Knows nothing of parsing: it gets checked arguments
//! and a parsed function and applies the rules of DESIGN.md, "The attribute".

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::visit::Visit;
use syn::visit_mut::VisitMut;
use syn::{Block, Expr, ExprMethodCall, ItemFn, Pat, Stmt, parse_quote};

use super::attr::RawArgs;
use super::check::Returns;

/// Names the rewrite needs.
pub(crate) struct Context {
    /// The crate path (`::accel_core` unless overridden).
    pub krate: syn::Path,
    /// The binding through which the body reaches the accelerator.
    pub name: syn::Ident,
    /// The model's VarStore, when known.
    pub model: Option<syn::Ident>,
}

/// The builder chain the arguments ask for.
pub(crate) fn builder(raw: &RawArgs, krate: &syn::Path) -> TokenStream {
    let mut calls = TokenStream::new();
    let variant = |s: &str| syn::Ident::new(&(s[..1].to_uppercase() + &s[1..]), Span::call_site());
    let strategy = match (
        raw.strategy.as_ref().map(|s| s.value.as_str()),
        raw.sharding.as_ref().map(|s| s.value.as_str()),
    ) {
        (Some("fsdp"), Some("full_shard")) => Some("zero3"),
        (Some("fsdp"), Some("shard_grad_op")) => Some("zero2"),
        (Some("fsdp"), Some("no_shard")) => Some("ddp"),
        (Some("fsdp"), Some("hybrid_shard")) => Some("hybridShard"),
        (Some(s), _) => Some(s),
        (None, _) => None,
    };
    if let Some(s) = strategy {
        let v = variant(s);
        calls.extend(quote!(.strategy(#krate::Strategy::#v)));
    }
    if let Some(p) = &raw.precision {
        let v = variant(&p.value);
        calls.extend(quote!(.precision(#krate::Precision::#v)));
    }
    if let Some(a) = &raw.accumulate {
        let a = a.value as u32;
        calls.extend(quote!(.accumulate(#a)));
    }
    if let Some(c) = &raw.clip_grad_norm {
        let c = c.value;
        calls.extend(quote!(.clip_grad_norm(#c)));
    }
    if let Some(s) = &raw.seed {
        let s = s.value;
        calls.extend(quote!(.seed(#s)));
    }
    if let Some(c) = &raw.cpu {
        let c = c.value;
        calls.extend(quote!(.cpu(#c)));
    }
    if let Some(o) = &raw.offload {
        let o = o.value;
        calls.extend(quote!(.offload(#o)));
    }
    if let Some(c) = &raw.config {
        let c = &c.value;
        calls.extend(quote!(.config_file(#c)));
    }
    quote!(#krate::Accelerator::builder() #calls .build())
}

fn last_segments(path: &syn::Path, n: usize) -> Vec<String> {
    let segs: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
    segs[segs.len().saturating_sub(n)..].to_vec()
}

fn is_call_to(expr: &Expr, tail: &[&str]) -> bool {
    match expr {
        Expr::Call(call) => match &*call.func {
            Expr::Path(p) => last_segments(&p.path, tail.len()) == tail,
            _ => false,
        },
        _ => false,
    }
}

/// Names of tch optimizer configurations, to recognise `config.build(&vs, lr)`.
const OPTIMIZER_CONFIGS: &[&str] =
    &["Sgd", "Adam", "AdamW", "RmsProp", "sgd", "adam", "adamw", "rms_prop"];

fn mentions_optimizer_config(expr: &Expr) -> bool {
    struct Finder(bool);
    impl<'a> Visit<'a> for Finder {
        fn visit_path(&mut self, p: &'a syn::Path) {
            if p.segments.iter().any(|s| OPTIMIZER_CONFIGS.contains(&s.ident.to_string().as_str()))
            {
                self.0 = true;
            }
            syn::visit::visit_path(self, p);
        }
    }
    let mut f = Finder(false);
    f.visit_expr(expr);
    f.0
}

fn ident_of_ref(expr: &Expr) -> Option<syn::Ident> {
    let Expr::Reference(r) = expr else { return None };
    let Expr::Path(p) = &*r.expr else { return None };
    p.path.get_ident().cloned()
}

/// VarStores created in the body (`let vs = ...VarStore::new(..)`) and taken as parameters.
pub(crate) fn find_varstores(f: &ItemFn) -> Vec<syn::Ident> {
    struct Finder(Vec<syn::Ident>);
    impl<'a> Visit<'a> for Finder {
        fn visit_local(&mut self, local: &'a syn::Local) {
            if let (Pat::Ident(p), Some(init)) = (&local.pat, &local.init) {
                let mut calls = CallFinder(false);
                calls.visit_expr(&init.expr);
                if calls.0 {
                    self.0.push(p.ident.clone());
                }
            }
            syn::visit::visit_local(self, local);
        }
    }
    struct CallFinder(bool);
    impl<'a> Visit<'a> for CallFinder {
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            if is_call_to(&Expr::Call(c.clone()), &["VarStore", "new"]) {
                self.0 = true;
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

/// Whether `expr`/`block` contains a backward call (not counting closures).
struct BackwardFinder<'c> {
    found: bool,
    optimizers: &'c [syn::Ident],
}

impl<'a> Visit<'a> for BackwardFinder<'_> {
    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        let method = m.method.to_string();
        if (method == "backward" && m.args.is_empty())
            || (method.starts_with("backward_step") && receiver_is(&m.receiver, self.optimizers))
        {
            self.found = true;
        }
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
}

fn receiver_is(expr: &Expr, names: &[syn::Ident]) -> bool {
    matches!(expr, Expr::Path(p) if p.path.get_ident().is_some_and(|i| names.contains(i)))
}

fn has_backward(block: &Block, optimizers: &[syn::Ident]) -> bool {
    let mut f = BackwardFinder { found: false, optimizers };
    f.visit_block(block);
    f.found
}

fn stmt_has_backward(stmt: &Stmt, optimizers: &[syn::Ident]) -> bool {
    let mut f = BackwardFinder { found: false, optimizers };
    f.visit_stmt(stmt);
    f.found
}

/// Optimizer bindings: `let [mut] opt = <expr with an optimizer build>`.
pub(crate) fn find_optimizers(f: &ItemFn, model: &Option<syn::Ident>) -> Vec<syn::Ident> {
    struct Finder<'m> {
        found: Vec<syn::Ident>,
        model: &'m Option<syn::Ident>,
    }
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_local(&mut self, local: &'a syn::Local) {
            if let (Pat::Ident(p), Some(init)) = (&local.pat, &local.init) {
                let mut b = BuildFinder { found: false, model: self.model };
                b.visit_expr(&init.expr);
                if b.found {
                    self.found.push(p.ident.clone());
                }
            }
            syn::visit::visit_local(self, local);
        }
    }
    let mut finder = Finder { found: Vec::new(), model };
    finder.visit_block(&f.block);
    finder.found
}

struct BuildFinder<'m> {
    found: bool,
    model: &'m Option<syn::Ident>,
}

impl<'a> Visit<'a> for BuildFinder<'_> {
    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        if is_optimizer_build(m, self.model) {
            self.found = true;
        }
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
        if is_accel_optimizer_new(&Expr::Call(c.clone())) {
            self.found = true;
        }
        syn::visit::visit_expr_call(self, c);
    }
}

/// VarStores that an optimizer configuration is built over (`config.build(&vs, lr)`).
pub(crate) fn optimizer_varstores(f: &ItemFn) -> Vec<syn::Ident> {
    struct Finder(Vec<syn::Ident>);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            if m.method == "build" && m.args.len() == 2 && mentions_optimizer_config(&m.receiver) {
                self.0.extend(ident_of_ref(&m.args[0]));
            }
            syn::visit::visit_expr_method_call(self, m);
        }
    }
    let mut finder = Finder(Vec::new());
    finder.visit_block(&f.block);
    finder.0
}

fn is_optimizer_build(m: &ExprMethodCall, model: &Option<syn::Ident>) -> bool {
    if m.method != "build" || m.args.len() != 2 {
        return false;
    }
    match (ident_of_ref(&m.args[0]), model) {
        (Some(vs), Some(model)) if vs == *model => true,
        (Some(_), _) => mentions_optimizer_config(&m.receiver),
        _ => false,
    }
}

fn is_accel_optimizer_new(expr: &Expr) -> bool {
    ["Sgd", "Adam", "AdamW"].iter().any(|o| is_call_to(expr, &[o, "new"]))
}

/// The rewrite of the body.
struct Rewriter<'c> {
    cx: &'c Context,
    optimizers: Vec<syn::Ident>,
    unit: bool,
    errors: Vec<syn::Error>,
    in_closure: usize,
    rewrote_build: bool,
}

impl Rewriter<'_> {
    /// Wraps the iterable of the innermost loops that contain a backward call, and puts their
    /// forward part under autocast.
    fn rewrite_loops(&mut self, block: &mut Block) {
        let n = block.stmts.len();
        for i in 0..n {
            let (before, rest) = block.stmts.split_at_mut(i);
            let stmt = &mut rest[0];
            let Stmt::Expr(expr, _) = stmt else {
                if let Stmt::Local(local) = stmt {
                    if let Some(init) = &mut local.init {
                        self.rewrite_loops_in_expr(&mut init.expr);
                    }
                }
                continue;
            };
            match expr {
                Expr::ForLoop(l) if has_backward(&l.body, &self.optimizers) => {
                    if self.contains_inner_loop_with_backward(&l.body) {
                        self.rewrite_loops(&mut l.body);
                    } else {
                        let name = &self.cx.name;
                        let iterable = &l.expr;
                        *l.expr = parse_quote!(#name.prepare_iter(#iterable));
                        self.add_autocast(&mut l.body);
                    }
                }
                Expr::While(w) if has_backward(&w.body, &self.optimizers) => {
                    if self.contains_inner_loop_with_backward(&w.body) {
                        self.rewrite_loops(&mut w.body);
                        continue;
                    }
                    // `while let Some(x) = it.next()`: wrap where `it` is made.
                    let iterator = match &*w.cond {
                        Expr::Let(l) => match &*l.expr {
                            Expr::MethodCall(m) if m.method == "next" && m.args.is_empty() => {
                                match &*m.receiver {
                                    Expr::Path(p) => p.path.get_ident().cloned(),
                                    _ => None,
                                }
                            }
                            _ => None,
                        },
                        _ => None,
                    };
                    let made = iterator.as_ref().and_then(|it| {
                        before.iter_mut().rev().find_map(|s| match s {
                            Stmt::Local(local) => match (&local.pat, &mut local.init) {
                                (Pat::Ident(p), Some(init)) if p.ident == *it => Some(init),
                                _ => None,
                            },
                            _ => None,
                        })
                    });
                    match made {
                        Some(init) => {
                            let name = &self.cx.name;
                            let e = &init.expr;
                            *init.expr = parse_quote!(#name.prepare_iter(#e));
                            self.add_autocast(&mut w.body);
                        }
                        None => self.errors.push(syn::Error::new_spanned(
                            &w.cond,
                            "#[accelerate] wraps the data of the loop that calls `.backward()`, but \
                             cannot see where this loop's iterator is made; write `for batch in data \
                             { .. }`, or `let mut it = data.into_iter();` right before a `while let \
                             Some(batch) = it.next()` loop",
                        )),
                    }
                }
                Expr::Loop(l) if has_backward(&l.body, &self.optimizers) => {
                    self.rewrite_loops(&mut l.body)
                }
                Expr::Block(b) => self.rewrite_loops(&mut b.block),
                other => self.rewrite_loops_in_expr(other),
            }
        }
    }

    fn rewrite_loops_in_expr(&mut self, expr: &mut Expr) {
        match expr {
            Expr::Block(b) => self.rewrite_loops(&mut b.block),
            Expr::If(i) => {
                self.rewrite_loops(&mut i.then_branch);
                if let Some((_, e)) = &mut i.else_branch {
                    self.rewrite_loops_in_expr(e);
                }
            }
            _ => {}
        }
    }

    fn contains_inner_loop_with_backward(&self, body: &Block) -> bool {
        struct Finder<'o> {
            found: bool,
            optimizers: &'o [syn::Ident],
        }
        impl<'a> Visit<'a> for Finder<'_> {
            fn visit_expr_for_loop(&mut self, l: &'a syn::ExprForLoop) {
                self.found |= has_backward(&l.body, self.optimizers);
            }
            fn visit_expr_while(&mut self, w: &'a syn::ExprWhile) {
                self.found |= has_backward(&w.body, self.optimizers);
            }
            fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        }
        let mut f = Finder { found: false, optimizers: &self.optimizers };
        f.visit_block(body);
        f.found
    }

    /// The loop body's forward part runs under autocast: the guard is taken first and
    /// dropped before the statement that runs backward.
    fn add_autocast(&self, body: &mut Block) {
        let name = &self.cx.name;
        let position = body
            .stmts
            .iter()
            .position(|s| stmt_has_backward(s, &self.optimizers))
            .unwrap_or(body.stmts.len());
        body.stmts.insert(position, parse_quote!(drop(__accel_autocast);));
        body.stmts.insert(0, parse_quote!(let __accel_autocast = #name.autocast()?;));
    }

    /// Whether an optimizer configuration's `.build(&vs, lr)` was rewritten.
    fn built_optimizer(&self) -> bool {
        self.rewrote_build
    }
}

impl VisitMut for Rewriter<'_> {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        syn::visit_mut::visit_expr_mut(self, expr);
        let name = self.cx.name.clone();
        let span = expr_span(expr);
        // Hard-coded accelerator devices become the process's device.
        if is_call_to(expr, &["Device", "cuda_if_available"])
            || is_call_to(expr, &["Device", "Cuda"])
        {
            *expr = parse_quote_spanned_expr(span, quote!(#name.device()));
            return;
        }
        // Our optimizers built by hand over the model's variables.
        if let Expr::Try(t) = &*expr {
            if is_accel_optimizer_new(&t.expr) {
                if let Some(model) = &self.cx.model {
                    let inner = &t.expr;
                    *expr = parse_quote_spanned_expr(
                        span,
                        quote!(#name.prepare_optimizer_for(&#model, #inner?)?),
                    );
                }
                return;
            }
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
        let method = m.method.to_string();
        let receiver = &m.receiver;
        let args: Vec<&Expr> = m.args.iter().collect();
        let on_optimizer = receiver_is(receiver, &self.optimizers);
        let replacement = match (method.as_str(), args.as_slice()) {
            ("backward", []) => Some(quote!(#name.backward(&#receiver)?)),
            ("build", [vs, lr]) if is_optimizer_build(m, &self.cx.model) => {
                self.rewrote_build = true;
                Some(quote!(#name.build_optimizer(#receiver, #vs, #lr)))
            }
            ("step" | "zero_grad", []) if on_optimizer => {
                let method = &m.method;
                Some(quote!(#receiver.#method()?))
            }
            ("backward_step", [loss]) if on_optimizer => {
                Some(quote!({ #receiver.zero_grad()?; #name.backward(#loss)?; #receiver.step()? }))
            }
            ("backward_step_clip_norm", [loss, max]) if on_optimizer => Some(quote!({
                #receiver.zero_grad()?;
                #name.backward(#loss)?;
                #receiver.clip_grad_norm(#max)?;
                #receiver.step()?
            })),
            ("clip_grad_norm", [max]) if on_optimizer => {
                Some(quote!(#receiver.clip_grad_norm(#max)?))
            }
            _ => None,
        };
        if let Some(tokens) = replacement {
            *expr = parse_quote_spanned_expr(span, tokens);
        }
    }

    fn visit_expr_closure_mut(&mut self, c: &mut syn::ExprClosure) {
        self.in_closure += 1;
        syn::visit_mut::visit_expr_closure_mut(self, c);
        self.in_closure -= 1;
    }
}

fn expr_span(expr: &Expr) -> Span {
    expr.to_token_stream().into_iter().next().map_or_else(Span::call_site, |t| t.span())
}

fn parse_quote_spanned_expr(span: Span, tokens: TokenStream) -> Expr {
    let tokens = quote_spanned!(span=> #tokens);
    syn::parse2(tokens).expect("generated expressions parse")
}

/// The whole rewritten function.
pub(crate) fn function(
    mut f: ItemFn,
    raw: &RawArgs,
    cx: Context,
    returns: Returns,
) -> syn::Result<TokenStream> {
    let optimizers = find_optimizers(&f, &cx.model);
    let unit = matches!(returns, Returns::Unit);
    let mut rewriter = Rewriter {
        cx: &cx,
        optimizers,
        unit,
        errors: Vec::new(),
        in_closure: 0,
        rewrote_build: false,
    };
    let mut body = (*f.block).clone();
    rewriter.rewrite_loops(&mut body);
    rewriter.visit_block_mut(&mut body);
    if let Some(mut first) = rewriter.errors.pop() {
        for e in rewriter.errors {
            first.combine(e);
        }
        return Err(first);
    }
    if rewriter.built_optimizer() {
        // `config.build(..)` became the accelerator's; keep the user's import of tch's
        // OptimizerConfig (which that call needed) from turning into an unused import.
        body.stmts.insert(
            0,
            parse_quote!(
                use OptimizerConfig as _;
            ),
        );
    }
    let name = &cx.name;
    let krate = &cx.krate;
    let build = builder(raw, krate);
    let stmts = &body.stmts;
    let new_body: Block = match returns {
        Returns::Result(ty) => parse_quote!({
            let #name = #build?;
            let __accel_exit = #name.exit_guard();
            // The body runs in a closure so that every exit (`return`, `?`, the end) passes
            // here: success waits for the other processes; failure or panic aborts the group.
            let __accel_result: #ty = (|| { #(#stmts)* })();
            if __accel_result.is_ok() {
                __accel_exit.finish()?;
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
                let __accel_result: ::core::result::Result<(), #krate::Error> = (|| {
                    #(#stmts)*
                    ::core::result::Result::Ok(())
                })();
                if let Err(e) = __accel_result.and_then(|()| __accel_exit.finish()) {
                    panic!("accel: {e}");
                }
            })
        }
    };
    f.block = Box::new(new_body);
    Ok(f.into_token_stream())
}
