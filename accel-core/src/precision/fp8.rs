//! fp8 training as torchao's `Float8Linear` does it (torchao 0.18): each linear layer's
//! three matmuls — output, gradient of the input, gradient of the weight — run on fp8
//! operands through ATen's `_scaled_mm`; weights, their gradients and the optimizer stay in
//! the higher precision. Scales are dynamic: recomputed from each operand's current amax.
//!
//! tch has no custom autograd functions, so the backward pass is injected with gradient
//! hooks (as the tensor-parallel mappings do): the forward value is computed without
//! autograd and joined to the input and weight through an exactly-zero link; a hook on the
//! output's gradient runs the two fp8 backward matmuls, and hooks on the link's ends hand
//! their results to autograd in place of the link's zeros.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tch::nn::Module;
use tch::{Device, Kind, Tensor};

use crate::config::Fp8Recipe;
use crate::error::{Error, Result};
use crate::shim::{add_grad_hook, autocast, autocast_state};
use crate::sync::Locked;

/// Smallest amax used for a scale (torchao's `EPS`): an all-zero tensor gets a finite scale.
const EPS: f64 = 1e-12;

/// The two fp8 formats (OCP FP8): e4m3 for values, e5m2 for the wider range of gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, no infinities (`torch.float8_e4m3fn`), max 448.
    E4m3,
    /// 5 exponent bits, 2 mantissa bits (`torch.float8_e5m2`), max 57344.
    E5m2,
}

impl Fp8Format {
    /// The tch kind holding this format.
    pub fn kind(self) -> Kind {
        match self {
            Fp8Format::E4m3 => Kind::Float8e4m3fn,
            Fp8Format::E5m2 => Kind::Float8e5m2,
        }
    }

    /// The largest finite value (`torch.finfo(dtype).max`).
    pub fn max(self) -> f64 {
        match self {
            Fp8Format::E4m3 => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }
}

/// Over what one scale is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One scale for the whole tensor.
    Tensor,
    /// One scale per slice: the amax is taken along this dimension (kept, of size 1).
    Axis(i64),
}

/// An operand in fp8: `bits ≈ value * scale`, saturated to the format's range.
#[derive(Debug)]
pub struct Scaled {
    /// The fp8 values.
    pub bits: Tensor,
    /// f32 scale(s): 0-dim for a tensorwise scale, else broadcastable against `bits`.
    pub scale: Tensor,
}

impl Scaled {
    /// The transpose of a 2-D operand, scales included.
    pub fn t(&self) -> Result<Scaled> {
        let scale =
            if self.scale.dim() == 2 { self.scale.f_tr()? } else { self.scale.shallow_clone() };
        Ok(Scaled { bits: self.bits.f_tr()?, scale })
    }

    /// Back to `kind`: `bits / scale` (what the fp8 operand stands for).
    pub fn dequantize(&self, kind: Kind) -> Result<Tensor> {
        Ok(self.bits.f_to_kind(Kind::Float)?.f_div(&self.scale)?.f_to_kind(kind)?)
    }
}

/// max(|t|) over the tensor (0-dim) or along an axis (kept), in `t`'s dtype.
pub fn amax(t: &Tensor, granularity: Granularity) -> Result<Tensor> {
    let abs = t.f_abs()?;
    Ok(match granularity {
        Granularity::Tensor => abs.f_max()?,
        Granularity::Axis(dim) => abs.f_amax([dim].as_slice(), true)?,
    })
}

/// The scale that maps `amax` onto the format's largest value, computed in f64 and stored
/// as f32 (torchao's `amax_to_scale`); optionally rounded down to a power of two.
pub fn scale_from_amax(amax: &Tensor, format: Fp8Format, round_to_pow2: bool) -> Result<Tensor> {
    let amax = amax.f_to_kind(Kind::Double)?.f_clamp_min(EPS)?;
    let scale = amax.f_full_like(format.max())?.f_div(&amax)?.f_to_kind(Kind::Float)?;
    if round_to_pow2 { Ok(scale.f_log2()?.f_floor()?.f_exp2()?) } else { Ok(scale) }
}

