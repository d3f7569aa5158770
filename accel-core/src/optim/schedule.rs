//! Learning-rate schedules, each computing exactly what its PyTorch / transformers
//! counterpart computes (in f64, in the same order of operations).

use serde::{Deserialize, Serialize};

use super::Optimizer;
use crate::error::{Error, Result};

/// Which schedule, and its parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Schedule {
    /// The optimizer's learning rate, unchanged.
    Constant,
    /// Linear warm-up from 0, then constant (transformers
    /// `get_constant_schedule_with_warmup`).
    ConstantWithWarmup {
        /// Steps of warm-up.
        warmup_steps: u64,
    },
    /// Linear warm-up from 0, then linear decay to 0 at `total_steps` (transformers
    /// `get_linear_schedule_with_warmup`).
    LinearWarmup {
        /// Steps of warm-up.
        warmup_steps: u64,
        /// Step at which the rate reaches 0.
        total_steps: u64,
    },
    /// Linear warm-up, then cosine decay (transformers `get_cosine_schedule_with_warmup`;
    /// `num_cycles` 0.5 decays once to 0).
    CosineWarmup {
        /// Steps of warm-up.
        warmup_steps: u64,
        /// Step at which the decay ends.
        total_steps: u64,
        /// Number of cosine waves (0.5 = from max to 0).
        num_cycles: f64,
    },
    /// `torch.optim.lr_scheduler.OneCycleLR` (two phases, cosine annealing); ignores the
    /// optimizer's own learning rate, as torch does.
    OneCycle {
        /// Peak learning rate.
        max_lr: f64,
        /// Length of the cycle in steps.
        total_steps: u64,
        /// Fraction of the cycle spent increasing the rate (torch: 0.3).
        pct_start: f64,
        /// Initial rate = max_lr / div_factor (torch: 25).
        div_factor: f64,
        /// Final rate = initial / final_div_factor (torch: 1e4).
        final_div_factor: f64,
        /// Cycle momentum (SGD) or beta1 (Adam) inversely to the rate (torch: true).
        cycle_momentum: bool,
        /// Momentum at the peak rate (torch: 0.85).
        base_momentum: f64,
        /// Momentum at the start and end (torch: 0.95).
        max_momentum: f64,
    },
    /// Multiply the rate by `gamma` every `step_size` steps (`torch.optim.lr_scheduler.StepLR`).
    Step {
        /// Steps between decays.
        step_size: u64,
        /// Decay factor.
        gamma: f64,
    },
}

impl Schedule {
    /// OneCycle with torch's defaults.
    pub fn one_cycle(max_lr: f64, total_steps: u64) -> Self {
        Schedule::OneCycle {
            max_lr,
            total_steps,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
            cycle_momentum: true,
            base_momentum: 0.85,
            max_momentum: 0.95,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("schedule {self:?}: {why}")));
        match *self {
            Schedule::LinearWarmup { warmup_steps, total_steps }
            | Schedule::CosineWarmup { warmup_steps, total_steps, .. }
                if warmup_steps > total_steps =>
            {
                bad(format!("warmup_steps {warmup_steps} > total_steps {total_steps}"))
            }
            Schedule::OneCycle { total_steps: 0, .. } => bad("total_steps must be > 0".into()),
            Schedule::OneCycle { pct_start, .. } if !(0.0..=1.0).contains(&pct_start) => {
                bad("pct_start must be in [0, 1]".into())
            }
            Schedule::Step { step_size: 0, .. } => bad("step_size must be > 0".into()),
            _ => Ok(()),
        }
    }

    /// transformers' multiplicative factor for the LambdaLR-style schedules.
    fn lambda(&self, step: u64) -> Option<f64> {
        let s = step as f64;
        Some(match *self {
            Schedule::Constant => 1.0,
            Schedule::ConstantWithWarmup { warmup_steps } => {
                if step < warmup_steps {
                    s / (warmup_steps.max(1) as f64)
                } else {
                    1.0
                }
            }
            Schedule::LinearWarmup { warmup_steps, total_steps } => {
                if step < warmup_steps {
                    s / (warmup_steps.max(1) as f64)
                } else {
                    (0.0f64).max(
                        (total_steps as f64 - s) / ((total_steps - warmup_steps).max(1) as f64),
                    )
                }
            }
            Schedule::CosineWarmup { warmup_steps, total_steps, num_cycles } => {
                if step < warmup_steps {
                    s / (warmup_steps.max(1) as f64)
                } else {
                    let progress =
                        (s - warmup_steps as f64) / ((total_steps - warmup_steps).max(1) as f64);
                    (0.0f64).max(
                        0.5 * (1.0 + (std::f64::consts::PI * num_cycles * 2.0 * progress).cos()),
                    )
                }
            }
            Schedule::OneCycle { .. } | Schedule::Step { .. } => return None,
        })
    }
}

