//! The C ABI of `csrc/shim.cpp`. Everything here is unsafe; `super` wraps each function.
//!
//! Functions returning `*mut c_char` return NULL on success or a `malloc`'d message that
//! the caller must `free` (see [`super::check`]).

use std::ffi::{c_char, c_void};
use torch_sys::C_tensor;

/// c10's packed stream (`c10::Stream::pack3`) plus its native `cudaStream_t`, as the shim's
/// stream functions take and fill it (its methods are in `cuda_runtime`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    pub(super) id: i64,
    pub(super) device_index: i64,
    pub(super) device_type: i64,
    pub(super) native: *mut c_void,
}

// SAFETY: a stream is a handle that CUDA lets any host thread use; c10::Stream is a value
// type, and the native pointer is only handed to NCCL, which takes streams from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above; nothing mutates through a shared `Stream`.
unsafe impl Sync for Stream {}

/// A post-accumulate-grad callback: receives an owned `at::Tensor*` (the parameter).
pub(crate) type PostAccFn = unsafe extern "C" fn(*mut c_void, *mut C_tensor) -> *mut c_char;
/// A gradient callback: receives an owned `at::Tensor*` (the gradient) and may store an
/// owned replacement in the out-pointer.
pub(crate) type GradFn =
    unsafe extern "C" fn(*mut c_void, *mut C_tensor, *mut *mut C_tensor) -> *mut c_char;
/// Drops the closure behind a callback context.
pub(crate) type DropFn = unsafe extern "C" fn(*mut c_void);
/// A forward pass: receives an owned `at::Tensor*` (the input) and stores an owned output
/// in the out-pointer.
pub(crate) type ForwardFn =
    unsafe extern "C" fn(*mut c_void, *mut C_tensor, *mut *mut C_tensor) -> *mut c_char;

