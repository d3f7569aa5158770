//! Collectives a training script calls by hand, as Accelerate's: `gather`,
//! `gather_for_metrics`, `reduce`, `broadcast`, `pad_across_processes`,
//! `main_process_first`, `split_between_processes`.

use tch::{Device, Tensor};

use super::Accelerator;
use crate::comm::{Backend, Communicator, ReduceOp};
use crate::error::Result;

/// Runs `op` on `tensor` through `comm`, on the device `comm` works on: NCCL reduces GPU
/// memory only, so a CPU tensor (a metric, a count) goes to `device` and its result comes
/// back.
#[track_caller]
fn on_comm_device(
    comm: &dyn Communicator,
    device: Device,
    tensor: &Tensor,
    op: impl FnOnce(&dyn Communicator, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    if comm.backend() == Backend::Nccl && tensor.device() != device {
        let back = tensor.device();
        Ok(op(comm, &tensor.f_to_device(device)?)?.f_to_device(back)?)
    } else {
        op(comm, tensor)
    }
}

impl Accelerator {
    /// Every process's `tensor` (same shape on all) concatenated along dim 0; a scalar
    /// becomes one element per process.
    #[track_caller]
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.inner.strategy.take_error()?;
        if self.num_processes() == 1 {
            return Ok(if tensor.dim() == 0 {
                tensor.f_reshape([1])?
            } else {
                tensor.shallow_clone()
            });
        }
        let everyone = self.inner.mesh.everyone();
        on_comm_device(everyone.as_ref(), self.device(), tensor, |c, t| c.all_gather(t))
    }

    /// [`gather`](Self::gather), minus the samples that padded the last round of a
    /// prepared loader (Accelerate's `gather_for_metrics`): over an epoch, exactly the
    /// data set's samples come back.
    #[track_caller]
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        // A sharded forward that failed where it could not say so (evaluation under zero3).
        self.inner.strategy.take_error()?;
        // Over the data-parallel replicas: their tensor ranks and stages hold the same samples.
        let gathered = match self.inner.mesh.dims().size(crate::mesh::Dim::Data) {
            replicas if replicas == self.num_processes() => self.gather(tensor)?,
            _ => {
                let data = self.inner.mesh.comm(crate::mesh::Dim::Data);
                let t =
                    if tensor.dim() == 0 { tensor.f_reshape([1])? } else { tensor.shallow_clone() };
                on_comm_device(data.as_ref(), self.device(), &t, |c, t| c.all_gather(t))?
            }
        };
        if self.inner.state.end_of_dataloader() {
            if let Some(remainder) = self.inner.state.remainder() {
                return Ok(gathered.f_narrow(0, 0, (remainder as i64).min(gathered.size()[0]))?);
            }
        }
        Ok(gathered)
    }

    /// The reduction of `tensor` over processes (a new tensor).
    #[track_caller]
    pub fn reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.inner.strategy.take_error()?;
        let out = tensor.f_detach_copy()?;
        if self.num_processes() == 1 {
            return Ok(out);
        }
        let everyone = self.inner.mesh.everyone();
        on_comm_device(everyone.as_ref(), self.device(), &out, |c, t| {
            c.all_reduce(t, op)?;
            Ok(t.shallow_clone())
        })
    }

    /// Rank `from`'s `tensor` on every process (a new tensor).
    #[track_caller]
    pub fn broadcast(&self, tensor: &Tensor, from: usize) -> Result<Tensor> {
        self.inner.strategy.take_error()?;
        let out = tensor.f_detach_copy()?;
        if self.num_processes() == 1 {
            return Ok(out);
        }
        let everyone = self.inner.mesh.everyone();
        on_comm_device(everyone.as_ref(), self.device(), &out, |c, t| {
            c.broadcast(t, from)?;
            Ok(t.shallow_clone())
        })
    }

    /// Pads `tensor` along `dim` to the largest size any process has, with `pad_value`, at
    /// the end (or the start with `pad_first`), so that it can be gathered.
    #[track_caller]
    pub fn pad_across_processes(
        &self,
        tensor: &Tensor,
        dim: i64,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor> {
        if self.num_processes() == 1 {
            return Ok(tensor.shallow_clone());
        }
        let size = tensor.size();
        let d = if dim < 0 { dim + size.len() as i64 } else { dim } as usize;
        let everyone = self.inner.mesh.everyone();
        let len = on_comm_device(
            everyone.as_ref(),
            self.device(),
            &Tensor::from_slice(&[size[d]]),
            |c, t| {
                c.all_reduce(t, ReduceOp::Max)?;
                Ok(t.shallow_clone())
            },
        )?;
        let max = len.int64_value(&[0]);
        if max == size[d] {
            return Ok(tensor.shallow_clone());
        }
        let mut padded_shape = size.clone();
        padded_shape[d] = max;
        let out = Tensor::f_full(&padded_shape, pad_value, (tensor.kind(), tensor.device()))?;
        let start = if pad_first { max - size[d] } else { 0 };
        out.f_narrow(d as i64, start, size[d])?.f_copy_(tensor)?;
        Ok(out)
    }

    /// Runs `f` on the main process first, then on the others (e.g. a download or a cache
    /// that one process should make).
    pub fn main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let out = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(out)
    }

    /// This process's contiguous share of `items` (the first `len % N` processes get one
    /// more); with `pad`, shares are padded with the last item to equal length.
    pub fn split_between_processes<T: Clone>(&self, items: &[T], pad: bool) -> Vec<T> {
        split_between(items, self.process_index(), self.num_processes(), pad)
    }
}

/// Accelerate's `split_between_processes` arithmetic.
pub fn split_between<T: Clone>(items: &[T], rank: usize, world: usize, pad: bool) -> Vec<T> {
    let (base, extra) = (items.len() / world, items.len() % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    let mut share = items[start..start + len].to_vec();
    if pad && extra > 0 && share.len() < base + 1 {
        if let Some(last) = items.last() {
            share.push(last.clone());
        }
    }
    share
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_between_processes_gives_the_first_ranks_one_more() {
        let items: Vec<u32> = (0..7).collect();
        assert_eq!(split_between(&items, 0, 3, false), [0, 1, 2]);
        assert_eq!(split_between(&items, 1, 3, false), [3, 4]);
        assert_eq!(split_between(&items, 2, 3, false), [5, 6]);
        assert_eq!(split_between(&items, 2, 3, true), [5, 6, 6]);
        assert_eq!(split_between(&items, 0, 1, false), items);
    }
}
