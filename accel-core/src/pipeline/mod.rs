//! Pipeline parallelism: the model's layers cut into stages along the mesh's pipeline
//! dimension, micro-batches flowing through them — activations forward to the next stage,
//! their gradients back — under GPipe's or 1F1B's schedule (schedule.rs, after Megatron-LM's
//! `pipeline_parallel/schedules.py`). The accumulation window is the set of micro-batches of
//! one step: `accumulate = 8` means 8 micro-batches in flight per optimizer step. See
//! README.md beside this file.

mod schedule;

use std::ops::Range;
use std::sync::Arc;

use tch::{Kind, Tensor};

use crate::Accelerator;
use crate::comm::Communicator;
use crate::error::{Error, Result};

/// The order of forward and backward passes of a step's micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Every micro-batch forward, then every micro-batch backward (GPipe): simple, holds
    /// the activations of all micro-batches at once.
    GPipe,
    /// One forward, one backward (PipeDream-flush): after a warm-up, each stage alternates,
    /// so a stage holds at most as many micro-batches' activations as there are stages
    /// after it. The same bubble as GPipe, less memory.
    OneForwardOneBackward,
}

/// This process's stage of the pipeline.
#[derive(Clone)]
pub struct Pipeline {
    comm: Arc<dyn Communicator>,
    schedule: Schedule,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("stage", &self.stage())
            .field("stages", &self.stages())
            .field("schedule", &self.schedule)
            .finish()
    }
}

/// `n` layers cut into `stages` contiguous ranges, as even as possible (the first stages
/// take one more).
pub fn stage_layers(n: usize, stages: usize, stage: usize) -> Range<usize> {
    let (base, extra) = (n / stages, n % stages);
    let start = stage * base + stage.min(extra);
    start..start + base + usize::from(stage < extra)
}

impl Pipeline {
    /// The pipeline of `accelerator`'s mesh, run under `schedule`.
    pub fn new(accelerator: &Accelerator, schedule: Schedule) -> Self {
        Self { comm: accelerator.inner.parallel.stages(), schedule }
    }

    /// This process's stage.
    pub fn stage(&self) -> usize {
        self.comm.rank()
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.comm.size()
    }

    /// Whether this stage takes the data.
    pub fn is_first(&self) -> bool {
        self.stage() == 0
    }

    /// Whether this stage computes the loss.
    pub fn is_last(&self) -> bool {
        self.stage() + 1 == self.stages()
    }

    /// Which of `n` layers this stage holds (contiguous, as even as possible); an error if
    /// there are fewer layers than stages.
    pub fn layers(&self, n: usize) -> Result<Range<usize>> {
        if n < self.stages() {
            return Err(Error::Config(format!(
                "{n} layer(s) cannot be cut into {} pipeline stages",
                self.stages()
            )));
        }
        Ok(stage_layers(n, self.stages(), self.stage()))
    }

    /// One optimizer step's forward and backward passes of `micro_batches` (inputs,
    /// targets) through this stage: `forward` runs the stage's layers (on the first stage
    /// on the inputs, elsewhere on the activations the previous stage sends), `loss` turns
    /// the last stage's output and the targets into a scalar. Gradients accumulate in the
    /// parameters, each micro-batch's loss divided by the accelerator's `accumulate`; then
    /// step the optimizer. A step takes `accumulate` micro-batches, or fewer at the end of an
    /// epoch (a short last window, as Accelerate ends one: still divided by `accumulate`).
    /// Returns each micro-batch's loss, on every stage.
    pub fn train_step(
        &self,
        accelerator: &Accelerator,
        micro_batches: &[(Tensor, Tensor)],
        forward: impl Fn(&Tensor) -> Tensor,
        loss: impl Fn(&Tensor, &Tensor) -> Tensor,
    ) -> Result<Vec<f64>> {
        let m = micro_batches.len();
        let accumulate = accelerator.config().accumulate as usize;
        if m == 0 || m > accumulate {
            return Err(Error::Config(format!(
                "a pipeline step of {m} micro-batches with accumulate = {accumulate}: the \
                 micro-batches of one step are the accumulation window, so pass `accumulate` \
                 of them (fewer only for the last window of an epoch)"
            )));
        }
        let running = accelerator.pipeline_step(m as u64);
        let mut run = schedule::Run {
            pipeline: self,
            accelerator,
            micro_batches,
            forward: &forward,
            loss: &loss,
            losses: vec![0.0; m],
        };
        match self.schedule {
            Schedule::GPipe => run.gpipe(),
            Schedule::OneForwardOneBackward => run.one_forward_one_backward(),
        }?;
        drop(running);
        // The losses live on the last stage; every stage reports them.
        let losses = Tensor::from_slice(&run.losses).f_to_kind(Kind::Double)?;
        self.comm.broadcast(&losses, self.stages() - 1)?;
        Vec::<f64>::try_from(&losses).map_err(Error::from)
    }

    /// Forward passes only, without gradients (evaluation): `micro_batches` through every
    /// stage; returns `score(output, target)` of each micro-batch (computed on the last
    /// stage), on every stage.
    pub fn eval_step(
        &self,
        accelerator: &Accelerator,
        micro_batches: &[(Tensor, Tensor)],
        forward: impl Fn(&Tensor) -> Tensor,
        score: impl Fn(&Tensor, &Tensor) -> Tensor,
    ) -> Result<Vec<f64>> {
        let mut run = schedule::Run {
            pipeline: self,
            accelerator,
            micro_batches,
            forward: &forward,
            loss: &score,
            losses: vec![0.0; micro_batches.len()],
        };
        tch::no_grad(|| run.forward_only())?;
        let scores = Tensor::from_slice(&run.losses).f_to_kind(Kind::Double)?;
        self.comm.broadcast(&scores, self.stages() - 1)?;
        Vec::<f64>::try_from(&scores).map_err(Error::from)
    }
}
