//! What `#[accelerate]` expansions call besides the public API: turning tch optimizer
//! configurations into accel optimizers, adopting optimizers made where the attribute
//! cannot see, and the guard that ends a run cleanly.

use tch::nn::VarStore;

use super::{AcceleratedOptimizer, Accelerator};
use crate::error::Result;
use crate::optim::{Adam, AdamConfig, AdamW, Optimizer, Param, Sgd, SgdConfig, TchOptimizer};
use crate::sync::Locked;

/// An optimizer configuration the attribute can turn into an accelerator optimizer: tch's
/// `nn::Sgd`, `nn::Adam`, `nn::AdamW` (as accel's own optimizers, with exportable state,
/// AMSGrad included) and `nn::RmsProp` (as tch's, which cannot be checkpointed or sharded).
/// The VarStore's parameter groups (`vs.root().set_group(g)`) become the optimizer's groups.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an optimizer configuration #[accelerate] can prepare",
    label = "this `.build(..)` is turned into the accelerator's optimizer",
    note = "the configurations are tch's nn::Sgd, nn::Adam, nn::AdamW and nn::RmsProp; for another \
            optimizer, build it with accel_core::optim or make it outside the loop and name the \
            model: #[accelerate(model = vs)]"
)]
pub trait IntoAccelOptimizer {
    /// The optimizer over `vs`'s trainable variables with learning rate `lr`.
    fn into_accel(
        self,
        accelerator: &Accelerator,
        vs: &VarStore,
        lr: f64,
    ) -> Result<Box<dyn Optimizer>>;
}

/// The trainable variables of `vs` by tch parameter group (`Path::set_group`), each group
/// sorted by name; one group when the store uses only group 0.
fn param_groups(acc: &Accelerator, vs: &VarStore) -> Result<Vec<Vec<Param>>> {
    let group_of: std::collections::HashMap<usize, usize> = {
        let variables = vs.variables_.locked();
        variables
            .trainable_variables
            .iter()
            .map(|v| Ok((crate::shim::tensor_id(&v.tensor)?, v.group)))
            .collect::<Result<_>>()?
    };
    let mut groups: Vec<Vec<Param>> = vec![Vec::new()];
    for param in acc.params(vs) {
        let group = group_of.get(&crate::shim::tensor_id(&param.tensor)?).copied().unwrap_or(0);
        if groups.len() <= group {
            groups.resize_with(group + 1, Vec::new);
        }
        groups[group].push(param);
    }
    Ok(groups)
}

impl IntoAccelOptimizer for tch::nn::Sgd {
    fn into_accel(self, acc: &Accelerator, vs: &VarStore, lr: f64) -> Result<Box<dyn Optimizer>> {
        let config = SgdConfig {
            lr,
            momentum: self.momentum,
            dampening: self.dampening,
            weight_decay: self.wd,
            nesterov: self.nesterov,
            maximize: false,
            // torch's default path, which an ordinary tch program is compared with; ATen's
            // fused kernel rounds differently (about 1e-6 after 100 momentum steps).
            fused: false,
        };
        let mut groups = param_groups(acc, vs)?.into_iter();
        let mut sgd = Sgd::new(groups.next().unwrap_or_default(), config)?;
        for group in groups {
            sgd.add_param_group(group, config)?;
        }
        Ok(Box::new(sgd))
    }
}

fn adam_config(lr: f64, beta1: f64, beta2: f64, eps: f64, wd: f64, amsgrad: bool) -> AdamConfig {
    AdamConfig { lr, beta1, beta2, eps, weight_decay: wd, maximize: false, fused: false, amsgrad }
}

impl IntoAccelOptimizer for tch::nn::Adam {
    fn into_accel(self, acc: &Accelerator, vs: &VarStore, lr: f64) -> Result<Box<dyn Optimizer>> {
        let config = adam_config(lr, self.beta1, self.beta2, self.eps, self.wd, self.amsgrad);
        let mut groups = param_groups(acc, vs)?.into_iter();
        let mut adam = Adam::new(groups.next().unwrap_or_default(), config)?;
        for group in groups {
            adam.add_param_group(group, config)?;
        }
        Ok(Box::new(adam))
    }
}

