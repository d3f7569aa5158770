//! The training loops of the body. Every expression position is searched (blocks, `if`
//! and `match` arms, labeled and `unsafe` blocks, block values, `break`/`return` values,
//! closures called in place), never closures that may run elsewhere nor nested items.
//!
//! Of each loop that runs backward, the innermost one that takes its batches from something
//! the attribute can see is *prepared*: its iterable dealt by the accelerator, its body run
//! under autocast. A loop whose data it cannot see is refused at its span (unless
//! `data = "manual"`), and [`coverage`] then checks that every backward call of the body
//! sits in a prepared loop: a rewrite is complete, or it is an error.

use proc_macro2::Span;
use syn::visit::Visit;
use syn::visit_mut::VisitMut;
use syn::{Block, Expr, ExprMethodCall, Pat, Stmt, parse_quote};

use super::body::{self, called_in_place, span_of};
use super::expand::Rewriter;

/// The statement every prepared loop body starts with; [`coverage`] recognises prepared
/// loops by it.
const AUTOCAST: &str = "__accel_autocast";

struct BackwardFinder(bool);

impl<'a> Visit<'a> for BackwardFinder {
    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        self.0 |= body::is_backward(m);
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
        body::visit_call(self, c);
    }
    // Closures may never run (and are refused by `coverage` if they hold a backward), and
    // nested items are other functions.
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    fn visit_item(&mut self, _: &'a syn::Item) {}
}

fn block_has_backward(block: &Block) -> bool {
    let mut f = BackwardFinder(false);
    f.visit_block(block);
    f.0
}

/// A loop's body, if `expr` is a loop.
fn loop_body(expr: &Expr) -> Option<&Block> {
    match expr {
        Expr::ForLoop(l) => Some(&l.body),
        Expr::While(w) => Some(&w.body),
        Expr::Loop(l) => Some(&l.body),
        _ => None,
    }
}

fn loop_body_mut(expr: &mut Expr) -> Option<&mut Block> {
    match expr {
        Expr::ForLoop(l) => Some(&mut l.body),
        Expr::While(w) => Some(&mut w.body),
        Expr::Loop(l) => Some(&mut l.body),
        _ => None,
    }
}

/// A loop whose body runs backward.
fn is_training_loop(expr: &Expr) -> bool {
    loop_body(expr).is_some_and(block_has_backward)
}

/// Where a training loop takes its batches from, as far as the attribute can see.
enum Data {
    /// `for batch in data` (any iterable but a counting range), or a range whose variable
    /// picks the batch (`for i in 0..n { let b = &batches[i]; .. }`): the iterable is dealt.
    Iterable,
    /// `while let Some(b) = it.next()` or `loop { let Some(b) = it.next() else { .. }; .. }`.
    Next(syn::Ident),
    /// A range whose variable only counts (`for epoch in 1..200`, `for _ in 0..n`): the
    /// batches come from elsewhere.
    Counter { span: Span, what: String },
    /// `while cond { .. }` or `loop { .. }` with no `it.next()` to follow.
    Unseen { span: Span },
}

fn data_of(expr: &Expr) -> Data {
    match expr {
        Expr::ForLoop(l) => match range_of(&l.expr) {
            Some(range) if !picks_data(&l.pat, &l.body) => Data::Counter {
                span: span_of(range),
                what: quote::ToTokens::to_token_stream(&*l.expr)
                    .to_string()
                    .replace(" . ", ".")
                    .replace(" ..= ", "..=")
                    .replace(" .. ", ".."),
            },
            _ => Data::Iterable,
        },
        Expr::While(w) => match next_receiver(Some(&w.cond), &w.body) {
            Some(it) => Data::Next(it),
            None => Data::Unseen { span: span_of(&w.while_token) },
        },
        Expr::Loop(l) => match next_receiver(None, &l.body) {
            Some(it) => Data::Next(it),
            None => Data::Unseen { span: span_of(&l.loop_token) },
        },
        _ => Data::Unseen { span: span_of(expr) },
    }
}

/// The range a `for` loop counts over: `a..b`, `(a..b)`, `(a..b).rev()`, `(a..=b).step_by(k)`.
fn range_of(expr: &Expr) -> Option<&Expr> {
    match expr {
        Expr::Range(_) => Some(expr),
        Expr::Paren(p) => range_of(&p.expr),
        Expr::MethodCall(m)
            if ["rev", "step_by", "skip", "take"].contains(&&*m.method.to_string()) =>
        {
            range_of(&m.receiver)
        }
        _ => None,
    }
}