/// `t` in fp8 with a dynamic scale: `clamp(t * scale, ±max)` cast to the format (the clamp
/// saturates: libtorch 2.11's cast alone would turn overflow into NaN).
pub fn cast(
    t: &Tensor,
    format: Fp8Format,
    granularity: Granularity,
    round_to_pow2: bool,
) -> Result<Scaled> {
    let scale = scale_from_amax(&amax(t, granularity)?, format, round_to_pow2)?;
    let max = format.max();
    let bits =
        t.f_to_kind(Kind::Float)?.f_mul(&scale)?.f_clamp(-max, max)?.f_to_kind(format.kind())?;
    Ok(Scaled { bits, scale })
}

/// torchao's test for a row-major 2-D layout.
fn is_row_major(t: &Tensor) -> bool {
    let s = t.stride();
    s[0] > s[1] && s[1] == 1
}

/// `a @ b` of two fp8 operands, in `out` (torchao's `addmm_float8_unwrapped`): `_scaled_mm`
/// with the inverse scales, `a` row-major and `b` column-major as cuBLAS wants them. Row-wise
/// scales without fast accumulation are applied after a unit-scaled product, and
/// `_scaled_mm` gives them in bf16 only. `emulate` computes the same product from
/// dequantised f32 operands instead (torchao's `emulate`, for devices without the kernel).
pub fn scaled_mm(
    a: &Scaled,
    b: &Scaled,
    out: Kind,
    fast_accum: bool,
    emulate: bool,
) -> Result<Tensor> {
    // CUDA's `_scaled_mm` takes an inner dimension and an output width that are multiples
    // of 16; the same rule on CPU (and in emulation), so that what passes here runs there.
    let (inner, cols) = (a.bits.size()[1], b.bits.size()[1]);
    if inner % 16 != 0 || cols % 16 != 0 {
        return Err(Error::Training(format!(
            "fp8 matmul of [{}, {inner}] by [{inner}, {cols}]: _scaled_mm needs the inner \
             dimension and the output width to be multiples of 16",
            a.bits.size()[0]
        )));
    }
    if emulate {
        let (a, b) = (a.dequantize(Kind::Float)?, b.dequantize(Kind::Float)?);
        return Ok(a.f_mm(&b)?.f_to_kind(out)?);
    }
    let a_bits =
        if is_row_major(&a.bits) { a.bits.shallow_clone() } else { a.bits.f_contiguous()? };
    let b_bits = if is_row_major(&b.bits) {
        b.bits.f_tr()?.f_contiguous()?.f_tr()?
    } else {
        b.bits.shallow_clone()
    };
    let (mut a_inv, mut b_inv) = (a.scale.f_reciprocal()?, b.scale.f_reciprocal()?);
    let rows = a.bits.size()[0];
    let cols = b.bits.size()[1];
    let rowwise = a.scale.size() == [rows, 1] && b.scale.size() == [1, cols];
    let mut post_scale = None;
    if rowwise && !fast_accum {
        post_scale = Some(a_inv.f_mul(&b_inv)?);
        a_inv = a_inv.f_new_ones([], (Kind::Float, a_inv.device()))?;
        b_inv = a_inv.shallow_clone();
    }
    let widen = rowwise && matches!(out, Kind::Half | Kind::Float);
    let mm_out = if widen { Kind::BFloat16 } else { out };
    let product = || {
        a_bits.f_internal_scaled_mm(
            &b_bits,
            &a_inv,
            &b_inv,
            None::<Tensor>,
            None::<Tensor>,
            mm_out,
            fast_accum,
        )
    };
    // On CPU, libtorch's own path (see `shim::without_onednn`); the reference scripts take
    // it too (python/reference/cpu_fp8.py).
    let mut product = if a_bits.device() == tch::Device::Cpu {
        crate::shim::without_onednn(product)??
    } else {
        product()?
    };
    if let Some(post) = post_scale {
        let _ = product.f_mul_(&post)?;
    }
    Ok(if widen { product.f_to_kind(out)? } else { product })
}

/// How each operand of the three matmuls is cast, per recipe.
#[derive(Debug, Clone, Copy)]
struct RecipeSpec {
    input: Fp8Format,
    weight: Fp8Format,
    grad_output: Fp8Format,
    rowwise: bool,
    round_to_pow2: bool,
}

impl RecipeSpec {
    fn of(recipe: Fp8Recipe) -> Self {
        match recipe {
            Fp8Recipe::Tensorwise => Self {
                input: Fp8Format::E4m3,
                weight: Fp8Format::E4m3,
                grad_output: Fp8Format::E5m2,
                rowwise: false,
                round_to_pow2: false,
            },
            Fp8Recipe::Rowwise => Self {
                input: Fp8Format::E4m3,
                weight: Fp8Format::E4m3,
                grad_output: Fp8Format::E4m3,
                rowwise: true,
                round_to_pow2: true,
            },
        }
    }

