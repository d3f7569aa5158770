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

/// An expression whose every token is at `span` (the user's loop or `break`): a call the
/// accelerator locates with `#[track_caller]` must be wholly the user's line, or rustc
/// reports the attribute's.
macro_rules! located {
    ($span:expr=> $($tokens:tt)*) => {
        syn::parse2::<Expr>(quote::quote_spanned!($span=> $($tokens)*))
            .expect("generated expressions parse")
    };
}
use super::index;

/// The statement every prepared loop body starts with; [`coverage`] recognises prepared
/// loops by it.
const AUTOCAST: &str = "__accel_autocast";

/// Finds a backward call; with `own_only`, outside the training loops inside what it visits.
struct BackwardFinder {
    found: bool,
    own_only: bool,
}

impl<'a> Visit<'a> for BackwardFinder {
    fn visit_expr(&mut self, e: &'a Expr) {
        if !(self.own_only && is_training_loop(e)) {
            syn::visit::visit_expr(self, e);
        }
    }
    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        self.found |= body::is_backward(m);
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
    let mut f = BackwardFinder { found: false, own_only: false };
    f.visit_block(block);
    f.found
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
pub(super) fn is_training_loop(expr: &Expr) -> bool {
    loop_body(expr).is_some_and(block_has_backward)
}

/// Whether `body` runs a backward outside its inner training loops (and outside closures
/// and items).
fn runs_own_backward(body: &Block) -> bool {
    let mut f = BackwardFinder { found: false, own_only: true };
    f.visit_block(body);
    f.found
}

/// The iterator the training loops inside `body` take their batches from: the receiver of
/// the first `it.next()` in one of them (`let Some(real) = batches.next() else { .. }` in a
/// critic loop).
fn inner_next_receiver(body: &Block) -> Option<syn::Ident> {
    struct Inner(Option<syn::Ident>);
    impl<'a> Visit<'a> for Inner {
        fn visit_expr(&mut self, e: &'a Expr) {
            match loop_body(e) {
                Some(inner) if self.0.is_none() && is_training_loop(e) => {
                    self.0 = first_next(|f| f.visit_block(inner));
                }
                _ => syn::visit::visit_expr(self, e),
            }
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut inner = Inner(None);
    inner.visit_block(body);
    inner.0
}

/// Where a training loop takes its batches from, as far as the attribute can see.
enum Data {
    /// `for batch in data` (any iterable but a counting range): the iterable is dealt.
    Iterable,
    /// `while let Some(b) = it.next()` or `loop { let Some(b) = it.next() else { .. }; .. }`.
    Next(syn::Ident),
    /// A range whose index only picks the batch (`x.narrow(0, i * bs, bs)`, `batches[i]`):
    /// the range is dealt.
    Indexed,
    /// A range whose index picks the batch and is used otherwise too, or is passed where
    /// the attribute cannot tell what it does: refused at those uses.
    Refused(Vec<syn::Error>),
    /// A loop that only counts (`for iter in 0..max_iters` whose index picks nothing,
    /// `loop { .. }`, `while cond { .. }`): its body draws its own batches, so every process
    /// runs every iteration, each drawing from a random stream of its own.
    Counting,
    /// `while let` over something other than `it.next()`.
    Unseen { span: Span },
}

impl Data {
    /// A loop that deals data (or is refused for how it would): searched for first.
    fn deals(&self) -> bool {
        matches!(self, Data::Iterable | Data::Next(_) | Data::Indexed | Data::Refused(_))
    }
}

/// How the attribute decides what a loop's data is (the `data` key).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// The default: from what the loop's body does with its index; asks when unclear.
    Decide,
    /// `data = "dealt"`: a range's index picks the batch.
    Dealt,
    /// `data = "drawn"`: counting loops draw their own batches.
    Drawn,
    /// `data = "manual"`: nothing is dealt; every training loop runs under autocast only.
    Manual,
}

impl Mode {
    pub(super) fn of(data: Option<accel_choices::DataSharding>) -> Self {
        use accel_choices::DataSharding::*;
        match data {
            None | Some(Prepared) => Mode::Decide,
            Some(Dealt) => Mode::Dealt,
            Some(Drawn) => Mode::Drawn,
            Some(Manual) => Mode::Manual,
        }
    }
}

fn range_text(range: &Expr) -> String {
    quote::ToTokens::to_token_stream(range)
        .to_string()
        .replace(" . ", ".")
        .replace(" ..= ", "..=")
        .replace(" .. ", "..")
        .replace("( ", "(")
        .replace(" )", ")")
}

fn data_of(expr: &Expr, mode: Mode) -> Data {
    match expr {
        Expr::ForLoop(l) => match range_of(&l.expr) {
            Some(range) => index_data(&l.pat, &l.body, range, mode),
            None => Data::Iterable,
        },
        Expr::While(w) => match next_receiver(Some(&w.cond), &w.body) {
            Some(it) => Data::Next(it),
            // Batches from a source the attribute cannot see: each process draws its own
            // when the attribute says so, else the user is asked.
            None if matches!(&*w.cond, Expr::Let(_)) && mode == Mode::Drawn => Data::Counting,
            None if matches!(&*w.cond, Expr::Let(_)) => {
                Data::Unseen { span: span_of(&w.while_token) }
            }
            None => counting(mode, span_of(&w.while_token)),
        },
        Expr::Loop(l) => match next_receiver(None, &l.body) {
            Some(it) => Data::Next(it),
            // `loop { let Some(b) = source() else { break }; .. }`: batches from somewhere
            // the attribute cannot see, as with `while let`.
            None if mode != Mode::Drawn
                && matches!(l.body.stmts.first(), Some(Stmt::Local(local))
                if local.init.as_ref().is_some_and(|i| i.diverge.is_some())) =>
            {
                Data::Unseen { span: span_of(&l.loop_token) }
            }
            None => counting(mode, span_of(&l.loop_token)),
        },
        _ => Data::Unseen { span: span_of(expr) },
    }
}

/// A loop with no index and no iterator in sight: it counts, unless told to deal.
fn counting(mode: Mode, span: Span) -> Data {
    if mode != Mode::Dealt {
        return Data::Counting;
    }
    Data::Refused(vec![syn::Error::new(
        span,
        "`data = \"dealt\"`, but this loop has nothing to deal: write it over the batches \
         (`for batch in data { .. }`) or over their indices (`for i in 0..n { .. }`)",
    )])
}

/// A range loop: dealt, counting, or refused, from what its body does with the index.
fn index_data(pat: &Pat, body: &Block, range: &Expr, mode: Mode) -> Data {
    if mode == Mode::Drawn {
        return Data::Counting;
    }
    let uses = index::uses(pat, body);
    let name = index::bound_names(pat).join(", ");
    let range = range_text(range);
    let pick = uses.picks.first().map(|u| u.what.clone());
    let other_errors = |pick: &str| -> Vec<syn::Error> {
        uses.other
            .iter()
            .map(|u| {
                syn::Error::new(
                    u.span,
                    format!(
                        "`{name}` {pick}, so #[accelerate] deals this loop across processes: each \
                         of N processes takes every Nth `{name}` of `{range}` (process 0 takes 0, N, \
                         2N, ..). Here `{name}` {}, which would then differ from process to \
                         process. Count the steps apart from the index: `for (step, {name}) in \
                         ({range}).enumerate() {{ .. }}` (`step` counts this process's batches, \
                         the same on every process); for gradient accumulation, step every batch \
                         and set `accumulate = k` in the attribute",
                        u.what
                    ),
                )
            })
            .collect()
    };
    match mode {
        Mode::Dealt if uses.other.is_empty() => Data::Indexed,
        Mode::Dealt => Data::Refused(other_errors("picks the batch (`data = \"dealt\"`)")),
        _ if !uses.unclear.is_empty() => Data::Refused(
            uses.unclear
                .iter()
                .map(|u| {
                    syn::Error::new(
                        u.span,
                        format!(
                            "`{name}` {}, and #[accelerate] cannot tell whether that picks this \
                             loop's batch or only counts. If it picks the batch, the loop is \
                             dealt: each of N processes takes every Nth `{name}` of `{range}`. If it \
                             only counts (a schedule; a loop that draws random batches, as \
                             nanoGPT's does), every process runs every iteration and draws batches \
                             of its own. Say which: #[accelerate(data = \"dealt\")] or \
                             #[accelerate(data = \"drawn\")]",
                            u.what
                        ),
                    )
                })
                .collect(),
        ),
        _ => match pick {
            None => Data::Counting,
            Some(_) if uses.other.is_empty() => Data::Indexed,
            Some(pick) => Data::Refused(other_errors(&pick)),
        },
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

/// Whether `body` holds a training loop (outside closures and items) for which `pick` is
/// true.
fn holds_loop(body: &Block, pick: &dyn Fn(&Expr) -> bool) -> bool {
    struct Finder<'p> {
        pick: &'p dyn Fn(&Expr) -> bool,
        found: bool,
    }
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_expr(&mut self, e: &'a Expr) {
            if is_training_loop(e) && (self.pick)(e) {
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
    let mut f = Finder { pick, found: false };
    f.visit_block(body);
    f.found
}

/// The iterator a loop takes its data from: `while let .. = it.next()`, or the first
/// `it.next()` in its body (`let Some(b) = it.next() else { break };`).
fn next_receiver(cond: Option<&Expr>, body: &Block) -> Option<syn::Ident> {
    cond.and_then(|c| first_next(|f| f.visit_expr(c)))
        .or_else(|| body.stmts.first().and_then(|s| first_next(|f| f.visit_stmt(s))))
}

/// Finds the first `it.next()` (outside closures) in what `visit` visits.
struct NextFinder(Option<syn::Ident>);

impl<'a> Visit<'a> for NextFinder {
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

/// The receiver of the first `it.next()` that `visit` finds.
fn first_next(visit: impl FnOnce(&mut NextFinder)) -> Option<syn::Ident> {
    let mut f = NextFinder(None);
    visit(&mut f);
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

/// What preparing the training loops of a body found.
#[derive(Default)]
pub(super) struct Prepared {
    /// Data loops prepared.
    pub(super) loops: usize,
    /// Of those, loops that count and draw their own batches.
    pub(super) drawn: usize,
    /// Loops refused, at their spans.
    pub(super) errors: Vec<syn::Error>,
}

/// Prepares the training loops of `block` (see the module's documentation) for the
/// accelerator named `name`.
pub(super) fn prepare(block: &mut Block, mode: Mode, name: &syn::Ident) -> Prepared {
    let mut loops = Loops { mode, name, found: Prepared::default() };
    loops.visit_block_mut(block);
    loops.found
}

/// Whether `stmt` calls `.backward()` anywhere.
pub(super) fn runs_backward(stmt: &Stmt) -> bool {
    let mut f = BackwardFinder { found: false, own_only: false };
    f.visit_stmt(stmt);
    f.found
}

/// The search for training loops, over every expression position of the body.
struct Loops<'a> {
    mode: Mode,
    /// The accelerator's variable.
    name: &'a syn::Ident,
    found: Prepared,
}

impl VisitMut for Loops<'_> {
    fn visit_block_mut(&mut self, block: &mut Block) {
        for i in 0..block.stmts.len() {
            let (before, rest) = block.stmts.split_at_mut(i);
            match &mut rest[0] {
                Stmt::Expr(expr, _) if is_training_loop(expr) => {
                    // A replacement keeps the statement's semicolon (and so its type).
                    if let Some(wrapped) = self.training_loop(expr, before) {
                        *expr = wrapped;
                    }
                }
                stmt => self.visit_stmt_mut(stmt),
            }
        }
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        if is_training_loop(expr) {
            // A loop in value position (a `match` arm, `let x = loop { .. }`): no statements
            // before it to prepare an iterator in, so it may become a block.
            if let Some(wrapped) = self.training_loop(expr, &mut []) {
                *expr = wrapped;
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

impl Loops<'_> {
    /// A loop that runs backward: searched further when a loop inside it is the one to
    /// prepare, else prepared (or refused). Returns a replacement when it had to be wrapped.
    ///
    /// The loop prepared is the innermost one that deals data; failing that, the innermost
    /// training loop, which counts (its body draws its own batches). A counting loop inside
    /// a data loop (`for _ in 0..n_critic`) only repeats the step on the batch dealt around it.
    ///
    /// A loop that runs a backward of its own besides its inner training loops (WGAN's
    /// generator step after `n_critic` critic steps) is the step itself when nothing inside
    /// it deals data: it is prepared, its inner loops only repeat steps within it, and the
    /// iterator they take their batches from (`it.next()`) is the data it deals.
    fn training_loop(&mut self, expr: &mut Expr, before: &mut [Stmt]) -> Option<Expr> {
        let mode = self.mode;
        let manual = mode == Mode::Manual;
        let mut data = data_of(expr, mode);
        let body = loop_body_mut(expr).expect("a training loop");
        let deals_inside = !manual && holds_loop(body, &|e| data_of(e, mode).deals());
        let own_step = !deals_inside && runs_own_backward(body);
        let inner_step = !own_step && holds_loop(body, &|_| true);
        if deals_inside || (inner_step && (manual || !data.deals())) {
            self.visit_block_mut(body);
            return None;
        }
        if own_step && matches!(data, Data::Counting) && mode != Mode::Drawn {
            if let Some(it) = inner_next_receiver(body) {
                data = Data::Next(it);
            }
        }
        // Its body runs under autocast in every case: a refused loop is reported once, at
        // the loop, not again at each of its backward calls.
        self.add_autocast(body);
        if manual {
            self.found.loops += 1;
            return None;
        }
        let name = self.name.clone();
        match data {
            Data::Iterable | Data::Indexed => {
                let Expr::ForLoop(l) = expr else { unreachable!("only `for` loops iterate") };
                // The loop's own span: the accelerator knows each loop by its line.
                let at = span_of(&l.for_token);
                let name = respan(&name, at);
                let prepare = |data: &Expr| {
                    let data = match data {
                        Expr::Paren(p) => &*p.expr,
                        other => other,
                    };
                    located!(at=> #name.prepare_iter(#data))
                };
                // `enumerate` counts this process's batches, as Python's `enumerate` over a
                // prepared data loader does, so it stays outside.
                match &mut *l.expr {
                    Expr::MethodCall(m) if m.method == "enumerate" && m.args.is_empty() => {
                        *m.receiver = prepare(&m.receiver);
                    }
                    data => *data = prepare(data),
                }
                self.found.loops += 1;
                self.note_exits(loop_body_mut(expr).expect("a loop"));
                None
            }
            Data::Next(it) => {
                self.found.loops += 1;
                self.note_exits(loop_body_mut(expr).expect("a loop"));
                self.prepare_iterator(it, before, expr)
            }
            Data::Counting => {
                self.found.loops += 1;
                self.found.drawn += 1;
                self.note_exits(loop_body_mut(expr).expect("a loop"));
                if let Expr::ForLoop(l) = expr {
                    let (at, range) = (span_of(&l.for_token), &l.expr);
                    let name = respan(&name, at);
                    *l.expr = located!(at=> #name.prepare_steps(#range));
                    return None;
                }
                // `loop`/`while`: no iterable to wrap; a guard around the loop counts its
                // iterations (its drop ends them, as a prepared iterator's does).
                let at = span_of(&*expr);
                let body = loop_body_mut(expr).expect("a loop");
                body.stmts.insert(1, parse_quote!(__accel_steps.next_step();));
                let name = respan(&name, at);
                let guard = located!(at=> #name.drawn_loop());
                Some(parse_quote!({
                    let mut __accel_steps = #guard;
                    #expr
                }))
            }
            Data::Refused(errors) => {
                self.found.errors.extend(errors);
                None
            }
            Data::Unseen { span } => {
                self.found.errors.push(syn::Error::new(
                    span,
                    "#[accelerate] prepares the data of the loop that calls `.backward()`, but \
                     cannot see where this loop takes its batches from; write `for batch in \
                     data { .. }`, `while let Some(batch) = it.next() { .. }`, or start the loop \
                     with `let Some(batch) = it.next() else { break };` — or say how each \
                     process gets its batches: #[accelerate(data = \"drawn\")] (each draws its \
                     own, from its own random stream) or #[accelerate(data = \"manual\")] (the \
                     program gives each its part)",
                ));
                None
            }
        }
    }
}

impl Loops<'_> {
    /// Prepares the iterator `it` of a `while`/`loop` that calls `it.next()`: where it is
    /// made, when that is a `let` just before and nothing between uses it; else by borrowing
    /// it for the loop (an iterator configured first, `it.shuffle()`, keeps its own type).
    fn prepare_iterator(
        &mut self,
        it: syn::Ident,
        before: &mut [Stmt],
        the_loop: &mut Expr,
    ) -> Option<Expr> {
        let at = span_of(&*the_loop);
        let name = respan(self.name, at);
        let made = before.iter().rposition(|s| match s {
            Stmt::Local(local) => {
                body::simple_binding(&local.pat).is_some_and(|i| *i == it) && local.init.is_some()
            }
            _ => false,
        });
        let used_between = made.is_some_and(|i| {
            before[i + 1..].iter().any(|s| mentions(&quote::ToTokens::to_token_stream(s), &it))
        });
        if let (Some(i), false) = (made, used_between) {
            if let Stmt::Local(local) = &mut before[i] {
                let init = local.init.as_mut().expect("checked above");
                let e = &init.expr;
                *init.expr = located!(at=> #name.prepare_iter(#e));
                return None;
            }
        }
        // Made elsewhere (an argument, say): the loop borrows it through a prepared view.
        let prepared = syn::Ident::new(&format!("__accel_{it}"), it.span());
        RenameNext { from: &it, to: &prepared }.visit_expr_mut(the_loop);
        let prepare = located!(at=> #name.prepare_iter(#it.by_ref()));
        Some(parse_quote!({
            let mut #prepared = #prepare;
            #the_loop
        }))
    }

    /// Each way out of a prepared loop's body before its data ends (`break`, `return`) first
    /// tells the accelerator where it leaves, so that a process leaving alone is reported
    /// with that line.
    fn note_exits(&self, body: &mut Block) {
        struct Exits<'n> {
            name: &'n syn::Ident,
            /// Labels of the loops inside the prepared one, innermost last; `None` unlabeled.
            inner: Vec<Option<String>>,
        }
        impl Exits<'_> {
            fn leaves(&self, label: Option<&syn::Lifetime>) -> bool {
                match label {
                    None => self.inner.is_empty(),
                    Some(l) => !self.inner.iter().flatten().any(|i| l.ident == i),
                }
            }
            fn nested(&mut self, label: Option<&syn::Label>, f: impl FnOnce(&mut Self)) {
                self.inner.push(label.map(|l| l.name.ident.to_string()));
                f(self);
                self.inner.pop();
            }
        }
        impl VisitMut for Exits<'_> {
            fn visit_expr_mut(&mut self, e: &mut Expr) {
                match e {
                    Expr::ForLoop(l) => {
                        self.visit_expr_mut(&mut l.expr);
                        let label = l.label.clone();
                        self.nested(label.as_ref(), |s| s.visit_block_mut(&mut l.body));
                    }
                    Expr::While(w) => {
                        self.visit_expr_mut(&mut w.cond);
                        let label = w.label.clone();
                        self.nested(label.as_ref(), |s| s.visit_block_mut(&mut w.body));
                    }
                    Expr::Loop(l) => {
                        let label = l.label.clone();
                        self.nested(label.as_ref(), |s| s.visit_block_mut(&mut l.body));
                    }
                    Expr::Closure(_) | Expr::Async(_) => {}
                    Expr::Break(b) if b.expr.is_none() && self.leaves(b.label.as_ref()) => {
                        let span = span_of(&*b);
                        let name = respan(self.name, span);
                        let call = located!(span=> #name.leaving_loop());
                        *e = parse_quote!({ #call; #b });
                    }
                    Expr::Return(r) => {
                        if let Some(value) = &mut r.expr {
                            self.visit_expr_mut(value);
                        }
                        let span = span_of(&*r);
                        let name = respan(self.name, span);
                        let call = located!(span=> #name.leaving_loop());
                        *e = parse_quote!({ #call; #r });
                    }
                    _ => syn::visit_mut::visit_expr_mut(self, e),
                }
            }
            fn visit_local_mut(&mut self, local: &mut syn::Local) {
                // `let Some(b) = it.next() else { break };` is the loop's end of data.
                if let Some(init) = &mut local.init {
                    self.visit_expr_mut(&mut init.expr);
                    let reads_next =
                        matches!(&*init.expr, Expr::MethodCall(m) if m.method == "next");
                    if let (Some((_, diverge)), false) = (&mut init.diverge, reads_next) {
                        self.visit_expr_mut(diverge);
                    }
                }
            }
            fn visit_item_mut(&mut self, _: &mut syn::Item) {}
            fn visit_macro_mut(&mut self, _: &mut syn::Macro) {}
        }
        Exits { name: self.name, inner: Vec::new() }.visit_block_mut(body);
    }

    /// The whole loop body runs under autocast: the forward passes of the step, however they
    /// are nested. `backward` and the optimizer step switch it off while they run.
    fn add_autocast(&self, body: &mut Block) {
        let name = self.name;
        let guard = syn::Ident::new(AUTOCAST, Span::call_site());
        body.stmts.insert(0, parse_quote!(let #guard = #name.autocast_step()?;));
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
                     pass run under autocast; move it into that loop (a step every k batches, \
                     as a GAN's generator step: `if i % k == 0 {{ .. }}` in `for (i, batch) \
                     in data.enumerate()`), or {fix}"
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

/// Whether `tokens` mention the identifier `ident`.
pub(super) fn mentions(tokens: &proc_macro2::TokenStream, ident: &syn::Ident) -> bool {
    tokens.clone().into_iter().any(|t| match t {
        proc_macro2::TokenTree::Ident(i) => i == *ident,
        proc_macro2::TokenTree::Group(g) => mentions(&g.stream(), ident),
        _ => false,
    })
}

/// The accelerator's name at `span`: a call the accelerator locates with `#[track_caller]`
/// (a loop, a `break`) must start at the user's line, not at the attribute's.
fn respan(name: &syn::Ident, span: Span) -> syn::Ident {
    syn::Ident::new(&name.to_string(), span)
}