/// Whether the variables `pat` binds pick data in `body`: used as an index (`xs[i]`) or in
/// the arguments of a call (`xs.narrow(0, i * b, b)`, `batch(i)`), outside macros. A
/// variable used only in conditions, arithmetic or `println!` only counts.
fn picks_data(pat: &Pat, body: &Block) -> bool {
    struct Names(Vec<syn::Ident>);
    impl<'a> Visit<'a> for Names {
        fn visit_pat_ident(&mut self, p: &'a syn::PatIdent) {
            if !p.ident.to_string().starts_with('_') {
                self.0.push(p.ident.clone());
            }
        }
    }
    let mut names = Names(Vec::new());
    names.visit_pat(pat);
    if names.0.is_empty() {
        return false;
    }
    struct Uses<'n> {
        names: &'n [syn::Ident],
        /// Inside an index or a call's arguments.
        depth: usize,
        found: bool,
    }
    impl Uses<'_> {
        fn inside(&mut self, f: impl FnOnce(&mut Self)) {
            self.depth += 1;
            f(self);
            self.depth -= 1;
        }
    }
    impl<'a> Visit<'a> for Uses<'_> {
        fn visit_expr_path(&mut self, p: &'a syn::ExprPath) {
            self.found |= self.depth > 0 && self.names.iter().any(|n| p.path.is_ident(n));
        }
        fn visit_expr_index(&mut self, i: &'a syn::ExprIndex) {
            self.visit_expr(&i.expr);
            self.inside(|s| s.visit_expr(&i.index));
        }
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            self.visit_expr(&c.func);
            self.inside(|s| c.args.iter().for_each(|a| s.visit_expr(a)));
        }
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            self.visit_expr(&m.receiver);
            self.inside(|s| m.args.iter().for_each(|a| s.visit_expr(a)));
        }
    }
    let mut uses = Uses { names: &names.0, depth: 0, found: false };
    uses.visit_block(body);
    uses.found
}

