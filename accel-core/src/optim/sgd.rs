//! SGD with momentum, dampening, Nesterov momentum and L2 weight decay, step for step
//! `torch.optim.SGD` (its single-tensor path, the default on CPU; `fused: true` is
//! `fused=True`, ATen's one call over every parameter of a group).

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::{
    Optimizer, OptimizerState, Param, ParamGroup, Restore, groups_from_json, groups_to_json,
};
use crate::error::{Error, Result};
use crate::shim::{SgdStep, fused_sgd};

/// `torch.optim.SGD`'s hyper-parameters, with its defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 = plain SGD).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
    /// Maximise the objective instead.
    pub maximize: bool,
    /// One call of ATen's fused kernel over the group's parameters (`fused=True`).
    #[serde(default)]
    pub fused: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
            fused: false,
        }
    }
}

impl SgdConfig {
    fn validate(&self) -> Result<()> {
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::Config(
                "SGD: Nesterov momentum requires momentum > 0 and dampening = 0".into(),
            ));
        }
        if self.lr.is_nan() || self.lr < 0.0 || self.momentum < 0.0 || self.weight_decay < 0.0 {
            return Err(Error::Config(format!(
                "SGD: lr, momentum and weight_decay must be >= 0, got {self:?}"
            )));
        }
        Ok(())
    }
}

/// Stochastic gradient descent. Momentum buffers are created at the first step, as torch does.
#[derive(Debug)]
pub struct Sgd {
    groups: Vec<ParamGroup<SgdConfig>>,
    /// One per parameter, in group order; `None` until the first step with momentum.
    momentum_buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    /// SGD over `params` with `config`.
    pub fn new(params: Vec<Param>, config: SgdConfig) -> Result<Self> {
        let mut sgd = Self { groups: Vec::new(), momentum_buffers: Vec::new() };
        sgd.add_param_group(params, config)?;
        Ok(sgd)
    }

    /// Adds a group with its own hyper-parameters.
    pub fn add_param_group(&mut self, params: Vec<Param>, config: SgdConfig) -> Result<()> {
        config.validate()?;
        self.momentum_buffers.extend(params.iter().map(|_| None));
        self.groups.push(ParamGroup { params, hyper: config });
        Ok(())
    }
}

impl Sgd {
    /// The hyper-parameters and momentum buffers `state` holds, checked against this
    /// optimizer's parameters.
    fn restored(
        &self,
        groups: &serde_json::Value,
        mut tensors: Restore<'_>,
    ) -> Result<(Vec<SgdConfig>, Vec<Option<Tensor>>)> {
        let hypers: Vec<SgdConfig> = groups_from_json("SGD", groups, self.groups.len())?;
        let mut buffers = Vec::new();
        for param in self.groups.iter().flat_map(|g| &g.params) {
            let key = format!("{}/momentum_buffer", param.name);
            let like = (param.tensor.kind(), param.tensor.device());
            buffers.push(match tensors.has(&key) {
                true => Some(tensors.slot("SGD", &key, &param.tensor.size(), like)?),
                false => None,
            });
        }
        Ok((hypers, buffers))
    }

    fn restore(&mut self, groups: &serde_json::Value, tensors: Restore<'_>) -> Result<()> {
        // Everything is read and checked before anything changes.
        let (hypers, buffers) = self.restored(groups, tensors)?;
        for (group, hyper) in self.groups.iter_mut().zip(hypers) {
            group.hyper = hyper;
        }
        self.momentum_buffers = buffers;
        Ok(())
    }
}

