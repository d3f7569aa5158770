//! A hang the compiler can see: a collective call inside a branch that only some processes
//! take (`if accelerator.is_main_process() { accelerator.save_state(..)? }`). Every process
//! must call a collective, in the same order; the others never arrive, and the run waits
//! until the timeout. This is among the most common hangs Accelerate users report.

use proc_macro2::Span;
use quote::ToTokens;
use syn::visit::Visit;
use syn::{Expr, ExprMethodCall};

use super::body;

/// Calls every process must make together.
const COLLECTIVES: &[&str] = &[
    "wait_for_everyone",
    "save_state",
    "load_state",
    "save_checkpoint",
    "load_latest_checkpoint",
    "save_model",
    "full_state_dict",
    "gather",
    "gather_for_metrics",
    "reduce",
    "broadcast",
    "pad_across_processes",
    "main_process_first",
    "all_reduce",
    "all_reduce_async",
    "all_gather",
    "all_gather_async",
    "reduce_scatter",
    "barrier",
    "backward",
    "backward_step",
    "backward_step_clip",
    "backward_step_clip_norm",
];

/// Method calls and names whose value differs between processes.
const RANK_METHODS: &[&str] =
    &["is_main_process", "is_local_main_process", "process_index", "local_process_index"];
const RANK_NAMES: &[&str] = &["rank", "local_rank", "global_rank", "process_index"];
/// Environment variables the launchers set to a process's rank.
const RANK_VARIABLES: &[&str] =
    &["RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];

/// What makes `cond` differ between processes, as written (`accelerator.is_main_process()`).
fn rank_dependence(cond: &Expr) -> Option<String> {
    struct Finder(Option<String>);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
            if self.0.is_none() && RANK_METHODS.iter().any(|r| m.method == r) {
                self.0 =
                    Some(m.to_token_stream().to_string().replace(" . ", ".").replace(" (", "("));
            }
            syn::visit::visit_expr_method_call(self, m);
        }
        fn visit_expr_path(&mut self, p: &'a syn::ExprPath) {
            if self.0.is_none() && RANK_NAMES.iter().any(|r| p.path.is_ident(r)) {
                self.0 = Some(p.path.to_token_stream().to_string());
            }
        }
        fn visit_expr_field(&mut self, f: &'a syn::ExprField) {
            if self.0.is_none() {
                if let syn::Member::Named(name) = &f.member {
                    if RANK_NAMES.iter().any(|r| name == r) {
                        self.0 = Some(
                            f.to_token_stream().to_string().replace(" . ", ".").replace(' ', ""),
                        );
                    }
                }
            }
            syn::visit::visit_expr_field(self, f);
        }
        fn visit_expr_call(&mut self, c: &'a syn::ExprCall) {
            // `std::env::var("RANK")`: the launcher's rank variables.
            let reads_env = matches!(&*c.func, Expr::Path(p)
                if p.path.segments.last().is_some_and(|s| s.ident == "var" || s.ident == "var_os")
                    && p.path.segments.iter().any(|s| s.ident == "env"));
            if let (true, None, Some(Expr::Lit(lit))) = (reads_env, &self.0, c.args.first()) {
                if let syn::Lit::Str(name) = &lit.lit {
                    if RANK_VARIABLES.contains(&name.value().as_str()) {
                        self.0 = Some(format!("env::var({:?})", name.value()));
                    }
                }
            }
            syn::visit::visit_expr_call(self, c);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
    }
    let mut finder = Finder(None);
    finder.visit_expr(cond);
    finder.0
}

/// Collective calls in `node` (not in closures, which may run anywhere): the accelerator's,
/// and `save` of one of the function's VarStores, which the attribute makes the
/// accelerator's (every process waits until the file is written).
struct Collectives<'v> {
    found: Vec<(Span, String)>,
    varstores: &'v [syn::Ident],
}

impl<'a> Visit<'a> for Collectives<'_> {
    fn visit_expr_method_call(&mut self, m: &'a ExprMethodCall) {
        let method = m.method.to_string();
        let varstore =
            || body::place_key(&m.receiver).is_some_and(|k| self.varstores.iter().any(|v| *v == k));
        if COLLECTIVES.contains(&method.as_str()) {
            self.found.push((
                m.method.span(),
                format!(
                    "`{method}` is a collective: every process must call it, in the same order"
                ),
            ));
        } else if method == "save" && varstore() {
            self.found.push((
                m.method.span(),
                "`save` of the model's VarStore is, under #[accelerate], the accelerator's \
                 `save_varstore`: the main process writes the file while every process waits \
                 for it, so every process must call it (it is written once all the same)"
                    .into(),
            ));
        }
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
}

struct Lint {
    errors: Vec<syn::Error>,
    varstores: Vec<syn::Ident>,
}

impl Lint {
    fn check_branches<'a>(&mut self, cond: &Expr, branches: impl IntoIterator<Item = &'a Expr>) {
        let Some(why) = rank_dependence(cond) else { return };
        for branch in branches {
            let mut found = Collectives { found: Vec::new(), varstores: &self.varstores };
            found.visit_expr(branch);
            for (span, what) in found.found {
                self.errors.push(syn::Error::new(
                    span,
                    format!(
                        "{what}. Here it is inside a branch on `{why}`, which only some \
                         processes take, so the others would never join it and the run would \
                         hang until the timeout. Call it on every process (outside the branch); \
                         inside the branch, keep only what one process should do (print, log, \
                         write its own files). For work the main process does first, use \
                         `accelerator.main_process_first(|| ..)`"
                    ),
                ));
            }
        }
    }
}

impl<'a> Visit<'a> for Lint {
    fn visit_expr_if(&mut self, i: &'a syn::ExprIf) {
        let then = Expr::Block(syn::ExprBlock {
            attrs: Vec::new(),
            label: None,
            block: i.then_branch.clone(),
        });
        let otherwise = i.else_branch.as_ref().map(|(_, e)| &**e);
        self.check_branches(&i.cond, std::iter::once(&then).chain(otherwise));
        syn::visit::visit_expr_if(self, i);
    }
    fn visit_expr_match(&mut self, m: &'a syn::ExprMatch) {
        self.check_branches(&m.expr, m.arms.iter().map(|a| &*a.body));
        syn::visit::visit_expr_match(self, m);
    }
}

/// One error per collective call inside a branch that depends on the process's rank.
pub(crate) fn collectives_in_rank_branches(f: &syn::ItemFn) -> Vec<syn::Error> {
    let mut lint = Lint { errors: Vec::new(), varstores: body::varstores(f) };
    lint.visit_block(&f.block);
    lint.errors
}
