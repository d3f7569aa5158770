//! The data loops of the body: the iterable of each innermost loop that runs backward is
//! prepared by the accelerator, and its forward part runs under autocast.

use proc_macro2::Span;
use syn::visit::Visit;
use syn::visit_mut::VisitMut;
use syn::{Block, Expr, ExprMethodCall, Stmt, parse_quote};

use super::body::{self, span_of};
use super::expand::Rewriter;

/// Whether `node` runs a backward pass (closures not counted: they may never run).
fn has_backward(visit: impl FnOnce(&mut BackwardFinder)) -> bool {
    let mut f = BackwardFinder(false);
    visit(&mut f);
    f.0
}

struct BackwardFinder(bool);

impl<'a> Visit<'a> for BackwardFinder {
    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        self.0 |= body::is_backward(m);
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
}

fn block_has_backward(block: &Block) -> bool {
    has_backward(|f| f.visit_block(block))
}

pub(super) fn stmt_has_backward(stmt: &Stmt) -> bool {
    has_backward(|f| f.visit_stmt(stmt))
}

/// Whether a loop (for, while, loop) inside `body` runs backward.
fn contains_training_loop(body: &Block) -> bool {
    struct Finder(bool);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_for_loop(&mut self, l: &'a syn::ExprForLoop) {
            self.0 |= block_has_backward(&l.body);
        }
        fn visit_expr_while(&mut self, w: &'a syn::ExprWhile) {
            self.0 |= block_has_backward(&w.body);
        }
        fn visit_expr_loop(&mut self, l: &'a syn::ExprLoop) {
            self.0 |= block_has_backward(&l.body);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    }
    let mut f = Finder(false);
    f.visit_block(body);
    f.0
}

/// The iterator a loop takes its data from: `while let .. = it.next()`, or the first
/// `it.next()` in its body (`let Some(b) = it.next() else { break };`).
fn next_receiver(cond: Option<&Expr>, body: &Block) -> Option<syn::Ident> {
    struct Finder(Option<syn::Ident>);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            if self.0.is_none() && m.method == "next" && m.args.is_empty() {
                if let Expr::Path(p) = &*m.receiver {
                    self.0 = p.path.get_ident().cloned();
                }
            }
            syn::visit::visit_expr_method_call(self, m);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    }
    let mut f = Finder(None);
    if let Some(cond) = cond {
        f.visit_expr(cond);
    }
    if f.0.is_none() {
        if let Some(first) = body.stmts.first() {
            f.visit_stmt(first);
        }
    }
    f.0
}

/// Replaces `it.next()` by `with.next()` in `node`.
struct RenameNext<'a> {
    from: &'a syn::Ident,
    to: &'a syn::Ident,
}

impl VisitMut for RenameNext<'_> {
    fn visit_expr_method_call_mut(&mut self, m: &mut ExprMethodCall) {
        syn::visit_mut::visit_expr_method_call_mut(self, m);
        if m.method == "next" && m.args.is_empty() {
            if let Expr::Path(p) = &mut *m.receiver {
                if p.path.is_ident(self.from) {
                    let to = self.to;
                    *m.receiver = parse_quote!(#to);
                }
            }
        }
    }
}

