//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `examples/custom-optimizer/
//! main.rs` (`run`) with `examples/custom-optimizer/sparse_adam.rs` (`SparseAdam`), MIT or
//! Apache-2.0 (`Cargo.toml`: `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE). Not among tch-rs's examples in tests/real_code.
//!
//! The loop: full-batch training over MNIST, `for epoch in 1..200`, the optimizer a custom
//! Sparse-Adam written by the program (`SparseAdam::new(&vs, ..)` over the VarStore's shared
//! variable list `vs.variables_`), stepped with `opt.zero_grad(); loss.backward(); opt.step()`,
//! test accuracy printed every epoch.
//!
//! Changed: MNIST (`tch::vision::mnist::load_dir("data")`) replaced by the digits as a tch
//! `Dataset` (`load_dir()` below), so IMAGE_DIM 784 -> 64 and HIDDEN_NODES 128 -> 32; 199
//! epochs -> 19; `run` renamed `train` (the module's entry point is `run`); `f64::from` ->
//! `f64::try_from(..)?` (tch 0.24); `net` returns `impl Module + use<>` (Rust 2024 would
//! otherwise tie the module to the temporary `vs.root()`). `sparse_adam.rs` is kept as the
//! inline module `sparse_adam`, unchanged.
//!
//! Expected: **Refused { line: 215, says: "is not an optimizer the accelerator can prepare" }**,
//! at `sparse_adam::SparseAdam::new(..)`, rustc's E0277 from accel's `AdoptOptimizer` bound.
//! The optimizer is made by a call the attribute cannot see into (docs/attribute.md,
//! "Optimizers are found by use"), so it is adopted over the function's only VarStore,
//! `accelerator.adopt_optimizer(&vs, sparse_adam::SparseAdam::new(..))?`, and `SparseAdam`
//! implements neither tch's `nn::Optimizer` nor accel's `Optimizer` (the note names them).
//! Were it accepted, the loop, a full batch counted by `epoch`, would draw its own batches
//! and stop on 2 processes with "computed the same loss", as mnist_nn does.
use tch::nn::{self, Module};
use tch::vision::dataset::Dataset;
use tch::Device;

use crate::data;

mod sparse_adam {
    use std::sync::{Arc, Mutex};
    use tch::nn::{VarStore, Variables};
    use tch::{no_grad, Device, Kind, Tensor};

    /// Buffer of first/second order moment for the Adam optimizer
    struct Buffer {
        pub first_moment: Tensor,
        pub second_moment: Tensor,
        idx: usize,
    }

    impl Buffer {
        pub fn new(size: &[i64]) -> Buffer {
            Buffer {
                first_moment: Tensor::zeros(size, (Kind::Float, Device::Cpu)),
                second_moment: Tensor::zeros(size, (Kind::Float, Device::Cpu)),
                idx: 1,
            }
        }

        // Return and increment the timestep
        pub fn inc(&mut self) -> usize {
            let old_val = self.idx;
            self.idx += 1;

            old_val
        }
    }

    /// Sparse-Adam optimizer supporting sparse and dense gradients
    ///
    /// This demonstrates how a custom optimizer can be implemented. It handles a shared copy
    /// of the variables store `vars` and updates it by traversing the computation graph.
    pub struct SparseAdam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        force_sparse: bool,

