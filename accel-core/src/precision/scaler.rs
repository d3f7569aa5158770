//! Dynamic loss scaling for fp16, as `torch.amp.GradScaler` with its defaults: scale 65536,
//! ×2 after 2000 steps without overflow, ×0.5 and the step skipped on inf/NaN gradients.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::shim::amp_unscale;

/// GradScaler's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerConfig {
    /// Starting scale (torch: 2^16).
    pub init_scale: f64,
    /// Growth factor after `growth_interval` clean steps (torch: 2.0).
    pub growth_factor: f64,
    /// Factor applied on overflow (torch: 0.5).
    pub backoff_factor: f64,
    /// Clean steps before growing (torch: 2000).
    pub growth_interval: i64,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

/// What a checkpoint keeps of a scaler.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f64,
    /// Clean steps since the last change.
    pub growth_tracker: i64,
}

/// The loss scaler. One per run; the optimizers of the run share it.
#[derive(Debug)]
pub struct GradScaler {
    config: ScalerConfig,
    scale: Tensor,
    growth_tracker: Tensor,
    /// Set by `unscale` for the current step: 1.0 when some gradient overflowed.
    found_inf: Option<Tensor>,
}

impl GradScaler {
    /// A scaler whose state tensors live on `device` (where the gradients are).
    pub fn new(config: ScalerConfig, device: Device) -> Self {
        Self {
            config,
            scale: Tensor::full([1], config.init_scale, (Kind::Float, device)),
            growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
            found_inf: None,
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
        let _ = self.scale.f_internal_amp_update_scale_(
            &self.growth_tracker,
            &found_inf,
            self.config.growth_factor,
            self.config.backoff_factor,
            self.config.growth_interval,
        )?;
        Ok(())
    }

    /// The state a checkpoint keeps.
    pub fn state(&self) -> ScalerState {
        ScalerState { scale: self.scale(), growth_tracker: self.growth_tracker.int64_value(&[0]) }
    }

    /// Restores a state from [`GradScaler::state`].
    pub fn load_state(&mut self, state: ScalerState) -> Result<()> {
        let _ = self.scale.f_fill_(state.scale)?;
        let _ = self.growth_tracker.f_fill_(state.growth_tracker)?;
        self.found_inf = None;
        Ok(())
    }
}
