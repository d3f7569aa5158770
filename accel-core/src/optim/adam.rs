//! Adam (L2 weight decay) and AdamW (decoupled weight decay), step for step
//! `torch.optim.Adam` / `torch.optim.AdamW` (single-tensor path, the default on CPU;
//! `fused: true` is `fused=True`, ATen's fused kernel, for AdamW).

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::{
    Optimizer, OptimizerState, Param, ParamGroup, Restore, groups_from_json, groups_to_json,
};
use crate::error::{Error, Result};
use crate::shim::{AdamWStep, fused_adam, fused_adamw};

/// Hyper-parameters of Adam and AdamW, with torch's defaults (AdamW's weight decay
/// defaults to 0.01 through [`AdamConfig::adamw`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first-moment average.
    pub beta1: f64,
    /// Decay of the second-moment average.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Adam: L2 penalty added to the gradient; AdamW: decoupled decay of the weights.
    pub weight_decay: f64,
    /// Maximise the objective instead.
    pub maximize: bool,
    /// Use ATen's fused kernel: one call over every parameter of a group
    /// (`torch._fused_adamw_` / `torch._fused_adam_`; AMSGrad steps take torch's
    /// single-tensor path).
    pub fused: bool,
    /// AMSGrad: normalise by the largest second moment seen so far (`amsgrad=True`).
    #[serde(default)]
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            maximize: false,
            fused: false,
            amsgrad: false,
        }
    }
}

impl AdamConfig {
    /// AdamW's defaults: torch's (as Adam's, with weight decay 0.01), plus ATen's fused
    /// kernel, which gives the same values (to 1e-6) in one pass over memory instead of
    /// about ten: 2-3× less time per step on CPU (`cargo xtask bench`). Set `fused: false`
    /// for torch's default arithmetic to the last bit.
    pub fn adamw() -> Self {
        Self { weight_decay: 1e-2, fused: true, ..Self::default() }
    }

    fn validate(&self, name: &str) -> Result<()> {
        let ok = self.lr >= 0.0
            && self.eps >= 0.0
            && (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.weight_decay >= 0.0;
        if !ok {
            return Err(Error::Config(format!(
                "{name}: need lr >= 0, eps >= 0, 0 <= beta1, beta2 < 1, weight_decay >= 0; got \
                 {self:?}"
            )));
        }
        Ok(())
    }
}

/// Per-parameter state, created at the first step.
#[derive(Debug)]
struct Moments {
    /// The step count, a float tensor as torch keeps it.
    step: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// AMSGrad's running maximum of `exp_avg_sq`.
    max_exp_avg_sq: Option<Tensor>,
}

impl Moments {
    /// Zero state. The step counter lives where its kernel reads it, as torch keeps it: on
    /// the parameter's device for the fused kernel (no copy, no host sync per parameter),
    /// on the host for the single-tensor step (which reads it on the host).
    fn zeros(param: &Tensor, amsgrad: bool, fused: bool) -> Result<Self> {
        let step_device = if fused { param.device() } else { Device::Cpu };
        Ok(Self {
            step: Tensor::f_zeros([], (Kind::Float, step_device))?,
            exp_avg: param.f_zeros_like()?.f_detach()?,
            exp_avg_sq: param.f_zeros_like()?.f_detach()?,
            max_exp_avg_sq: if amsgrad { Some(param.f_zeros_like()?.f_detach()?) } else { None },
        })
    }
}

/// The shared implementation; `decoupled` tells AdamW from Adam.
#[derive(Debug)]
struct AdamCore {
    name: &'static str,
    decoupled: bool,
    groups: Vec<ParamGroup<AdamConfig>>,
    moments: Vec<Option<Moments>>,
}

impl AdamCore {
    fn add_param_group(&mut self, params: Vec<Param>, config: AdamConfig) -> Result<()> {
        config.validate(self.name)?;
        self.moments.extend(params.iter().map(|_| None));
        self.groups.push(ParamGroup { params, hyper: config });
        Ok(())
    }

    fn update(&mut self) -> Result<()> {
        let mut index = 0;
        for group in &self.groups {
            let h = group.hyper;
            let first = index;
            index += group.params.len();
            // Lazily create the state of parameters that have a gradient now.
            for (param, moments) in group.params.iter().zip(&mut self.moments[first..index]) {
                if moments.is_none() && param.tensor.grad().defined() {
                    *moments = Some(Moments::zeros(&param.tensor, h.amsgrad, h.fused)?);
                }
            }
            let live: Vec<(&Param, &Moments)> = group
                .params
                .iter()
                .zip(&self.moments[first..index])
                .filter(|(p, _)| p.tensor.grad().defined())
                .filter_map(|(p, m)| m.as_ref().map(|m| (p, m)))
                .collect();
            if h.fused && !h.amsgrad {
                fused_step(&live, h, self.decoupled)?;
            } else {
                for (param, moments) in live {
                    single_tensor_step(param, moments, h, self.decoupled)?;
                }
            }
        }
        Ok(())
    }