        vars: Arc<Mutex<Variables>>,
        buffers: Vec<Buffer>,
    }

    impl SparseAdam {
        pub fn new(
            vs: &VarStore,
            lr: f64,
            beta1: f64,
            beta2: f64,
            eps: f64,
            force_sparse: bool,
        ) -> SparseAdam {
            let vars = vs.variables_.clone();

            // create buffers for every trainable variable
            let buffers = vars
                .lock()
                .unwrap()
                .trainable_variables
                .iter()
                .map(|x| Buffer::new(&x.tensor.size()))
                .collect();

            SparseAdam { lr, beta1, beta2, eps, force_sparse, vars, buffers }
        }

        /// Ensure that the gradient update is not part of the autograd routine
        pub fn step(&mut self) {
            no_grad(|| self._step());
        }

        pub fn _step(&mut self) {
            let mut vars = self.vars.lock().unwrap();

            // iterate through all trainable variables
            for (var, buffer) in vars.trainable_variables.iter_mut().zip(&mut self.buffers) {
                let mut grad = var.tensor.grad();

                // calculate both bias correction values
                let buffer_idx = buffer.inc();
                let bias_correction1 = 1.0 - self.beta1.powf(buffer_idx as f64);
                let bias_correction2 = 1.0 - self.beta2.powf(buffer_idx as f64);

                // check whether the gradient is sparse
                if grad.is_sparse() || self.force_sparse {
                    // convert matrix to sparse matrix if necessary
                    if !grad.is_sparse() {
                        grad = grad.to_sparse_sparse_dim(1);
                    }

                    // deduplicate coordinates in the sparse matrix
                    let grad = grad.coalesce();
                    // get indices and values of the sparse gradient
                    let indices = grad.indices().squeeze();
                    let values = grad.values();

                    // for SGD we would do:
                    //tensor.index_add_(0, &indices, &(-self.lr * &values));

                    // update both moments
                    // old = b*old + (1-b) * new <==> old += (1-b) * (new - old)
                    let update_first_moment = (1.0 - self.beta1)
                        * (&values - buffer.first_moment.index_select(0, &indices));
                    let update_second_moment = (1.0 - self.beta2)
                        * (&values * &values - buffer.second_moment.index_select(0, &indices));

                    let _ = buffer.first_moment.index_add_(0, &indices, &update_first_moment);
                    let _ = buffer.second_moment.index_add_(0, &indices, &update_second_moment);

                    // first part of update step -lr * m_t / (1-b_1^t)
                    let part1 = buffer.first_moment.index_select(0, &indices)
                        * (-self.lr / bias_correction1);
                    // second part of update step sqrt(v_t / (1-b_2^t)) + eps
                    let part2 = (buffer.second_moment.index_select(0, &indices)
                        / bias_correction2)
                        .sqrt()
                        + self.eps;

                    let _ = var.tensor.index_add_(0, &indices, &(part1 / part2));
                } else {
                    // update first moment
                    buffer.first_moment *= self.beta1;
                    buffer.first_moment += (1.0 - self.beta1) * &grad;
                    // update second raw moment
                    buffer.second_moment *= self.beta2;
                    let scaled_grad = grad * (1.0 - self.beta2).sqrt();
                    let _ = buffer.second_moment.addcmul_(&scaled_grad, &scaled_grad);

                    // first part of update step -lr * m_t / (1-b_1^t)
                    let part1 = &buffer.first_moment * (-self.lr / bias_correction1);
                    // second part of update step sqrt(v_t / (1-b_2^t)) + eps
                    let part2 = (&buffer.second_moment / bias_correction2).sqrt() + self.eps;

                    // calculate fraction and update parameters
                    let _ = var.tensor.addcdiv_(&part1, &part2);
                }
            }
        }

        // zero the gradient of all trainable variables
        pub fn zero_grad(&mut self) {
            let mut vars = self.vars.lock().unwrap();
            for var in &mut vars.trainable_variables {
                var.tensor.zero_grad();
            }
        }
    }
}

const IMAGE_DIM: i64 = 64;
const HIDDEN_NODES: i64 = 32;
const LABELS: i64 = 10;

fn net(vs: &nn::Path) -> impl Module + use<> {
    nn::seq()
        .add(nn::linear(vs / "layer1", IMAGE_DIM, HIDDEN_NODES, Default::default()))
        .add_fn(|xs| xs.relu())
        .add(nn::linear(vs, HIDDEN_NODES, LABELS, Default::default()))
}

/// Stand-in for `tch::vision::mnist::load_dir("data")`: the digits as tch's `Dataset`.
fn load_dir() -> anyhow::Result<Dataset> {
    let d = data::load()?;
    Ok(Dataset {
        train_images: d.train_x,
        train_labels: d.train_y,
        test_images: d.test_x,
        test_labels: d.test_y,
        labels: 10,
    })
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let m = load_dir()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = net(&vs.root());

    // force a sparse update step (in order to test on dense problem)
    let force_sparse = false;
    // create a custom optimizer with learning rate `0.005`, beta_1 `0.9` and beta2 `0.999`
    let mut opt = sparse_adam::SparseAdam::new(&vs, 5e-3, 0.9, 0.999, 1e-8, force_sparse);

    for epoch in 1..20 {
        let loss = net.forward(&m.train_images).cross_entropy_for_logits(&m.train_labels);

        // call custom optimizer
        opt.zero_grad();
        loss.backward();
        opt.step();

        let test_accuracy = net.forward(&m.test_images).accuracy_for_logits(&m.test_labels);
        println!(
            "epoch: {:4} train loss: {:8.5} test acc: {:5.2}%",
            epoch,
            f64::try_from(&loss)?,
            100. * f64::try_from(&test_accuracy)?,
        );
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