impl IntoAccelOptimizer for tch::nn::AdamW {
    fn into_accel(self, acc: &Accelerator, vs: &VarStore, lr: f64) -> Result<Box<dyn Optimizer>> {
        let config = AdamConfig {
            fused: true,
            ..adam_config(lr, self.beta1, self.beta2, self.eps, self.wd, self.amsgrad)
        };
        let mut groups = param_groups(acc, vs)?.into_iter();
        let mut adamw = AdamW::new(groups.next().unwrap_or_default(), config)?;
        for group in groups {
            adamw.add_param_group(group, config)?;
        }
        Ok(Box::new(adamw))
    }
}

impl IntoAccelOptimizer for tch::nn::RmsProp {
    fn into_accel(self, _acc: &Accelerator, vs: &VarStore, lr: f64) -> Result<Box<dyn Optimizer>> {
        let optimizer = tch::nn::OptimizerConfig::build(self, vs, lr)?;
        Ok(Box::new(TchOptimizer::new(optimizer, lr)))
    }
}

/// An optimizer made where `#[accelerate]` cannot see (a helper function, a closure), which
/// it prepares once the model is named with `model = ...`: tch's `nn::Optimizer` (single and
/// DDP runs; it cannot be sharded), any of accel's optimizers, or one already prepared.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an optimizer the accelerator can prepare",
    note = "the optimizers are tch's nn::Optimizer, accel_core::optim::{{Sgd, Adam, AdamW}} (or any \
            accel_core::optim::Optimizer) and an AcceleratedOptimizer"
)]
pub trait AdoptOptimizer {
    /// The optimizer prepared by `accelerator`.
    fn adopt(self, accelerator: &Accelerator) -> AcceleratedOptimizer;
}

impl AdoptOptimizer for tch::nn::Optimizer {
    fn adopt(self, accelerator: &Accelerator) -> AcceleratedOptimizer {
        accelerator.prepare_optimizer(TchOptimizer::adopted(self))
    }
}

impl<O: Optimizer + 'static> AdoptOptimizer for O {
    fn adopt(self, accelerator: &Accelerator) -> AcceleratedOptimizer {
        accelerator.prepare_optimizer(self)
    }
}

impl AdoptOptimizer for AcceleratedOptimizer {
    fn adopt(self, _accelerator: &Accelerator) -> AcceleratedOptimizer {
        self
    }
}

impl crate::optim::Preparer for Accelerator {
    type Prepared = AcceleratedOptimizer;
    fn prepare_boxed(
        &self,
        vs: &VarStore,
        optimizer: Box<dyn Optimizer>,
    ) -> Result<AcceleratedOptimizer> {
        self.prepare_model_once(vs)?;
        Ok(self.prepare_boxed_optimizer(optimizer))
    }
}

impl Accelerator {
    /// Prepares the model in `vs` (once) and builds the accelerator's optimizer from a tch
    /// optimizer configuration: what `config.build(vs, lr)` becomes under `#[accelerate]`
    /// (`vs` is whatever the user passed to tch's `build`).
    pub fn build_optimizer(
        &self,
        config: impl IntoAccelOptimizer,
        vs: &VarStore,
        lr: f64,
    ) -> Result<AcceleratedOptimizer> {
        self.prepare_model_once(vs)?;
        let optimizer = config.into_accel(self, vs, lr)?;
        let prepared = self.prepare_boxed_optimizer(optimizer);
        prepared.built_over(vs);
        Ok(prepared)
    }

    /// Prepares the model in `vs` (once) and then `optimizer`, made elsewhere: what an
    /// optimizer from a helper or a closure becomes under `#[accelerate(model = vs)]`.
    pub fn adopt_optimizer(
        &self,
        vs: &VarStore,
        optimizer: impl AdoptOptimizer,
    ) -> Result<AcceleratedOptimizer> {
        self.prepare_model_once(vs)?;
        Ok(optimizer.adopt(self))
    }