    fn state(&self) -> OptimizerState {
        let mut state = OptimizerState {
            groups: groups_to_json(&self.groups.iter().map(|g| &g.hyper).collect::<Vec<_>>()),
            ..Default::default()
        };
        let names = self.groups.iter().flat_map(|g| &g.params).map(|p| &p.name);
        for (name, moments) in names.zip(&self.moments) {
            if let Some(m) = moments {
                state.tensors.insert(format!("{name}/step"), m.step.copy());
                state.tensors.insert(format!("{name}/exp_avg"), m.exp_avg.copy());
                state.tensors.insert(format!("{name}/exp_avg_sq"), m.exp_avg_sq.copy());
                if let Some(max) = &m.max_exp_avg_sq {
                    state.tensors.insert(format!("{name}/max_exp_avg_sq"), max.copy());
                }
            }
        }
        state
    }

    fn load_state(&mut self, groups: &serde_json::Value, tensors: Restore<'_>) -> Result<()> {
        // Everything is read and checked before anything changes.
        let (hypers, moments) = self.restored(groups, tensors)?;
        for (group, hyper) in self.groups.iter_mut().zip(hypers) {
            group.hyper = hyper;
        }
        self.moments = moments;
        Ok(())
    }

    /// The hyper-parameters and moments a state holds, checked against the parameters.
    fn restored(
        &self,
        groups: &serde_json::Value,
        mut tensors: Restore<'_>,
    ) -> Result<(Vec<AdamConfig>, Vec<Option<Moments>>)> {
        let hypers: Vec<AdamConfig> = groups_from_json(self.name, groups, self.groups.len())?;
        let mut all = Vec::new();
        for (group, hyper) in self.groups.iter().zip(&hypers) {
            for param in &group.params {
                let key = |slot: &str| format!("{}/{slot}", param.name);
                if !tensors.has(&key("step")) {
                    all.push(None);
                    continue;
                }
                // Where `Moments::zeros` keeps each slot.
                let (p, kind) = (&param.tensor, param.tensor.kind());
                let step_device = if hyper.fused { p.device() } else { Device::Cpu };
                let mut slot = |name: &str, shape: &[i64], like: (Kind, Device)| {
                    tensors.slot(self.name, &key(name), shape, like)
                };
                let step = slot("step", &[], (Kind::Float, step_device))?;
                let exp_avg = slot("exp_avg", &p.size(), (kind, p.device()))?;
                let exp_avg_sq = slot("exp_avg_sq", &p.size(), (kind, p.device()))?;
                let max_exp_avg_sq = match hyper.amsgrad {
                    true => Some(slot("max_exp_avg_sq", &p.size(), (kind, p.device()))?),
                    false => None,
                };
                all.push(Some(Moments { step, exp_avg, exp_avg_sq, max_exp_avg_sq }));
            }
        }
        Ok((hypers, all))
    }
}

/// `torch.optim.adam._single_tensor_adam` (non-capturable).
fn single_tensor_step(param: &Param, m: &Moments, h: AdamConfig, decoupled: bool) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        let grad = param.tensor.grad();
        let mut grad = if h.maximize { grad.f_neg()? } else { grad };
        let mut p = param.tensor.shallow_clone();
        let (mut step, mut exp_avg, mut exp_avg_sq) =
            (m.step.shallow_clone(), m.exp_avg.shallow_clone(), m.exp_avg_sq.shallow_clone());
        let _ = step.f_add_scalar_(1.0)?;
        if h.weight_decay != 0.0 {
            if decoupled {
                let _ = p.f_mul_scalar_(1.0 - h.lr * h.weight_decay)?;
            } else {
                grad = grad.f_add(&(&p * h.weight_decay))?;
            }
        }
        let _ = exp_avg.f_lerp_(&grad, 1.0 - h.beta1)?;
        let _ = exp_avg_sq.f_mul_scalar_(h.beta2)?;
        let _ = exp_avg_sq.f_addcmul_(&(&grad * (1.0 - h.beta2)), &grad)?;
        let t = step.f_double_value(&[])?;
        let bias_correction1 = 1.0 - h.beta1.powf(t);
        let bias_correction2 = 1.0 - h.beta2.powf(t);
        let step_size = h.lr / bias_correction1;
        let second = match &m.max_exp_avg_sq {
            Some(max) => {
                let max = max.shallow_clone();
                let _ = max.f_maximum_out(&max, &exp_avg_sq)?;
                max
            }
            None => exp_avg_sq.shallow_clone(),
        };
        let denom = (second.f_sqrt()? / bias_correction2.sqrt()).f_add_scalar(h.eps)?;
        let _ = p.f_addcdiv_(&(&exp_avg * -step_size), &denom)?;
        Ok(())
    })
}

