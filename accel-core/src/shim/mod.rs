//! Safe wrappers over the libtorch shim in `csrc/shim.cpp`: what tch does not expose.
//!
//! - [`add_post_accumulate_grad_hook`] and [`add_grad_hook`]: autograd hooks (DDP buckets
//!   and ZeRO reduce-scatter are launched from them);
//! - [`set_grad`]: assign or clear `.grad`;
//! - [`autocast`]: CPU/CUDA autocast with a chosen dtype, as a guard;
//! - [`free_storage`] / [`allocate_storage`] / [`move_storage`]: release, re-create or hand
//!   over a tensor's memory while its views stay valid objects (ZeRO-3 parameters between
//!   uses);
//! - [`cuda_runtime`]: CUDA streams and events, `record_stream`, peak memory (what the NCCL
//!   communicator orders its work with);
//! - [`fused_adamw`], [`fused_adam`], [`fused_sgd`]: ATen's fused optimizer kernels;
//! - [`amp_unscale`]: GradScaler's fused inf/NaN check and unscale;
//! - [`rng_state`] / [`set_rng_state`]: the default generators' states, for checkpoints.

mod autocast;
pub mod cuda_runtime;
mod ffi;
mod hooks;

use std::ffi::{CStr, c_char};

use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

use crate::error::{Error, Result};

pub use autocast::{AutocastGuard, autocast, autocast_state};
pub use hooks::{
    GradHook, PostAccumulateGradHook, add_grad_hook, add_post_accumulate_grad_hook, checkpoint,
};

/// Turns a shim result (NULL, or a malloc'd message) into a `Result`.
fn check(message: *mut c_char, op: &'static str) -> Result<()> {
    if message.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null result is a NUL-terminated string from malloc, owned by us now.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    // SAFETY: allocated with malloc by the shim (or by `malloc_message`), freed once here.
    unsafe { libc::free(message.cast()) };
    Err(Error::Libtorch { op, message: text })
}

/// Copies `text` into a malloc'd C string, which the shim frees.
fn malloc_message(text: &str) -> *mut c_char {
    let bytes = text.replace('\0', " ");
    // SAFETY: plain allocation; a NULL result is handled by the shim as "no message".
    let out = unsafe { libc::malloc(bytes.len() + 1) }.cast::<u8>();
    if !out.is_null() {
        // SAFETY: `out` has room for len + 1 bytes and does not overlap `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, bytes.len());
            *out.add(bytes.len()) = 0;
        }
    }
    out.cast()
}

/// The shim takes tensors as `at::Tensor*`; libtorch mutates only the shared TensorImpl
/// behind it (as every tch call taking `&self` does), never the handle itself.
fn raw(tensor: &Tensor) -> *mut C_tensor {
    tensor.as_ptr().cast_mut()
}

/// The libtorch version the shim was compiled against (`TORCH_VERSION`, e.g. "2.11.0").
pub fn torch_version() -> &'static str {
    // SAFETY: returns a pointer to a static NUL-terminated string literal.
    unsafe { CStr::from_ptr(ffi::accel_torch_version()) }.to_str().unwrap_or("unknown")
}

/// Sets `tensor.grad` to `grad` (which must have the tensor's shape), or clears it
/// (`None`, as `zero_grad(set_to_none=True)`).
pub fn set_grad(tensor: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    let grad = grad.map_or(std::ptr::null_mut(), raw);
    // SAFETY: both pointers are live tensors for the duration of the call (or grad is NULL).
    check(unsafe { ffi::accel_set_grad(raw(tensor), grad) }, "set_grad")
}

/// Whether `tensor` lives in page-locked host memory (`Tensor.is_pinned()`; tch's
/// `is_pinned(device)` passes the argument torch 2.11 deprecates, with a warning each call).
pub fn is_pinned(tensor: &Tensor) -> Result<bool> {
    let mut pinned = false;
    // SAFETY: live tensor; out-pointer to a local.
    check(unsafe { ffi::accel_is_pinned(raw(tensor), &mut pinned) }, "is_pinned")?;
    Ok(pinned)
}

