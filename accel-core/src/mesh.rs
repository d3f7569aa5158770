//! The run's parallel dimensions, validated once ([`ParallelDims`], as torchtitan's), and
//! a communicator per dimension ([`DeviceMesh`]).
//!
//! Ranks are laid out `[pipeline, data-replicate, data-shard, context, tensor]` (torchtitan's
//! order), the tensor dimension varying fastest (its ranks are neighbours, on one machine
//! when they fit), then the context and data-parallel ones. Some dimensions are flattened
//! views of several axes, as torchtitan's `dp_shard_cp` and `batch` are:
//!
//! - [`Dim::Batch`] = data-replicate × data-shard: the ranks that see different batches
//!   (what a data loader deals over).
//! - [`Dim::DataShard`] = data-shard × context, and [`Dim::Data`] = data-replicate ×
//!   data-shard × context: what gradients are averaged and parameters sharded over. The
//!   ranks of a context group hold the same weights and compute gradients on different
//!   parts of one sequence, so to a strategy they are data-parallel ranks like any other.
//!
//! DDP and ZeRO-1 replicate over all of `Data`; ZeRO-2/3 shard over all of it; hybrid
//! sharding shards within a machine and replicates across machines — a shape of the mesh,
//! not a strategy of its own.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::Device;

use crate::comm::ledger::{self, SequenceChecker};
use crate::comm::nccl::NcclComm;
use crate::comm::{Communicator, LocalComm, ProcessGroup};
use crate::config::{Config, Strategy};
use crate::error::{Error, Result};
use crate::topology::Topology;

/// One dimension of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dim {
    /// Pipeline stages.
    Pipeline,
    /// Data-parallel replicas (DDP; hybrid sharding's machines).
    DataReplicate,
    /// Data-parallel shards (ZeRO-2/3; hybrid sharding's processes of one machine).
    DataShard,
    /// All data parallelism: `DataReplicate × DataShard` (the context ranks included:
    /// gradients are averaged over it).
    Data,
    /// The ranks that see different batches: `DataReplicate × DataShard` without the context
    /// ranks (which share a batch and split its sequences).
    Batch,
    /// Context parallelism: the ranks that split each sequence ([`crate::strategy::cp`]).
    Context,
    /// Tensor (and sequence) parallelism.
    Tensor,
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(view(*self).name)
    }
}

/// An axis of the mesh: one factor of the number of processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Axis {
    /// Pipeline stages.
    Pipeline,
    /// Data-parallel replicas.
    DataReplicate,
    /// Data-parallel shards.
    DataShard,
    /// Context-parallel ranks.
    Context,
    /// Tensor-parallel ranks.
    Tensor,
}

/// The mesh's axes, in the order ranks are laid out (outermost first; the last varies
/// fastest, so that tensor ranks are neighbours), with their names: torchtitan's layout. A
/// new axis (expert parallelism, say) is a row here, a field of [`ParallelDims`], the views
/// that span it below, and its strategy file.
const AXES: [(Axis, &str); 5] = [
    (Axis::Pipeline, "pipeline"),
    (Axis::DataReplicate, "data-replicate"),
    (Axis::DataShard, "data-shard"),
    (Axis::Context, "context"),
    (Axis::Tensor, "tensor"),
];

/// A dimension strategies work over: its name and the axes it spans (a flattened view where
/// several, outermost first).
struct View {
    dim: Dim,
    name: &'static str,
    axes: &'static [Axis],
}

/// Every dimension, as a view of the axes: the one place that says which are flattened.
const VIEWS: [View; 7] = [
    View {
        dim: Dim::Data,
        name: "data",
        axes: &[Axis::DataReplicate, Axis::DataShard, Axis::Context],
    },
    View { dim: Dim::DataReplicate, name: "data-replicate", axes: &[Axis::DataReplicate] },
    // The context ranks hold the same weights and split one sequence: to a sharded
    // strategy they are shards like any other.
    View { dim: Dim::DataShard, name: "data-shard", axes: &[Axis::DataShard, Axis::Context] },
    View { dim: Dim::Batch, name: "batch", axes: &[Axis::DataReplicate, Axis::DataShard] },
    View { dim: Dim::Context, name: "context", axes: &[Axis::Context] },
    View { dim: Dim::Tensor, name: "tensor", axes: &[Axis::Tensor] },
    View { dim: Dim::Pipeline, name: "pipeline", axes: &[Axis::Pipeline] },
];

