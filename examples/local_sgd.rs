//! Local SGD (Accelerate's `accelerate.local_sgd.LocalSGD`) as a strategy of one's own,
//! written against accel-core's public API only: the proof that strategies plug in from
//! outside the crate.
//!
//! Each process steps on its own gradients (no gradient all-reduce); the parameters are
//! averaged across processes every `K` batches and once more at the end of training.
//! Batches are counted as Accelerate's `LocalSGD.step()` is in its `by_feature/local_sgd.py`:
//! once per batch, at each `optimizer.step()` call, whether or not accumulation lets the
//! optimizer update.

use std::sync::{Arc, Mutex};

use accel_core::Result;
use accel_core::comm::{Communicator, ReduceOp};
use accel_core::mesh::Dim;
use accel_core::optim::{Optimizer, Param};
use accel_core::strategy::{Context, ModelOptions, OptimizerPlan, Strategy};
use tch::Tensor;

/// What the strategy and the plans of its optimizers share.
#[derive(Debug, Default)]
struct Shared {
    /// The data-parallel processes (set when the first model is prepared).
    comm: Option<Arc<dyn Communicator>>,
    /// Every parameter of the prepared models.
    params: Vec<Tensor>,
    /// Batches counted so far.
    steps: u64,
}

impl Shared {
    /// Every parameter replaced by its mean over the processes (Accelerate's
    /// `_sync_and_avg_model_params`: a barrier, then a mean-reduce of each).
    fn average(&self) -> Result<()> {
        let Some(comm) = &self.comm else { return Ok(()) };
        comm.barrier()?;
        tch::no_grad(|| -> Result<()> {
            for param in &self.params {
                comm.all_reduce(param, ReduceOp::Sum)?;
                let _ = param.shallow_clone().f_div_scalar_(comm.size() as f64)?;
            }
            Ok(())
        })
    }
}

/// Local SGD averaging the parameters every `every` batches.
#[derive(Debug, Clone)]
pub struct LocalSgd {
    every: u64,
    shared: Arc<Mutex<Shared>>,
}

impl LocalSgd {
    /// Averages the parameters every `every` batches (at least 1).
    pub fn new(every: u64) -> Self {
        Self { every: every.max(1), shared: Arc::default() }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Strategy for LocalSgd {
    fn name(&self) -> String {
        format!("local_sgd(every {} batches)", self.every)
    }

    fn prepare_model(&self, cx: &Context<'_>, params: &[Param], _: &ModelOptions) -> Result<()> {
        let comm = cx.mesh().comm(Dim::Data);
        // Every replica starts from rank 0's values, as a DDP wrapper's would.
        tch::no_grad(|| -> Result<()> {
            for p in params {
                comm.broadcast(&p.tensor, 0)?;
            }
            Ok(())
        })?;
        let mut shared = self.shared();
        shared.params.extend(
            params.iter().filter(|p| p.tensor.requires_grad()).map(|p| p.tensor.shallow_clone()),
        );
        shared.comm = Some(comm);
        Ok(())
    }

    fn prepare_optimizer(
        &self,
        _: &Context<'_>,
        _: &mut dyn Optimizer,
    ) -> Result<Box<dyn OptimizerPlan>> {
        Ok(Box::new(self.clone()))
    }

    fn end_training(&self, _: &Context<'_>) -> Result<()> {
        self.shared().average()
    }
}

impl OptimizerPlan for LocalSgd {
    fn after_step(&mut self, _: &mut dyn Optimizer, _stepped: bool) -> Result<()> {
        let mut shared = self.shared();
        shared.steps += 1;
        if shared.steps.is_multiple_of(self.every) {
            shared.average()?;
        }
        Ok(())
    }
}