/// A copy of the CPU tensor `tensor` in page-locked host memory (`Tensor.pin_memory()`), for
/// asynchronous copies to the GPU; an error without one.
pub fn pin_memory(tensor: &Tensor) -> Result<Tensor> {
    let mut pinned = std::ptr::null_mut();
    // SAFETY: live tensor; out-pointer to a local, holding a fresh `new at::Tensor` on success.
    check(unsafe { ffi::accel_pin_memory(raw(tensor), &mut pinned) }, "pin_memory")?;
    // SAFETY: the shim handed us ownership of a valid at::Tensor.
    Ok(unsafe { Tensor::from_ptr(pinned) })
}

/// A tensor of `shape_like`'s sizes, with `device_like`'s dtype and device, whose storage
/// holds no memory (as after [`free_storage`]): a parameter placed on a device released,
/// without ever being whole there. A read of it fails until [`allocate_storage`].
pub fn released(device_like: &Tensor, shape_like: &Tensor) -> Result<Tensor> {
    let mut out = std::ptr::null_mut();
    // SAFETY: live tensors; out-pointer to a local, holding a fresh `new at::Tensor` on success.
    check(unsafe { ffi::accel_released(raw(device_like), raw(shape_like), &mut out) }, "released")?;
    // SAFETY: the shim handed us ownership of a valid at::Tensor.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Bytes held by the storage behind `tensor` (0 after [`free_storage`]).
pub fn storage_nbytes(tensor: &Tensor) -> Result<u64> {
    let mut nbytes = 0;
    // SAFETY: live tensor; out-pointer to a local.
    check(unsafe { ffi::accel_storage_nbytes(raw(tensor), &mut nbytes) }, "storage_nbytes")?;
    Ok(nbytes)
}

/// Identifies the tensor behind a handle: equal for shallow clones of one tensor (a
/// parameter and the optimizer's copy of its handle), even while its storage is freed.
pub fn tensor_id(tensor: &Tensor) -> Result<usize> {
    let mut id = 0;
    // SAFETY: live tensor; out-pointer to a local.
    check(unsafe { ffi::accel_tensor_impl(raw(tensor), &mut id) }, "tensor_id")?;
    Ok(id)
}

/// Releases the memory of the storage behind `tensor`. The tensor and every view of the
/// same storage stay valid objects (autograd keeps seeing the same parameters), and
/// [`allocate_storage`] gives them memory again. In between, every read or write of the
/// storage's data fails with an error (see [`set_released_message`]) instead of touching
/// memory that is not there.
///
/// # Safety
/// Other tensors on the same storage lose its values too: the caller must own it, or know
/// that every holder of it expects the release.
pub unsafe fn free_storage(tensor: &Tensor) -> Result<()> {
    // SAFETY: live tensor; the caller upholds the no-access contract above.
    check(unsafe { ffi::accel_storage_free(raw(tensor)) }, "free_storage")
}

/// The mean cross-entropy of the logits `x · wᵀ` (`x` `[N, d]`, `w` `[V, d]`) against
/// `targets` `[N]`, rows whose target is `ignore_index` left out, `chunk` rows at a time: the
/// N × V logits never exist whole. The gradients are computed chunk by chunk in forward and
/// kept for backward (`w`'s summed into one tensor). Under autocast the products run in its
/// dtype; the loss is fp32. See [`crate::nn::linear_cross_entropy`].
pub fn linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
    chunk: i64,
) -> Result<Tensor> {
    let mut loss: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: live tensors; on success the shim stores a fresh `new at::Tensor` we own.
    let message = unsafe {
        ffi::accel_linear_cross_entropy(
            raw(x),
            raw(w),
            raw(targets),
            ignore_index,
            chunk,
            &mut loss,
        )
    };
    check(message, "linear_cross_entropy")?;
    // SAFETY: see above.
    Ok(unsafe { Tensor::from_ptr(loss) })
}