    /// What `#[accelerate]` calls after a training loop, before the first statement that
    /// reaches the model, and before returning a model that leaves the function:
    /// [`summon_full_params`](Self::summon_full_params). The main process says once what
    /// it costs, and where.
    #[doc(hidden)]
    #[track_caller]
    pub fn attribute_summon(&self) -> Result<()> {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let site = std::panic::Location::caller();
        let bytes = self.summon_full_params()?;
        if bytes > 0
            && self.is_main_process()
            && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let size = match bytes {
                b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
                b => format!("{:.1} KiB", b as f64 / 1024.0),
            };
            eprintln!(
                "accel: the model is read after its training loop ({}:{}): zero3 gathers it \
                 whole there, {size} on every process (FSDP's summon_full_params), until \
                 training resumes",
                site.file(),
                site.line(),
            );
        }
        Ok(())
    }

    /// Ends the run when dropped: on the error or panic path it aborts the process group so
    /// that no other rank waits for this one; [`ExitGuard::finish`] is the success path.
    pub fn exit_guard(&self) -> ExitGuard {
        ExitGuard { accelerator: self.clone(), armed: true }
    }
}

/// See [`Accelerator::exit_guard`].
#[derive(Debug)]
#[must_use = "the guard ends the run when dropped"]
pub struct ExitGuard {
    accelerator: Accelerator,
    armed: bool,
}

impl ExitGuard {
    /// The success path: [`Accelerator::end_training`] (the strategy's last word, the
    /// trackers finished, a barrier). With `ACCEL_FINAL_STATE_DIR` set, every process also
    /// writes what it ends with, after the strategy's last word (see
    /// [`Accelerator::write_final_state`]).
    pub fn finish(mut self) -> Result<()> {
        self.armed = false;
        if let Err(e) = self.accelerator.end_strategy() {
            let _ = self.accelerator.finish_trackers(true);
            return Err(e);
        }
        if let Some(dir) = std::env::var_os(FINAL_STATE_ENV) {
            self.accelerator.write_final_state(std::path::Path::new(&dir))?;
        }
        self.accelerator.end_training()
    }
}

/// Names a folder where an `#[accelerate]` function's processes write their final state.
pub const FINAL_STATE_ENV: &str = crate::config::env::FINAL_STATE_DIR;

impl Accelerator {
    /// Writes, for checking a run from outside, what this process ends with: every
    /// prepared model's variables, whole (gathered where sharded: a collective), to
    /// `dir/model{i}.rank{r}.safetensors`, and the step counters to
    /// `dir/counters.rank{r}.json`. The successful end of an `#[accelerate]` function calls
    /// it when `ACCEL_FINAL_STATE_DIR` names `dir` (tests/real_code.rs compares the ranks).
    pub fn write_final_state(&self, dir: &std::path::Path) -> Result<()> {
        let rank = self.process_index();
        std::fs::create_dir_all(dir)
            .map_err(|source| crate::Error::Io { path: dir.to_path_buf(), source })?;
        let models = self.registry().models.clone();
        // Read as the program would read them after its loop: the variables themselves
        // (gathered whole where zero3 released them), each checked against its shards.
        self.summon_full_params()?;
        for (i, params) in models.into_iter().enumerate() {
            let tensors: Vec<tch::Tensor> =
                params.iter().map(|p| p.tensor.shallow_clone()).collect();
            let mut whole = self.full_state_of(params)?;
            for ((name, value), tensor) in whole.iter_mut().zip(&tensors) {
                if tensor.size() != value.size() {
                    continue; // a tensor-parallel part: the program holds its own piece
                }
                let seen = tensor.f_detach()?.f_to_device(value.device())?;
                let both_nan = seen.f_isnan()?.f_logical_and(&value.f_isnan()?)?;
                let ne = seen.f_ne_tensor(value)?.f_logical_and(&both_nan.f_logical_not()?)?;
                let differ = ne.f_any()?.f_int64_value(&[])? != 0;
                if differ {
                    return Err(crate::Error::Training(format!(
                        "rank {rank}: `{name}` reads other values than its shards hold after \
                         training"
                    )));
                }
                *value = seen;
            }
            let path = dir.join(format!("model{i}.rank{rank}.safetensors"));
            tch::Tensor::write_safetensors(&whole, &path)?;
        }
        let path = dir.join(format!("counters.rank{rank}.json"));
        let counters = serde_json::to_string(&self.counters()).expect("counters serialize");
        std::fs::write(&path, counters).map_err(|source| crate::Error::Io { path, source })
    }
}

impl Drop for ExitGuard {
    /// The failure path: trackers record the failure (MLflow's run FAILED), then the
    /// process group is aborted so that no peer waits on this process.
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.accelerator.finish_trackers(true) {
                eprintln!("accel: {e}");
            }
            self.accelerator.abort();
        }
    }
}
