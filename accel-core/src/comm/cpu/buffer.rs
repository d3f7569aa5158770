//! A contiguous CPU tensor seen as bytes, for the transports: shared borrows of one range,
//! exclusive borrows of another (the ring sends one chunk while receiving into another),
//! and reductions of received bytes into a range by ATen kernels.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::diagnosis::Fault;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};

/// A contiguous CPU tensor's bytes (the tensor is kept alive by the buffer).
pub(crate) struct Buffer {
    tensor: Tensor,
    ptr: *mut u8,
    len: usize,
    elem: usize,
    kind: Kind,
}

// SAFETY: a buffer is used by one thread at a time (the group's worker, or the scoped
// threads of one transfer, which borrow disjoint ranges through `split`); the storage it
// points into is kept alive by `tensor`.
unsafe impl Send for Buffer {}

impl Buffer {
    /// The tensor's data, made contiguous first if it is not (the result is then copied
    /// back by the caller).
    pub fn new(tensor: &Tensor) -> Result<Self> {
        if tensor.device() != Device::Cpu {
            return Err(Error::Unsupported(format!(
                "the cpu backend works on CPU tensors, got one on {:?}; use the nccl backend for GPUs",
                tensor.device()
            )));
        }
        let tensor = tensor.f_contiguous()?;
        let elem = tensor.kind().elt_size_in_bytes();
        let len = tensor.numel() * elem;
        Ok(Self { ptr: tensor.data_ptr().cast(), len, elem, kind: tensor.kind(), tensor })
    }

    /// The tensor the bytes belong to.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Size of one element in bytes.
    pub fn elem(&self) -> usize {
        self.elem
    }

    /// Where the bytes start in this process (for peers that read them directly).
    pub fn address(&self) -> u64 {
        self.ptr as u64
    }

    fn check(&self, range: &Range<usize>) {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "{range:?} outside {}",
            self.len
        );
    }

    /// The bytes of `range`.
    pub fn bytes(&self, range: Range<usize>) -> &[u8] {
        self.check(&range);
        // SAFETY: within the tensor's storage, alive as long as `self`; no `&mut` borrow of
        // `self` can coexist with this shared one.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }

    /// The bytes of `range`, to write.
    pub fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        self.check(&range);
        // SAFETY: as in `bytes`, and `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// `read` to read and `write` to write at once; the ranges must not overlap.
    pub fn split(&mut self, read: Range<usize>, write: Range<usize>) -> (&[u8], &mut [u8]) {
        self.check(&read);
        self.check(&write);
        assert!(read.end <= write.start || write.end <= read.start, "{read:?} overlaps {write:?}");
        // SAFETY: both ranges lie in the storage and do not overlap, so the shared and the
        // exclusive borrow never alias; `&mut self` keeps any other borrow out.
        unsafe {
            (
                std::slice::from_raw_parts(self.ptr.add(read.start), read.len()),
                std::slice::from_raw_parts_mut(self.ptr.add(write.start), write.len()),
            )
        }
    }

    /// The element kind of the buffer.
    pub fn kind(&self) -> Kind {
        self.kind
    }
}

/// `dst = reduce(dst, src)`, element-wise over `kind` elements, by an ATen kernel.
pub(crate) fn reduce_into(
    dst: &mut [u8],
    src: &[u8],
    kind: Kind,
    op: ReduceOp,
) -> std::result::Result<(), Fault> {
    assert_eq!(dst.len(), src.len(), "reduce_into needs equal lengths");
    let n = (src.len() / kind.elt_size_in_bytes()) as i64;
    // SAFETY: both views cover memory that outlives them (the borrowed slices), hold `n`
    // elements of `kind`, and do not overlap (one is `&mut`).
    let (dst, src) = unsafe {
        (
            Tensor::from_blob(dst.as_mut_ptr(), &[n], &[1], kind, Device::Cpu),
            Tensor::from_blob(src.as_ptr(), &[n], &[1], kind, Device::Cpu),
        )
    };
    let mut dst = dst;
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            let _ = dst.f_add_(&src)?;
        }
        ReduceOp::Min => {
            let _ = dst.f_minimum_out(&dst, &src)?;
        }
        ReduceOp::Max => {
            let _ = dst.f_maximum_out(&dst, &src)?;
        }
    }
    Ok(())
}

/// Byte ranges of `n` nearly equal chunks of `count` elements of `elem` bytes.
pub(crate) fn chunks(count: usize, n: usize, elem: usize) -> Vec<Range<usize>> {
    let (base, extra) = (count / n, count % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start * elem..(start + len) * elem;
            start += len;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_everything_nearly_evenly() {
        assert_eq!(chunks(10, 3, 4), vec![0..16, 16..28, 28..40]);
        assert_eq!(chunks(2, 3, 1), vec![0..1, 1..2, 2..2]);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn overlapping_borrows_are_refused() {
        let t = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        let mut b = Buffer::new(&t).unwrap();
        let _ = b.split(0..8, 4..12);
    }
}