/// `value`, a loss computed without autograd, as a tensor whose backward hands `grad_x`
/// (computed with it, for an incoming gradient of 1) to `x`, scaled by the gradient that
/// comes. Part of the graph whenever grad mode is on, so that hooks on it run in backward,
/// even when `x` needs no gradient (`grad_x` is then not kept).
pub fn loss_with_gradient(value: &Tensor, x: &Tensor, grad_x: Option<&Tensor>) -> Result<Tensor> {
    let mut loss: *mut C_tensor = std::ptr::null_mut();
    let grad_x = grad_x.map_or(std::ptr::null_mut(), raw);
    // SAFETY: live tensors (or NULL for none); on success the shim stores a fresh
    // `new at::Tensor` we own.
    let message = unsafe { ffi::accel_loss_with_gradient(raw(value), raw(x), grad_x, &mut loss) };
    check(message, "loss_with_gradient")?;
    // SAFETY: see above.
    Ok(unsafe { Tensor::from_ptr(loss) })
}

/// Whether autograd records operations on this thread (not under `no_grad`).
pub fn grad_mode_enabled() -> Result<bool> {
    let mut enabled = false;
    // SAFETY: an out-pointer to a local.
    check(unsafe { ffi::accel_grad_mode_enabled(&mut enabled) }, "grad_mode_enabled")?;
    Ok(enabled)
}

/// Rows of logits computed at once by [`crate::nn::linear_cross_entropy`]: about 32 MiB of
/// fp32 logits for a vocabulary of `vocab` entries.
pub fn cross_entropy_chunk(vocab: i64) -> i64 {
    ((1i64 << 23) / vocab.max(1)).max(1)
}