fn view(dim: Dim) -> &'static View {
    VIEWS.iter().find(|v| v.dim == dim).expect("every dimension has a view")
}

/// Where an axis is in the layout.
fn position(axis: Axis) -> usize {
    AXES.iter().position(|(a, _)| *a == axis).expect("every axis is in the table")
}

/// The sizes of the parallel dimensions; their product is the number of processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    /// Pipeline stages.
    pub pipeline: usize,
    /// Data-parallel replicas.
    pub data_replicate: usize,
    /// Data-parallel shards.
    pub data_shard: usize,
    /// Context-parallel ranks (each sequence split among them).
    pub context: usize,
    /// Tensor-parallel ranks.
    pub tensor: usize,
}

impl fmt::Display for ParallelDims {
    /// `pipeline 1 × data-replicate 2 × data-shard 2 × tensor 1` (context only where used).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: Vec<String> = AXES
            .iter()
            .filter(|(axis, _)| *axis != Axis::Context || self.context > 1)
            .map(|(axis, name)| format!("{name} {}", self.axis(*axis)))
            .collect();
        f.write_str(&shown.join(" × "))
    }
}

impl ParallelDims {
    /// Checks that the sizes multiply to `world` and none is 0; the error shows the
    /// arithmetic.
    pub fn new(
        world: usize,
        pipeline: usize,
        data_replicate: usize,
        data_shard: usize,
        context: usize,
        tensor: usize,
    ) -> Result<Self> {
        let dims = Self { pipeline, data_replicate, data_shard, context, tensor };
        if dims.sizes().contains(&0) {
            return Err(Error::Config(format!("every parallel degree must be at least 1: {dims}")));
        }
        let product = dims.sizes().iter().try_fold(1usize, |p, &n| p.checked_mul(n));
        if product != Some(world) {
            return Err(Error::Config(format!(
                "the parallel degrees do not fit the {world} process(es): {dims} = {} ≠ {world}",
                product.map_or("overflow".into(), |p| p.to_string())
            )));
        }
        Ok(dims)
    }

    /// The dimensions a run's configuration asks for: all processes data-parallel,
    /// replicated (single, ddp, zero1) or sharded (zero2, zero3, fsdp); hybrid sharding shards
    /// over each machine's processes and replicates across machines.
    pub fn for_run(config: &Config, topology: &Topology) -> Result<Self> {
        let world = topology.world_size;
        let (tp, pp, cp) =
            (config.tensor_parallel, config.pipeline_parallel, config.context_parallel);
        let model = tp * pp * cp;
        if model == 0 || world % model != 0 {
            let context = if cp > 1 { format!(" × context_parallel {cp}") } else { String::new() };
            return Err(Error::Config(format!(
                "tensor_parallel {tp} × pipeline_parallel {pp}{context} = {model} does not divide \
                 the {world} process(es): the data-parallel degree would be {world}/{model}"
            )));
        }
        if cp > 1 && pp > 1 {
            return Err(Error::Unsupported(format!(
                "context_parallel {cp} together with pipeline_parallel {pp}: not implemented; \
                 use context parallelism with data and tensor parallelism"
            )));
        }
        let dp = world / model;
        match DataAxes::of(config.strategy) {
            DataAxes::Replicated => Self::new(world, pp, dp, 1, cp, tp),
            DataAxes::Sharded => Self::new(world, pp, 1, dp, cp, tp),
            DataAxes::Hybrid if model > 1 => Err(Error::Unsupported(format!(
                "hybrid_shard together with tensor_parallel {tp} / pipeline_parallel {pp} / \
                 context_parallel {cp}: use zero3 (sharded over every data-parallel process)"
            ))),
            DataAxes::Hybrid => {
                let local = topology.local_world_size;
                if local == 0 || world % local != 0 || local == world {
                    return Err(Error::Config(format!(
                        "hybrid_shard needs several machines with the same number of processes \
                         each (here {world} process(es), {local} on this machine); use zero3 on \
                         one machine"
                    )));
                }
                Self::new(world, 1, world / local, local, 1, 1)
            }
        }
    }

    /// Number of processes.
    pub fn world(&self) -> usize {
        self.sizes().iter().product()
    }

    /// The size of one axis.
    pub fn axis(&self, axis: Axis) -> usize {
        match axis {
            Axis::Pipeline => self.pipeline,
            Axis::DataReplicate => self.data_replicate,
            Axis::DataShard => self.data_shard,
            Axis::Context => self.context,
            Axis::Tensor => self.tensor,
        }
    }

