//! `strategy = "auto"`: the strategy chosen when the model is prepared, from its size, the
//! optimizer's state (Adam's two moments assumed: the optimizer is prepared after the
//! model), the processes sharing the work and this process's memory — the lightest in
//! communication whose model state (the ZeRO paper's formulas, `accel estimate-memory`'s)
//! fits in [`BUDGET`] of the memory, else zero3 with offload. The main process prints the
//! choice and the arithmetic. Any other strategy set anywhere overrides it.

use std::sync::{Arc, OnceLock};

use tch::{Device, Tensor};

use super::{Context, ModelOptions, OptimizerPlan, Placement, Strategy};
use crate::config::Strategy as StrategyName;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};
use crate::optim::{Optimizer, Param};
use crate::strategy::fsdp::ShardOptions;

/// The share of memory model state may take; the rest is for activations and buffers.
pub const BUDGET: f64 = 0.6;

/// Bytes of Adam's state per parameter (two fp32 moments).
const ADAM_STATE: f64 = 8.0;

/// Model state bytes per process under `strategy` (parameters and gradients in fp32, the
/// master weights of mixed precision included, and `state` bytes of optimizer state per
/// parameter) for `params` parameters over `n` processes: 4Ψ+4Ψ+kΨ for ddp, then the ZeRO
/// stages shard the state, the gradients, the parameters.
pub fn model_state_bytes(strategy: StrategyName, params: f64, n: f64, state: f64) -> f64 {
    let (p, g, s) = model_state_parts(strategy, params, n, state);
    p + g + s
}

/// [`model_state_bytes`] as (parameters, gradients, optimizer state) bytes
/// (`accel estimate-memory` prints them apart).
pub fn model_state_parts(
    strategy: StrategyName,
    params: f64,
    n: f64,
    state: f64,
) -> (f64, f64, f64) {
    match strategy {
        StrategyName::Zero1 => (4.0 * params, 4.0 * params, state * params / n),
        StrategyName::Zero2 => (4.0 * params, 4.0 * params / n, state * params / n),
        StrategyName::Zero3 | StrategyName::Fsdp | StrategyName::HybridShard => {
            (4.0 * params / n, 4.0 * params / n, state * params / n)
        }
        _ => (4.0 * params, 4.0 * params, state * params),
    }
}

/// The formula of [`model_state_bytes`], as printed.
fn formula(strategy: StrategyName) -> &'static str {
    match strategy {
        StrategyName::Zero1 => "8Ψ + 8Ψ/N",
        StrategyName::Zero2 => "4Ψ + 12Ψ/N",
        StrategyName::Zero3 => "16Ψ/N",
        _ => "16Ψ",
    }
}

fn human(bytes: f64) -> String {
    let mut value = bytes;
    for unit in ["B", "KiB", "MiB"] {
        if value < 1024.0 {
            return if unit == "B" {
                format!("{value:.0} B")
            } else {
                format!("{value:.1} {unit}")
            };
        }
        value /= 1024.0;
    }
    format!("{value:.2} GiB")
}

/// What the choice was made of.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The strategy.
    pub strategy: StrategyName,
    /// Whether master shards and optimizer state go to host memory.
    pub offload: bool,
    /// The lines of arithmetic behind it.
    pub reasons: Vec<String>,
}

/// The lightest strategy whose model state fits in `BUDGET × memory` bytes, for `params`
/// parameters over `n` data-parallel processes; `offload_asked`: the user wants offload,
/// which only a sharded strategy gives.
pub fn choose(params: f64, n: usize, memory: f64, where_: &str, offload_asked: bool) -> Choice {
    let budget = BUDGET * memory;
    let mut reasons = vec![format!(
        "Ψ = {params:.0} parameters, N = {n} data-parallel process(es), Adam's state assumed \
         (8 bytes per parameter); budget {:.0}% of {} ({where_}) = {}",
        100.0 * BUDGET,
        human(memory),
        human(budget)
    )];
    let candidates =
        [StrategyName::Ddp, StrategyName::Zero1, StrategyName::Zero2, StrategyName::Zero3];
    for strategy in candidates {
        if offload_asked && !strategy.shards() {
            continue;
        }
        let bytes = model_state_bytes(strategy, params, n as f64, ADAM_STATE);
        let fits = bytes <= budget;
        reasons.push(format!(
            "{strategy}: {} = {} {} budget",
            formula(strategy),
            human(bytes),
            if fits { "≤" } else { ">" }
        ));
        if fits {
            return Choice { strategy, offload: offload_asked, reasons };
        }
    }
    reasons.push(
        "nothing fits on the device: zero3 with master shards and state offloaded to host memory"
            .into(),
    );
    Choice { strategy: StrategyName::Zero3, offload: true, reasons }
}

