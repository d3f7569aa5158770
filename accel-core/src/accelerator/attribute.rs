//! What `#[accelerate]` expansions call besides the public API: turning tch optimizer
//! configurations into accel optimizers, and the guard that ends a run cleanly.

use tch::nn::VarStore;

use super::{AcceleratedOptimizer, Accelerator};
use crate::error::{Error, Result};
use crate::optim::{Adam, AdamConfig, AdamW, Optimizer, Sgd, SgdConfig, TchOptimizer};

/// An optimizer configuration the attribute can turn into an accelerator optimizer: tch's
/// `nn::Sgd`, `nn::Adam`, `nn::AdamW` (as accel's own optimizers, with exportable state)
/// and `nn::RmsProp` (as tch's, which cannot be checkpointed).
pub trait IntoAccelOptimizer {
    /// The optimizer over `vs`'s trainable variables with learning rate `lr`.
    fn into_accel(
        self,
        accelerator: &Accelerator,
        vs: &VarStore,
        lr: f64,
    ) -> Result<Box<dyn Optimizer>>;
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
        };
        Ok(Box::new(Sgd::new(acc.params(vs), config)?))
    }
}

fn adam_config(
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    wd: f64,
    amsgrad: bool,
    fused: bool,
) -> Result<AdamConfig> {
    if amsgrad {
        return Err(Error::Unsupported(
            "amsgrad: accel's Adam/AdamW do not implement it yet".into(),
        ));
    }
    Ok(AdamConfig { lr, beta1, beta2, eps, weight_decay: wd, maximize: false, fused })
}

impl IntoAccelOptimizer for tch::nn::Adam {
    fn into_accel(self, acc: &Accelerator, vs: &VarStore, lr: f64) -> Result<Box<dyn Optimizer>> {
        let config =
            adam_config(lr, self.beta1, self.beta2, self.eps, self.wd, self.amsgrad, false)?;
        Ok(Box::new(Adam::new(acc.params(vs), config)?))
    }
}

impl IntoAccelOptimizer for tch::nn::AdamW {
    fn into_accel(self, acc: &Accelerator, vs: &VarStore, lr: f64) -> Result<Box<dyn Optimizer>> {
        let config =
            adam_config(lr, self.beta1, self.beta2, self.eps, self.wd, self.amsgrad, true)?;
        Ok(Box::new(AdamW::new(acc.params(vs), config)?))
    }
}

impl IntoAccelOptimizer for tch::nn::RmsProp {
    fn into_accel(self, _acc: &Accelerator, vs: &VarStore, lr: f64) -> Result<Box<dyn Optimizer>> {
        let optimizer = tch::nn::OptimizerConfig::build(self, vs, lr)?;
        Ok(Box::new(TchOptimizer::new(optimizer, lr)))
    }
}

impl Accelerator {
    /// Prepares the model in `vs` (once) and builds the accelerator's optimizer from a tch
    /// optimizer configuration: what `config.build(&vs, lr)` becomes under `#[accelerate]`.
    pub fn build_optimizer(
        &self,
        config: impl IntoAccelOptimizer,
        vs: &VarStore,
        lr: f64,
    ) -> Result<AcceleratedOptimizer> {
        self.prepare_model_once(vs)?;
        let optimizer = config.into_accel(self, vs, lr)?;
        Ok(self.prepare_boxed_optimizer(optimizer))
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
    /// The success path: waits for every process to finish.
    pub fn finish(mut self) -> Result<()> {
        self.armed = false;
        self.accelerator.wait_for_everyone()
    }
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        if self.armed {
            self.accelerator.abort();
        }
    }
}
