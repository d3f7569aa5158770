//! Autograd hooks backed by Rust closures.
//!
//! Hooks run on autograd's threads, hence `Send + Sync`. A panic inside a closure is
//! caught before it reaches C++ (unwinding across FFI is undefined behaviour); the hook
//! then raises a C++ error, which autograd re-raises from `backward()`, so the training
//! thread gets `Err` from `Tensor::f_backward` naming the hook and the panic.

use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use tch::Tensor;
use torch_sys::C_tensor;

use super::{check, ffi, malloc_message, panic_message, raw};
use crate::error::Result;
use crate::sync::Locked;

type PostAccClosure = Box<dyn Fn(&Tensor) + Send + Sync>;
type GradClosure = Box<dyn Fn(&Tensor) -> Option<Tensor> + Send + Sync>;
/// Called by one thread at a time (the forward's, then autograd's in backward): the mutex
/// makes a `Send` closure shareable.
type ForwardClosure = std::sync::Mutex<Box<dyn Fn(&Tensor) -> Tensor + Send>>;

/// A post-accumulate-grad hook on a parameter; [`remove`](Self::remove) takes it off.
/// Dropping the handle leaves the hook in place (as torch's `RemovableHandle`).
#[derive(Debug)]
///
/// Dropping the handle removes the hook: a model keeps no hook of an accelerator that is
/// gone (a second `#[accelerate]` run over the same model must not run the first run's DDP).
pub struct PostAccumulateGradHook {
    param: Tensor,
    id: u64,
    removed: bool,
}

impl PostAccumulateGradHook {
    /// Removes the hook; returns whether it was still registered.
    pub fn remove(mut self) -> Result<bool> {
        self.take_off()
    }

    fn take_off(&mut self) -> Result<bool> {
        if std::mem::replace(&mut self.removed, true) {
            return Ok(false);
        }
        let mut removed = false;
        // SAFETY: live tensor; out-pointer to a local.
        let message = unsafe {
            ffi::accel_remove_post_acc_grad_hook(raw(&self.param), self.id, &mut removed)
        };
        check(message, "remove_post_accumulate_grad_hook")?;
        Ok(removed)
    }
}

impl Drop for PostAccumulateGradHook {
    fn drop(&mut self) {
        let _ = self.take_off();
    }
}

/// Calls `hook(param)` each time a gradient has been accumulated into `param.grad` during
/// backward (torch's `register_post_accumulate_grad_hook`): once per parameter per
/// backward, in the order autograd finishes them, which is the reverse of their use in the
/// forward pass. `param` must be a leaf that requires grad.
pub fn add_post_accumulate_grad_hook(
    param: &Tensor,
    hook: impl Fn(&Tensor) + Send + Sync + 'static,
) -> Result<PostAccumulateGradHook> {
    let ctx = Box::into_raw(Box::new(Box::new(hook) as PostAccClosure)).cast::<c_void>();
    let mut id = 0;
    // SAFETY: ownership of `ctx` passes to the shim, which calls `drop_post_acc` exactly
    // once (on failure right away, else when the hook is removed or the tensor dies).
    let message = unsafe {
        ffi::accel_add_post_acc_grad_hook(
            raw(param),
            post_acc_trampoline,
            ctx,
            drop_post_acc,
            &mut id,
        )
    };
    check(message, "add_post_accumulate_grad_hook")?;
    Ok(PostAccumulateGradHook { param: param.shallow_clone(), id, removed: false })
}

/// A gradient hook on a tensor; [`remove`](Self::remove) takes it off.
#[derive(Debug)]
pub struct GradHook {
    tensor: Tensor,
    handle: u32,
}

impl GradHook {
    /// Removes the hook.
    pub fn remove(self) -> Result<()> {
        // SAFETY: live tensor; the handle came from `accel_add_grad_hook` on it.
        check(
            unsafe { ffi::accel_remove_grad_hook(raw(&self.tensor), self.handle) },
            "remove_grad_hook",
        )
    }
}

/// Calls `hook(grad)` when the gradient of `tensor` has been computed, before it is
/// accumulated (torch's `Tensor.register_hook`). Returning `Some(t)` replaces the gradient
/// with `t`; `None` keeps it.
pub fn add_grad_hook(
    tensor: &Tensor,
    hook: impl Fn(&Tensor) -> Option<Tensor> + Send + Sync + 'static,
) -> Result<GradHook> {
    let ctx = Box::into_raw(Box::new(Box::new(hook) as GradClosure)).cast::<c_void>();
    let mut handle = 0;
    // SAFETY: as in `add_post_accumulate_grad_hook`; `drop_grad` runs exactly once.
    let message = unsafe {
        ffi::accel_add_grad_hook(raw(tensor), grad_trampoline, ctx, drop_grad, &mut handle)
    };
    check(message, "add_grad_hook")?;
    Ok(GradHook { tensor: tensor.shallow_clone(), handle })
}

