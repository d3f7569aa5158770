//! Layers the accelerator makes, so that the run's configuration can change how they
//! compute: fp8 linear layers, and the module filter that keeps some of them in higher
//! precision (Accelerate's `filter_first_and_last_linear_layers`).

use std::sync::atomic::Ordering;

use tch::Tensor;
use tch::nn::{self, LinearConfig};

use super::Accelerator;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::optim::Param;
use crate::precision::Float8Linear;
use crate::precision::fp8::shapes_suit;

impl Accelerator {
    /// The layer `make(path)` builds under `path`, as a [`Unit`](crate::Unit) made for this
    /// accelerator: under zero3/fsdp its parameters live as shards and are gathered only
    /// around its forward and backward; under every other strategy it is the layer
    /// unchanged. `#[accelerate]` writes this around each layer added to an `nn::seq()` in
    /// the function it annotates (`.add(nn::linear(path, ..))`), so that unchanged code is
    /// sharded. Such units yield to `ShardOptions::min_unit_params` (a layer smaller than it
    /// stays whole); two of one name wait unbound rather than fail.
    pub fn unit<'a, P: std::borrow::Borrow<nn::Path<'a>>, M>(
        &self,
        path: P,
        make: impl FnOnce(P) -> M,
    ) -> crate::Unit<M> {
        let prefix = path.borrow().components().collect::<Vec<_>>().join(".");
        let layer = make(path);
        crate::Unit::named(self, prefix, layer, true)
    }

    /// A linear layer with `tch::nn::linear`'s variables and initialisation, whose matmuls
    /// run in fp8 when the run's precision is fp8 (torchao's `Float8Linear`, with the
    /// configured [`Fp8Recipe`](crate::Fp8Recipe)); in any other precision it computes
    /// exactly as `nn::Linear`. `#[accelerate(precision = "fp8")]` writes this in place of
    /// the `nn::linear(..)` calls of the function it annotates.
    ///
    /// As Accelerate does, [`prepare_model`](Self::prepare_model) keeps the model's first
    /// and last such layers in higher precision, and so does each layer whose input or
    /// output features are not multiples of 16 (what `_scaled_mm` takes); the main process
    /// reports which layers are in fp8.
    pub fn linear<'a>(
        &self,
        path: impl std::borrow::Borrow<nn::Path<'a>>,
        in_dim: i64,
        out_dim: i64,
        config: LinearConfig,
    ) -> Float8Linear {
        let path = path.borrow();
        let linear = nn::linear(path, in_dim, out_dim, config);
        let Some(fp8) = &self.inner.fp8 else { return Float8Linear::plain(linear) };
        match fp8.register(path, &linear.ws) {
            Ok(switch) => Float8Linear::with_switch(linear, fp8.recipe, switch),
            // Only a weight without a tensor behind it fails here; nn::linear makes none.
            Err(e) => panic!("accelerator.linear: {e}"),
        }
    }

    /// Under fp8: applies the module filter to the layers of the model being prepared and
    /// reports the result once; an error when the model has no layer that could be fp8.
    pub(crate) fn filter_fp8_layers(&self, params: &[Param]) -> Result<()> {
        let Some(fp8) = &self.inner.fp8 else { return Ok(()) };
        let ids: Vec<usize> =
            params.iter().filter_map(|p| crate::shim::tensor_id(&p.tensor).ok()).collect();
        let mine = fp8.among(&ids);
        // With a pipeline, the model's first layer is on the first stage and its last on
        // the last; a stage without linear layers is fine if another stage has some.
        let stages = self.inner.parallel.stages();
        let anywhere = Tensor::from_slice(&[mine.len() as i64]);
        stages.all_reduce(&anywhere, ReduceOp::Max)?;
        if anywhere.int64_value(&[0]) == 0 {
            return Err(Error::Config(
                "precision fp8 makes the matmuls of linear layers fp8, but this model has no \
                 layer made by `accelerator.linear(..)` (or the tensor-parallel layers of \
                 `accelerator.tensor_parallel()`): build its linear layers inside the function \
                 that carries #[accelerate(precision = \"fp8\")] (its `nn::linear` calls become \
                 fp8 layers), or with `accelerator.linear(path, in, out, config)` in place of \
                 `nn::linear`; or use precision bf16"
                    .into(),
            ));
        }
        let (first_stage, last_stage) = (stages.rank() == 0, stages.rank() + 1 == stages.size());
        let mut kept = Vec::new();
        for (i, layer) in mine.iter().enumerate() {
            let reason = if i == 0 && first_stage {
                Some("the first".to_owned())
            } else if i + 1 == mine.len() && last_stage {
                Some("the last".to_owned())
            } else if !shapes_suit(layer.features.0, layer.features.1) {
                Some(format!(
                    "{}→{} features, not multiples of 16",
                    layer.features.0, layer.features.1
                ))
            } else {
                None
            };
            if let Some(reason) = reason {
                layer.enabled.store(false, Ordering::Relaxed);
                kept.push(format!("{} ({reason})", layer.path));
            }
        }
        if self.is_main_process() {
            let in_fp8 = mine.len() - kept.len();
            let recipe = fp8.recipe;
            let kept = if kept.is_empty() {
                String::new()
            } else {
                format!("; in bf16: {}", kept.join(", "))
            };
            eprintln!(
                "accel: fp8 ({recipe}): {in_fp8} of {} linear layers in fp8{kept}",
                mine.len()
            );
            if self.device() == tch::Device::Cpu {
                eprintln!(
                    "accel: fp8 on CPU runs the recipe through libtorch's reference kernels, \
                     slower than bf16: use it to check numerics, train fast on an fp8 GPU"
                );
            }
        }
        Ok(())
    }
}