/// [`linear_cross_entropy`] in chunks of [`cross_entropy_chunk`] rows for `w`'s vocabulary
/// (`crate::nn::linear_cross_entropy`; here for the strategies, which the layers build on).
pub fn linear_cross_entropy_in_chunks(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Tensor> {
    let chunk = cross_entropy_chunk(w.size().first().copied().unwrap_or(1));
    linear_cross_entropy(x, w, targets, ignore_index, chunk)
}

/// Gives the storage behind `tensor` fresh memory of `nbytes` bytes from its own allocator
/// (CPU or CUDA caching allocator). The contents are unspecified until written.
pub fn allocate_storage(tensor: &Tensor, nbytes: u64) -> Result<()> {
    // SAFETY: live tensor; the new DataPtr is owned by the storage.
    check(unsafe { ffi::accel_storage_allocate(raw(tensor), nbytes) }, "allocate_storage")
}

/// Moves the memory of `from`'s storage into `to`'s storage, which must hold none (a
/// released tensor, or a new one of 0 elements): `to` and its views then read it, and
/// `from`'s storage holds none, as after [`free_storage`].
///
/// # Safety
/// As for [`free_storage`] of `from`.
pub unsafe fn move_storage(from: &Tensor, to: &Tensor) -> Result<()> {
    // SAFETY: live tensors; the caller upholds the no-access contract above.
    check(unsafe { ffi::accel_storage_move(raw(from), raw(to)) }, "move_storage")
}

/// Sets what a read of `tensor`'s storage says while it is released (after
/// [`free_storage`], [`move_storage`] from it, or made by [`released`]): every such read
/// fails with this message, instead of touching memory that is not there.
pub fn set_released_message(tensor: &Tensor, message: &str) -> Result<()> {
    let message = std::ffi::CString::new(message.replace('\0', " ")).expect("no NUL left");
    // SAFETY: live tensor; the C string outlives the call (the shim copies it).
    check(
        unsafe { ffi::accel_storage_set_message(raw(tensor), message.as_ptr()) },
        "set_released_message",
    )
}

/// Whether `tensor`'s storage is released: a read of its data fails (with the message of
/// [`set_released_message`]) until it is given memory again.
pub fn is_released(tensor: &Tensor) -> Result<bool> {
    let mut guarded = false;
    // SAFETY: live tensor; out-pointer to a local.
    check(unsafe { ffi::accel_storage_guarded(raw(tensor), &mut guarded) }, "is_released")?;
    Ok(guarded)
}

/// Whether `tensor` is the only handle on its tensor and the only tensor on its storage: no
/// view or other handle could read its memory.
pub fn sole_owner(tensor: &Tensor) -> Result<bool> {
    let mut sole = false;
    // SAFETY: live tensor; out-pointer to a local.
    check(unsafe { ffi::accel_storage_sole_owner(raw(tensor), &mut sole) }, "sole_owner")?;
    Ok(sole)
}

/// Runs `f` with libtorch's use of oneDNN turned off (`torch.backends.mkldnn.flags(
/// enabled=False)`), then puts the setting back. On CPUs with AMX, libtorch's CPU
/// `_scaled_mm` hands fp8 products to oneDNN's reference kernel, hundreds of times slower
/// than its own path, which gives the same values; fp8 layers on CPU go around it.
pub fn without_onednn<T>(f: impl FnOnce() -> T) -> Result<T> {
    let mut previous = true;
    // SAFETY: out-pointer to a local; the shim catches every C++ exception.
    check(unsafe { ffi::accel_set_onednn_enabled(false, &mut previous) }, "set_onednn_enabled")?;
    let out = f();
    let mut ignored = false;
    // SAFETY: as above.
    check(unsafe { ffi::accel_set_onednn_enabled(previous, &mut ignored) }, "set_onednn_enabled")?;
    Ok(out)
}

/// Starts libtorch's profiler (Kineto) on this thread: CPU operators, and CUDA kernels with
/// `cuda`; the other flags as `torch.profiler.profile`'s.
pub fn profiler_start(
    cuda: bool,
    record_shapes: bool,
    profile_memory: bool,
    with_stack: bool,
) -> Result<()> {
    // SAFETY: plain call; the shim catches every C++ exception.
    let status =
        unsafe { ffi::accel_profiler_start(cuda, record_shapes, profile_memory, with_stack) };
    check(status, "profiler_start")
}

/// Stops the profiler and writes its Chrome trace to `path`.
pub fn profiler_stop(path: &std::path::Path) -> Result<()> {
    let c = std::ffi::CString::new(path.to_string_lossy().into_owned()).map_err(|_| {
        Error::Libtorch {
            op: "profiler_stop",
            message: format!("{} contains a NUL byte", path.display()),
        }
    })?;
    // SAFETY: a NUL-terminated path alive for the call.
    check(unsafe { ffi::accel_profiler_stop(c.as_ptr()) }, "profiler_stop")
}

/// Joins this (worker) thread to the profiler the main thread runs, or leaves it when that
/// stopped; cheap when nothing changed.
pub fn profiler_follow_main() {
    // SAFETY: plain call; a failure only means this thread's ranges are not recorded.
    let _ = check(unsafe { ffi::accel_profiler_follow_main() }, "profiler_follow_main");
}

/// A named range in the profiler's trace until dropped (`torch.profiler.record_function`);
/// nothing is allocated when no profiler records.
#[derive(Debug)]
pub struct Range(*mut std::ffi::c_void);

/// Whether a profiler records ranges on this thread now (so that a range's name need not
/// be made otherwise).
pub fn recording() -> bool {
    // SAFETY: plain query.
    unsafe { ffi::accel_recording() }
}

/// Opens a [`Range`] named `name` (nothing, and no allocation, when nothing records).
pub fn range(name: &str) -> Range {
    if !recording() {
        return Range(std::ptr::null_mut());
    }
    let Ok(c) = std::ffi::CString::new(name) else { return Range(std::ptr::null_mut()) };
    let mut ptr = std::ptr::null_mut();
    // SAFETY: NUL-terminated name alive for the call (the shim copies it); out-pointer to a
    // local. A failure leaves no range.
    if check(unsafe { ffi::accel_range_begin(c.as_ptr(), &mut ptr) }, "range_begin").is_err() {
        ptr = std::ptr::null_mut();
    }
    Range(ptr)
}

impl Drop for Range {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: made by accel_range_begin on this thread, ended once.
            unsafe { ffi::accel_range_end(self.0) }
        }
    }
}

/// Makes `cuda:{device_index}` the current CUDA device of this thread (as
/// `torch.cuda.set_device`).
pub fn set_cuda_device(device_index: usize) -> Result<()> {
    // SAFETY: plain call; the shim catches every C++ exception.
    check(unsafe { ffi::accel_set_cuda_device(device_index as i32) }, "set_cuda_device")
}