unsafe extern "C" fn post_acc_trampoline(ctx: *mut c_void, param: *mut C_tensor) -> *mut c_char {
    // SAFETY: the shim passes a fresh `new at::Tensor`, which we own and drop.
    let param = unsafe { Tensor::from_ptr(param) };
    // SAFETY: `ctx` came from `Box::into_raw` in `add_post_accumulate_grad_hook` and lives
    // until `drop_post_acc`, which the shim only calls after the last invocation.
    let hook = unsafe { &*ctx.cast::<PostAccClosure>() };
    match catch_unwind(AssertUnwindSafe(|| hook(&param))) {
        Ok(()) => std::ptr::null_mut(),
        Err(payload) => malloc_message(&format!(
            "a post-accumulate-grad hook panicked: {}",
            panic_message(payload.as_ref())
        )),
    }
}

unsafe extern "C" fn grad_trampoline(
    ctx: *mut c_void,
    grad: *mut C_tensor,
    replacement: *mut *mut C_tensor,
) -> *mut c_char {
    // SAFETY: as in `post_acc_trampoline`.
    let grad = unsafe { Tensor::from_ptr(grad) };
    // SAFETY: as in `post_acc_trampoline`.
    let hook = unsafe { &*ctx.cast::<GradClosure>() };
    match catch_unwind(AssertUnwindSafe(|| hook(&grad))) {
        Ok(None) => std::ptr::null_mut(),
        Ok(Some(mut new_grad)) => {
            // Ownership of the at::Tensor passes to the shim, which deletes it.
            // SAFETY: `replacement` is a valid out-pointer for the duration of the call.
            unsafe { *replacement = new_grad.as_mut_ptr() };
            std::mem::forget(new_grad);
            std::ptr::null_mut()
        }
        Err(payload) => malloc_message(&format!(
            "a gradient hook panicked: {}",
            panic_message(payload.as_ref())
        )),
    }
}

unsafe extern "C" fn drop_post_acc(ctx: *mut c_void) {
    // SAFETY: called once by the shim with the pointer from `Box::into_raw`.
    drop(unsafe { Box::from_raw(ctx.cast::<PostAccClosure>()) });
}

unsafe extern "C" fn drop_grad(ctx: *mut c_void) {
    // SAFETY: called once by the shim with the pointer from `Box::into_raw`.
    drop(unsafe { Box::from_raw(ctx.cast::<GradClosure>()) });
}

/// Activation checkpointing (torch's `checkpoint`, reentrant form): runs `forward(input)`
/// without keeping its activations, and returns its output with a backward that runs
/// `forward` again — with the random generators (CPU and the input's device) and the
/// autocast settings of the first run, so dropout masks and casts are the same — and then
/// backward through it: the module's parameters get their gradients, the input its own.
/// Memory: the input is kept; everything `forward` computes is recomputed in backward.
/// With gradients off it is a plain forward pass.
///
/// `forward` must compute the same thing each time from its input and the parameters it
/// reads (it runs on autograd's thread in backward, hence `Send + 'static`).
pub fn checkpoint(
    input: &Tensor,
    forward: impl Fn(&Tensor) -> Tensor + Send + 'static,
) -> Result<Tensor> {
    let forward: ForwardClosure = std::sync::Mutex::new(Box::new(forward));
    let ctx = Box::into_raw(Box::new(forward)).cast::<c_void>();
    let mut output: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: as in `add_grad_hook`: the shim owns `ctx` from here and calls
    // `drop_forward` exactly once; `output` receives an owned tensor on success.
    let message = unsafe {
        ffi::accel_checkpoint(raw(input), forward_trampoline, ctx, drop_forward, &mut output)
    };
    check(message, "checkpoint")?;
    // SAFETY: on success the shim stored a fresh `new at::Tensor`, which we now own.
    Ok(unsafe { Tensor::from_ptr(output) })
}

unsafe extern "C" fn forward_trampoline(
    ctx: *mut c_void,
    input: *mut C_tensor,
    output: *mut *mut C_tensor,
) -> *mut c_char {
    // SAFETY: as in `post_acc_trampoline`.
    let input = unsafe { Tensor::from_ptr(input) };
    // SAFETY: as in `post_acc_trampoline`.
    let forward = unsafe { &*ctx.cast::<ForwardClosure>() };
    let run = || forward.locked()(&input);
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(mut out) => {
            // Ownership of the at::Tensor passes to the shim.
            // SAFETY: `output` is a valid out-pointer for the duration of the call.
            unsafe { *output = out.as_mut_ptr() };
            std::mem::forget(out);
            std::ptr::null_mut()
        }
        Err(payload) => malloc_message(&format!(
            "a checkpointed forward pass panicked: {}",
            panic_message(payload.as_ref())
        )),
    }
}

unsafe extern "C" fn drop_forward(ctx: *mut c_void) {
    // SAFETY: called once by the shim with the pointer from `Box::into_raw`.
    drop(unsafe { Box::from_raw(ctx.cast::<ForwardClosure>()) });
}
