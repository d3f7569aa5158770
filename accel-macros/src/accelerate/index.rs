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
//! - **other**: it counts: arithmetic, a condition, an optimizer setting, a print.
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
        let decided = matches!(self.ctx, Ctx::Pick(_) | Ctx::Other(_))
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

    fn visit_expr_assign(&mut self, a: &'a syn::ExprAssign) {
        // `lr = get_lr(i);` makes `lr` a counter, as a `let` would.
        self.derived = false;
        self.within(Ctx::Derive, |f| f.visit_expr(&a.right));
        if self.derived {
            if let Some(key) = body::place_key(&a.left) {
                self.names.push(key);
            }
        }
        self.visit_expr(&a.left);
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
        let what = format!("decides a branch (`if {}`)", text(&e.cond));
        self.within(Ctx::Other(what), |f| f.visit_expr(&e.cond));
        self.visit_block(&e.then_branch);
        if let Some((_, other)) = &e.else_branch {
            self.visit_expr(other);
        }
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
            let name = m.path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default();
            let what = if ["println", "print", "eprintln", "eprint", "format", "write", "writeln"]
                .contains(&name.as_str())
            {
                format!("is printed (`{name}!`)")
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
        // nanoGPT: the schedule's function only counts; the batch comes from elsewhere.
        let nano = parse_quote!({
            opt.set_lr(get_lr(iter));
            let (xb, yb) = get_batch(&data);
            if iter % 100 == 0 {
                println!("{iter}");
            }
        });
        assert_eq!(of(parse_quote!(iter), nano), (0, 0, 3));
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
}
