//! The vocabulary of collective operations — what each is called and how it reduces —
//! shared by the communicators (`comm`) and by errors, which name the operation that failed.

use std::fmt;

/// The reductions of all-reduce and reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Mean over ranks (floating-point tensors only).
    Avg,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        })
    }
}

/// A collective operation, as errors and the wire name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// All-reduce with a reduction.
    AllReduce(ReduceOp),
    /// Broadcast from one rank.
    Broadcast,
    /// All-gather.
    AllGather,
    /// Reduce-scatter with a reduction.
    ReduceScatter(ReduceOp),
    /// Point-to-point send and receive.
    SendRecv,
    /// Equal parts exchanged with every rank.
    AllToAll,
    /// An exchange of serialised objects (control traffic).
    Objects,
    /// A barrier.
    Barrier,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::AllReduce(r) => write!(f, "all_reduce({r})"),
            Op::Broadcast => f.write_str("broadcast"),
            Op::AllGather => f.write_str("all_gather"),
            Op::ReduceScatter(r) => write!(f, "reduce_scatter({r})"),
            Op::SendRecv => f.write_str("send/recv"),
            Op::AllToAll => f.write_str("all_to_all"),
            Op::Objects => f.write_str("object exchange"),
            Op::Barrier => f.write_str("barrier"),
        }
    }
}
