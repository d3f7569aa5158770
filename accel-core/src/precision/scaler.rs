//! Dynamic loss scaling for fp16, as `torch.amp.GradScaler` with its defaults: scale 65536,
//! ×2 after 2000 steps without overflow, ×0.5 and the step skipped on inf/NaN gradients.
//! DeepSpeed's settings add hysteresis (back off only after that many overflows since the
//! last growth), a floor, and a static scale.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::shim::amp_unscale;

pub use crate::config::ScalerConfig;

/// Whether torch's own update kernel does it (no hysteresis, floor or static scale).
fn is_torchs(config: &ScalerConfig) -> bool {
    config.hysteresis <= 1
        && config.min_scale <= 0.0
        && config.dynamic
        && !config.consecutive_hysteresis
}

/// What a checkpoint keeps of a scaler.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f64,
    /// Clean steps since the last change.
    pub growth_tracker: i64,
    /// Overflows still allowed before the next back-off (with hysteresis).
    #[serde(default)]
    pub hysteresis_left: Option<u32>,
}

/// The loss scaler. One per run; the optimizers of the run share it.
#[derive(Debug)]
pub struct GradScaler {
    config: ScalerConfig,
    scale: Tensor,
    growth_tracker: Tensor,
    /// Set by `unscale` for the current step: 1.0 when some gradient overflowed.
    found_inf: Option<Tensor>,
    /// Overflows still allowed before the next back-off.
    hysteresis_left: u32,
}

impl GradScaler {
    /// A scaler whose state tensors live on `device` (where the gradients are).
    pub fn new(config: ScalerConfig, device: Device) -> Self {
        Self {
            config,
            scale: Tensor::full([1], config.init_scale, (Kind::Float, device)),
            growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
            found_inf: None,
            hysteresis_left: config.hysteresis.max(1),
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale.double_value(&[0])
    }

    /// `loss × scale`.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.f_mul(&self.scale.f_to_kind(loss.kind())?.f_squeeze()?)?)
    }

    /// Divides the gradients of `params` by the scale in place (once per step; later
    /// calls in the same step do nothing) and records whether any overflowed.
    pub fn unscale(&mut self, params: &[Tensor]) -> Result<()> {
        if self.found_inf.is_some() {
            return Ok(());
        }
        let inv_scale = self.scale.f_reciprocal()?;
        let found_inf = Tensor::zeros([1], (Kind::Float, self.scale.device()));
        // The fused kernel wants one device and dtype per call, as torch groups them.
        let mut groups: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for p in params {
            let grad = p.grad();
            if grad.defined() {
                groups
                    .entry(format!("{:?}/{:?}", grad.device(), grad.kind()))
                    .or_default()
                    .push(grad);
            }
        }
        for grads in groups.values() {
            let device = grads[0].device();
            let local_inf = Tensor::zeros([1], (Kind::Float, device));
            amp_unscale(grads, &local_inf, &inv_scale.f_to_device(device)?)?;
            let _ = tch::no_grad(|| {
                found_inf.shallow_clone().f_add_(&local_inf.f_to_device(found_inf.device())?)
            })?;
        }
        self.found_inf = Some(found_inf);
        Ok(())
    }

    /// Makes the overflow flag of this step every rank's: with sharded gradients each rank
    /// checks only its shard, and all must skip the step together.
    pub fn share_found_inf(
        &mut self,
        params: &[Tensor],
        group: &dyn crate::comm::Communicator,
    ) -> Result<()> {
        self.unscale(params)?;
        if let Some(found) = &self.found_inf {
            group.all_reduce(found, crate::comm::ReduceOp::Max)?;
        }
        Ok(())
    }

    /// Whether the gradients unscaled in this step hold an inf or NaN (unscales first).
    pub fn found_inf(&mut self, params: &[Tensor]) -> Result<bool> {
        self.unscale(params)?;
        Ok(self.found_inf.as_ref().is_some_and(|f| f.double_value(&[0]) != 0.0))
    }