    /// The axes each dimension spans (indices into [`coords`](Self::coords)), outermost
    /// first, from the views' table.
    fn axes(dim: Dim) -> impl Iterator<Item = usize> {
        view(dim).axes.iter().map(|&axis| position(axis))
    }

    /// The axes' sizes in layout order.
    fn sizes(&self) -> [usize; 5] {
        AXES.map(|(axis, _)| self.axis(axis))
    }

    /// Size of `dim`.
    pub fn size(&self, dim: Dim) -> usize {
        Self::axes(dim).map(|a| self.sizes()[a]).product()
    }

    /// `rank`'s coordinates: (pipeline, data-replicate, data-shard, context, tensor).
    pub fn coords(&self, rank: usize) -> [usize; 5] {
        let sizes = self.sizes();
        let mut coords = [0; 5];
        let mut rest = rank;
        for axis in (0..5).rev() {
            coords[axis] = rest % sizes[axis];
            rest /= sizes[axis];
        }
        coords
    }

    fn rank_of(&self, coords: [usize; 5]) -> usize {
        coords.iter().zip(self.sizes()).fold(0, |rank, (&c, size)| rank * size + c)
    }

    /// Every group along `dim`: the lists of ranks that differ only in its axes, each in
    /// rank order, the lists ordered by their first rank.
    pub fn groups(&self, dim: Dim) -> Vec<Vec<usize>> {
        let mut groups: BTreeMap<[usize; 5], Vec<usize>> = BTreeMap::new();
        for rank in 0..self.world() {
            let mut key = self.coords(rank);
            for axis in Self::axes(dim) {
                key[axis] = 0;
            }
            groups.entry(key).or_default().push(rank);
        }
        let mut out: Vec<Vec<usize>> = groups.into_values().collect();
        out.sort();
        out
    }

    /// `rank`'s position within its group along `dim`.
    pub fn index(&self, dim: Dim, rank: usize) -> usize {
        let (coords, sizes) = (self.coords(rank), self.sizes());
        Self::axes(dim).fold(0, |index, a| index * sizes[a] + coords[a])
    }

    /// The rank at `coords` (for tests and layouts).
    pub fn rank(&self, coords: [usize; 5]) -> usize {
        self.rank_of(coords)
    }
}

/// A communicator for each dimension of the run, and the world's group for control traffic.
#[derive(Clone)]
pub struct DeviceMesh {
    dims: ParallelDims,
    rank: usize,
    world: Option<ProcessGroup>,
    comms: BTreeMap<Dim, Arc<dyn Communicator>>,
    /// Every process, on the run's tensors (NCCL's on GPUs; the world's group on CPU).
    everyone: Arc<dyn Communicator>,
    /// Compares the ranks' collectives at every optimizer step (several processes, unless
    /// `ACCEL_CHECK_COLLECTIVES=0`).
    checker: Option<Arc<SequenceChecker>>,
    steps: Arc<AtomicU64>,
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMesh").field("dims", &self.dims).field("rank", &self.rank).finish()
    }
}

/// Every dimension, in the order their communicators are made (the views' table's).
fn every_dim() -> impl Iterator<Item = Dim> {
    VIEWS.iter().map(|v| v.dim)
}

/// How a strategy spreads its data-parallel processes over the data axes: the one place
/// that reads strategy names when the mesh is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataAxes {
    /// All on data-replicate: every process holds the whole model (single, ddp, zero1).
    Replicated,
    /// All on data-shard: parameters or gradients sharded over every data-parallel process
    /// (zero2, zero3, fsdp; auto, which decides later among them all, on the same processes).
    Sharded,
    /// Sharded within a machine, replicated across machines (hybrid_shard).
    Hybrid,
}

impl DataAxes {
    fn of(strategy: Strategy) -> Self {
        match strategy {
            Strategy::Single | Strategy::Ddp | Strategy::Zero1 => DataAxes::Replicated,
            Strategy::Zero2 | Strategy::Zero3 | Strategy::Fsdp | Strategy::Auto => {
                DataAxes::Sharded
            }
            Strategy::HybridShard => DataAxes::Hybrid,
        }
    }
}

/// `ACCEL_GROUP_OF_ONE=1`: a run of one process still makes its process group, and its
/// strategy runs over real communicators of one rank (NCCL's on a GPU) instead of none —
/// how `scripts/gpu-check.sh` puts every strategy through NCCL on a machine with one GPU.
pub fn group_of_one() -> bool {
    std::env::var(crate::config::env::GROUP_OF_ONE).is_ok_and(|v| v.trim() == "1")
}