/// Memory this process may count on: `ACCEL_AUTO_MEMORY` (bytes; a GPU shared with other
/// work, or a check), else the GPU's total, else the host's available memory shared among
/// this machine's processes.
fn memory_of(device: Device, local_processes: usize) -> (f64, String) {
    if let Some(bytes) = std::env::var(crate::config::env::AUTO_MEMORY)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
    {
        return (bytes, crate::config::env::AUTO_MEMORY.into());
    }
    if let Device::Cuda(i) = device {
        if let Some((name, bytes)) =
            crate::cuda::driver_info().ok().and_then(|d| d.devices.get(i).cloned())
        {
            return (bytes as f64, format!("cuda:{i}, {name}"));
        }
    }
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(8.0 * f64::from(1u32 << 30), |kib| kib * 1024.0);
    (
        available / local_processes.max(1) as f64,
        format!("host memory available / {} local process(es)", local_processes.max(1)),
    )
}

/// The strategy that decides when the first model is prepared.
pub(crate) struct Auto {
    mesh: DeviceMesh,
    sharding: ShardOptions,
    local_processes: usize,
    chosen: OnceLock<Arc<dyn Strategy>>,
}

impl std::fmt::Debug for Auto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auto").field("chosen", &self.chosen.get().map(|s| s.name())).finish()
    }
}

impl Auto {
    pub(crate) fn new(mesh: &DeviceMesh, sharding: ShardOptions, local_processes: usize) -> Self {
        Self { mesh: mesh.clone(), sharding, local_processes, chosen: OnceLock::new() }
    }

    fn inner(&self) -> Result<&Arc<dyn Strategy>> {
        self.chosen.get().ok_or_else(|| {
            Error::Training(
                "strategy auto decides when the model is prepared: call prepare_model first".into(),
            )
        })
    }
}

impl Strategy for Auto {
    fn name(&self) -> String {
        match self.chosen.get() {
            Some(s) => format!("{} (auto)", s.name()),
            None => "auto".into(),
        }
    }

    fn prepare_model(
        &self,
        cx: &Context<'_>,
        params: &[Param],
        options: &ModelOptions,
    ) -> Result<()> {
        if self.chosen.get().is_none() {
            let count: i64 = params
                .iter()
                .filter(|p| p.tensor.requires_grad())
                .map(|p| p.tensor.numel() as i64)
                .sum();
            let n = self.mesh.dims().size(Dim::Data);
            let (mut memory, mut where_) = memory_of(cx.device(), self.local_processes);
            // Every rank must choose the same: the largest share of the model (pipeline
            // stages differ) and the smallest memory of any rank decide.
            let mut count = count;
            if let Some(world) = self.mesh.world() {
                let all: Vec<(i64, f64)> = world.all_gather_objects(&(count, memory))?;
                count = all.iter().map(|a| a.0).max().unwrap_or(count);
                let least = all.iter().map(|a| a.1).fold(f64::INFINITY, f64::min);
                if least < memory {
                    where_ = format!("the least of any rank; here {where_}");
                }
                memory = least;
            }
            let choice = choose(count as f64, n, memory, &where_, self.sharding.offload);
            if self.mesh.rank() == 0 {
                eprintln!(
                    "accel: strategy auto chose {}{}:",
                    choice.strategy,
                    if choice.offload { " with offload" } else { "" }
                );
                for reason in &choice.reasons {
                    eprintln!("accel:   {reason}");
                }
                if self.sharding.param_dtype.is_some() && choice.strategy != StrategyName::Zero3 {
                    eprintln!(
                        "accel:   ShardOptions::param_dtype is not used: {} gathers no units",
                        choice.strategy
                    );
                }
            }
            let sharding = ShardOptions { offload: choice.offload, ..self.sharding.clone() };
            let chosen =
                super::builtin(choice.strategy, &self.mesh, sharding, self.local_processes);
            let _ = self.chosen.set(chosen);
        }
        let inner = self.inner()?;
        if !inner.places_parameters() {
            super::place_whole(cx, params)?;
        }
        inner.prepare_model(cx, params, options)
    }