/// One fused step over a group's parameters that have a gradient: those whose momentum
/// buffers exist already, then (as torch's first step makes them) those whose do not.
fn fused_step(params: &[Param], buffers: &mut [Option<Tensor>], h: SgdConfig) -> Result<()> {
    let step = SgdStep {
        lr: h.lr,
        momentum: h.momentum,
        dampening: h.dampening,
        weight_decay: h.weight_decay,
        nesterov: h.nesterov,
        maximize: h.maximize,
    };
    let live = || params.iter().zip(buffers.iter()).filter(|(p, _)| p.tensor.grad().defined());
    if h.momentum == 0.0 {
        let (ps, gs): (Vec<Tensor>, Vec<Tensor>) =
            live().map(|(p, _)| (p.tensor.shallow_clone(), p.tensor.grad())).unzip();
        return if ps.is_empty() { Ok(()) } else { fused_sgd(&ps, &gs, &[], step, false) };
    }
    let (mut old, mut fresh) = (Vec::new(), Vec::new());
    for (i, (p, b)) in params.iter().zip(buffers.iter()).enumerate() {
        if p.tensor.grad().defined() {
            if b.is_some() { old.push(i) } else { fresh.push(i) }
        }
    }
    for i in &fresh {
        buffers[*i] = Some(params[*i].tensor.grad().f_empty_like()?);
    }
    for (which, first) in [(old, false), (fresh, true)] {
        if which.is_empty() {
            continue;
        }
        let ps: Vec<Tensor> = which.iter().map(|&i| params[i].tensor.shallow_clone()).collect();
        let gs: Vec<Tensor> = which.iter().map(|&i| params[i].tensor.grad()).collect();
        let bs: Vec<Tensor> = which
            .iter()
            .map(|&i| buffers[i].as_ref().expect("made above").shallow_clone())
            .collect();
        fused_sgd(&ps, &gs, &bs, step, first)?;
    }
    Ok(())
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "SGD"
    }

    fn step(&mut self) -> Result<()> {
        super::guard_unprepared_step("SGD")?;
        self.prepared_step()
    }

    fn prepared_step(&mut self) -> Result<()> {
        let mut index = 0;
        tch::no_grad(|| -> Result<()> {
            for group in &self.groups {
                let h = group.hyper;
                if h.fused {
                    let buffers = &mut self.momentum_buffers[index..index + group.params.len()];
                    index += group.params.len();
                    fused_step(&group.params, buffers, h)?;
                    continue;
                }
                for param in &group.params {
                    let buffer = &mut self.momentum_buffers[index];
                    index += 1;
                    let grad = param.tensor.grad();
                    if !grad.defined() {
                        continue;
                    }
                    let mut d_p = if h.maximize { grad.f_neg()? } else { grad };
                    if h.weight_decay != 0.0 {
                        d_p = d_p.f_add(&(&param.tensor * h.weight_decay))?;
                    }
                    if h.momentum != 0.0 {
                        let buf = match buffer {
                            None => buffer.insert(d_p.f_detach_copy()?),
                            Some(buf) => {
                                let _ = buf.f_mul_scalar_(h.momentum)?;
                                let _ = buf.f_add_(&(&d_p * (1.0 - h.dampening)))?;
                                buf
                            }
                        };
                        d_p = if h.nesterov {
                            d_p.f_add(&(&*buf * h.momentum))?
                        } else {
                            buf.shallow_clone()
                        };
                    }
                    let mut p = param.tensor.shallow_clone();
                    let _ = p.f_sub_(&(d_p * h.lr))?;
                }
            }
            Ok(())
        })
    }

    fn params(&self) -> Vec<Tensor> {
        self.groups.iter().flat_map(|g| g.params.iter().map(|p| p.tensor.shallow_clone())).collect()
    }

    fn param_names(&self) -> Vec<String> {
        self.groups.iter().flat_map(|g| g.params.iter().map(|p| p.name.clone())).collect()
    }

    fn num_groups(&self) -> usize {
        self.groups.len()
    }
    fn lr(&self, group: usize) -> f64 {
        self.groups[group].hyper.lr
    }
    fn set_lr(&mut self, group: usize, lr: f64) {
        self.groups[group].hyper.lr = lr;
    }
    fn momentum(&self, group: usize) -> Option<f64> {
        Some(self.groups[group].hyper.momentum)
    }
    fn set_momentum(&mut self, group: usize, momentum: f64) {
        self.groups[group].hyper.momentum = momentum;
    }
    fn set_weight_decay(&mut self, group: usize, weight_decay: f64) {
        self.groups[group].hyper.weight_decay = weight_decay;
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut state = OptimizerState {
            groups: groups_to_json(&self.groups.iter().map(|g| &g.hyper).collect::<Vec<_>>()),
            ..Default::default()
        };
        let names = self.groups.iter().flat_map(|g| &g.params).map(|p| &p.name);
        for (name, buffer) in names.zip(&self.momentum_buffers) {
            if let Some(buffer) = buffer {
                state.tensors.insert(format!("{name}/momentum_buffer"), buffer.copy());
            }
        }
        Ok(state)
    }

    fn retain(&mut self, keep: &dyn Fn(usize) -> bool) -> Result<()> {
        super::retain_params(&mut self.groups, &mut self.momentum_buffers, keep);
        Ok(())
    }
    fn replace_params(&mut self, replace: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
        super::replace_params("SGD", &mut self.groups, &self.momentum_buffers, replace)
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        self.restore(&state.groups, Restore::Copy(&state.tensors))
    }
    fn take_state(&mut self, state: OptimizerState) -> Result<()> {
        self.restore(&state.groups, Restore::Take(state.tensors))
    }
    fn check_state(&self, state: &OptimizerState) -> Result<()> {
        self.restored(&state.groups, Restore::Check(&state.tensors)).map(|_| ())
    }
}
