//! What the index of a counting loop (`for i in 0..n`) does in the loop's body: the one
//! question that decides whether the loop is dealt across processes (the index picks each
//! batch) or runs whole on every process (the index only counts, and the body draws its own
//! batches, as nanoGPT's loop does).
//!
//! Each use of the index — or of a value computed from it (`let start = i * bs;`,
//! `let (x, y) = get_batch(i);`) — is one of:
//! - a **pick**: it selects data: an index (`batches[i]`), the arguments of a slicing
//!   method (`x.narrow(0, i * bs, bs)`), a model's input or a loss's target;
//! - **unclear**: it is passed to a function the attribute cannot see into, in a place
//!   that decides nothing visible (`train_step(i)`);
//! - **other**: it counts: arithmetic, a condition, an optimizer setting;
//! - **logs**: it is printed or logged, or decides only whether something is
//!   (`if i % 100 == 0 { println!("batch {i} loss {l}") }`): nothing computed depends on it,
//!   so a dealt loop may use it so (each batch's line is printed by the process that took
//!   that batch, with that batch's index).
//!
//! Values made from data (`let xb = x.narrow(0, i * bs, bs)`) are data, not counters:
//! their later uses (`total += loss`) say nothing about the index.

use proc_macro2::Span;
use quote::ToTokens;
use syn::visit::Visit;
use syn::{Block, Expr, ExprMethodCall, Pat};

use super::body::{self, span_of};

/// Methods whose arguments select part of their receiver.
const SLICING: &[&str] = &[
    "narrow",
    "slice",
    "i",
    "get",
    "get_mut",
    "select",
    "index_select",
    "take",
    "chunk",
    "split_at",
    "gather",
];

/// Macros that print or log their arguments and return nothing training uses.
const LOG_MACROS: &[&str] =
    &["println", "print", "eprintln", "eprint", "info", "debug", "warn", "error", "trace", "log"];

/// Methods that print, log or show progress (`accelerator.print(..)`, a tracker's
/// `log(..)`, indicatif's progress bars), with at least one argument.
const LOG_METHODS: &[&str] =
    &["print", "log", "inc", "set_message", "set_position", "set_prefix", "println"];

fn macro_name(m: &syn::Macro) -> String {
    m.path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default()
}

/// Whether `block` only prints or logs: each statement a logging macro or method call, an
/// update of a variable in `log_vars` (which only logging reads: a running loss reset after
/// it is printed), or an `if` on such statements.
fn only_logs(block: &Block, log_vars: &[String]) -> bool {
    block.stmts.iter().all(|stmt| match stmt {
        syn::Stmt::Macro(m) => LOG_MACROS.contains(&macro_name(&m.mac).as_str()),
        syn::Stmt::Expr(e, _) => logs(e, log_vars),
        syn::Stmt::Local(local) => {
            let names = bound_names(&local.pat);
            !names.is_empty() && names.iter().all(|n| log_vars.contains(n))
        }
        syn::Stmt::Item(_) => false,
    })
}

fn logs(e: &Expr, log_vars: &[String]) -> bool {
    match e {
        Expr::Macro(m) => LOG_MACROS.contains(&macro_name(&m.mac).as_str()),
        Expr::MethodCall(m) => {
            LOG_METHODS.iter().any(|l| m.method == l)
                && !m.args.is_empty()
                && matches!(&*m.receiver, Expr::Path(_) | Expr::Field(_))
        }
        Expr::Assign(a) => body::place_key(&a.left).is_some_and(|k| log_vars.contains(&k)),
        Expr::Binary(b) if is_compound_assign(&b.op) => {
            body::place_key(&b.left).is_some_and(|k| log_vars.contains(&k))
        }
        Expr::If(i) => {
            only_logs(&i.then_branch, log_vars)
                && i.else_branch.as_ref().is_none_or(|(_, e)| match &**e {
                    Expr::Block(b) => only_logs(&b.block, log_vars),
                    other => logs(other, log_vars),
                })
        }
        Expr::Block(b) => only_logs(&b.block, log_vars),
        _ => false,
    }
}

fn is_compound_assign(op: &syn::BinOp) -> bool {
    use syn::BinOp::*;
    matches!(op, AddAssign(_) | SubAssign(_) | MulAssign(_) | DivAssign(_) | RemAssign(_))
}

