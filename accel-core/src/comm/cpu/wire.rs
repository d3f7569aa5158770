//! The cpu backend's wire format: every transfer starts with a 32-byte header saying which
//! collective it belongs to (sequence number, operation, dtype, element count) and how many
//! payload bytes follow, so ranks that disagree get an error naming both sides instead of
//! reading each other's data as their own.

use tch::Kind;

use super::diagnosis::{Fault, FaultResult};
use crate::comm::{Op, ReduceOp};
use crate::error::{Error, Result};

pub(crate) const MAGIC: u32 = 0xACCE_1001;
pub(crate) const HEADER: usize = 32;

/// What a transfer belongs to; both sides must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tag {
    pub seq: u64,
    pub op: Op,
    pub kind: WireKind,
    pub numel: u64,
}

/// The dtypes the cpu backend carries, with their wire codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireKind {
    /// Untyped bytes (objects, handshakes).
    Bytes,
    F32,
    F64,
    F16,
    Bf16,
    I64,
    I32,
    U8,
    Bool,
}

impl WireKind {
    pub fn of(kind: Kind) -> Result<Self> {
        Ok(match kind {
            Kind::Float => Self::F32,
            Kind::Double => Self::F64,
            Kind::Half => Self::F16,
            Kind::BFloat16 => Self::Bf16,
            Kind::Int64 => Self::I64,
            Kind::Int => Self::I32,
            Kind::Uint8 => Self::U8,
            Kind::Bool => Self::Bool,
            other => {
                return Err(Error::Unsupported(format!(
                    "collectives on {other:?} tensors; use f32, f64, f16, bf16, i64, i32, u8 or bool"
                )));
            }
        })
    }

    fn code(self) -> u8 {
        match self {
            Self::Bytes => 0,
            Self::F32 => 1,
            Self::F64 => 2,
            Self::F16 => 3,
            Self::Bf16 => 4,
            Self::I64 => 5,
            Self::I32 => 6,
            Self::U8 => 7,
            Self::Bool => 8,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        [
            Self::Bytes,
            Self::F32,
            Self::F64,
            Self::F16,
            Self::Bf16,
            Self::I64,
            Self::I32,
            Self::U8,
            Self::Bool,
        ]
        .into_iter()
        .find(|k| k.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Bytes => "bytes",
            Self::F32 => "f32",
            Self::F64 => "f64",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::I64 => "i64",
            Self::I32 => "i32",
            Self::U8 => "u8",
            Self::Bool => "bool",
        }
    }
}

fn reduce_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Avg => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
    }
}

fn reduce_of(code: u8) -> Option<ReduceOp> {
    [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max]
        .into_iter()
        .find(|op| reduce_code(*op) == code)
}

/// The operation's wire code: a family in the tens, the reduction in the units.
fn op_code(op: Op) -> u8 {
    match op {
        Op::AllReduce(r) => 10 + reduce_code(r),
        Op::Broadcast => 20,
        Op::AllGather => 30,
        Op::ReduceScatter(r) => 40 + reduce_code(r),
        Op::SendRecv => 50,
        Op::Objects => 60,
        Op::Barrier => 70,
        Op::AllToAll => 80,
    }
}

fn op_of(code: u8) -> Option<Op> {
    Some(match code {
        11..=14 => Op::AllReduce(reduce_of(code - 10)?),
        20 => Op::Broadcast,
        30 => Op::AllGather,
        41..=44 => Op::ReduceScatter(reduce_of(code - 40)?),
        50 => Op::SendRecv,
        60 => Op::Objects,
        70 => Op::Barrier,
        80 => Op::AllToAll,
        _ => return None,
    })
}

/// The header of a transfer of `payload` bytes.
pub(crate) fn encode(tag: Tag, payload: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..12].copy_from_slice(&tag.seq.to_le_bytes());
    h[12] = op_code(tag.op);
    h[13] = tag.kind.code();
    h[16..24].copy_from_slice(&tag.numel.to_le_bytes());
    h[24..32].copy_from_slice(&payload.to_le_bytes());
    h
}

/// A header read back: its tag and payload length, or what is wrong with it.
pub(crate) fn decode(h: &[u8; HEADER]) -> std::result::Result<(Tag, u64), String> {
    let word =
        |range: std::ops::Range<usize>| u64::from_le_bytes(h[range].try_into().expect("8 bytes"));
    if u32::from_le_bytes(h[0..4].try_into().expect("4 bytes")) != MAGIC {
        return Err("a corrupt header (not accel's wire format)".into());
    }
    let op = op_of(h[12]).ok_or_else(|| format!("a header with unknown operation {}", h[12]))?;
    let kind = WireKind::from_code(h[13])
        .ok_or_else(|| format!("a header with unknown dtype {}", h[13]))?;
    Ok((Tag { seq: word(4..12), op, kind, numel: word(16..24) }, word(24..32)))
}

/// What a rank in another collective than this one is told.
pub(crate) fn mismatch(peer: usize, theirs: Tag, tag: Tag) -> String {
    format!(
        "rank {peer} is in collective #{} {} of {} × {}, this rank in #{} {} of {} × {}; every \
         rank must call the same collectives in the same order with the same shapes",
        theirs.seq,
        theirs.op,
        theirs.numel,
        theirs.kind.name(),
        tag.seq,
        tag.op,
        tag.numel,
        tag.kind.name()
    )
}

/// The payload word of `peer`'s header `h` if it belongs to `tag`; else what is wrong
/// (`verb`: how it came, "sent" or "signalled").
pub(crate) fn check_header(
    peer: usize,
    h: &[u8; HEADER],
    tag: Tag,
    verb: &str,
) -> FaultResult<u64> {
    let (theirs, payload) = decode(h).map_err(|detail| Fault::Mismatch {
        peer,
        detail: format!("rank {peer} {verb} {detail}"),
    })?;
    if theirs != tag {
        return Err(Fault::Mismatch { peer, detail: mismatch(peer, theirs, tag) });
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_every_operation_and_dtype() {
        let ops = [
            Op::AllReduce(ReduceOp::Sum),
            Op::AllReduce(ReduceOp::Max),
            Op::Broadcast,
            Op::AllGather,
            Op::ReduceScatter(ReduceOp::Avg),
            Op::SendRecv,
            Op::Objects,
            Op::Barrier,
            Op::AllToAll,
        ];
        for op in ops {
            for kind in [WireKind::Bytes, WireKind::F32, WireKind::Bf16, WireKind::Bool] {
                let tag = Tag { seq: 7, op, kind, numel: 1 << 40 };
                assert_eq!(decode(&encode(tag, 99)), Ok((tag, 99)));
            }
        }
        let mut bad = encode(Tag { seq: 1, op: Op::Barrier, kind: WireKind::Bytes, numel: 0 }, 0);
        bad[12] = 99;
        assert!(decode(&bad).unwrap_err().contains("unknown operation 99"));
        bad[0] = 0;
        assert!(decode(&bad).unwrap_err().contains("corrupt"));
    }
}