impl DeviceMesh {
    /// One process: every dimension of size 1.
    pub fn single() -> Self {
        let dims = ParallelDims::new(1, 1, 1, 1, 1, 1).expect("1 = 1");
        let comms = every_dim().map(|d| (d, Arc::new(LocalComm) as Arc<dyn Communicator>));
        Self {
            dims,
            rank: 0,
            world: None,
            comms: comms.collect(),
            everyone: Arc::new(LocalComm),
            checker: None,
            steps: Arc::default(),
        }
    }

    /// Makes the communicator of every dimension from the world's group (a collective:
    /// every process makes every group, in the same order, and keeps its own). A dimension
    /// of size 1 needs no traffic; one spanning the world is the world's group. On a CUDA
    /// `device` the dimensions' communicators are NCCL's (the world's, split per
    /// dimension); the cpu groups stay as their control plane.
    pub fn new(dims: ParallelDims, world: &ProcessGroup, device: Device) -> Result<Self> {
        if dims.world() != world.size() {
            return Err(Error::Config(format!(
                "the mesh {dims} has {} ranks, the run {}",
                dims.world(),
                world.size()
            )));
        }
        let rank = world.rank();
        let nccl_world = match device {
            Device::Cuda(_) => Some(Arc::new(NcclComm::new(world, device)?)),
            _ => None,
        };
        let mut comms: BTreeMap<Dim, Arc<dyn Communicator>> = BTreeMap::new();
        let mut made: BTreeMap<Vec<Vec<usize>>, Arc<dyn Communicator>> = BTreeMap::new();
        // A group of one (see `group_of_one`) uses its one real communicator everywhere.
        let one = dims.world() == 1;
        for dim in every_dim() {
            let groups = dims.groups(dim);
            let comm: Arc<dyn Communicator> = if dims.size(dim) == 1 && !one {
                Arc::new(LocalComm)
            } else if dims.size(dim) == dims.world() {
                match &nccl_world {
                    Some(nccl) => nccl.clone(),
                    None => Arc::new(world.clone()),
                }
            } else if let Some(same) = made.get(&groups) {
                same.clone()
            } else {
                let mut mine = None;
                for ranks in &groups {
                    mine = world.new_subgroup(ranks)?.or(mine);
                }
                let group = mine.expect("every rank is in one group of each dimension");
                let group: Arc<dyn Communicator> = match &nccl_world {
                    Some(nccl) => {
                        let color =
                            groups.iter().position(|g| g.contains(&rank)).expect("a member");
                        Arc::new(nccl.split(Some(&group), color)?.expect("a member gets one"))
                    }
                    None => Arc::new(group),
                };
                made.insert(groups, group.clone());
                group
            };
            comms.insert(dim, comm);
        }
        let checker = if ledger::enabled() {
            let rank = world.members()[world.rank()];
            Some(Arc::new(SequenceChecker::start(
                world.new_store_connection()?,
                world.timeout(),
                crate::comm::exit_after_grace(rank),
            )?))
        } else {
            None
        };
        let everyone: Arc<dyn Communicator> = match nccl_world {
            Some(nccl) => nccl,
            None => Arc::new(world.clone()),
        };
        Ok(Self {
            dims,
            rank,
            world: Some(world.clone()),
            comms,
            everyone,
            checker,
            steps: Arc::default(),
        })
    }

    /// The sequence check of an optimizer step: hands this rank's ledgers over to be
    /// compared with the other ranks' (see [`crate::comm::ledger`]); returns a divergence
    /// found at an earlier step.
    pub fn check_collectives(&self) -> Result<()> {
        let Some(checker) = &self.checker else { return Ok(()) };
        let step = self.steps.fetch_add(1, Ordering::SeqCst) + 1;
        let world = self.world.iter().map(|w| Arc::new(w.clone()) as Arc<dyn Communicator>);
        let all = self.comms.values().cloned().chain([self.everyone.clone()]).chain(world);
        checker.submit(step, ledger::distinct(all))
    }