/// The variables of `body` that only logging reads: assigned (`=`, `+=`, ...) somewhere in
/// it, and otherwise read only inside logging macros and calls, or to update one another —
/// a running loss summed for printing and reset after it.
fn log_only_variables(body: &Block) -> Vec<String> {
    // Every place a variable is read, with whether it is a logging read.
    struct Reads {
        assigned: Vec<String>,
        /// (name, read by logging or by an update of the variable named)
        reads: Vec<(String, Option<String>)>,
        /// Inside a logging macro or call, or the right side of an update of this place.
        within: Option<Option<String>>,
    }
    impl<'a> Visit<'a> for Reads {
        fn visit_expr_assign(&mut self, a: &'a syn::ExprAssign) {
            let key = body::place_key(&a.left);
            if let Some(k) = &key {
                self.assigned.push(k.clone());
            }
            let outer = self.within.replace(key);
            self.visit_expr(&a.right);
            self.within = outer;
        }
        fn visit_expr_binary(&mut self, b: &'a syn::ExprBinary) {
            if !is_compound_assign(&b.op) {
                return syn::visit::visit_expr_binary(self, b);
            }
            let key = body::place_key(&b.left);
            if let Some(k) = &key {
                self.assigned.push(k.clone());
            }
            let outer = self.within.replace(key);
            self.visit_expr(&b.right);
            self.within = outer;
        }
        fn visit_local(&mut self, local: &'a syn::Local) {
            let names = bound_names(&local.pat);
            self.assigned.extend(names.iter().cloned());
            if let Some(init) = &local.init {
                let outer = self.within.replace(names.first().cloned());
                self.visit_expr(&init.expr);
                self.within = outer;
            }
        }
        fn visit_macro(&mut self, m: &'a syn::Macro) {
            let logging = LOG_MACROS.contains(&macro_name(m).as_str());
            // Macro arguments are tokens: every identifier in them counts as a read.
            fn idents(tokens: proc_macro2::TokenStream, out: &mut Vec<String>) {
                for t in tokens {
                    match t {
                        proc_macro2::TokenTree::Ident(i) => out.push(i.to_string()),
                        proc_macro2::TokenTree::Group(g) => idents(g.stream(), out),
                        proc_macro2::TokenTree::Literal(l) => {
                            // Inline format arguments: `{name}`, `{name:.3}`.
                            let l = l.to_string();
                            for part in l.split('{').skip(1) {
                                let name: String = part
                                    .chars()
                                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                                    .collect();
                                if !name.is_empty() {
                                    out.push(name);
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            let mut names = Vec::new();
            idents(m.tokens.clone(), &mut names);
            let by = if logging { Some(None) } else { None };
            for name in names {
                self.reads.push((name, by.clone().unwrap_or(Some(String::new()))));
            }
        }
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            if LOG_METHODS.iter().any(|l| m.method == l) && !m.args.is_empty() {
                self.visit_expr(&m.receiver);
                let outer = self.within.replace(None);
                m.args.iter().for_each(|a| self.visit_expr(a));
                self.within = outer;
                return;
            }
            syn::visit::visit_expr_method_call(self, m);
        }
        fn visit_expr_path(&mut self, p: &'a syn::ExprPath) {
            if let Some(ident) = p.path.get_ident() {
                // Outside any logging or update, a read that counts: `Some("")` names no
                // variable, so it never passes.
                let by = self.within.clone().unwrap_or(Some(String::new()));
                self.reads.push((ident.to_string(), by));
            }
        }
    }
    let mut reads = Reads { assigned: Vec::new(), reads: Vec::new(), within: None };
    reads.visit_block(body);
    // Start from every assigned variable that logging reads; drop those read otherwise,
    // until none drops.
    let mut vars: Vec<String> = reads.assigned.clone();
    vars.retain(|v| reads.reads.iter().any(|(name, by)| name == v && by.is_none()));
    vars.sort();
    vars.dedup();
    loop {
        let before = vars.len();
        let keep: Vec<String> = vars
            .iter()
            .filter(|v| {
                reads.reads.iter().filter(|(name, _)| name == *v).all(|(_, by)| match by {
                    None => true,
                    Some(target) => vars.contains(target),
                })
            })
            .cloned()
            .collect();
        vars = keep;
        if vars.len() == before {
            return vars;
        }
    }
}

/// Methods that feed their arguments (or, for `apply`, their receiver) to a model.
const MODEL: &[&str] = &["forward", "forward_t", "apply", "apply_t"];

/// Methods of numbers, which compute with the index without deciding anything.
const NUMERIC: &[&str] = &[
    "min",
    "max",
    "clamp",
    "abs",
    "pow",
    "powi",
    "powf",
    "sqrt",
    "exp",
    "ln",
    "log",
    "log2",
    "log10",
    "sin",
    "cos",
    "tanh",
    "floor",
    "ceil",
    "round",
    "rem_euclid",
    "div_euclid",
    "saturating_sub",
    "saturating_add",
    "wrapping_add",
    "wrapping_sub",
    "checked_sub",
    "checked_add",
    "mul_add",
    "into",
    "try_into",
    "unwrap",
    "expect",
    "clone",
];

/// A use of the index: where, and what it does there (for messages).
#[derive(Clone)]
pub(super) struct Use {
    pub span: Span,
    /// "sets the learning rate (`opt.set_lr(..)`)", "is passed to `get_batch(..)`".
    pub what: String,
}

/// Every use of a loop's index in its body.
#[derive(Default)]
pub(super) struct IndexUses {
    pub picks: Vec<Use>,
    pub unclear: Vec<Use>,
    pub other: Vec<Use>,
    pub logs: Vec<Use>,
}

/// How the expression being visited uses what it contains.
#[derive(Clone)]
enum Ctx {
    /// Nothing decided yet: a bare use here counts (other).
    Plain,
    /// Inside a `let`'s initializer: a bare use makes the bound names counters too.
    Derive,
    Pick(String),
    Unclear(String),
    Other(String),
    /// Printed or logged, or deciding only whether something is.
    Logs(String),
}

struct Finder {
    /// The index and the names computed from it.
    names: Vec<String>,
    ctx: Ctx,
    /// The statement being visited, for "is used in `..`".
    statement: String,
    uses: IndexUses,
    /// Set while visiting a `let` initializer: whether a use there made it a counter.
    derived: bool,
    /// Variables only logging reads (see [`log_only_variables`]).
    log_vars: Vec<String>,
}

fn text(tokens: &impl ToTokens) -> String {
    let s = tokens.to_token_stream().to_string();
    let s = s
        .replace(" . ", ".")
        .replace(" .", ".")
        .replace(" (", "(")
        .replace("( ", "(")
        .replace(" )", ")")
        .replace(" [", "[")
        .replace("[ ", "[")
        .replace(" ]", "]")
        .replace(" ,", ",")
        .replace("& ", "&")
        .replace(" ;", ";")
        .replace(" ..", "..")
        .replace(".. ", "..");
    if s.chars().count() > 60 {
        format!("{}…", s.chars().take(57).collect::<String>())
    } else {
        s
    }
}

fn call_name(func: &Expr) -> String {
    match func {
        Expr::Path(p) => {
            p.path.segments.iter().map(|s| s.ident.to_string()).collect::<Vec<_>>().join("::")
        }
        other => text(other),
    }
}

impl Finder {
    fn within(&mut self, ctx: Ctx, f: impl FnOnce(&mut Self)) {
        // A decided context is kept by what is inside it: `opt.set_lr(get_lr(i))` sets the
        // learning rate, whatever `get_lr` does. In a `let`, what a helper makes of the
        // index is decided by how the result is used (`let (x, y) = get_batch(i);`).
        let decided = matches!(self.ctx, Ctx::Pick(_) | Ctx::Other(_) | Ctx::Logs(_))
            || (matches!(self.ctx, Ctx::Derive) && matches!(ctx, Ctx::Unclear(_)));
        if decided {
            return f(self);
        }
        let outer = std::mem::replace(&mut self.ctx, ctx);
        f(self);
        self.ctx = outer;
    }

    fn found(&mut self, span: Span) {
        let what = match &self.ctx {
            Ctx::Derive => {
                self.derived = true;
                return;
            }
            Ctx::Pick(w) => {
                self.uses.picks.push(Use { span, what: w.clone() });
                return;
            }
            Ctx::Unclear(w) => {
                self.uses.unclear.push(Use { span, what: w.clone() });
                return;
            }
            Ctx::Logs(w) => {
                self.uses.logs.push(Use { span, what: w.clone() });
                return;
            }
            Ctx::Other(w) => w.clone(),
            Ctx::Plain => format!("is used in `{}`", self.statement),
        };
        self.uses.other.push(Use { span, what });
    }

    fn mentions(&self, tokens: proc_macro2::TokenStream) -> Option<Span> {
        for tree in tokens {
            match tree {
                proc_macro2::TokenTree::Ident(i) if self.names.iter().any(|n| i == n) => {
                    return Some(i.span());
                }
                proc_macro2::TokenTree::Group(g) => {
                    if let Some(s) = self.mentions(g.stream()) {
                        return Some(s);
                    }
                }
                proc_macro2::TokenTree::Literal(l) => {
                    // Inline format arguments: `println!("{i}")`, `"{i:>4}"`.
                    let lit_span = l.span();
                    let l = l.to_string();
                    if l.starts_with('"')
                        && self.names.iter().any(|n| {
                            l.contains(&format!("{{{n}}}")) || l.contains(&format!("{{{n}:"))
                        })
                    {
                        return Some(lit_span);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

impl<'a> Visit<'a> for Finder {
    fn visit_stmt(&mut self, s: &'a syn::Stmt) {
        let outer = std::mem::replace(&mut self.statement, text(s));
        match s {
            syn::Stmt::Local(local) => {
                if let Some(init) = &local.init {
                    self.derived = false;
                    self.within(Ctx::Derive, |f| {
                        f.visit_expr(&init.expr);
                        if let Some((_, diverge)) = &init.diverge {
                            f.visit_expr(diverge);
                        }
                    });
                    if self.derived {
                        self.names.extend(bound_names(&local.pat));
                    }
                }
            }
            other => syn::visit::visit_stmt(self, other),
        }
        self.statement = outer;
    }

    fn visit_expr_path(&mut self, p: &'a syn::ExprPath) {
        if let Some(ident) = p.path.get_ident() {
            if self.names.iter().any(|n| ident == n) {
                self.found(ident.span());
            }
        }
    }

    fn visit_expr_field(&mut self, f: &'a syn::ExprField) {
        match body::place_key(&Expr::Field(f.clone())) {
            Some(key) if self.names.contains(&key) => self.found(span_of(f)),
            _ => self.visit_expr(&f.base),
        }
    }

    fn visit_expr_index(&mut self, i: &'a syn::ExprIndex) {
        self.visit_expr(&i.expr);
        let what = format!("picks the batch (`{}[..]`)", text(&i.expr));
        self.within(Ctx::Pick(what), |f| f.visit_expr(&i.index));
    }

    fn visit_expr_if(&mut self, e: &'a syn::ExprIf) {
        if logs(&Expr::If(e.clone()), &self.log_vars) {
            // Its branches only print or log: whatever decides it changes no computation.
            let what = format!("decides only whether to log (`if {}`)", text(&e.cond));
            return self.within(Ctx::Logs(what), |f| {
                f.visit_expr(&e.cond);
                f.visit_block(&e.then_branch);
                if let Some((_, other)) = &e.else_branch {
                    f.visit_expr(other);
                }
            });
        }
        let what = format!("decides a branch (`if {}`)", text(&e.cond));
        self.within(Ctx::Other(what), |f| f.visit_expr(&e.cond));
        self.visit_block(&e.then_branch);
        if let Some((_, other)) = &e.else_branch {
            self.visit_expr(other);
        }
    }

    fn visit_expr_assign(&mut self, a: &'a syn::ExprAssign) {
        // `lr = get_lr(i);` makes `lr` a counter, as a `let` would; an update of a variable
        // only logging reads logs.
        if body::place_key(&a.left).is_some_and(|k| self.log_vars.contains(&k)) {
            let what = format!("is logged (through `{}`)", text(&a.left));
            return self.within(Ctx::Logs(what), |f| f.visit_expr(&a.right));
        }
        self.derived = false;
        self.within(Ctx::Derive, |f| f.visit_expr(&a.right));
        if self.derived {
            if let Some(key) = body::place_key(&a.left) {
                self.names.push(key);
            }
        }
        self.visit_expr(&a.left);
    }

    fn visit_expr_while(&mut self, e: &'a syn::ExprWhile) {
        let what = format!("decides a loop (`while {}`)", text(&e.cond));
        self.within(Ctx::Other(what), |f| f.visit_expr(&e.cond));
        self.visit_block(&e.body);
    }

    fn visit_expr_match(&mut self, m: &'a syn::ExprMatch) {
        let what = format!("decides a `match {}`", text(&m.expr));
        self.within(Ctx::Other(what), |f| f.visit_expr(&m.expr));
        for arm in &m.arms {
            self.visit_arm(arm);
        }
    }

    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        let method = m.method.to_string();
        let shown = format!("`{}.{method}(..)`", text(&m.receiver));
        let (receiver_ctx, args_ctx) = if SLICING.contains(&method.as_str()) {
            (None, Some(Ctx::Pick(format!("picks the batch ({shown})"))))
        } else if MODEL.contains(&method.as_str()) {
            let pick = Ctx::Pick(format!("is the model's input ({shown})"));
            let receiver = method.starts_with("apply").then(|| pick.clone());
            (receiver, Some(pick))
        } else if method.contains("loss")
            || method.contains("cross_entropy")
            || method.contains("accuracy")
        {
            (None, Some(Ctx::Pick(format!("is the loss's target ({shown})"))))
        } else if body::INFALLIBLE.contains(&method.as_str()) && method.starts_with("set_") {
            (None, Some(Ctx::Other(format!("sets the optimizer ({shown})"))))
        } else if NUMERIC.contains(&method.as_str()) {
            (None, None)
        } else if LOG_METHODS.contains(&method.as_str()) && !m.args.is_empty() {
            (None, Some(Ctx::Logs(format!("is logged ({shown})"))))
        } else {
            (None, Some(Ctx::Unclear(format!("is passed to {shown}"))))
        };
        match receiver_ctx {
            Some(ctx) => self.within(ctx, |f| f.visit_expr(&m.receiver)),
            None => self.visit_expr(&m.receiver),
        }
        for arg in &m.args {
            match &args_ctx {
                Some(ctx) => self.within(ctx.clone(), |f| f.visit_expr(arg)),
                None => self.visit_expr(arg),
            }
        }
    }

    fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
        if let Some(closure) = body::called_in_place(c) {
            self.visit_expr(&closure.body);
            return c.args.iter().for_each(|a| self.visit_expr(a));
        }
        let name = call_name(&c.func);
        let last = name.rsplit("::").next().unwrap_or_default();
        // Constructors (`Some(i)`, `Batch(..)`) and conversions (`f64::from(i)`) compute.
        let computes = last.starts_with(|ch: char| ch.is_uppercase())
            || ["from", "try_from", "min", "max"].contains(&last);
        if computes {
            return c.args.iter().for_each(|a| self.visit_expr(a));
        }
        let ctx = Ctx::Unclear(format!("is passed to `{name}(..)`"));
        self.within(ctx, |f| c.args.iter().for_each(|a| f.visit_expr(a)));
    }

    fn visit_macro(&mut self, m: &'a syn::Macro) {
        if let Some(span) = self.mentions(m.tokens.clone()) {
            let name = macro_name(m);
            if LOG_MACROS.contains(&name.as_str()) {
                return self
                    .within(Ctx::Logs(format!("is printed (`{name}!`)")), |f| f.found(span));
            }
            let what = if ["format", "write", "writeln"].contains(&name.as_str()) {
                format!("is formatted (`{name}!`)")
            } else {
                format!("is used in `{name}!`")
            };
            self.within(Ctx::Other(what), |f| f.found(span));
        }
    }

    // Closures and nested items run elsewhere; what they do with a captured index is
    // theirs (a closure called in place is read above).
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    fn visit_item(&mut self, _: &'a syn::Item) {}
}

/// The names a pattern binds (not `_`-prefixed ones).
pub(super) fn bound_names(pat: &Pat) -> Vec<String> {
    struct Names(Vec<String>);
    impl<'a> Visit<'a> for Names {
        fn visit_pat_ident(&mut self, p: &'a syn::PatIdent) {
            if !p.ident.to_string().starts_with('_') {
                self.0.push(p.ident.to_string());
            }
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut names = Names(Vec::new());
    names.visit_pat(pat);
    names.0
}

/// How the variables `pat` binds are used in `body`.
pub(super) fn uses(pat: &Pat, body: &Block) -> IndexUses {
    let names = bound_names(pat);
    if names.is_empty() {
        return IndexUses::default();
    }
    let mut finder = Finder {
        names,
        ctx: Ctx::Plain,
        statement: String::new(),
        uses: IndexUses::default(),
        derived: false,
        log_vars: log_only_variables(body),
    };
    finder.visit_block(body);
    finder.uses
}

#[cfg(test)]
mod tests {
    use super::*;
    use syn::parse_quote;

    fn of(pat: Pat, body: Block) -> (usize, usize, usize) {
        let u = uses(&pat, &body);
        (u.picks.len(), u.unclear.len(), u.other.len())
    }

    fn logged(pat: Pat, body: Block) -> usize {
        uses(&pat, &body).logs.len()
    }

    #[test]
    fn slicing_and_indexing_pick_while_schedules_and_conditions_count() {
        let i: Pat = parse_quote!(i);
        assert_eq!(
            of(
                i.clone(),
                parse_quote!({
                    let xb = x.narrow(0, i * bs, bs);
                })
            ),
            (1, 0, 0)
        );
        assert_eq!(
            of(
                i.clone(),
                parse_quote!({
                    let (x, y) = &batches[i];
                })
            ),
            (1, 0, 0)
        );
        let start = parse_quote!({
            let s = i * bs;
            let xb = x.narrow(0, s, bs);
            total += xb;
        });
        assert_eq!(of(i.clone(), start), (1, 0, 0));
        let schedule = parse_quote!({
            opt.set_lr(0.05 * (1.0 - i as f64 / n as f64));
            let xb = x.narrow(0, i * bs, bs);
            if (i + 1) % 4 == 0 {
                opt.step();
            }
        });
        assert_eq!(of(i.clone(), schedule), (1, 0, 2));
        // nanoGPT: the schedule's function only counts; the batch comes from elsewhere; the
        // index decides only what is printed.
        let nano: Block = parse_quote!({
            opt.set_lr(get_lr(iter));
            let (xb, yb) = get_batch(&data);
            if iter % 100 == 0 {
                println!("{iter}");
            }
        });
        assert_eq!(of(parse_quote!(iter), nano.clone()), (0, 0, 1));
        assert_eq!(logged(parse_quote!(iter), nano), 2);
        let via_let = parse_quote!({
            let lr = get_lr(iter);
            opt.set_lr(lr);
        });
        assert_eq!(of(parse_quote!(iter), via_let), (0, 0, 1));
        // A batch made from the index by a helper, then fed to the model, is picked.
        let helper = parse_quote!({
            let (xb, yb) = get_batch(i);
            let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
        });
        assert_eq!(of(i.clone(), helper), (2, 0, 0));
        assert_eq!(
            of(
                i.clone(),
                parse_quote!({
                    train_step(i);
                })
            ),
            (0, 1, 0)
        );
        assert_eq!(
            of(
                parse_quote!(_),
                parse_quote!({
                    f(i);
                })
            ),
            (0, 0, 0)
        );
    }

    /// The hand-written loop's logging: every k-th batch printed, a running loss printed and
    /// reset — nothing computed depends on the index there. A branch that does anything else
    /// still counts, as do formats (a file name) and variables read outside logging.
    #[test]
    fn logging_the_index_is_not_a_use_that_changes_training() {
        let i: Pat = parse_quote!(i);
        let log: Block = parse_quote!({
            let xb = x.narrow(0, i * bs, bs);
            let loss = net.forward(&xb).mse_loss(&yb, Reduction::Mean);
            running += loss.double_value(&[]);
            if i % 100 == 0 {
                println!("batch {i} loss {}", running / 100.0);
                running = 0.0;
            } else if i % 10 == 0 {
                log::info!("batch {}", i);
            }
            bar.inc(1);
            accelerator.print(format!("{i}"));
        });
        assert_eq!(of(i.clone(), log.clone()), (1, 0, 0));
        assert!(logged(i.clone(), log) >= 4);
        // A branch that also steps, or a variable the loop reads to compute: counts.
        let steps: Block = parse_quote!({
            let xb = x.narrow(0, i * bs, bs);
            if i % 4 == 0 {
                println!("{i}");
                opt.step();
            }
        });
        assert_eq!(of(i.clone(), steps), (1, 0, 1));
        let feeds: Block = parse_quote!({
            let xb = x.narrow(0, i * bs, bs);
            if i % 4 == 0 {
                scale = 0.5;
            }
            let loss = net.forward(&xb).mean(Kind::Float) * scale;
        });
        assert_eq!(of(i.clone(), feeds), (1, 0, 1));
        let file: Block = parse_quote!({
            let xb = x.narrow(0, i * bs, bs);
            let path = format!("ckpt_{i}.pt");
        });
        assert_eq!(of(i.clone(), file), (1, 0, 1));
    }
}