/// The part of a scheduler a checkpoint needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerState {
    /// The schedule.
    pub schedule: Schedule,
    /// Learning rates of the groups when the scheduler was made (`initial_lr`).
    pub base_lrs: Vec<f64>,
    /// Steps taken (`last_epoch`).
    pub step: u64,
}

/// Sets the optimizer's learning rates (and, for one-cycle, momenta) step by step.
/// Construction applies step 0, as torch's schedulers do.
#[derive(Debug, Clone)]
pub struct LrScheduler {
    state: SchedulerState,
}

impl LrScheduler {
    /// A scheduler for `optimizer`, which it sets to step 0 of `schedule` right away.
    pub fn new(schedule: Schedule, optimizer: &mut dyn Optimizer) -> Result<Self> {
        schedule.validate()?;
        let base_lrs = match &schedule {
            Schedule::OneCycle { max_lr, div_factor, .. } => {
                vec![max_lr / div_factor; optimizer.num_groups()]
            }
            _ => (0..optimizer.num_groups()).map(|g| optimizer.lr(g)).collect(),
        };
        if base_lrs.iter().any(|lr: &f64| lr.is_nan()) {
            return Err(Error::Config(format!(
                "a schedule starts from the optimizer's learning rate, and {}'s is unknown (it \
                 was built outside accel): call set_lr first",
                optimizer.name()
            )));
        }
        if let Schedule::OneCycle { cycle_momentum: true, max_momentum, .. } = schedule {
            for g in 0..optimizer.num_groups() {
                if optimizer.momentum(g).is_none() {
                    return Err(Error::Config(format!(
                        "one-cycle with cycle_momentum needs an optimizer with momentum; {} has \
                         none",
                        optimizer.name()
                    )));
                }
                optimizer.set_momentum(g, max_momentum);
            }
        }
        let scheduler = Self { state: SchedulerState { schedule, base_lrs, step: 0 } };
        scheduler.apply(optimizer)?;
        Ok(scheduler)
    }

    /// Advances one step and sets the new rates.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<()> {
        self.state.step += 1;
        self.apply(optimizer)
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.state.step
    }

    /// The current schedule's state, for checkpoints.
    pub fn state(&self) -> &SchedulerState {
        &self.state
    }

    /// Restores a saved state and applies its rates to `optimizer`.
    pub fn load_state(
        &mut self,
        state: SchedulerState,
        optimizer: &mut dyn Optimizer,
    ) -> Result<()> {
        if state.base_lrs.len() != optimizer.num_groups() {
            return Err(Error::Checkpoint {
                path: None,
                message: format!(
                    "scheduler state has {} groups, the optimizer {}",
                    state.base_lrs.len(),
                    optimizer.num_groups()
                ),
            });
        }
        self.state = state;
        Ok(())
    }

    fn apply(&self, optimizer: &mut dyn Optimizer) -> Result<()> {
        let step = self.state.step;
        let schedule = &self.state.schedule;
        if let Some(factor) = schedule.lambda(step) {
            for (g, base) in self.state.base_lrs.iter().enumerate() {
                optimizer.set_lr(g, base * factor);
            }
            return Ok(());
        }
        match *schedule {
            // torch's StepLR is recursive: it multiplies the current rate.
            Schedule::Step { step_size, gamma } => {
                if step > 0 && step % step_size == 0 {
                    for g in 0..optimizer.num_groups() {
                        let lr = optimizer.lr(g);
                        optimizer.set_lr(g, lr * gamma);
                    }
                }
            }
            Schedule::OneCycle {
                max_lr,
                total_steps,
                pct_start,
                final_div_factor,
                cycle_momentum,
                base_momentum,
                max_momentum,
                ..
            } => {
                if step > total_steps {
                    return Err(Error::Training(format!(
                        "one-cycle schedule stepped {step} times, beyond its total_steps \
                         {total_steps}"
                    )));
                }
                let phase_one_end = pct_start * total_steps as f64 - 1.0;
                let phase_two_end = total_steps as f64 - 1.0;
                let s = step as f64;
                for (g, &initial) in self.state.base_lrs.iter().enumerate() {
                    let min_lr = initial / final_div_factor;
                    let (pct, lr, momentum) = if s <= phase_one_end {
                        let pct = s / phase_one_end;
                        (pct, (initial, max_lr), (max_momentum, base_momentum))
                    } else {
                        let pct = (s - phase_one_end) / (phase_two_end - phase_one_end);
                        (pct, (max_lr, min_lr), (base_momentum, max_momentum))
                    };
                    optimizer.set_lr(g, annealing_cos(lr.0, lr.1, pct));
                    if cycle_momentum {
                        optimizer.set_momentum(g, annealing_cos(momentum.0, momentum.1, pct));
                    }
                }
            }
            _ => unreachable!("lambda schedules return above"),
        }
        Ok(())
    }
}

/// torch's `OneCycleLR._annealing_cos`.
fn annealing_cos(start: f64, end: f64, pct: f64) -> f64 {
    let cos_out = (std::f64::consts::PI * pct).cos() + 1.0;
    end + (start - end) / 2.0 * cos_out
}
