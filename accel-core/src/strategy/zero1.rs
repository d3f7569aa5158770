//! ZeRO stage 1 (as torch's `ZeroRedundancyOptimizer`): gradients are averaged by DDP, then
//! each process keeps the optimizer state of its share of the parameters only, steps them,
//! and broadcasts them to the others.

use std::sync::Arc;

use tch::Tensor;

use super::ddp::DdpStrategy;
use super::{Context, ModelOptions, OptimizerPlan, Placement, Strategy};
use crate::comm::Communicator;
use crate::error::Result;
use crate::optim::{Optimizer, Param};

/// ZeRO-1 over the mesh's data dimension.
#[derive(Debug)]
pub struct Zero1 {
    ddp: DdpStrategy,
    group: Arc<dyn Communicator>,
}

impl Zero1 {
    pub(crate) fn new(group: Arc<dyn Communicator>) -> Self {
        Self { ddp: DdpStrategy::new(group.clone()), group }
    }
}

/// Shares parameters out so that every rank owns about as many elements: each in turn to
/// the rank with the fewest so far (the same on every rank).
pub(crate) fn partition(params: &[Tensor], world: usize) -> Vec<usize> {
    let mut load = vec![0i64; world];
    params
        .iter()
        .map(|p| {
            let rank = (0..world).min_by_key(|&r| (load[r], r)).expect("world >= 1");
            load[rank] += p.numel() as i64;
            rank
        })
        .collect()
}

impl Strategy for Zero1 {
    fn name(&self) -> String {
        "zero1".into()
    }

    fn prepare_model(&self, cx: &Context<'_>, params: &[Param], o: &ModelOptions) -> Result<()> {
        self.ddp.prepare_model(cx, params, o)
    }

    fn prepare_optimizer(
        &self,
        _: &Context<'_>,
        optimizer: &mut dyn Optimizer,
    ) -> Result<Box<dyn OptimizerPlan>> {
        let all = optimizer.params();
        let owner = partition(&all, self.group.size());
        let rank = self.group.rank();
        optimizer.retain(&|i| owner[i] == rank)?;
        Ok(Box::new(Zero1Plan { group: self.group.clone(), all, owner }))
    }

    fn after_backward(&self, cx: &Context<'_>, sync: bool) -> Result<()> {
        self.ddp.after_backward(cx, sync)
    }

    fn zero_grad_in_place(&self) -> bool {
        self.ddp.zero_grad_in_place()
    }
}

/// One optimizer's share under ZeRO-1.
struct Zero1Plan {
    group: Arc<dyn Communicator>,
    /// Every parameter, in the optimizer's order.
    all: Vec<Tensor>,
    /// The rank that owns (steps) each of them.
    owner: Vec<usize>,
}

impl OptimizerPlan for Zero1Plan {
    fn gradients(&self, _: &dyn Optimizer) -> Vec<Tensor> {
        // Averaged by DDP: every process holds every gradient.
        self.all.iter().map(Tensor::shallow_clone).collect()
    }

    fn after_step(&mut self, _: &mut dyn Optimizer, stepped: bool) -> Result<()> {
        if !stepped {
            return Ok(());
        }
        // Each parameter from the process that stepped it: all launched, then all waited
        // for, so that they follow each other without a wait between (one queue on NCCL's
        // stream, one on the cpu backend's worker).
        tch::no_grad(|| -> Result<()> {
            let launched: Vec<_> = self
                .all
                .iter()
                .zip(&self.owner)
                .map(|(param, &owner)| self.group.broadcast_async(param, owner))
                .collect::<Result<_>>()?;
            launched.into_iter().try_for_each(|work| work.wait())
        })
    }

    fn state_placement(&self, _: &str, _: &Tensor) -> Placement {
        Placement::Whole { write: true }
    }

    fn state_placement_of(&self, _: &str, _: i64) -> Placement {
        Placement::Whole { write: true }
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::partition;
    use crate::optim::{AdamConfig, AdamW, Optimizer, unnamed_params};

    #[test]
    fn zero1_shares_parameters_evenly_and_keeps_only_its_own_state() {
        let sizes = [1000i64, 10, 600, 400, 10, 5];
        let params: Vec<Tensor> = sizes
            .iter()
            .map(|&n| Tensor::ones([n], (Kind::Float, Device::Cpu)).set_requires_grad(true))
            .collect();
        let owner = partition(&params, 2);
        // Each to the lighter rank: 1000 | 10 600 400 | then 10 and 5 back to rank 0.
        assert_eq!(owner, [0, 1, 1, 1, 0, 0]);
        let load =
            |r| sizes.iter().zip(&owner).filter(|(_, o)| **o == r).map(|(n, _)| n).sum::<i64>();
        assert_eq!((load(0), load(1)), (1015, 1010));

        let mut opt = AdamW::new(unnamed_params(&params), AdamConfig::adamw()).unwrap();
        opt.retain(&|i| owner[i] == 1).unwrap();
        assert_eq!(opt.params().len(), 3);
        for p in &params {
            crate::shim::set_grad(p, Some(&p.ones_like())).unwrap();
        }
        opt.step().unwrap();
        let state = opt.state().unwrap();
        // Moments exist for the three owned tensors only (step, exp_avg, exp_avg_sq each).
        assert_eq!(state.tensors.len(), 9);
        assert!(!state.tensors.keys().any(|k| k.starts_with("param.0/")));
        assert_eq!(
            params[0].double_value(&[0]),
            1.0,
            "a parameter another rank owns is not stepped here"
        );
    }
}