    fn places_parameters(&self) -> bool {
        // Decided when the model is prepared: `prepare_model` places them as chosen.
        true
    }

    fn prepare_optimizer(
        &self,
        cx: &Context<'_>,
        optimizer: &mut dyn Optimizer,
    ) -> Result<Box<dyn OptimizerPlan>> {
        self.inner()?.prepare_optimizer(cx, optimizer)
    }

    fn after_backward(&self, cx: &Context<'_>, sync: bool) -> Result<()> {
        match self.chosen.get() {
            Some(s) => s.after_backward(cx, sync),
            None => Ok(()),
        }
    }

    fn take_error(&self) -> Result<()> {
        self.chosen.get().map_or(Ok(()), |s| s.take_error())
    }

    fn zero_grad_in_place(&self) -> bool {
        self.chosen.get().is_some_and(|s| s.zero_grad_in_place())
    }

    fn steps_whole_parameters(&self) -> bool {
        self.chosen.get().is_none_or(|s| s.steps_whole_parameters())
    }

    fn end_training(&self, cx: &Context<'_>) -> Result<()> {
        self.chosen.get().map_or(Ok(()), |s| s.end_training(cx))
    }

    fn parameter(&self, param: &Param) -> Result<(Tensor, Placement)> {
        match self.chosen.get() {
            Some(s) => s.parameter(param),
            None => Ok((param.tensor.f_detach()?, Placement::Replicated)),
        }
    }

    fn load_parameter(&self, param: &Param, whole: &Tensor) -> Result<()> {
        self.inner()?.load_parameter(param, whole)
    }

    fn load_part(&self, param: &Param, part: &Tensor) -> Result<()> {
        self.inner()?.load_part(param, part)
    }

    fn after_load(&self) -> Result<()> {
        self.chosen.get().map_or(Ok(()), |s| s.after_load())
    }

    fn summon_full_params(&self) -> Result<u64> {
        self.chosen.get().map_or(Ok(0), |s| s.summon_full_params())
    }

    fn full_parameters(&self, params: &[Param]) -> Result<Vec<Tensor>> {
        match self.chosen.get() {
            Some(s) => s.full_parameters(params),
            None => params.iter().map(|p| Ok(p.tensor.f_detach_copy()?)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;

    #[test]
    fn the_lightest_strategy_that_fits_is_chosen_and_says_why() {
        // 100M parameters on 8 processes: ddp 1.6 GB, zero1 0.9 GB, zero2 0.55 GB, zero3 0.2 GB.
        let pick =
            |memory_gib: f64, offload: bool| choose(1e8, 8, memory_gib * GIB, "test", offload);
        assert_eq!(pick(80.0, false).strategy, StrategyName::Ddp);
        assert_eq!(pick(2.0, false).strategy, StrategyName::Zero1);
        assert_eq!(pick(1.0, false).strategy, StrategyName::Zero2);
        assert_eq!(pick(0.5, false).strategy, StrategyName::Zero3);
        let tight = pick(0.2, false);
        assert_eq!((tight.strategy, tight.offload), (StrategyName::Zero3, true));
        assert_eq!(pick(80.0, true).strategy, StrategyName::Zero2, "offload needs sharding");
        let why = pick(1.0, false).reasons.join("\n");
        assert!(why.contains("Ψ = 100000000 parameters, N = 8"), "{why}");
        assert!(why.contains("zero1: 8Ψ + 8Ψ/N = 858.3 MiB > budget"), "{why}");
        assert!(why.contains("zero2: 4Ψ + 12Ψ/N = 524.5 MiB ≤ budget"), "{why}");
        assert_eq!(model_state_bytes(StrategyName::Zero3, 1e6, 4.0, 8.0), 4e6);
    }
}
