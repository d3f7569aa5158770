//! The two schedules of a pipeline step, and the transfers between neighbouring stages.
//! An activation travels with a small header (its shape and dtype), so stages need not know
//! each other's shapes; its gradient comes back without one (the sender knows its shape).
//! A stage sending to a neighbour that sends to it at the same time (1F1B's steady state)
//! does both at once (`send_recv`), so that neither waits for the other.

use std::collections::VecDeque;

use tch::{Device, Kind, Tensor};

use super::Pipeline;
use crate::Accelerator;
use crate::comm::Backend;
use crate::error::{Error, Result};

const KINDS: [Kind; 4] = [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double];

/// A tensor's shape and dtype as 9 integers: rank, up to 7 dimensions, dtype code.
fn header(t: &Tensor) -> Result<Tensor> {
    let size = t.size();
    if size.len() > 7 {
        return Err(Error::Unsupported(format!(
            "pipeline activations of {} dimensions (at most 7)",
            size.len()
        )));
    }
    let kind = KINDS.iter().position(|k| *k == t.kind()).ok_or_else(|| {
        Error::Unsupported(format!("pipeline activations of {:?} (f32, bf16, f16, f64)", t.kind()))
    })?;
    let mut values = vec![size.len() as i64];
    values.extend(&size);
    values.resize(8, 0);
    values.push(kind as i64);
    Ok(Tensor::from_slice(&values))
}

/// An empty tensor of the shape and dtype `h` describes, on `device`.
fn from_header(h: &Tensor, device: Device) -> Result<Tensor> {
    let v = Vec::<i64>::try_from(&h.f_to_device(Device::Cpu)?).map_err(Error::from)?;
    let ndim = v[0].clamp(0, 7) as usize;
    let kind = KINDS.get(v[8] as usize).copied().unwrap_or(Kind::Float);
    Ok(Tensor::f_empty(&v[1..1 + ndim], (kind, device))?)
}

/// One step of one stage.
pub(super) struct Run<'a> {
    pub pipeline: &'a Pipeline,
    pub accelerator: &'a Accelerator,
    pub micro_batches: &'a [(Tensor, Tensor)],
    pub forward: &'a dyn Fn(&Tensor) -> Tensor,
    pub loss: &'a dyn Fn(&Tensor, &Tensor) -> Tensor,
    /// Each micro-batch's loss (last stage).
    pub losses: Vec<f64>,
}

/// What backward needs of a micro-batch's forward: the stage's input (a leaf that
/// collects its gradient, except on the first stage) and its output (the loss on the last).
struct InFlight {
    input: Tensor,
    output: Tensor,
}