    /// Ends the step: backs off or grows the scale (`torch._amp_update_scale_`).
    pub fn update(&mut self) -> Result<()> {
        let found_inf = match self.found_inf.take() {
            Some(f) => f,
            None => Tensor::zeros([1], (Kind::Float, self.scale.device())),
        };
        if is_torchs(&self.config) {
            let _ = self.scale.f_internal_amp_update_scale_(
                &self.growth_tracker,
                &found_inf,
                self.config.growth_factor,
                self.config.backoff_factor,
                self.config.growth_interval,
            )?;
            return Ok(());
        }
        // DeepSpeed's DynamicLossScaler (its step reads the overflow flag on the host too).
        if !self.config.dynamic {
            return Ok(());
        }
        let c = self.config;
        let (mut scale, mut clean) = (self.scale(), self.growth_tracker.int64_value(&[0]));
        if found_inf.double_value(&[0]) != 0.0 {
            if self.hysteresis_left <= 1 {
                if c.min_scale > 0.0 && scale <= c.min_scale {
                    // DeepSpeed's raise_error_at_min_scale: skipping forever helps nobody.
                    return Err(crate::Error::Training(format!(
                        "fp16: the loss scale is at its minimum ({}) and the gradients still \
                         overflow: training has diverged; lower the learning rate, or use bf16",
                        c.min_scale
                    )));
                }
                scale = (scale * c.backoff_factor).max(c.min_scale);
            } else {
                self.hysteresis_left -= 1;
            }
            clean = 0;
        } else {
            if c.consecutive_hysteresis {
                self.hysteresis_left = c.hysteresis.max(1);
            }
            clean += 1;
            if clean >= c.growth_interval {
                scale *= c.growth_factor;
                clean = 0;
                self.hysteresis_left = c.hysteresis.max(1);
            }
        }
        let _ = self.scale.f_fill_(scale)?;
        let _ = self.growth_tracker.f_fill_(clean)?;
        Ok(())
    }

    /// The state a checkpoint keeps.
    pub fn state(&self) -> ScalerState {
        ScalerState {
            scale: self.scale(),
            growth_tracker: self.growth_tracker.int64_value(&[0]),
            hysteresis_left: (!is_torchs(&self.config)).then_some(self.hysteresis_left),
        }
    }

    /// Restores a state from [`GradScaler::state`].
    pub fn load_state(&mut self, state: ScalerState) -> Result<()> {
        let _ = self.scale.f_fill_(state.scale)?;
        let _ = self.growth_tracker.f_fill_(state.growth_tracker)?;
        if let Some(left) = state.hysteresis_left {
            self.hysteresis_left = left.max(1);
        }
        self.found_inf = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSpeed's DynamicLossScaler, step by step (its `update_scale` with hysteresis 2,
    /// window 3, floor 2, worked through by hand): a first overflow is forgiven, the second
    /// backs off, growth restores the allowance, and the floor holds.
    #[test]
    fn deepspeed_hysteresis_window_and_floor() {
        let config = ScalerConfig {
            init_scale: 8.0,
            growth_interval: 3,
            hysteresis: 2,
            min_scale: 2.0,
            ..ScalerConfig::default()
        };
        let mut scaler = GradScaler::new(config, Device::Cpu);
        let param = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut scales = Vec::new();
        for overflow in [true, true, false, false, false, true, true, true] {
            let grad = Tensor::from_slice(&[if overflow { f32::INFINITY } else { 1.0 }]);
            crate::shim::set_grad(&param, Some(&grad)).unwrap();
            assert_eq!(scaler.found_inf(&[param.shallow_clone()]).unwrap(), overflow);
            scaler.update().unwrap();
            scales.push(scaler.scale());
        }
        assert_eq!(scales, [8.0, 4.0, 4.0, 4.0, 8.0, 8.0, 4.0, 2.0]);
        // The allowance left travels with a checkpoint.
        let state = scaler.state();
        assert_eq!(state.hysteresis_left, Some(1));
        // At the floor with no allowance left, one more overflow stops training (DeepSpeed's
        // raise_error_at_min_scale) instead of skipping every step from then on.
        let mut stuck = GradScaler::new(config, Device::Cpu);
        stuck.load_state(state).unwrap();
        crate::shim::set_grad(&param, Some(&Tensor::from_slice(&[f32::INFINITY]))).unwrap();
        assert!(stuck.found_inf(&[param.shallow_clone()]).unwrap());
        let err = stuck.update().unwrap_err().to_string();
        assert!(err.contains("loss scale is at its minimum (2)"), "{err}");
        let mut resumed = GradScaler::new(config, Device::Cpu);
        resumed.load_state(state).unwrap();
        assert_eq!(resumed.state(), state);
        // A static scale never moves.
        let fixed = ScalerConfig { init_scale: 128.0, dynamic: false, ..ScalerConfig::default() };
        let mut scaler = GradScaler::new(fixed, Device::Cpu);
        crate::shim::set_grad(&param, Some(&Tensor::from_slice(&[f32::NAN]))).unwrap();
        assert!(scaler.found_inf(&[param.shallow_clone()]).unwrap());
        scaler.update().unwrap();
        assert_eq!(scaler.scale(), 128.0);
    }
}