impl Rewriter<'_> {
    /// Wraps the data of the innermost loops that run backward, and puts their forward part
    /// under autocast.
    pub(super) fn rewrite_loops(&mut self, block: &mut Block) {
        let mut i = 0;
        while i < block.stmts.len() {
            let (before, rest) = block.stmts.split_at_mut(i);
            let stmt = &mut rest[0];
            let replacement = match stmt {
                Stmt::Local(local) => {
                    if let Some(init) = &mut local.init {
                        self.rewrite_loops_in_expr(&mut init.expr);
                    }
                    None
                }
                Stmt::Expr(expr, _) => self.rewrite_loop(expr, before),
                _ => None,
            };
            if let Some(wrapped) = replacement {
                block.stmts[i] = wrapped;
            }
            i += 1;
        }
    }

    /// A statement that is a loop; returns a replacement when the loop had to be wrapped.
    fn rewrite_loop(&mut self, expr: &mut Expr, before: &mut [Stmt]) -> Option<Stmt> {
        match expr {
            Expr::ForLoop(l) if block_has_backward(&l.body) => {
                if contains_training_loop(&l.body) {
                    self.rewrite_loops(&mut l.body);
                    return None;
                }
                let name = &self.cx.name;
                // `enumerate` counts this process's batches, as Python's `enumerate` over a
                // prepared data loader does, so it stays outside.
                match &mut *l.expr {
                    Expr::MethodCall(m) if m.method == "enumerate" && m.args.is_empty() => {
                        let data = &m.receiver;
                        *m.receiver = parse_quote!(#name.prepare_iter(#data));
                    }
                    data => *data = parse_quote!(#name.prepare_iter(#data)),
                }
                self.add_autocast(&mut l.body);
                None
            }
            Expr::While(w) if block_has_backward(&w.body) => {
                if contains_training_loop(&w.body) {
                    self.rewrite_loops(&mut w.body);
                    return None;
                }
                let iterator = next_receiver(Some(&w.cond), &w.body);
                let span = span_of(&w.cond);
                self.add_autocast(&mut w.body);
                self.prepare_iterator(iterator, before, expr, span)
            }
            Expr::Loop(l) if block_has_backward(&l.body) => {
                if contains_training_loop(&l.body) {
                    self.rewrite_loops(&mut l.body);
                    return None;
                }
                let iterator = next_receiver(None, &l.body);
                let span = span_of(&l.loop_token);
                self.add_autocast(&mut l.body);
                self.prepare_iterator(iterator, before, expr, span)
            }
            other => {
                self.rewrite_loops_in_expr(other);
                None
            }
        }
    }

    /// Prepares the iterator `it` of a `while`/`loop` that calls `it.next()`: where it is
    /// made, when that is a `let` just before; else by borrowing it for the loop.
    fn prepare_iterator(
        &mut self,
        iterator: Option<syn::Ident>,
        before: &mut [Stmt],
        the_loop: &mut Expr,
        span: Span,
    ) -> Option<Stmt> {
        let name = self.cx.name.clone();
        let Some(it) = iterator else {
            self.errors.push(syn::Error::new(
                span,
                "#[accelerate] prepares the data of the loop that calls `.backward()`, but cannot \
                 see where this loop takes its batches from; write `for batch in data { .. }`, \
                 `while let Some(batch) = it.next() { .. }`, or start the loop with \
                 `let Some(batch) = it.next() else { break };`",
            ));
            return None;
        };
        let made = before.iter_mut().rev().find_map(|s| match s {
            Stmt::Local(local) => match (body::simple_binding(&local.pat), &mut local.init) {
                (Some(ident), Some(init)) if *ident == it => Some(init),
                _ => None,
            },
            _ => None,
        });
        if let Some(init) = made {
            let e = &init.expr;
            *init.expr = parse_quote!(#name.prepare_iter(#e));
            return None;
        }
        // Made elsewhere (an argument, say): the loop borrows it through a prepared view.
        let prepared = syn::Ident::new(&format!("__accel_{it}"), it.span());
        RenameNext { from: &it, to: &prepared }.visit_expr_mut(the_loop);
        Some(Stmt::Expr(
            parse_quote!({
                let mut #prepared = #name.prepare_iter(#it.by_ref());
                #the_loop
            }),
            None,
        ))
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

    /// The loop body's forward part runs under autocast: the guard is taken first and
    /// dropped before the statement that runs backward. A loss computed inside that
    /// statement (`net.forward(&x).mse_loss(..).backward();`) is computed first, under it.
    fn add_autocast(&self, body: &mut Block) {
        let name = &self.cx.name;
        let position = body.stmts.iter().position(stmt_has_backward).unwrap_or(body.stmts.len());
        if let Some(Stmt::Expr(Expr::MethodCall(m), Some(_))) = body.stmts.get_mut(position) {
            if m.method == "backward" && m.args.is_empty() && !matches!(&*m.receiver, Expr::Path(_))
            {
                let loss = &m.receiver;
                let hoisted: Stmt = parse_quote!(let __accel_loss = #loss;);
                *m.receiver = parse_quote!(__accel_loss);
                body.stmts.insert(position, hoisted);
                body.stmts.insert(position + 1, parse_quote!(drop(__accel_autocast);));
                body.stmts.insert(0, parse_quote!(let __accel_autocast = #name.autocast()?;));
                return;
            }
        }
        body.stmts.insert(position, parse_quote!(drop(__accel_autocast);));
        body.stmts.insert(0, parse_quote!(let __accel_autocast = #name.autocast()?;));
    }

    /// Before the first statement that runs backward (looking into plain blocks), the model
    /// named by `model = ..` is prepared, so that driven optimizers step a prepared model.
    pub(super) fn prepare_model_before_training(&self, block: &mut Block) {
        let (Some(model), name) = (&self.cx.model, &self.cx.name) else { return };
        let Some(i) = block.stmts.iter().position(stmt_has_backward) else { return };
        if let Stmt::Expr(Expr::Block(inner), _) = &mut block.stmts[i] {
            return self.prepare_model_before_training(&mut inner.block);
        }
        block.stmts.insert(i, parse_quote!(#name.prepare_model_once(&#model)?;));
    }
}