impl Run<'_> {
    /// Where transfers between stages live: host memory for the cpu backend, the GPU for
    /// NCCL.
    fn wire(&self) -> Device {
        match self.pipeline.comm.backend() {
            Backend::Nccl => self.accelerator.device(),
            Backend::Cpu | Backend::Local => Device::Cpu,
        }
    }

    fn prev(&self) -> usize {
        self.pipeline.stage() - 1
    }

    fn next(&self) -> usize {
        self.pipeline.stage() + 1
    }

    /// The input of micro-batch `i`: the data on the first stage, else the activation the
    /// previous stage sends (header, then data).
    fn recv_forward(&self, i: usize) -> Result<Tensor> {
        if self.pipeline.is_first() {
            return Ok(self.micro_batches[i].0.to_device(self.accelerator.device()));
        }
        let h = Tensor::f_zeros([9], (Kind::Int64, self.wire()))?;
        self.pipeline.comm.recv(&h, self.prev())?;
        let input = from_header(&h, self.wire())?;
        self.pipeline.comm.recv(&input, self.prev())?;
        Ok(input.f_to_device(self.accelerator.device())?.set_requires_grad(true))
    }

    /// Sends the header of `output` to the next stage (the data follows).
    fn send_header(&self, output: &Tensor) -> Result<Tensor> {
        let data = output.f_detach()?.f_to_device(self.wire())?.f_contiguous()?;
        self.pipeline.comm.send(&header(&data)?.f_to_device(self.wire())?, self.next())?;
        Ok(data)
    }

    fn send_forward(&self, output: &Tensor) -> Result<()> {
        if self.pipeline.is_last() {
            return Ok(());
        }
        let data = self.send_header(output)?;
        self.pipeline.comm.send(&data, self.next())
    }

    fn recv_backward(&self, output: &Tensor) -> Result<Tensor> {
        let grad = Tensor::f_empty(output.size().as_slice(), (output.kind(), self.wire()))?;
        self.pipeline.comm.recv(&grad, self.next())?;
        Ok(grad)
    }

    /// Sends `output` forward and receives the gradient of an earlier output, `pending`
    /// (its micro-batch may be another size, as the last one of an epoch is), at once.
    fn send_forward_recv_backward(&self, output: &Tensor, pending: &Tensor) -> Result<Tensor> {
        let data = self.send_header(output)?;
        let grad = Tensor::f_empty(pending.size().as_slice(), (pending.kind(), self.wire()))?;
        self.pipeline.comm.send_recv_async(&data, self.next(), &grad, self.next())?.wait()?;
        Ok(grad)
    }

    fn send_backward(&self, input_grad: Option<Tensor>) -> Result<()> {
        match input_grad {
            Some(g) if !self.pipeline.is_first() => self.pipeline.comm.send(&g, self.prev()),
            _ => Ok(()),
        }
    }

    /// Sends an input gradient back and receives micro-batch `i`'s input, at once.
    fn send_backward_recv_forward(&self, input_grad: Option<Tensor>, i: usize) -> Result<Tensor> {
        let Some(grad) = input_grad.filter(|_| !self.pipeline.is_first()) else {
            return self.recv_forward(i);
        };
        let h = Tensor::f_zeros([9], (Kind::Int64, self.wire()))?;
        self.pipeline.comm.recv(&h, self.prev())?;
        let input = from_header(&h, self.wire())?;
        self.pipeline.comm.send_recv_async(&grad, self.prev(), &input, self.prev())?.wait()?;
        Ok(input.f_to_device(self.accelerator.device())?.set_requires_grad(true))
    }

    /// The stage's forward of micro-batch `i` (its loss on the last stage).
    fn forward_step(&mut self, i: usize, input: Tensor) -> Result<InFlight> {
        let guard = self.accelerator.autocast()?;
        let mut output = (self.forward)(&input);
        if self.pipeline.is_last() {
            let target = self.micro_batches[i].1.to_device(self.accelerator.device());
            output = (self.loss)(&output.f_to_kind(Kind::Float)?, &target);
            self.losses[i] = output.f_double_value(&[])?;
        }
        drop(guard);
        Ok(InFlight { input, output })
    }

    /// The stage's backward of a micro-batch: from the loss on the last stage, else from
    /// the output's gradient; returns the input's gradient (to send back).
    fn backward_step(
        &self,
        flight: InFlight,
        output_grad: Option<Tensor>,
    ) -> Result<Option<Tensor>> {
        match output_grad {
            None => self.accelerator.backward(&flight.output)?,
            Some(grad) => self
                .accelerator
                .backward_with_grad(&flight.output, &grad.f_to_device(flight.output.device())?)?,
        }
        Ok((!self.pipeline.is_first()).then(|| flight.input.grad().to_device(self.wire())))
    }

    /// Every micro-batch forward, nothing kept for backward (evaluation).
    pub fn forward_only(&mut self) -> Result<()> {
        for i in 0..self.micro_batches.len() {
            let input = self.recv_forward(i)?;
            let flight = self.forward_step(i, input)?;
            self.send_forward(&flight.output)?;
        }
        Ok(())
    }

    /// GPipe: every forward, then every backward in reverse order.
    pub fn gpipe(&mut self) -> Result<()> {
        let m = self.micro_batches.len();
        let mut flights = Vec::with_capacity(m);
        for i in 0..m {
            let input = self.recv_forward(i)?;
            let flight = self.forward_step(i, input)?;
            self.send_forward(&flight.output)?;
            flights.push(flight);
        }
        for flight in flights.into_iter().rev() {
            let grad = match self.pipeline.is_last() {
                true => None,
                false => Some(self.recv_backward(&flight.output)?),
            };
            let input_grad = self.backward_step(flight, grad)?;
            self.send_backward(input_grad)?;
        }
        Ok(())
    }

    /// 1F1B (PipeDream-flush, Megatron's `forward_backward_pipelining_without_interleaving`):
    /// a warm-up of forwards (as many as stages after this one), a steady state of one
    /// forward then one backward, a cool-down of the remaining backwards.
    pub fn one_forward_one_backward(&mut self) -> Result<()> {
        let m = self.micro_batches.len();
        let (p, s) = (self.pipeline.stages(), self.pipeline.stage());
        let warmup = (p - s - 1).min(m);
        let remaining = m - warmup;
        let mut flights: VecDeque<InFlight> = VecDeque::new();
        for i in 0..warmup {
            let input = self.recv_forward(i)?;
            let flight = self.forward_step(i, input)?;
            self.send_forward(&flight.output)?;
            flights.push_back(flight);
        }
        let mut input = if remaining > 0 { Some(self.recv_forward(warmup)?) } else { None };
        for i in 0..remaining {
            let flight = self.forward_step(warmup + i, input.take().expect("received"))?;
            flights.push_back(flight);
            let oldest = flights.pop_front().expect("one in flight at least");
            let grad = match flights.back() {
                // The last stage has nothing in flight: its own loss starts the backward.
                None => None,
                Some(newest) => {
                    Some(self.send_forward_recv_backward(&newest.output, &oldest.output)?)
                }
            };
            let input_grad = self.backward_step(oldest, grad)?;
            if i + 1 == remaining {
                self.send_backward(input_grad)?;
            } else {
                input = Some(self.send_backward_recv_forward(input_grad, warmup + i + 1)?);
            }
        }
        while let Some(flight) = flights.pop_front() {
            let grad = self.recv_backward(&flight.output)?;
            let input_grad = self.backward_step(flight, Some(grad))?;
            self.send_backward(input_grad)?;
        }
        Ok(())
    }
}