    /// A mesh over communicators made elsewhere (tests driving ranks as threads).
    pub fn from_parts(
        dims: ParallelDims,
        rank: usize,
        world: Option<ProcessGroup>,
        comms: impl IntoIterator<Item = (Dim, Arc<dyn Communicator>)>,
    ) -> Self {
        let mut all: BTreeMap<Dim, Arc<dyn Communicator>> = comms.into_iter().collect();
        for dim in every_dim() {
            all.entry(dim).or_insert_with(|| Arc::new(LocalComm));
        }
        let everyone: Arc<dyn Communicator> = match &world {
            Some(w) => Arc::new(w.clone()),
            None => Arc::new(LocalComm),
        };
        Self { dims, rank, world, comms: all, everyone, checker: None, steps: Arc::default() }
    }

    /// The sizes of the dimensions.
    pub fn dims(&self) -> ParallelDims {
        self.dims
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The communicator of `dim` (a group of one where the dimension has size 1).
    pub fn comm(&self, dim: Dim) -> Arc<dyn Communicator> {
        self.comms[&dim].clone()
    }

    /// This rank's index among the data-parallel replicas that see different batches, and
    /// their number (the process index and count without tensor, pipeline or context
    /// parallelism: those ranks share a replica's batches).
    pub fn data_parallel(&self) -> (usize, usize) {
        (self.dims.index(Dim::Batch, self.rank), self.dims.size(Dim::Batch))
    }

    /// This rank's position within its group along `dim`.
    pub fn index(&self, dim: Dim) -> usize {
        self.dims.index(dim, self.rank)
    }

    /// Whether every process holds all of the model's layers (no pipeline stages).
    pub fn whole_model_per_process(&self) -> bool {
        self.dims.size(Dim::Pipeline) == 1
    }

    /// Every process, for collectives on the run's tensors (NCCL's communicator on GPUs,
    /// the world's group on CPU, a group of one with one process).
    pub fn everyone(&self) -> Arc<dyn Communicator> {
        self.everyone.clone()
    }

    /// The world's group, for control traffic (`None` with one process).
    pub fn world(&self) -> Option<&ProcessGroup> {
        self.world.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn degrees_that_do_not_multiply_to_the_world_show_the_arithmetic() {
        let err = ParallelDims::new(8, 2, 1, 2, 1, 3).unwrap_err().to_string();
        assert!(
            err.contains("pipeline 2 × data-replicate 1 × data-shard 2 × tensor 3 = 12 ≠ 8"),
            "{err}"
        );
        assert!(
            ParallelDims::new(4, 1, 0, 4, 1, 1).unwrap_err().to_string().contains("at least 1")
        );
    }

    /// The tables agree with themselves: every dimension is a view of named axes, once; the
    /// strategies' data axes are where `for_run` puts their processes.
    #[test]
    fn every_dimension_is_a_view_of_the_axes_in_the_table() {
        let mut dims: Vec<Dim> = every_dim().collect();
        dims.sort();
        dims.dedup();
        assert_eq!(dims.len(), VIEWS.len(), "each dimension has one view");
        for v in &VIEWS {
            assert!(!v.axes.is_empty(), "{}", v.name);
            assert_eq!(v.dim.to_string(), v.name);
        }
        let dims = ParallelDims::new(2 * 3 * 5 * 7 * 11, 2, 3, 5, 7, 11).unwrap();
        for (axis, name) in AXES {
            let alone = VIEWS.iter().find(|v| v.axes == [axis]).map(|v| v.dim);
            if let Some(dim) = alone {
                assert_eq!(dims.size(dim), dims.axis(axis), "{name}");
            }
        }
        assert_eq!(dims.size(Dim::Data), 3 * 5 * 7);
        assert_eq!(dims.size(Dim::Batch), 3 * 5);
        assert_eq!(DataAxes::of(Strategy::Zero1), DataAxes::Replicated);
        assert_eq!(DataAxes::of(Strategy::Fsdp), DataAxes::Sharded);
        assert_eq!(DataAxes::of(Strategy::HybridShard), DataAxes::Hybrid);
    }

    #[test]
    fn tensor_ranks_are_neighbours_and_groups_partition_the_world() {
        let dims = ParallelDims::new(8, 2, 1, 2, 1, 2).unwrap();
        assert_eq!(dims.groups(Dim::Tensor), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(dims.groups(Dim::Data), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
        assert_eq!(
            dims.groups(Dim::Pipeline),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        for dim in [Dim::Tensor, Dim::Data, Dim::Pipeline, Dim::DataShard] {
            let mut all: Vec<usize> = dims.groups(dim).concat();
            all.sort();
            assert_eq!(all, (0..8).collect::<Vec<_>>(), "{dim}");
        }
        for rank in 0..8 {
            assert_eq!(dims.rank(dims.coords(rank)), rank);
        }
        assert_eq!(dims.index(Dim::Data, 6), 1);
    }

    /// The context axis sits between the data axes and the tensor one; `batch` leaves it out
    /// (its ranks share batches), `data` and `data-shard` take it in (torchtitan's
    /// `dp_shard_cp`: gradients averaged and parameters sharded over it).
    #[test]
    fn the_context_axis_and_the_flattened_views_name_the_right_ranks() {
        let topology = Topology { world_size: 8, local_world_size: 8, ..Topology::single() };
        let config = Config {
            strategy: Strategy::Zero3,
            tensor_parallel: 2,
            context_parallel: 2,
            ..Config::default()
        };
        let dims = ParallelDims::for_run(&config, &topology).unwrap();
        assert_eq!((dims.data_replicate, dims.data_shard, dims.context, dims.tensor), (1, 2, 2, 2));
        assert_eq!(
            dims.to_string(),
            "pipeline 1 × data-replicate 1 × data-shard 2 × context 2 × tensor 2"
        );
        assert_eq!(dims.groups(Dim::Tensor), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(dims.groups(Dim::Context), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
        assert_eq!(dims.groups(Dim::Batch), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert_eq!(dims.groups(Dim::Data), vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        assert_eq!(dims.groups(Dim::DataShard), dims.groups(Dim::Data));
        assert_eq!(
            [Dim::Batch, Dim::Context, Dim::Data, Dim::DataShard].map(|d| dims.size(d)),
            [2, 2, 4, 4]
        );
        // Rank 6 = (data-shard 1, context 1, tensor 0).
        assert_eq!(dims.coords(6), [0, 0, 1, 1, 0]);
        assert_eq!([Dim::Batch, Dim::Context, Dim::Data].map(|d| dims.index(d, 6)), [1, 1, 3]);
        for dim in [Dim::Batch, Dim::Context, Dim::Data] {
            for group in dims.groups(dim) {
                let indices: Vec<usize> = group.iter().map(|&r| dims.index(dim, r)).collect();
                assert_eq!(indices, (0..group.len()).collect::<Vec<_>>(), "{dim}");
            }
        }
        let with_pipeline = Config { pipeline_parallel: 2, tensor_parallel: 1, ..config };
        let err = ParallelDims::for_run(&with_pipeline, &topology).unwrap_err().to_string();
        assert!(err.contains("context_parallel 2 together with pipeline_parallel 2"), "{err}");
        let odd = Config { context_parallel: 3, tensor_parallel: 1, ..Config::default() };
        let err = ParallelDims::for_run(&odd, &topology).unwrap_err().to_string();
        assert!(err.contains("× context_parallel 3 = 3 does not divide the 8"), "{err}");
    }

    #[test]
    fn tensor_and_pipeline_degrees_leave_the_rest_to_data_parallelism() {
        let topology = Topology { world_size: 8, local_world_size: 8, ..Topology::single() };
        let config = Config {
            strategy: Strategy::Zero3,
            tensor_parallel: 2,
            pipeline_parallel: 2,
            ..Config::default()
        };
        let dims = ParallelDims::for_run(&config, &topology).unwrap();
        assert_eq!(
            (dims.pipeline, dims.data_replicate, dims.data_shard, dims.tensor),
            (2, 1, 2, 2)
        );
        let config = Config { tensor_parallel: 3, ..Config::default() };
        let err = ParallelDims::for_run(&config, &topology).unwrap_err().to_string();
        assert!(
            err.contains("tensor_parallel 3 × pipeline_parallel 1 = 3 does not divide the 8"),
            "{err}"
        );
    }

    #[test]
    fn hybrid_sharding_is_machines_times_their_processes() {
        let topology = Topology { world_size: 4, local_world_size: 2, ..Topology::single() };
        let config = Config { strategy: Strategy::HybridShard, ..Config::default() };
        let dims = ParallelDims::for_run(&config, &topology).unwrap();
        assert_eq!((dims.data_replicate, dims.data_shard), (2, 2));
        // Shards within a machine (ranks 0, 1 and 2, 3), replicas across machines.
        assert_eq!(dims.groups(Dim::DataShard), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(dims.groups(Dim::DataReplicate), vec![vec![0, 2], vec![1, 3]]);
        let one_machine = Topology { world_size: 4, local_world_size: 4, ..Topology::single() };
        let err = ParallelDims::for_run(&config, &one_machine).unwrap_err().to_string();
        assert!(err.contains("use zero3 on one machine"), "{err}");
    }
}