    /// The granularity of an operand whose amax runs along `dim` in the row-wise recipe.
    fn along(&self, dim: i64) -> Granularity {
        if self.rowwise { Granularity::Axis(dim) } else { Granularity::Tensor }
    }

    /// libtorch's CPU `_scaled_mm` takes tensor-wise scales only; row-wise ones are
    /// emulated there, as torchao's `emulate = True` does.
    fn emulate(&self, device: Device) -> bool {
        self.rowwise && device == Device::Cpu
    }
}

/// Settings torchao uses for the three matmuls: fast accumulation for the output only.
const FAST_ACCUM_OUTPUT: bool = true;
const FAST_ACCUM_GRADS: bool = false;

/// Switches autocast off for `device` while alive (the fp8 matmuls choose their own
/// dtypes; autocast would re-cast the emulated products).
fn no_autocast(device: Device) -> Result<Option<crate::shim::AutocastGuard>> {
    match device {
        Device::Cpu | Device::Cuda(_) => Ok(Some(autocast(device, Kind::BFloat16, false)?)),
        _ => Ok(None),
    }
}

/// The output of an fp8 linear layer without autograd: `x @ wᵀ` with both in fp8, in `out`.
fn forward_value(x2d: &Tensor, w: &Tensor, spec: RecipeSpec, out: Kind) -> Result<Tensor> {
    let x8 = cast(x2d, spec.input, spec.along(-1), spec.round_to_pow2)?;
    let wt8 = cast(&w.f_tr()?, spec.weight, spec.along(0), spec.round_to_pow2)?;
    scaled_mm(&x8, &wt8, out, FAST_ACCUM_OUTPUT, spec.emulate(x2d.device()))
}

/// The gradients of an fp8 linear layer's input and weight for `grad` (the output's
/// gradient, 2-D), each in `grad`'s dtype.
fn backward_values(
    grad: &Tensor,
    x2d: &Tensor,
    w: &Tensor,
    spec: RecipeSpec,
    want_input: bool,
    want_weight: bool,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let out = grad.kind();
    let emulate = spec.emulate(grad.device());
    let grad_input = if want_input {
        let g8 = cast(grad, spec.grad_output, spec.along(-1), spec.round_to_pow2)?;
        let wt8 = cast(&w.f_tr()?, spec.weight, spec.along(-1), spec.round_to_pow2)?;
        Some(scaled_mm(&g8, &wt8.t()?, out, FAST_ACCUM_GRADS, emulate)?)
    } else {
        None
    };
    let grad_weight = if want_weight {
        // gradᵀ @ x sums over the tokens, `_scaled_mm`'s inner dimension: padded with zero
        // tokens to a multiple of 16, which changes neither the sum nor any scale (amax).
        let (grad, x2d) = (pad_rows_to_16(grad)?, pad_rows_to_16(x2d)?);
        let g8 = cast(&grad, spec.grad_output, spec.along(0), spec.round_to_pow2)?;
        let x8 = cast(&x2d, spec.input, spec.along(0), spec.round_to_pow2)?;
        Some(scaled_mm(&g8.t()?, &x8, out, FAST_ACCUM_GRADS, emulate)?)
    } else {
        None
    };
    Ok((grad_input, grad_weight))
}

/// `t` (2-D) with zero rows appended up to a multiple of 16 rows; said once per process.
fn pad_rows_to_16(t: &Tensor) -> Result<Tensor> {
    let rows = t.size()[0];
    let missing = (16 - rows % 16) % 16;
    if missing == 0 {
        return Ok(t.shallow_clone());
    }
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "accel: fp8: {rows} tokens per step is not a multiple of 16, which the weight \
             gradient's fp8 matmul needs: its tokens are padded with zeros (exact; said once)"
        );
    }
    Ok(t.f_constant_pad_nd([0, 0, 0, missing])?)
}

/// A gradient computed in one hook and handed over in another.
type Slot = Arc<Mutex<Option<Tensor>>>;

fn take(slot: &Slot) -> Option<Tensor> {
    slot.locked().take()
}

