//! Every built-in strategy trained on ranks run as threads, through communicators that
//! record what each rank issues and, in a second run, hold every operation back until its
//! work is waited for. The ranks must issue the same operations in the same order (the
//! contract of every backend: NCCL pairs operations by order alone), and a strategy that
//! read a result without waiting for it would train differently from the plain run.

use std::sync::{Arc, Mutex};

use tch::{Device, Kind, Tensor, nn, nn::Module};

use crate::Accelerator;
use crate::comm::tests::on_ranks;
use crate::comm::{Backend, Communicator, ProcessGroup, ReduceOp, Work, WorkHandle};
use crate::config::{Config, Strategy as StrategyName};
use crate::error::Result;
use crate::mesh::{DeviceMesh, Dim, ParallelDims};
use crate::optim::{AdamConfig, AdamW};
use crate::strategy::fsdp::Unit;

/// A communicator that notes every operation (and its shape and dtype) before handing it
/// on; with `deferred`, an async operation runs only when its work is waited for.
#[derive(Debug)]
struct Recording {
    inner: Arc<dyn Communicator>,
    log: Mutex<Vec<String>>,
    deferred: bool,
}

/// Work that runs its operation when waited for.
struct Deferred(Box<dyn FnOnce() -> Result<()> + Send>);

impl WorkHandle for Deferred {
    fn wait(self: Box<Self>) -> Result<()> {
        (self.0)()
    }
}

impl Recording {
    fn note(&self, what: &str, t: &Tensor) {
        self.log.lock().unwrap().push(format!("{what} {:?} {:?}", t.size(), t.kind()));
    }

    /// Runs `op` now, or when the work is waited for.
    fn run(
        &self,
        op: impl FnOnce(&dyn Communicator) -> Result<Work> + Send + 'static,
    ) -> Result<Work> {
        if !self.deferred {
            return op(self.inner.as_ref());
        }
        let inner = self.inner.clone();
        Ok(Work::from_handle(Box::new(Deferred(Box::new(move || op(inner.as_ref())?.wait())))))
    }
}

impl Communicator for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        self.note(&format!("all_reduce({op:?})"), tensor);
        let t = tensor.shallow_clone();
        self.run(move |c| c.all_reduce_async(&t, op))
    }
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        self.note(&format!("broadcast({root})"), tensor);
        let t = tensor.shallow_clone();
        self.run(move |c| c.broadcast_async(&t, root))
    }
    fn all_gather_in_place_async(&self, buffer: &Tensor) -> Result<Work> {
        self.note("all_gather", buffer);
        let t = buffer.shallow_clone();
        self.run(move |c| c.all_gather_in_place_async(&t))
    }
    fn reduce_scatter_in_place_async(&self, buffer: &Tensor, op: ReduceOp) -> Result<Work> {
        self.note(&format!("reduce_scatter({op:?})"), buffer);
        let t = buffer.shallow_clone();
        self.run(move |c| c.reduce_scatter_in_place_async(&t, op))
    }
    fn send_async(&self, tensor: &Tensor, to: usize) -> Result<Work> {
        let t = tensor.shallow_clone();
        self.run(move |c| c.send_async(&t, to))
    }
    fn recv_async(&self, tensor: &Tensor, from: usize) -> Result<Work> {
        let t = tensor.shallow_clone();
        self.run(move |c| c.recv_async(&t, from))
    }
    fn abort(&self) {
        self.inner.abort();
    }
}

/// Values that need no random generator (the ranks are threads sharing torch's).
fn values(shape: &[i64], salt: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + salt).sin().view(shape) * 0.5
}