/// Hyper-parameters of one AdamW step (torch.optim.AdamW's names and meaning).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first-moment average.
    pub beta1: f64,
    /// Decay of the second-moment average.
    pub beta2: f64,
    /// Decoupled weight decay (multiplies `lr * param`).
    pub weight_decay: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// Maximise the objective instead of minimising it.
    pub maximize: bool,
}

/// One AdamW step with ATen's fused kernel (`torch._fused_adamw_`) over parameters, their
/// gradients, both moment buffers and float step counters (one-element tensors), all
/// updated in place. As in `torch.optim.AdamW(fused=True)`, the counters must already
/// count this step.
pub fn fused_adamw(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[Tensor],
    hp: AdamWStep,
) -> Result<()> {
    fused_adam_any(params, grads, exp_avgs, exp_avg_sqs, steps, hp, true)
}

/// [`fused_adamw`] for Adam (`torch._fused_adam_`): `weight_decay` is an L2 penalty added to
/// the gradient, as `torch.optim.Adam(fused=True)` applies it.
pub fn fused_adam(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[Tensor],
    hp: AdamWStep,
) -> Result<()> {
    fused_adam_any(params, grads, exp_avgs, exp_avg_sqs, steps, hp, false)
}

fn fused_adam_any(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[Tensor],
    hp: AdamWStep,
    decoupled: bool,
) -> Result<()> {
    let op = if decoupled { "fused_adamw" } else { "fused_adam" };
    let n = params.len();
    if [grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()].iter().any(|&l| l != n) {
        return Err(Error::Libtorch {
            op,
            message: format!(
                "list lengths differ: {n} params, {} grads, {} exp_avgs, {} exp_avg_sqs, {} steps",
                grads.len(),
                exp_avgs.len(),
                exp_avg_sqs.len(),
                steps.len()
            ),
        });
    }
    let ptrs = |ts: &[Tensor]| ts.iter().map(raw).collect::<Vec<_>>();
    let (p, g, m, v, s) =
        (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs), ptrs(steps));
    // In-place updates of leaves that require grad are only allowed outside autograd.
    tch::no_grad(|| {
        // SAFETY: five arrays of n live tensor pointers, alive for the call.
        let message = unsafe {
            ffi::accel_fused_adam(
                p.as_ptr(),
                g.as_ptr(),
                m.as_ptr(),
                v.as_ptr(),
                s.as_ptr(),
                n,
                hp.lr,
                hp.beta1,
                hp.beta2,
                hp.weight_decay,
                hp.eps,
                hp.maximize,
                decoupled,
            )
        };
        check(message, op)
    })
}

/// SGD's hyper-parameters for one fused step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: no buffers).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Maximise the objective instead.
    pub maximize: bool,
}

/// One SGD step with ATen's fused kernel (`torch._fused_sgd_`) over parameters and their
/// gradients, updated in place. With momentum, `buffers` (one per parameter) are updated in
/// place too; `first_step` says they were just made (`empty_like`), and the kernel sets them
/// as torch's SGD creates them. Without momentum, `buffers` is empty.
pub fn fused_sgd(
    params: &[Tensor],
    grads: &[Tensor],
    buffers: &[Tensor],
    hp: SgdStep,
    first_step: bool,
) -> Result<()> {
    let n = params.len();
    let expected_buffers = if hp.momentum != 0.0 { n } else { 0 };
    if grads.len() != n || buffers.len() != expected_buffers {
        return Err(Error::Libtorch {
            op: "fused_sgd",
            message: format!(
                "{n} params, {} grads, {} momentum buffers (expected {expected_buffers})",
                grads.len(),
                buffers.len()
            ),
        });
    }
    let ptrs = |ts: &[Tensor]| ts.iter().map(raw).collect::<Vec<_>>();
    let (p, g, b) = (ptrs(params), ptrs(grads), ptrs(buffers));
    tch::no_grad(|| {
        // SAFETY: arrays of n (and n_buffers) live tensor pointers, alive for the call.
        let message = unsafe {
            ffi::accel_fused_sgd(
                p.as_ptr(),
                g.as_ptr(),
                b.as_ptr(),
                n,
                b.len(),
                hp.weight_decay,
                hp.momentum,
                hp.lr,
                hp.dampening,
                hp.nesterov,
                hp.maximize,
                first_step,
            )
        };
        check(message, "fused_sgd")
    })
}