/// `x @ wᵀ + bias` with the three matmuls in fp8 (torchao's `Float8Linear.forward`).
///
/// Under autocast the output comes in the autocast dtype (as `torch.mm` under autocast gives
/// it), and on CUDA the input is first cast to that dtype, as torchao does; gradients reach
/// `x` and `w` in their own dtypes.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, recipe: Fp8Recipe) -> Result<Tensor> {
    let spec = RecipeSpec::of(recipe);
    let device = x.device();
    let autocast_kind = match device {
        Device::Cpu | Device::Cuda(_) => autocast_state(device)?,
        _ => None,
    };
    let x = match (device, autocast_kind) {
        (Device::Cuda(_), Some(kind)) => x.f_to_kind(kind)?,
        _ => x.shallow_clone(),
    };
    let out_kind = autocast_kind.unwrap_or(x.kind());
    let (features_in, features_out) = (w.size()[1], w.size()[0]);
    let shape = x.size();
    if shape.last() != Some(&features_in) {
        return Err(Error::Config(format!(
            "fp8 linear layer of {features_in} inputs got an input of shape {shape:?}"
        )));
    }
    let x2d = x.f_reshape([-1, features_in])?;
    let value = {
        let _off = no_autocast(device)?;
        tch::no_grad(|| forward_value(&x2d, w, spec, out_kind))?
    };
    let mut out_shape = shape.clone();
    *out_shape.last_mut().expect("checked above") = features_out;
    let value = value.f_reshape(out_shape.as_slice())?;

    // Views whose only use is the link: their gradients are the link's zeros, which the
    // hooks below replace with the fp8 results. Under no_grad the link requires none.
    let x_link = x.f_view_as(&x)?;
    let w_link = w.f_view_as(w)?;
    let zero = x_link
        .f_narrow(0, 0, 0)?
        .f_sum(Kind::Float)?
        .f_add(&w_link.f_narrow(0, 0, 0)?.f_sum(Kind::Float)?)?;
    let (want_input, want_weight) = (x.requires_grad(), w.requires_grad());
    let product = if zero.requires_grad() {
        let product = value.f_add(&zero.f_to_kind(out_kind)?)?;
        let (input_slot, weight_slot): (Slot, Slot) = Default::default();
        // Tensors are Send but not Sync; hooks must be both.
        let saved = Mutex::new((x2d.f_detach()?, w.f_detach()?));
        let (input_out, weight_out) = (input_slot.clone(), weight_slot.clone());
        let (x_kind, w_kind) = (x.kind(), w.kind());
        add_grad_hook(&product, move |grad| {
            let computed = (|| -> Result<()> {
                let _off = no_autocast(grad.device())?;
                let grad2d = grad.f_reshape([-1, features_out])?;
                let (x_saved, w_saved) = &*saved.locked();
                let (gi, gw) =
                    backward_values(&grad2d, x_saved, w_saved, spec, want_input, want_weight)?;
                if let Some(gi) = gi {
                    *input_out.locked() = Some(gi.f_to_kind(x_kind)?.f_reshape(shape.as_slice())?);
                }
                if let Some(gw) = gw {
                    *weight_out.locked() = Some(gw.f_to_kind(w_kind)?);
                }
                Ok(())
            })();
            if let Err(e) = computed {
                panic!("fp8 linear layer: backward matmuls failed: {e}");
            }
            None
        })?;
        if want_input {
            add_grad_hook(&x_link, move |_zeros| {
                Some(take(&input_slot).expect("fp8: no input gradient"))
            })?;
        }
        if want_weight {
            add_grad_hook(&w_link, move |_zeros| {
                Some(take(&weight_slot).expect("fp8: no weight gradient"))
            })?;
        }
        product
    } else {
        value
    };
    Ok(match bias {
        Some(b) => product.f_add(&b.f_to_kind(product.kind())?)?,
        None => product,
    })
}

/// The fp8 layers of a run in the order they were made (the accelerator's and the
/// tensor-parallel ones alike), for the module filter and its report.
#[derive(Debug)]
pub(crate) struct Fp8Layers {
    pub(crate) recipe: Fp8Recipe,
    layers: Mutex<Vec<Fp8Layer>>,
}

/// One layer as the module filter sees it.
#[derive(Debug, Clone)]
pub(crate) struct Fp8Layer {
    /// Its variables' path, e.g. `blocks.0.qkv`.
    pub(crate) path: String,
    /// [`crate::shim::tensor_id`] of its weight.
    pub(crate) weight: usize,
    /// Input and output features of this rank's weight.
    pub(crate) features: (i64, i64),
    /// On while its matmuls run in fp8.
    pub(crate) enabled: Arc<AtomicBool>,
}

