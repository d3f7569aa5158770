//! Reading the model outside forward and backward. Under zero3 a unit's parameters hold no
//! values between its uses; code after a training loop that reads the model (its own
//! evaluation, a weight norm, its own save, a helper handed `&vs`) must read what one
//! process would. Before the first statement after a training loop that names the model,
//! the attribute calls `summon_full_params`, which gathers the parameters whole (FSDP's
//! `summon_full_params`) until training resumes; nothing is gathered where no statement
//! names it, so a function that only trains keeps 1/N of the model to the end. Where the
//! model leaves the function (a VarStore borrowed from the caller, or returned), it is
//! gathered before the function returns.

use std::collections::BTreeSet;

use proc_macro2::TokenTree;
use syn::visit::Visit;
use syn::{Block, Expr, ItemFn, Pat, Stmt};

use super::body;

/// The names through which the body reaches a model's variables: its VarStores and
/// `nn::seq()`s, and every local bound or assigned from an expression naming one of them
/// (layers, an optimizer, a struct or closure holding them), to a fixed point.
pub(super) fn model_names(f: &ItemFn) -> BTreeSet<String> {
    let mut names: BTreeSet<String> =
        body::varstores(f).into_iter().chain(body::sequentials(f)).map(|i| i.to_string()).collect();
    let mut bindings = Bindings(Vec::new());
    bindings.visit_block(&f.block);
    loop {
        let before = names.len();
        for (bound, source) in &bindings.0 {
            if bound.iter().any(|b| !names.contains(b)) && holds_model(source, &names) {
                names.extend(bound.iter().cloned());
            }
        }
        if names.len() == before {
            return names;
        }
    }
}

/// `let` bindings and assignments: the names bound, with the expression they come from.
struct Bindings(Vec<(Vec<String>, Expr)>);