/// Multiplies every gradient by `inv_scale` (a one-element f32 tensor) in place and sets
/// `found_inf` (one-element f32, zero on entry) to 1.0 if any holds an inf or NaN:
/// `torch._amp_foreach_non_finite_check_and_unscale_`, as GradScaler.unscale_ runs it.
pub fn amp_unscale(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    let ptrs: Vec<_> = grads.iter().map(raw).collect();
    // SAFETY: an array of live tensor pointers and two live tensors, alive for the call.
    let message = unsafe {
        ffi::accel_amp_unscale(ptrs.as_ptr(), ptrs.len(), raw(found_inf), raw(inv_scale))
    };
    check(message, "amp_unscale")
}

/// The state of `device`'s default random generator (a byte tensor), as
/// `torch.get_rng_state()` / `torch.cuda.get_rng_state(i)` give it.
pub fn rng_state(device: Device) -> Result<Tensor> {
    let (device_type, index) = generator_device(device)?;
    let mut state = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; on success it holds a fresh `new at::Tensor`.
    check(unsafe { ffi::accel_rng_get_state(device_type, index, &mut state) }, "rng_state")?;
    // SAFETY: the shim handed us ownership of a valid at::Tensor.
    Ok(unsafe { Tensor::from_ptr(state) })
}

/// Restores a state from [`rng_state`] into `device`'s default generator.
pub fn set_rng_state(device: Device, state: &Tensor) -> Result<()> {
    let (device_type, index) = generator_device(device)?;
    // SAFETY: live tensor; the generator copies the state.
    check(unsafe { ffi::accel_rng_set_state(device_type, index, raw(state)) }, "set_rng_state")
}

/// The seed the CPU generator was last seeded with (`torch.initial_seed()`): what
/// `tch::manual_seed` set, or torch's default.
pub fn initial_seed() -> Result<u64> {
    let mut seed = 0u64;
    // SAFETY: out-pointer to a local.
    check(unsafe { ffi::accel_rng_initial_seed(&mut seed) }, "initial_seed")?;
    Ok(seed)
}

/// A tensor's version counter (`tensor._version`): every in-place update advances it.
pub fn tensor_version(tensor: &Tensor) -> Result<i64> {
    let mut version = 0i64;
    // SAFETY: a live tensor and an out-pointer to a local.
    check(unsafe { ffi::accel_tensor_version(raw(tensor), &mut version) }, "tensor_version")?;
    Ok(version)
}

fn generator_device(device: Device) -> Result<(i32, i32)> {
    match device {
        Device::Cpu => Ok((0, -1)),
        Device::Cuda(i) => Ok((1, i as i32)),
        other => Err(Error::Libtorch {
            op: "rng_state",
            message: format!("random generator state is supported on CPU and CUDA, not {other:?}"),
        }),
    }
}

/// libtorch's `c10::DeviceType` code for the devices autocast knows.
fn device_type_code(device: Device) -> Result<i32> {
    match device {
        Device::Cpu => Ok(0),
        Device::Cuda(_) => Ok(1),
        other => Err(Error::Libtorch {
            op: "autocast",
            message: format!("autocast is supported on CPU and CUDA, not {other:?}"),
        }),
    }
}

/// libtorch's `c10::ScalarType` code for the floating-point kinds (tch keeps its own
/// mapping private; the values are fixed by c10/core/ScalarType.h).
fn scalar_type_code(kind: Kind) -> Result<i32> {
    match kind {
        Kind::Half => Ok(5),
        Kind::Float => Ok(6),
        Kind::Double => Ok(7),
        Kind::BFloat16 => Ok(15),
        other => Err(Error::Libtorch {
            op: "autocast",
            message: format!("autocast casts to a floating-point kind, not {other:?}"),
        }),
    }
}

fn kind_from_scalar_type_code(code: i32) -> Option<Kind> {
    match code {
        5 => Some(Kind::Half),
        6 => Some(Kind::Float),
        7 => Some(Kind::Double),
        15 => Some(Kind::BFloat16),
        _ => None,
    }
}

/// The text of a caught panic payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests;
