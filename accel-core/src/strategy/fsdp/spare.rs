//! Memory handed from one zero3 unit to the next on the CPU.
//!
//! A released unit's parameters and a finished collective's flat buffer go back to glibc,
//! which returns a block mapped on its own (32 MiB and more under accel's kept heap, more
//! than `MALLOC_MMAP_THRESHOLD_` where that is set) to the kernel at once. The next unit
//! then faults as many fresh pages in again, each zeroed on the way: per step, about six
//! times the model's size per process (a forward and a backward gather, each a flat buffer
//! and the parameters; the gradients and their flat buffer). The layers of a model are
//! alike, so the next unit asks for blocks of the sizes the last one gave back: [`Spare`]
//! keeps them for it. Only between two hooks: a hook that gathers frees whatever it left
//! unused ([`Spare::trim`]), and so does the end of a pass, so the memory held while a
//! unit computes, and between steps, is what it was without it. On a GPU the CUDA caching
//! allocator already reuses blocks; nothing is kept there.

use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::shim;

/// Blocks of memory given back by released parameters and flat buffers, each held by a
/// `Uint8` tensor of 0 elements whose storage owns it, with its size in bytes.
pub(super) struct Spare {
    keeps: bool,
    blocks: Vec<(u64, Tensor)>,
}

impl Spare {
    /// Keeps memory on the CPU only.
    pub(super) fn new(device: Device) -> Self {
        Self { keeps: device == Device::Cpu, blocks: Vec::new() }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> u64 {
        self.blocks.iter().map(|(n, _)| n).sum()
    }

    fn take(&mut self, nbytes: u64) -> Option<Tensor> {
        let Some(i) = self.blocks.iter().position(|(n, _)| *n == nbytes) else {
            // Asked for another size: what is kept no longer matches what comes next.
            self.blocks.clear();
            return None;
        };
        Some(self.blocks.swap_remove(i).1)
    }

    fn keep(&mut self, tensor: &Tensor, nbytes: u64) -> Result<()> {
        let block = Tensor::f_empty([0], (Kind::Uint8, tensor.device()))?;
        // SAFETY: the callers give up `tensor`'s memory (released parameters, whose
        // contract is free_storage's; flat buffers that nothing else refers to).
        unsafe { shim::move_storage(tensor, &block)? };
        self.blocks.push((nbytes, block));
        Ok(())
    }

    /// Gives the storage of `tensor` (released) `nbytes` of memory: a kept block of that
    /// size, or fresh. The contents are unspecified.
    pub(super) fn allocate(&mut self, tensor: &Tensor, nbytes: u64) -> Result<()> {
        if shim::storage_nbytes(tensor)? != 0 {
            // Given memory by a gather that failed after it: replaced.
            return shim::allocate_storage(tensor, nbytes);
        }
        match self.take(nbytes) {
            // SAFETY: the block's tensor is ours alone and dropped right after.
            Some(block) => unsafe { shim::move_storage(&block, tensor) },
            None => shim::allocate_storage(tensor, nbytes),
        }
    }

    /// Releases the memory of `tensor`'s storage, keeping it for the next unit on the CPU.
    ///
    /// # Safety
    /// As for [`shim::free_storage`]: nothing may read or write `tensor`'s storage until
    /// [`allocate`](Self::allocate) gives it memory again.
    pub(super) unsafe fn release(&mut self, tensor: &Tensor) -> Result<()> {
        if !self.keeps {
            // SAFETY: the caller's contract.
            return unsafe { shim::free_storage(tensor) };
        }
        let nbytes = shim::storage_nbytes(tensor)?;
        self.keep(tensor, nbytes)
    }

    /// A new uninitialised 1-D tensor of `numel` elements of `kind` on `device`, in a kept
    /// block if one has its size.
    pub(super) fn empty(&mut self, numel: i64, kind: Kind, device: Device) -> Result<Tensor> {
        let nbytes = (numel as usize * kind.elt_size_in_bytes()) as u64;
        let Some(block) = self.take(nbytes) else {
            return Ok(Tensor::f_empty([numel], (kind, device))?);
        };
        let mut tensor = Tensor::f_empty([0], (kind, device))?;
        // SAFETY: the block's tensor is ours alone and dropped right after.
        unsafe { shim::move_storage(&block, &tensor)? };
        // The storage holds `numel` elements already: this only sets the sizes.
        Ok(tensor.f_resize_([numel])?)
    }

    /// As [`empty`](Self::empty), filled with zeros.
    pub(super) fn zeros(&mut self, numel: i64, kind: Kind, device: Device) -> Result<Tensor> {
        let mut tensor = self.empty(numel, kind, device)?;
        let _ = tensor.f_zero_()?;
        Ok(tensor)
    }

    /// Takes back a flat buffer done with, if nothing else refers to its memory (a view or
    /// another handle still could read it: then it is freed when they are dropped).
    pub(super) fn recycle(&mut self, buffer: Tensor) -> Result<()> {
        if self.keeps && shim::sole_owner(&buffer)? {
            let nbytes = shim::storage_nbytes(&buffer)?;
            self.keep(&buffer, nbytes)?;
        }
        Ok(())
    }

    /// Frees every kept block.
    pub(super) fn trim(&mut self) {
        self.blocks.clear();
    }
}