/// Whether `body` holds a training loop (outside closures and items) the attribute would
/// prepare: one whose data it can see, or in `manual` mode any training loop.
fn holds_training_loop(body: &Block, manual: bool) -> bool {
    struct Finder {
        manual: bool,
        found: bool,
    }
    impl<'a> Visit<'a> for Finder {
        fn visit_expr(&mut self, e: &'a Expr) {
            if is_training_loop(e)
                && (self.manual || matches!(data_of(e), Data::Iterable | Data::Next(_)))
            {
                self.found = true;
                return;
            }
            syn::visit::visit_expr(self, e);
        }
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            body::visit_call(self, c);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut f = Finder { manual, found: false };
    f.visit_block(body);
    f.found
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

/// The search for training loops, over every expression position of the body.
struct Loops<'r, 'c> {
    rw: &'r mut Rewriter<'c>,
}

impl VisitMut for Loops<'_, '_> {
    fn visit_block_mut(&mut self, block: &mut Block) {
        for i in 0..block.stmts.len() {
            let (before, rest) = block.stmts.split_at_mut(i);
            let replacement = match &mut rest[0] {
                Stmt::Expr(expr, _) if is_training_loop(expr) => self.training_loop(expr, before),
                stmt => {
                    self.visit_stmt_mut(stmt);
                    None
                }
            };
            if let Some(wrapped) = replacement {
                block.stmts[i] = wrapped;
            }
        }
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        if is_training_loop(expr) {
            // A loop in value position (a `match` arm, `let x = loop { .. }`): no statements
            // before it to prepare an iterator in, so it may become a block.
            if let Some(wrapped) = self.training_loop(expr, &mut []) {
                *expr = Expr::Block(syn::ExprBlock {
                    attrs: Vec::new(),
                    label: None,
                    block: Block { brace_token: Default::default(), stmts: vec![wrapped] },
                });
            }
            return;
        }
        match expr {
            Expr::Call(call) if called_in_place(call).is_some() => {
                let Expr::Closure(c) = peel_parens_mut(&mut call.func) else { unreachable!() };
                self.visit_expr_mut(&mut c.body);
                call.args.iter_mut().for_each(|a| self.visit_expr_mut(a));
            }
            // Closures may run anywhere, any number of times; `coverage` refuses those that
            // run backward.
            Expr::Closure(_) | Expr::Async(_) => {}
            _ => syn::visit_mut::visit_expr_mut(self, expr),
        }
    }

    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
    fn visit_macro_mut(&mut self, _: &mut syn::Macro) {}
}

fn peel_parens_mut(expr: &mut Expr) -> &mut Expr {
    match expr {
        Expr::Paren(p) => peel_parens_mut(&mut p.expr),
        other => other,
    }
}

impl Loops<'_, '_> {
    /// A loop that runs backward: searched further when a loop inside it is the one to
    /// prepare, else prepared (or refused). Returns a replacement when it had to be wrapped.
    fn training_loop(&mut self, expr: &mut Expr, before: &mut [Stmt]) -> Option<Stmt> {
        let manual = self.rw.cx.manual_data;
        let data = data_of(expr);
        let body = loop_body_mut(expr).expect("a training loop");
        if holds_training_loop(body, manual) {
            self.visit_block_mut(body);
            return None;
        }
        // Its body runs under autocast in every case: a refused loop is reported once, at
        // the loop, not again at each of its backward calls.
        self.rw.add_autocast(body);
        if manual {
            self.rw.loops += 1;
            return None;
        }
        let name = self.rw.cx.name.clone();
        match data {
            Data::Iterable => {
                let Expr::ForLoop(l) = expr else { unreachable!("only `for` loops iterate") };
                // `enumerate` counts this process's batches, as Python's `enumerate` over a
                // prepared data loader does, so it stays outside.
                match &mut *l.expr {
                    Expr::MethodCall(m) if m.method == "enumerate" && m.args.is_empty() => {
                        let data = &m.receiver;
                        *m.receiver = parse_quote!(#name.prepare_iter(#data));
                    }
                    data => *data = parse_quote!(#name.prepare_iter(#data)),
                }
                self.rw.loops += 1;
                None
            }
            Data::Next(it) => {
                self.rw.loops += 1;
                self.rw.prepare_iterator(it, before, expr)
            }
            Data::Counter { span, what } => {
                self.rw.errors.push(syn::Error::new(
                    span,
                    format!(
                        "this loop runs backward, but it counts (`{what}`) and takes its batches \
                         from elsewhere, so #[accelerate] has no batches to deal: every process \
                         would train on the same data. Loop over the batches themselves (`for \
                         (x, y) in data {{ .. }}`, e.g. `m.train_iter(64)`), or, if each process \
                         picks its own batches (its own seed or files), say so with \
                         #[accelerate(data = \"manual\")]"
                    ),
                ));
                None
            }
            Data::Unseen { span } => {
                self.rw.errors.push(syn::Error::new(
                    span,
                    "#[accelerate] prepares the data of the loop that calls `.backward()`, but \
                     cannot see where this loop takes its batches from; write `for batch in \
                     data { .. }`, `while let Some(batch) = it.next() { .. }`, or start the loop \
                     with `let Some(batch) = it.next() else { break };` — or, if each process \
                     picks its own batches, say so with #[accelerate(data = \"manual\")]",
                ));
                None
            }
        }
    }
}

impl Rewriter<'_> {
    /// Prepares the training loops of `block` (see the module's documentation).
    pub(super) fn rewrite_loops(&mut self, block: &mut Block) {
        Loops { rw: self }.visit_block_mut(block);
    }

    /// Prepares the iterator `it` of a `while`/`loop` that calls `it.next()`: where it is
    /// made, when that is a `let` just before; else by borrowing it for the loop.
    fn prepare_iterator(
        &mut self,
        it: syn::Ident,
        before: &mut [Stmt],
        the_loop: &mut Expr,
    ) -> Option<Stmt> {
        let name = self.cx.name.clone();
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

    /// The whole loop body runs under autocast: the forward passes of the step, however they
    /// are nested. `backward` and the optimizer step switch it off while they run.
    fn add_autocast(&self, body: &mut Block) {
        let name = &self.cx.name;
        let guard = syn::Ident::new(AUTOCAST, Span::call_site());
        body.stmts.insert(0, parse_quote!(let #guard = #name.autocast_step()?;));
    }

    /// Before the first statement that runs backward (looking into plain blocks), the model
    /// named by `model = ..` is prepared, so that driven optimizers step a prepared model.
    pub(super) fn prepare_model_before_training(&self, block: &mut Block) {
        let (Some(model), name) = (&self.cx.model, &self.cx.name) else { return };
        let has_backward = |s: &Stmt| {
            let mut f = BackwardFinder(false);
            f.visit_stmt(s);
            f.0
        };
        let Some(i) = block.stmts.iter().position(has_backward) else { return };
        if let Stmt::Expr(Expr::Block(inner), _) = &mut block.stmts[i] {
            return self.prepare_model_before_training(&mut inner.block);
        }
        block.stmts.insert(i, parse_quote!(#name.prepare_model_once(&#model)?;));
    }
}

/// Where a backward call sits, as the coverage check sees it.
enum Place {
    /// In a closure that is not called where it is written.
    Closure { for_each: bool },
    /// In a function or other item defined inside the body.
    Item,
}

/// The coverage invariant, checked on the body after its loops were prepared: every
/// backward call is inside a prepared loop (whose body starts with the autocast guard),
/// else an error at the call saying why it could not be prepared and what to write.
pub(super) fn coverage(body: &Block, manual: bool) -> Vec<syn::Error> {
    struct Check {
        prepared: usize,
        loops: usize,
        places: Vec<Place>,
        manual: bool,
        errors: Vec<syn::Error>,
    }
    fn is_prepared(body: &Block) -> bool {
        matches!(body.stmts.first(), Some(Stmt::Local(l))
            if body::simple_binding(&l.pat).is_some_and(|i| i == AUTOCAST))
    }
    impl Check {
        fn in_loop(&mut self, body: &Block) {
            let prepared = usize::from(is_prepared(body));
            self.prepared += prepared;
            self.loops += 1;
            self.visit_block(body);
            self.loops -= 1;
            self.prepared -= prepared;
        }
        fn reason(&self) -> Option<String> {
            let fix = if self.manual {
                "write the training step in a loop of this function (`for batch in data { .. }`)"
            } else {
                "write the training step in a loop over the batches in this function (`for \
                 batch in data { .. }`)"
            };
            match self.places.last() {
                Some(Place::Closure { for_each: true }) => Some(
                    "this backward runs in a closure passed to `for_each`, which #[accelerate] \
                     does not rewrite: the batches would not be dealt across processes nor the \
                     forward pass run under autocast. Write `for batch in data { .. }` instead"
                        .to_owned(),
                ),
                Some(Place::Closure { .. }) => Some(format!(
                    "this backward runs in a closure, which may run anywhere and any number of \
                     times, so #[accelerate] cannot prepare its data or run its forward pass \
                     under autocast; {fix}, or call the closure where it is written \
                     (`(|| {{ .. }})()`)"
                )),
                Some(Place::Item) => Some(
                    "this backward runs in a function defined inside the annotated one, which \
                     #[accelerate] does not rewrite: put the training loop in the annotated \
                     function, or put #[accelerate] on this one"
                        .to_owned(),
                ),
                None if self.prepared > 0 => None,
                None if self.loops == 0 => Some(format!(
                    "this backward runs outside any loop, so #[accelerate] has no data loop to \
                     prepare (deal the batches across processes, close accumulation windows, \
                     run the forward pass under autocast); {fix}"
                )),
                // In a loop around the prepared one (refused loops count as prepared: they
                // are reported at the loop).
                None => Some(format!(
                    "this backward runs in a loop around the training loop #[accelerate] \
                     prepared, not inside it, so its batches are not dealt nor its forward \
                     pass run under autocast; move it into that loop, or {fix}"
                )),
            }
        }
    }
    impl<'a> Visit<'a> for Check {
        fn visit_expr_for_loop(&mut self, l: &'a syn::ExprForLoop) {
            self.visit_expr(&l.expr);
            self.in_loop(&l.body);
        }
        fn visit_expr_while(&mut self, w: &'a syn::ExprWhile) {
            self.visit_expr(&w.cond);
            self.in_loop(&w.body);
        }
        fn visit_expr_loop(&mut self, l: &'a syn::ExprLoop) {
            self.in_loop(&l.body);
        }
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            body::visit_call(self, c);
        }
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            if body::is_backward(m) {
                if let Some(why) = self.reason() {
                    self.errors.push(syn::Error::new(m.method.span(), why));
                }
            }
            self.visit_expr(&m.receiver);
            let for_each = m.method == "for_each" || m.method == "try_for_each";
            for arg in &m.args {
                match arg {
                    Expr::Closure(c) => {
                        self.places.push(Place::Closure { for_each });
                        self.visit_expr(&c.body);
                        self.places.pop();
                    }
                    other => self.visit_expr(other),
                }
            }
        }
        fn visit_expr_closure(&mut self, c: &'a syn::ExprClosure) {
            self.places.push(Place::Closure { for_each: false });
            self.visit_expr(&c.body);
            self.places.pop();
        }
        fn visit_item(&mut self, item: &'a syn::Item) {
            self.places.push(Place::Item);
            syn::visit::visit_item(self, item);
            self.places.pop();
        }
    }
    let mut check = Check { prepared: 0, loops: 0, places: Vec::new(), manual, errors: Vec::new() };
    check.visit_block(body);
    check.errors
}
