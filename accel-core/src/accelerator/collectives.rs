//! Collectives a training script calls by hand, as Accelerate's: `gather`,
//! `gather_for_metrics`, `reduce`, `broadcast`, `pad_across_processes`,
//! `main_process_first`, `split_between_processes`.

use tch::{Device, Tensor};

use super::Accelerator;
use crate::comm::{Backend, Communicator, ReduceOp};
use crate::error::Result;

/// `tensor` on the device `comm` works on, and the device it came from ([`back`] returns a
/// result there): NCCL reduces GPU memory only, so a CPU tensor (a metric, a count) goes to
/// `device`. The collective itself is called by the public method, so that the sequence
/// check records the user's line (`#[track_caller]` does not reach through closures).
fn to_comm_device(
    comm: &dyn Communicator,
    device: Device,
    tensor: &Tensor,
) -> Result<(Tensor, Device)> {
    let home = tensor.device();
    if comm.backend() == Backend::Nccl && home != device {
        Ok((tensor.f_to_device(device)?, home))
    } else {
        Ok((tensor.shallow_clone(), home))
    }
}

/// `result` on `home` (see [`to_comm_device`]).
fn back(result: Tensor, home: Device) -> Result<Tensor> {
    if result.device() == home { Ok(result) } else { Ok(result.f_to_device(home)?) }
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
        let (t, home) = to_comm_device(everyone.as_ref(), self.device(), tensor)?;
        back(everyone.all_gather(&t)?, home)
    }

    /// [`gather`](Self::gather), minus the samples that padded the last round of a
    /// prepared loader (Accelerate's `gather_for_metrics`): over an epoch, exactly the
    /// data set's samples come back.
    #[track_caller]
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        // A sharded forward that failed where it could not say so (evaluation under zero3).
        self.inner.strategy.take_error()?;
        // Over the data-parallel replicas: their tensor ranks and stages hold the same samples.
        let gathered = match self.data_parallel().1 {
            replicas if replicas == self.num_processes() => self.gather(tensor)?,
            _ => {
                let data = self.inner.mesh.comm(crate::mesh::Dim::Batch);
                let t =
                    if tensor.dim() == 0 { tensor.f_reshape([1])? } else { tensor.shallow_clone() };
                let (t, home) = to_comm_device(data.as_ref(), self.device(), &t)?;
                back(data.all_gather(&t)?, home)?
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
        let (t, home) = to_comm_device(everyone.as_ref(), self.device(), &out)?;
        everyone.all_reduce(&t, op)?;
        back(t, home)
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
        let (t, home) = to_comm_device(everyone.as_ref(), self.device(), &out)?;
        everyone.broadcast(&t, from)?;
        back(t, home)
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
        let (len, _) =
            to_comm_device(everyone.as_ref(), self.device(), &Tensor::from_slice(&[size[d]]))?;
        everyone.all_reduce(&len, ReduceOp::Max)?;
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

    /// The sequence check names the user's line for each helper, not one inside accel.
    #[test]
    fn the_sequence_check_records_the_callers_line_of_each_helper() {
        use crate::comm::tests::on_ranks;
        use crate::config::{Config, Strategy};
        use crate::mesh::{DeviceMesh, ParallelDims};
        use crate::topology::Topology;

        let results = on_ranks(2, std::time::Duration::from_secs(20), |group| {
            let rank = group.rank();
            let process = Topology {
                rank,
                world_size: 2,
                local_rank: rank,
                local_world_size: 2,
                master_addr: "127.0.0.1".into(),
                master_port: 0,
                source: "test",
            };
            let config = Config { strategy: Strategy::Ddp, ..Config::default() };
            let dims = ParallelDims::for_run(&config, &process).unwrap();
            let mesh = DeviceMesh::from_parts(dims, rank, Some(group.clone()), []);
            let acc = Accelerator::builder()
                .strategy(Strategy::Ddp)
                .cpu(true)
                .thread_rank(process, mesh)
                .build()
                .unwrap();
            let t = Tensor::ones([3], (tch::Kind::Float, Device::Cpu));
            let first = line!() + 1;
            let _ = acc.reduce(&t, ReduceOp::Sum).unwrap();
            let _ = acc.broadcast(&t, 0).unwrap();
            let _ = acc.gather(&t).unwrap();
            let _ = acc.pad_across_processes(&t, 0, 0.0, false).unwrap();
            let sites = group.ledger().unwrap().sites();
            (first, sites[sites.len() - 4..].to_vec())
        });
        for (first, sites) in results {
            let expected: Vec<String> = (first..first + 4)
                .map(|line| format!("src/accelerator/collectives.rs:{line}"))
                .collect();
            assert_eq!(sites, expected);
        }
    }
}