unsafe extern "C" {
    pub(crate) fn accel_torch_version() -> *const c_char;

    pub(crate) fn accel_add_post_acc_grad_hook(
        param: *mut C_tensor,
        f: PostAccFn,
        ctx: *mut c_void,
        drop: DropFn,
        id: *mut u64,
    ) -> *mut c_char;
    pub(crate) fn accel_remove_post_acc_grad_hook(
        param: *mut C_tensor,
        id: u64,
        removed: *mut bool,
    ) -> *mut c_char;

    pub(crate) fn accel_add_grad_hook(
        tensor: *mut C_tensor,
        f: GradFn,
        ctx: *mut c_void,
        drop: DropFn,
        handle: *mut u32,
    ) -> *mut c_char;
    pub(crate) fn accel_remove_grad_hook(tensor: *mut C_tensor, handle: u32) -> *mut c_char;

    pub(crate) fn accel_checkpoint(
        input: *mut C_tensor,
        f: ForwardFn,
        ctx: *mut c_void,
        drop: DropFn,
        output: *mut *mut C_tensor,
    ) -> *mut c_char;

    pub(crate) fn accel_linear_cross_entropy(
        x: *mut C_tensor,
        w: *mut C_tensor,
        targets: *mut C_tensor,
        ignore_index: i64,
        chunk: i64,
        loss: *mut *mut C_tensor,
    ) -> *mut c_char;

    pub(crate) fn accel_loss_with_gradient(
        value: *mut C_tensor,
        x: *mut C_tensor,
        grad_x: *mut C_tensor,
        loss: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub(crate) fn accel_grad_mode_enabled(enabled: *mut bool) -> *mut c_char;

    pub(crate) fn accel_set_grad(tensor: *mut C_tensor, grad: *mut C_tensor) -> *mut c_char;

    pub(crate) fn accel_autocast_enter(
        device_type: i32,
        dtype: i32,
        enabled: bool,
        prev_enabled: *mut bool,
        prev_dtype: *mut i32,
    ) -> *mut c_char;
    pub(crate) fn accel_autocast_exit(
        device_type: i32,
        prev_enabled: bool,
        prev_dtype: i32,
    ) -> *mut c_char;
    pub(crate) fn accel_autocast_state(
        device_type: i32,
        enabled: *mut bool,
        dtype: *mut i32,
    ) -> *mut c_char;

    pub(crate) fn accel_storage_nbytes(tensor: *mut C_tensor, nbytes: *mut u64) -> *mut c_char;
    pub(crate) fn accel_is_pinned(tensor: *mut C_tensor, pinned: *mut bool) -> *mut c_char;
    pub(crate) fn accel_released(
        device_like: *mut C_tensor,
        shape_like: *mut C_tensor,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub(crate) fn accel_pin_memory(
        tensor: *mut C_tensor,
        pinned: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub(crate) fn accel_tensor_impl(tensor: *mut C_tensor, id: *mut usize) -> *mut c_char;
    pub(crate) fn accel_storage_free(tensor: *mut C_tensor) -> *mut c_char;
    pub(crate) fn accel_storage_allocate(tensor: *mut C_tensor, nbytes: u64) -> *mut c_char;
    pub(crate) fn accel_storage_move(from: *mut C_tensor, to: *mut C_tensor) -> *mut c_char;
    pub(crate) fn accel_storage_sole_owner(tensor: *mut C_tensor, sole: *mut bool) -> *mut c_char;
    pub(crate) fn accel_storage_set_message(
        tensor: *mut C_tensor,
        message: *const c_char,
    ) -> *mut c_char;
    pub(crate) fn accel_storage_guarded(tensor: *mut C_tensor, guarded: *mut bool) -> *mut c_char;

    pub(crate) fn accel_set_cuda_device(device_index: i32) -> *mut c_char;

    pub(crate) fn accel_stream_current(device_index: i32, out: *mut Stream) -> *mut c_char;
    pub(crate) fn accel_stream_from_pool(
        device_index: i32,
        high_priority: bool,
        out: *mut Stream,
    ) -> *mut c_char;
    pub(crate) fn accel_stream_exchange(
        stream: *const Stream,
        previous: *mut Stream,
    ) -> *mut c_char;
    pub(crate) fn accel_stream_synchronize(stream: *const Stream) -> *mut c_char;
    pub(crate) fn accel_event_new(event: *mut *mut c_void) -> *mut c_char;
    pub(crate) fn accel_event_free(event: *mut c_void);
    pub(crate) fn accel_event_record(event: *mut c_void, stream: *const Stream) -> *mut c_char;
    pub(crate) fn accel_event_block(event: *mut c_void, stream: *const Stream) -> *mut c_char;
    pub(crate) fn accel_event_query(event: *mut c_void, done: *mut bool) -> *mut c_char;
    pub(crate) fn accel_event_synchronize(event: *mut c_void) -> *mut c_char;
    pub(crate) fn accel_record_stream(tensor: *mut C_tensor, stream: *const Stream) -> *mut c_char;
    pub(crate) fn accel_cuda_max_memory_allocated(
        device_index: i32,
        bytes: *mut u64,
    ) -> *mut c_char;
    pub(crate) fn accel_cuda_reset_peak_memory(device_index: i32) -> *mut c_char;
    pub(crate) fn accel_cuda_empty_cache() -> *mut c_char;

    pub(crate) fn accel_set_onednn_enabled(enabled: bool, previous: *mut bool) -> *mut c_char;

    pub(crate) fn accel_profiler_start(
        cuda: bool,
        record_shapes: bool,
        profile_memory: bool,
        with_stack: bool,
    ) -> *mut c_char;
    pub(crate) fn accel_profiler_stop(path: *const c_char) -> *mut c_char;
    pub(crate) fn accel_profiler_follow_main() -> *mut c_char;
    pub(crate) fn accel_range_begin(name: *const c_char, range: *mut *mut c_void) -> *mut c_char;
    pub(crate) fn accel_range_end(range: *mut c_void);
    pub(crate) fn accel_recording() -> bool;

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn accel_fused_adam(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        maximize: bool,
        decoupled: bool,
    ) -> *mut c_char;

    pub(crate) fn accel_fused_sgd(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        buffers: *const *mut C_tensor,
        n: usize,
        n_buffers: usize,
        weight_decay: f64,
        momentum: f64,
        lr: f64,
        dampening: f64,
        nesterov: bool,
        maximize: bool,
        is_first_step: bool,
    ) -> *mut c_char;

    pub(crate) fn accel_amp_unscale(
        grads: *const *mut C_tensor,
        n: usize,
        found_inf: *mut C_tensor,
        inv_scale: *mut C_tensor,
    ) -> *mut c_char;

    pub(crate) fn accel_rng_get_state(
        device_type: i32,
        device_index: i32,
        state: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub(crate) fn accel_rng_set_state(
        device_type: i32,
        device_index: i32,
        state: *mut C_tensor,
    ) -> *mut c_char;
    pub(crate) fn accel_rng_initial_seed(seed: *mut u64) -> *mut c_char;
    pub(crate) fn accel_tensor_version(tensor: *mut C_tensor, version: *mut i64) -> *mut c_char;
}