impl<'a> Visit<'a> for Bindings {
    fn visit_local(&mut self, local: &'a syn::Local) {
        if let Some(init) = &local.init {
            self.0.push((idents_of(&local.pat), (*init.expr).clone()));
        }
        syn::visit::visit_local(self, local);
    }
    fn visit_expr_assign(&mut self, a: &'a syn::ExprAssign) {
        if let Expr::Path(p) = &*a.left {
            if let Some(ident) = p.path.get_ident() {
                self.0.push((vec![ident.to_string()], (*a.right).clone()));
            }
        }
        syn::visit::visit_expr_assign(self, a);
    }
    fn visit_item(&mut self, _: &'a syn::Item) {}
}

fn idents_of(pat: &Pat) -> Vec<String> {
    struct Idents(Vec<String>);
    impl<'a> Visit<'a> for Idents {
        fn visit_pat_ident(&mut self, p: &'a syn::PatIdent) {
            self.0.push(p.ident.to_string());
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut found = Idents(Vec::new());
    found.visit_pat(pat);
    found.0
}

/// Calls whose result is data computed from the model, not a handle on its variables: a
/// forward (`net.forward(&x)`, `x.apply(&net)`) and what reads a number out of a tensor.
const DATA: &[&str] = &[
    "forward",
    "forward_t",
    "forward_mut",
    "apply",
    "apply_t",
    "double_value",
    "int64_value",
    "f_double_value",
    "f_int64_value",
    "backward",
];

/// Methods of a VarStore that `#[accelerate]` turns into the accelerator's, which read and
/// write sharded parameters themselves.
const HANDLED: &[&str] = &["save", "load", "load_partial"];

/// Whether `expr` may hold a handle on the model's variables: it names one of `names`
/// outside a call whose result is data (`let loss = net.forward(&x)...` holds none).
fn holds_model(expr: &Expr, names: &BTreeSet<String>) -> bool {
    let mut finder = Finder { names, found: false, skip_data: true };
    finder.visit_expr(expr);
    finder.found
}

struct Finder<'n> {
    names: &'n BTreeSet<String>,
    found: bool,
    /// Not into calls whose result is data ([`DATA`]), nor into the VarStore methods that
    /// the accelerator handles ([`HANDLED`]).
    skip_data: bool,
}

impl<'a> Visit<'a> for Finder<'_> {
    fn visit_expr_method_call(&mut self, m: &'a syn::ExprMethodCall) {
        let method = m.method.to_string();
        if self.skip_data && DATA.contains(&method.as_str()) {
            return;
        }
        if HANDLED.contains(&method.as_str()) {
            if let Expr::Path(p) = &*m.receiver {
                if p.path.get_ident().is_some_and(|i| self.names.contains(&i.to_string())) {
                    m.args.iter().for_each(|a| self.visit_expr(a));
                    return;
                }
            }
        }
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_path(&mut self, p: &'a syn::ExprPath) {
        if let Some(ident) = p.path.get_ident() {
            self.found |= self.names.contains(&ident.to_string());
        }
        syn::visit::visit_expr_path(self, p);
    }
    fn visit_macro(&mut self, m: &'a syn::Macro) {
        fn walk(tokens: proc_macro2::TokenStream, f: &mut Finder<'_>) {
            for t in tokens {
                match t {
                    TokenTree::Ident(i) => f.found |= f.names.contains(&i.to_string()),
                    TokenTree::Group(g) => walk(g.stream(), f),
                    _ => {}
                }
            }
        }
        walk(m.tokens.clone(), self);
    }
    fn visit_item(&mut self, _: &'a syn::Item) {}
}

/// Whether `stmt` reaches the model through one of `names` (a path of one segment, or an
/// identifier inside a macro's tokens: `println!("{}", vs.variables().len())`), forwards
/// included; the VarStore's `save`/`load`, which the accelerator handles, are not.
fn mentions(stmt: &Stmt, names: &BTreeSet<String>) -> bool {
    let mut finder = Finder { names, found: false, skip_data: false };
    finder.visit_stmt(stmt);
    finder.found
}

/// Whether the statement is, or holds, a loop whose body runs backward.
fn holds_training_loop(stmt: &Stmt) -> bool {
    struct Finder(bool);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr(&mut self, e: &'a Expr) {
            self.0 |= super::loops::is_training_loop(e);
            if !self.0 {
                syn::visit::visit_expr(self, e);
            }
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut finder = Finder(false);
    finder.visit_stmt(stmt);
    finder.0
}

/// Inserts `accelerator.attribute_summon(..)?;` before the first statement of each block
/// that names the model after a statement holding a training loop. Not in a block that runs
/// a backward of its own (the step of an outer loop: a WGAN's generator step after its
/// critic loop), where the model is read within training, as it always was.
pub(super) fn insert(block: &mut Block, names: &BTreeSet<String>, accelerator: &syn::Ident) {
    let direct_backward =
        block.stmts.iter().any(|s| super::loops::runs_backward(s) && !holds_training_loop(s));
    let mut after_loop = false;
    let mut i = 0;
    while i < block.stmts.len() {
        let stmt = &block.stmts[i];
        let trains = super::loops::runs_backward(stmt);
        if !direct_backward && after_loop && !trains && mentions(stmt, names) {
            // Spanned at the statement, whose line the accelerator names (`#[track_caller]`).
            let span = body::span_of(stmt);
            let call: Expr = syn::parse2(quote::quote_spanned!(span=>
                #accelerator.attribute_summon()?
            ))
            .expect("generated expressions parse");
            block.stmts.insert(i, Stmt::Expr(call, Some(Default::default())));
            after_loop = false;
            i += 2;
            continue;
        }
        if holds_training_loop(stmt) {
            after_loop = true;
        }
        Inner { names, accelerator }.stmt(&mut block.stmts[i]);
        i += 1;
    }
}

/// Visits the blocks nested in a statement (not closures, not items).
struct Inner<'n> {
    names: &'n BTreeSet<String>,
    accelerator: &'n syn::Ident,
}

impl Inner<'_> {
    fn stmt(mut self, stmt: &mut Stmt) {
        syn::visit_mut::VisitMut::visit_stmt_mut(&mut self, stmt);
    }
}

impl syn::visit_mut::VisitMut for Inner<'_> {
    fn visit_block_mut(&mut self, block: &mut Block) {
        insert(block, self.names, self.accelerator);
    }
    fn visit_expr_closure_mut(&mut self, _: &mut syn::ExprClosure) {}
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

/// Whether the model leaves the function: a VarStore borrowed from the caller, or a value
/// returned that names the model. It is then gathered whole before the function returns.
pub(super) fn leaves_function(f: &ItemFn, names: &BTreeSet<String>) -> bool {
    if !body::varstore_references(f).is_empty() {
        return true;
    }
    struct Returns<'n> {
        names: &'n BTreeSet<String>,
        found: bool,
    }
    impl<'a> Visit<'a> for Returns<'_> {
        fn visit_expr_return(&mut self, r: &'a syn::ExprReturn) {
            if let Some(e) = &r.expr {
                self.found |= holds_model(e, self.names);
            }
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut returns = Returns { names, found: false };
    returns.visit_block(&f.block);
    let tail = match f.block.stmts.last() {
        Some(Stmt::Expr(e, None)) => holds_model(e, names),
        _ => false,
    };
    returns.found || tail
}