impl Fp8Layers {
    pub(crate) fn new(recipe: Fp8Recipe) -> Self {
        Self { recipe, layers: Mutex::default() }
    }

    /// Registers a layer whose weight (`[out, in]`) is `weight`; returns its switch, on
    /// when `_scaled_mm` takes its shapes.
    pub(crate) fn register(
        &self,
        path: &tch::nn::Path,
        weight: &Tensor,
    ) -> Result<Arc<AtomicBool>> {
        let [features_out, features_in] = weight.size()[..] else {
            return Err(Error::Config(format!(
                "fp8 layer {}: the weight is not 2-D",
                path.path("")
            )));
        };
        let enabled = Arc::new(AtomicBool::new(shapes_suit(features_in, features_out)));
        let name = path.components().collect::<Vec<_>>().join(".");
        self.lock().push(Fp8Layer {
            path: name,
            weight: crate::shim::tensor_id(weight)?,
            features: (features_in, features_out),
            enabled: enabled.clone(),
        });
        Ok(enabled)
    }

    /// The registered layers whose weights are among `ids`, in the order they were made.
    pub(crate) fn among(&self, ids: &[usize]) -> Vec<Fp8Layer> {
        self.lock().iter().filter(|l| ids.contains(&l.weight)).cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Fp8Layer>> {
        self.layers.locked()
    }
}

/// A layer's fp8 recipe and the switch the module filter may turn off (`None`: the layer is
/// never fp8).
pub(crate) type Fp8Switch = Option<(Fp8Recipe, Arc<AtomicBool>)>;

/// The recipe a switch runs with now, if it is on.
fn active(fp8: &Fp8Switch) -> Option<Fp8Recipe> {
    fp8.as_ref().filter(|(_, on)| on.load(Ordering::Relaxed)).map(|(recipe, _)| *recipe)
}

/// `x @ wᵀ (+ b)`: in fp8 while the layer's switch is on, else exactly as `nn::Linear`.
pub(crate) fn switched_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    fp8: &Fp8Switch,
) -> Result<Tensor> {
    match active(fp8) {
        Some(recipe) => linear(x, w, bias, recipe),
        None => Ok(x.f_linear(w, bias)?),
    }
}

/// Whether `_scaled_mm` takes a layer of these features: both multiples of 16 (torchao's
/// and Accelerate's module filter).
pub fn shapes_suit(features_in: i64, features_out: i64) -> bool {
    features_in % 16 == 0 && features_out % 16 == 0
}

/// A linear layer whose matmuls run in fp8 when the run's precision is fp8 and the layer
/// qualifies, and exactly as `tch::nn::Linear` otherwise. Made by
/// [`Accelerator::linear`](crate::Accelerator::linear) (which `#[accelerate(precision =
/// "fp8")]` writes in place of `nn::linear`); its variables are `nn::linear`'s, initialised
/// the same way.
#[derive(Debug)]
pub struct Float8Linear {
    /// `[out, in]` weight, as `nn::Linear::ws`.
    pub ws: Tensor,
    /// Bias, as `nn::Linear::bs`.
    pub bs: Option<Tensor>,
    fp8: Fp8Switch,
}

impl Float8Linear {
    /// A layer over existing variables, in high precision throughout (as `nn::Linear`).
    pub fn plain(linear: tch::nn::Linear) -> Self {
        Self { ws: linear.ws, bs: linear.bs, fp8: None }
    }

    /// A layer over existing variables whose matmuls run with `recipe` while `enabled` is on.
    pub(crate) fn with_switch(
        linear: tch::nn::Linear,
        recipe: Fp8Recipe,
        enabled: Arc<AtomicBool>,
    ) -> Self {
        Self { ws: linear.ws, bs: linear.bs, fp8: Some((recipe, enabled)) }
    }

    /// The recipe its matmuls run with now, `None` when they run in high precision.
    pub fn fp8_recipe(&self) -> Option<Fp8Recipe> {
        active(&self.fp8)
    }

    /// The forward pass, with libtorch errors as `Err`.
    pub fn try_forward(&self, xs: &Tensor) -> Result<Tensor> {
        switched_linear(xs, &self.ws, self.bs.as_ref(), &self.fp8)
    }
}

impl Module for Float8Linear {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.try_forward(xs).unwrap_or_else(|e| panic!("{e}"))
    }
}

#[cfg(test)]
mod tests;