/// Four steps of a two-layer MLP (each layer a zero3 unit) with accumulation 2 on one
/// thread rank: what the rank's communicator saw, and the whole weights at the end.
fn train(
    strategy: StrategyName,
    group: ProcessGroup,
    deferred: bool,
) -> (Vec<String>, Vec<(String, Tensor)>) {
    let rank = group.rank();
    let recording = Arc::new(Recording {
        inner: Arc::new(group.clone()),
        log: Mutex::new(Vec::new()),
        deferred,
    });
    // Each rank makes its own batches below.
    let acc = thread_accelerator(strategy, group, recording.clone(), |b| {
        b.accumulate(2).data(crate::config::DataSharding::Manual)
    });
    // Rank 1 starts elsewhere: the strategy's broadcast from rank 0 must win.
    let (vs, layers) = two_units(&acc, rank);
    acc.prepare_model(&vs).unwrap();
    let mut opt = acc.prepare_optimizer(
        AdamW::new(acc.params(&vs), AdamConfig { lr: 0.05, ..AdamConfig::adamw() }).unwrap(),
    );
    for micro_step in 0..4 {
        let salt = (10 * micro_step + rank) as f64;
        let (x, y) = (values(&[6, 5], salt), values(&[6, 3], salt + 100.0));
        let hidden = layers[0].forward(&x).relu();
        let loss = (layers[1].forward(&hidden) - y).square().mean(Kind::Float);
        acc.backward(&loss).unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    let weights = acc.full_state_dict(&vs).unwrap();
    let log = recording.log.lock().unwrap().clone();
    (log, weights)
}

fn max_difference(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

#[test]
fn every_strategy_issues_the_same_operations_on_every_rank_and_waits_for_each() {
    for (strategy, expected) in [
        (StrategyName::Ddp, "all_reduce(Avg)"),
        (StrategyName::Zero1, "broadcast(1)"),
        (StrategyName::Zero2, "reduce_scatter(Sum)"),
        (StrategyName::Zero3, "all_gather"),
    ] {
        let plain =
            on_ranks(2, std::time::Duration::from_secs(20), move |g| train(strategy, g, false));
        let deferred =
            on_ranks(2, std::time::Duration::from_secs(20), move |g| train(strategy, g, true));
        for run in [&plain, &deferred] {
            let (log0, log1) = (&run[0].0, &run[1].0);
            assert_eq!(log0, log1, "{strategy}: the ranks issued different operations");
            assert!(log0.iter().any(|l| l.starts_with(expected)), "{strategy}: {log0:?}");
            let apart = max_difference(&run[0].1, &run[1].1);
            assert!(apart == 0.0, "{strategy}: ranks ended {apart:e} apart");
        }
        assert_eq!(plain[0].0, deferred[0].0, "{strategy}: deferring changed what was issued");
        let apart = max_difference(&plain[0].1, &deferred[0].1);
        assert!(
            apart == 0.0,
            "{strategy}: an operation was used before it was waited for ({apart:e})"
        );
        // The steps moved the weights (the comparison above is not of untrained models).
        let start = values(&[8, 5], "layers.0.weight".len() as f64);
        let moved = plain[0].1.iter().find(|(n, _)| n == "layers.0.weight").unwrap();
        assert!((&moved.1 - start).abs().max().double_value(&[]) > 1e-3, "{strategy}");
    }
}

/// An accelerator for thread rank `group.rank()` with `strategy`, its data-parallel
/// dimensions on `data`, further set by `with`.
pub(crate) fn thread_accelerator(
    strategy: StrategyName,
    group: ProcessGroup,
    data: Arc<dyn Communicator>,
    with: impl FnOnce(crate::AcceleratorBuilder) -> crate::AcceleratorBuilder,
) -> Accelerator {
    let process = crate::comm::tests::topology(group.rank(), group.size(), 0);
    let config = Config { strategy, ..Config::default() };
    let dims = ParallelDims::for_run(&config, &process).unwrap();
    let mesh = DeviceMesh::from_parts(
        dims,
        process.rank,
        Some(group),
        [(Dim::Data, data.clone()), (Dim::DataReplicate, data.clone()), (Dim::DataShard, data)]
            .into_iter()
            .filter(|(dim, _)| dims.size(*dim) > 1),
    );
    with(Accelerator::builder().strategy(strategy).cpu(true).thread_rank(process, mesh))
        .build()
        .unwrap()
}

/// Two zero3 units whose starting values differ by rank.
fn two_units(acc: &crate::Accelerator, rank: usize) -> (nn::VarStore, Vec<Unit<nn::Linear>>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let layers = [(5, 8), (8, 3)]
        .into_iter()
        .enumerate()
        .map(|(i, (n_in, n_out))| {
            let p = &root / "layers" / i;
            Unit::new(acc, &p, nn::linear(&p, n_in, n_out, Default::default()))
        })
        .collect();
    tch::no_grad(|| {
        for (name, mut var) in vs.variables() {
            var.copy_(&(values(&var.size(), name.len() as f64) + rank as f64));
        }
    });
    (vs, layers)
}

#[test]
fn fsdp_state_dict_types_and_sync_module_states_do_what_accelerate_says() {
    use crate::config::StateDict;
    let dir = std::env::temp_dir().join(format!("accel-state-dict-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shared = dir.clone();
    let results = on_ranks(2, std::time::Duration::from_secs(30), move |g| {
        let rank = g.rank();
        let mut whole = Vec::new();
        for how in [StateDict::Sharded, StateDict::Full] {
            let acc =
                thread_accelerator(StrategyName::Zero3, g.clone(), Arc::new(g.clone()), |b| {
                    b.state_dict(how)
                });
            let (vs, _layers) = two_units(&acc, rank);
            acc.prepare_model(&vs).unwrap();
            acc.save_state(shared.join(how.to_string())).unwrap();
            whole.push(acc.full_state_dict(&vs).unwrap());
            // Either layout loads back into a run that saves the other way.
            let other =
                thread_accelerator(StrategyName::Zero3, g.clone(), Arc::new(g.clone()), |b| b);
            let (vs2, _layers2) = two_units(&other, rank + 7);
            other.prepare_model(&vs2).unwrap();
            other.load_state(shared.join(how.to_string())).unwrap();
            assert_eq!(max_difference(&other.full_state_dict(&vs2).unwrap(), &whole[0]), 0.0);
        }
        // Off: each rank keeps its own start (here different), as FSDP without
        // sync_module_states; on (the default, above), rank 0's.
        let acc = thread_accelerator(StrategyName::Ddp, g.clone(), Arc::new(g), |b| {
            b.sync_module_states(false)
        });
        let (vs, _layers) = two_units(&acc, rank);
        acc.prepare_model(&vs).unwrap();
        let own = vs.variables()["layers.0.bias"].double_value(&[0]);
        (whole, own)
    });
    assert_eq!(max_difference(&results[0].0[0], &results[1].0[0]), 0.0);
    assert_eq!(max_difference(&results[0].0[0], &results[0].0[1]), 0.0);
    assert!((results[1].1 - results[0].1 - 1.0).abs() < 1e-6, "{} {}", results[0].1, results[1].1);
    let names = |file: &str| -> Vec<String> {
        Tensor::read_safetensors(dir.join(file)).unwrap().into_iter().map(|(n, _)| n).collect()
    };
    // Sharded: the units' parameters are in the shard files, in pieces.
    assert!(names("sharded/shard_0.safetensors").iter().any(|n| n.contains("layers.0.weight")));
    assert!(!names("sharded/model.safetensors").iter().any(|n| n.contains("layers.0.weight")));
    // Full: whole in the model file, written by the main process; nothing of them in shards.
    let full = Tensor::read_safetensors(dir.join("full/model.safetensors")).unwrap();
    let weight = full.iter().find(|(n, _)| n == "layers.0.weight").unwrap();
    assert_eq!(weight.1.size(), [8, 5]);
    for rank in 0..2 {
        let shard = dir.join(format!("full/shard_{rank}.safetensors"));
        if shard.exists() {
            let names: Vec<String> =
                Tensor::read_safetensors(shard).unwrap().into_iter().map(|(n, _)| n).collect();
            assert!(!names.iter().any(|n| n.contains("layers.")), "{names:?}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// An accelerator for thread rank `group.rank()` with `strategy` on the mesh `dims`, its
/// communicators made from `group` as a multi-process run makes them, further set by `with`
/// (which must ask for the same degrees as `dims`).
pub(crate) fn thread_accelerator_on(
    strategy: StrategyName,
    group: ProcessGroup,
    dims: ParallelDims,
    with: impl FnOnce(crate::AcceleratorBuilder) -> crate::AcceleratorBuilder,
) -> Accelerator {
    let process = crate::comm::tests::topology(group.rank(), group.size(), 0);
    let mesh = DeviceMesh::new(dims, &group, tch::Device::Cpu).unwrap();
    with(Accelerator::builder().strategy(strategy).cpu(true).thread_rank(process, mesh))
        .build()
        .unwrap()
}