fn fused_step(live: &[(&Param, &Moments)], h: AdamConfig, decoupled: bool) -> Result<()> {
    if live.is_empty() {
        return Ok(());
    }
    let params: Vec<Tensor> = live.iter().map(|(p, _)| p.tensor.shallow_clone()).collect();
    let grads: Vec<Tensor> = live.iter().map(|(p, _)| p.tensor.grad()).collect();
    let exp_avgs: Vec<Tensor> = live.iter().map(|(_, m)| m.exp_avg.shallow_clone()).collect();
    let exp_avg_sqs: Vec<Tensor> = live.iter().map(|(_, m)| m.exp_avg_sq.shallow_clone()).collect();
    // The fused kernel wants its step counters on the parameters' device, where they live.
    let device = params[0].device();
    let steps: Vec<Tensor> = live
        .iter()
        .map(|(_, m)| {
            let mut step = m.step.shallow_clone();
            let _ = tch::no_grad(|| step.f_add_scalar_(1.0))?;
            Ok(if step.device() == device { step } else { step.f_to_device(device)? })
        })
        .collect::<Result<_>>()?;
    let kernel = if decoupled { fused_adamw } else { fused_adam };
    kernel(
        &params,
        &grads,
        &exp_avgs,
        &exp_avg_sqs,
        &steps,
        AdamWStep {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            weight_decay: h.weight_decay,
            eps: h.eps,
            maximize: h.maximize,
        },
    )
}

macro_rules! adam_optimizer {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $decoupled:literal) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $ty(AdamCore);

        impl $ty {
            /// The optimizer over `params` with `config`.
            pub fn new(params: Vec<Param>, config: AdamConfig) -> Result<Self> {
                let mut core = AdamCore {
                    name: $name,
                    decoupled: $decoupled,
                    groups: Vec::new(),
                    moments: Vec::new(),
                };
                core.add_param_group(params, config)?;
                Ok(Self(core))
            }

            /// Adds a group with its own hyper-parameters.
            pub fn add_param_group(&mut self, params: Vec<Param>, config: AdamConfig) -> Result<()> {
                self.0.add_param_group(params, config)
            }
        }

        impl Optimizer for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn step(&mut self) -> Result<()> {
                super::guard_unprepared_step($name)?;
                self.0.update()
            }
            fn prepared_step(&mut self) -> Result<()> {
                self.0.update()
            }
            fn params(&self) -> Vec<Tensor> {
                self.0.groups.iter().flat_map(|g| g.params.iter().map(|p| p.tensor.shallow_clone())).collect()
            }
            fn param_names(&self) -> Vec<String> {
                self.0.groups.iter().flat_map(|g| g.params.iter().map(|p| p.name.clone())).collect()
            }
            fn num_groups(&self) -> usize {
                self.0.groups.len()
            }
            fn lr(&self, group: usize) -> f64 {
                self.0.groups[group].hyper.lr
            }
            fn set_lr(&mut self, group: usize, lr: f64) {
                self.0.groups[group].hyper.lr = lr;
            }
            fn momentum(&self, group: usize) -> Option<f64> {
                Some(self.0.groups[group].hyper.beta1)
            }
            fn set_momentum(&mut self, group: usize, momentum: f64) {
                self.0.groups[group].hyper.beta1 = momentum;
            }
            fn set_weight_decay(&mut self, group: usize, weight_decay: f64) {
                self.0.groups[group].hyper.weight_decay = weight_decay;
            }
            fn state(&self) -> Result<OptimizerState> {
                Ok(self.0.state())
            }
            fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
                self.0.load_state(&state.groups, Restore::Copy(&state.tensors))
            }
            fn take_state(&mut self, state: OptimizerState) -> Result<()> {
                self.0.load_state(&state.groups, Restore::Take(state.tensors))
            }
            fn check_state(&self, state: &OptimizerState) -> Result<()> {
                self.0.restored(&state.groups, Restore::Check(&state.tensors)).map(|_| ())
            }
            fn retain(&mut self, keep: &dyn Fn(usize) -> bool) -> Result<()> {
                super::retain_params(&mut self.0.groups, &mut self.0.moments, keep);
                Ok(())
            }
            fn replace_params(
                &mut self,
                replace: &dyn Fn(&Tensor) -> Result<Tensor>,
            ) -> Result<()> {
                super::replace_params($name, &mut self.0.groups, &self.0.moments, replace)
            }
        }
    };
}

adam_optimizer!(
    /// Adam with L2 weight decay (`torch.optim.Adam`).
    Adam, "Adam", false
);
adam_optimizer!(
    /// Adam with decoupled weight decay (`torch.optim.AdamW`); `fused: true` runs ATen's
    /// fused kernel.
    AdamW, "AdamW", true
);
