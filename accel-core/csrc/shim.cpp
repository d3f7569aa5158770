// What tch does not expose, as a small C ABI over libtorch. The Rust side is
// accel-core/src/shim/: every function here has exactly one safe wrapper there.
//
// Conventions:
// - A tensor argument is `at::Tensor*`, the same pointer tch's `Tensor` holds.
// - Functions that can fail return a malloc'd error message (the caller frees it
//   with free()) or NULL on success. No C++ exception crosses this boundary.
// - Hook callbacks are Rust functions that never unwind (they catch panics) and
//   return a malloc'd message on failure; the hook then throws, so autograd
//   reports the failure from backward() on the thread that called it.

#include <torch/torch.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

char* dup_message(const char* message) {
  size_t n = std::strlen(message);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) std::memcpy(out, message, n + 1);
  return out;
}

#define ACCEL_TRY(...)                                        \
  try {                                                       \
    __VA_ARGS__;                                              \
    return nullptr;                                           \
  } catch (const c10::Error& e) {                             \
    return dup_message(e.what_without_backtrace());           \
  } catch (const std::exception& e) {                         \
    return dup_message(e.what());                             \
  } catch (...) {                                             \
    return dup_message("unknown C++ exception in accel shim"); \
  }

// Rethrows a message returned by a Rust callback as a C++ exception (and frees it).
void throw_callback_error(char* message) {
  std::string text(message);
  std::free(message);
  throw std::runtime_error(text);
}

}  // namespace

extern "C" {

typedef char* (*accel_post_acc_fn)(void* ctx, at::Tensor* param);
typedef char* (*accel_grad_fn)(void* ctx, at::Tensor* grad, at::Tensor** replacement);
typedef void (*accel_drop_fn)(void* ctx);
// A forward pass: receives an owned `at::Tensor*` (the input) and stores an owned output.
typedef char* (*accel_forward_fn)(void* ctx, at::Tensor* input, at::Tensor** output);

}  // extern "C"

namespace {

// Owns one Rust closure; dropping it drops the closure on the Rust side.
struct Callback {
  void* ctx;
  accel_drop_fn drop;
  Callback(void* ctx, accel_drop_fn drop) : ctx(ctx), drop(drop) {}
  Callback(const Callback&) = delete;
  Callback& operator=(const Callback&) = delete;
  ~Callback() { drop(ctx); }
};

// A tensor holds a single post-accumulate-grad hook object (Python keeps a dict of
// hooks in it); ours keeps a list so that hooks can be added and removed by id.
struct PostAccHooks : torch::autograd::PostAccumulateGradHook {
  struct Entry {
    uint64_t id;
    accel_post_acc_fn fn;
    std::shared_ptr<Callback> callback;
  };
  std::vector<Entry> entries;

  void operator()(const torch::autograd::Variable& param) override {
    // Copy first: a hook may remove itself while running.
    std::vector<Entry> snapshot = entries;
    for (auto& entry : snapshot) {
      char* error = entry.fn(entry.callback->ctx, new at::Tensor(param));
      if (error != nullptr) throw_callback_error(error);
    }
  }
};

uint64_t next_hook_id = 1;
std::mutex hook_id_mutex;

uint64_t fresh_hook_id() {
  std::lock_guard<std::mutex> lock(hook_id_mutex);
  return next_hook_id++;
}

}  // namespace

extern "C" {

const char* accel_torch_version() { return TORCH_VERSION; }

// ---- post-accumulate-grad hooks -------------------------------------------------

char* accel_add_post_acc_grad_hook(at::Tensor* param, accel_post_acc_fn fn, void* ctx,
                                   accel_drop_fn drop, uint64_t* id) {
  // Own the closure before anything can throw, so it is dropped exactly once.
  auto callback = std::make_shared<Callback>(ctx, drop);
  ACCEL_TRY({
    TORCH_CHECK(param->defined(), "cannot hook an undefined tensor");
    TORCH_CHECK(param->requires_grad() && param->is_leaf(),
                "post-accumulate-grad hooks need a leaf tensor that requires grad");
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(*param);
    if (!slot) slot = std::make_unique<PostAccHooks>();
    auto* hooks = dynamic_cast<PostAccHooks*>(slot.get());
    TORCH_CHECK(hooks != nullptr, "the tensor already holds a foreign post-accumulate-grad hook");
    *id = fresh_hook_id();
    hooks->entries.push_back({*id, fn, std::move(callback)});
  })
}

char* accel_remove_post_acc_grad_hook(at::Tensor* param, uint64_t id, bool* removed) {
  ACCEL_TRY({
    *removed = false;
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(*param);
    auto* hooks = dynamic_cast<PostAccHooks*>(slot.get());
    if (hooks == nullptr) return nullptr;
    auto& entries = hooks->entries;
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if (it->id == id) {
        entries.erase(it);
        *removed = true;
        break;
      }
    }
  })
}

// ---- gradient hooks ---------------------------------------------------------------

char* accel_add_grad_hook(at::Tensor* tensor, accel_grad_fn fn, void* ctx, accel_drop_fn drop,
                          uint32_t* handle) {
  auto callback = std::make_shared<Callback>(ctx, drop);
  ACCEL_TRY({
    TORCH_CHECK(tensor->requires_grad(), "cannot hook a tensor that does not require grad");
    *handle = tensor->register_hook([fn, callback](const at::Tensor& grad) -> at::Tensor {
      at::Tensor* replacement = nullptr;
      char* error = fn(callback->ctx, new at::Tensor(grad), &replacement);
      if (error != nullptr) throw_callback_error(error);
      if (replacement == nullptr) return at::Tensor();
      at::Tensor out = std::move(*replacement);
      delete replacement;
      return out;
    });
  })
}

char* accel_remove_grad_hook(at::Tensor* tensor, uint32_t handle) {
  ACCEL_TRY(tensor->remove_hook(handle))
}

// ---- activation checkpointing -------------------------------------------------------

namespace {

// The generator states and autocast settings a forward pass ran with, so that its
// recomputation in backward draws the same dropout masks and casts the same way.
struct ForwardContext {
  c10::Device device;
  at::Tensor cpu_rng;
  at::Tensor device_rng;
  bool autocast_enabled = false;
  at::ScalarType autocast_dtype = at::kFloat;

  explicit ForwardContext(c10::Device device) : device(device) {
    cpu_rng = state_of(c10::Device(c10::kCPU));
    if (device.type() != c10::kCPU) device_rng = state_of(device);
    if (at::autocast::is_autocast_available(device.type())) {
      autocast_enabled = at::autocast::is_autocast_enabled(device.type());
      autocast_dtype = at::autocast::get_autocast_dtype(device.type());
    }
  }

  static at::Tensor state_of(c10::Device device) {
    auto gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }

  static void restore(c10::Device device, const at::Tensor& state) {
    auto gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
};

// The backward of a checkpointed forward pass: runs it again with gradients (same
// generator states, same autocast), then backward through it with the incoming gradient,
// which accumulates the module's parameter gradients and yields the input's.
struct CheckpointBackward : torch::autograd::Node {
  accel_forward_fn fn;
  std::shared_ptr<Callback> callback;
  at::Tensor input;
  bool input_requires_grad;
  ForwardContext context;

  CheckpointBackward(accel_forward_fn fn, std::shared_ptr<Callback> callback, at::Tensor input,
                     bool input_requires_grad, ForwardContext context)
      : fn(fn),
        callback(std::move(callback)),
        input(std::move(input)),
        input_requires_grad(input_requires_grad),
        context(std::move(context)) {}

  std::string name() const override { return "accel::CheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // The generators continue afterwards from where they are now, not from the replay.
    ForwardContext now(context.device);
    ForwardContext::restore(c10::Device(c10::kCPU), context.cpu_rng);
    if (context.device_rng.defined()) ForwardContext::restore(context.device, context.device_rng);
    auto type = context.device.type();
    bool autocast = at::autocast::is_autocast_available(type);
    if (autocast) {
      at::autocast::set_autocast_enabled(type, context.autocast_enabled);
      at::autocast::set_autocast_dtype(type, context.autocast_dtype);
      at::autocast::increment_nesting();
    }
    at::Tensor x = input.detach().requires_grad_(input_requires_grad);
    at::Tensor y;
    std::exception_ptr failure;
    try {
      at::AutoGradMode enable_grad(true);
      at::Tensor* out = nullptr;
      char* error = fn(callback->ctx, new at::Tensor(x), &out);
      if (error != nullptr) throw_callback_error(error);
      y = std::move(*out);
      delete out;
    } catch (...) {
      failure = std::current_exception();
    }
    if (autocast) {
      if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
      at::autocast::set_autocast_enabled(type, now.autocast_enabled);
      at::autocast::set_autocast_dtype(type, now.autocast_dtype);
    }
    ForwardContext::restore(c10::Device(c10::kCPU), now.cpu_rng);
    if (now.device_rng.defined()) ForwardContext::restore(context.device, now.device_rng);
    if (failure) std::rethrow_exception(failure);
    TORCH_CHECK(y.requires_grad(), "the recomputed forward pass does not require grad");
    torch::autograd::backward({y}, {grads[0]});
    if (!input_requires_grad) return {at::Tensor()};
    return {x.grad()};
  }
};

}  // namespace

// Runs `fn(input)` without recording its graph (no activations kept) and returns its output
// with a backward that runs it again (see CheckpointBackward). With grad mode off, a plain
// forward pass.
char* accel_checkpoint(at::Tensor* input, accel_forward_fn fn, void* ctx, accel_drop_fn drop,
                       at::Tensor** output) {
  auto callback = std::make_shared<Callback>(ctx, drop);
  ACCEL_TRY({
    bool record = at::GradMode::is_enabled();
    ForwardContext context(input->device());
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      at::Tensor* out = nullptr;
      char* error = fn(callback->ctx, new at::Tensor(input->detach()), &out);
      if (error != nullptr) throw_callback_error(error);
      y = std::move(*out);
      delete out;
    }
    if (record) {
      y = y.detach();
      bool needs = input->requires_grad();
      auto node = std::shared_ptr<CheckpointBackward>(
          new CheckpointBackward(fn, callback, input->detach(), needs, std::move(context)),
          torch::autograd::deleteNode);
      if (needs) node->set_next_edges(torch::autograd::collect_next_edges(*input));
      torch::autograd::set_history(y, node);
    }
    *output = new at::Tensor(y);
  })
}

// ---- the head and its cross-entropy, fused ---------------------------------------------

namespace {

// The backward of the fused head and cross-entropy: the gradients were computed in the
// forward pass, chunk by chunk, for an incoming gradient of 1; here they are scaled by the
// one that came (in place: they are this node's alone) and handed over.
struct LinearCrossEntropyBackward : torch::autograd::Node {
  at::Tensor grad_x, grad_w;

  std::string name() const override { return "accel::LinearCrossEntropyBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::NoGradGuard no_grad;
    TORCH_CHECK(grad_x.defined() || grad_w.defined() || !(should_compute_output(0) ||
                should_compute_output(1)), "linear_cross_entropy: backward ran twice");
    at::Tensor g = grads[0];
    bool one = g.numel() == 1 && g.item<double>() == 1.0;
    for (at::Tensor* t : {&grad_x, &grad_w}) {
      if (t->defined() && !one) t->mul_(g.to(t->scalar_type()));
    }
    return {std::move(grad_x), std::move(grad_w)};
  }
};

}  // namespace

// The mean cross-entropy of the logits x · wᵀ (x [N, d], w [V, d]) against `targets` [N]
// (rows whose target is `ignore_index` left out), `chunk` rows at a time, so that the
// N × V logits never exist at once. With gradients on, each chunk's gradients (of x's rows
// and, summed over the chunks, of w) are computed right away, by torch's own backward of
// nll_loss and log_softmax, and kept for backward: neither the logits nor `w` are needed
// after the forward pass. Under autocast the products run in its dtype, as a linear layer's
// would; the loss is fp32. With one chunk, every value is torch's `cross_entropy(x @ w.T)`'s.
char* accel_linear_cross_entropy(at::Tensor* x, at::Tensor* w, at::Tensor* targets,
                                 int64_t ignore_index, int64_t chunk, at::Tensor** loss) {
  ACCEL_TRY({
    TORCH_CHECK(x->dim() == 2 && w->dim() == 2 && x->size(1) == w->size(1),
                "linear_cross_entropy: x [N, d] and w [V, d] expected, got ", x->sizes(),
                " and ", w->sizes());
    TORCH_CHECK(targets->dim() == 1 && targets->size(0) == x->size(0),
                "linear_cross_entropy: targets [N] expected, got ", targets->sizes());
    TORCH_CHECK(chunk > 0, "linear_cross_entropy: chunk must be positive");
    auto type = x->device().type();
    at::ScalarType compute = x->scalar_type();
    if (at::autocast::is_autocast_available(type) && at::autocast::is_autocast_enabled(type)) {
      compute = at::autocast::get_autocast_dtype(type);
    }
    bool want_x = x->requires_grad(), want_w = w->requires_grad();
    bool record = at::GradMode::is_enabled() && (want_x || want_w);
    at::Tensor total, count, grad_x, grad_w;
    {
      at::NoGradGuard no_grad;
      at::Tensor w_compute = w->to(compute);
      count = targets->ne(ignore_index).sum().to(at::kFloat);
      at::Tensor one = at::ones({}, x->options().dtype(at::kFloat));
      if (record && want_x) grad_x = at::empty_like(*x);
      int64_t n = x->size(0);
      for (int64_t start = 0; start < n; start += chunk) {
        int64_t len = std::min(chunk, n - start);
        at::Tensor xc = x->narrow(0, start, len).to(compute);
        at::Tensor tc = targets->narrow(0, start, len);
        // Each step the operation torch's cross_entropy(x @ w.T, ...) runs, and its backward,
        // with the same kernels; each result written over the input it no longer needs, so
        // that two chunk-sized tensors exist at a time, not four.
        at::Tensor out = at::mm(xc, w_compute.t()).to(at::kFloat);
        at::_log_softmax_out(out, out, 1, false);
        at::Tensor part = at::nll_loss(out, tc, {}, at::Reduction::Sum, ignore_index);
        total = total.defined() ? total.add_(part) : part;
        if (!record) continue;
        at::Tensor grad =
            at::nll_loss_backward(one, out, tc, {}, at::Reduction::Mean, ignore_index, count);
        at::_log_softmax_backward_data_out(grad, grad, out, 1, at::kFloat);
        out.reset();
        grad = grad.to(compute);
        if (want_x) grad_x.narrow(0, start, len).copy_(at::mm(grad, w_compute));
        if (!want_w) continue;
        // As autograd's backward of x · wᵀ computes it for a row-major w: gradᵀ · x, laid out
        // as w is (a transposed result would be copied again by AccumulateGrad).
        if (!grad_w.defined()) {
          grad_w = at::mm(grad.t(), xc);
        } else {
          grad_w.addmm_(grad.t(), xc);
        }
      }
      if (grad_w.defined() && grad_w.scalar_type() != w->scalar_type()) {
        grad_w = grad_w.to(w->scalar_type());
      }
    }
    at::Tensor out = total / count;
    if (record) {
      auto node = std::shared_ptr<LinearCrossEntropyBackward>(new LinearCrossEntropyBackward(),
                                                              torch::autograd::deleteNode);
      node->grad_x = std::move(grad_x);
      node->grad_w = std::move(grad_w);
      node->set_next_edges(torch::autograd::collect_next_edges(*x, *w));
      torch::autograd::set_history(out, node);
    }
    *loss = new at::Tensor(out);
  })
}

// `value` (a loss computed without autograd) as a tensor whose backward hands `grad_x`,
// scaled by the incoming gradient, to `x`: a loss whose gradients were computed with it in
// the forward pass (the vocabulary-parallel head under zero3). Attached whenever grad mode
// is on, even if `x` needs no gradient, so that backward reaches it (and the hooks on it).
char* accel_loss_with_gradient(at::Tensor* value, at::Tensor* x, at::Tensor* grad_x,
                               at::Tensor** loss) {
  ACCEL_TRY({
    at::Tensor out = value->detach().clone();
    if (at::GradMode::is_enabled()) {
      auto node = std::shared_ptr<LinearCrossEntropyBackward>(new LinearCrossEntropyBackward(),
                                                              torch::autograd::deleteNode);
      if (x->requires_grad() && grad_x != nullptr) node->grad_x = *grad_x;
      node->set_next_edges(torch::autograd::collect_next_edges(*x, at::Tensor()));
      torch::autograd::set_history(out, node);
    }
    *loss = new at::Tensor(out);
  })
}

char* accel_grad_mode_enabled(bool* enabled) {
  ACCEL_TRY({ *enabled = at::GradMode::is_enabled(); })
}

// ---- .grad ---------------------------------------------------------------------

// grad == NULL clears the gradient (None).
char* accel_set_grad(at::Tensor* tensor, at::Tensor* grad) {
  ACCEL_TRY({
    if (grad == nullptr) {
      tensor->mutable_grad() = at::Tensor();
    } else {
      TORCH_CHECK(grad->sizes() == tensor->sizes(), "gradient shape ", grad->sizes(),
                  " does not match the tensor's ", tensor->sizes());
      tensor->mutable_grad() = *grad;
    }
  })
}

// ---- autocast ------------------------------------------------------------------

// Saves the thread's autocast state for `device_type` into prev_*, then enables it
// with `dtype` (an at::ScalarType value).
char* accel_autocast_enter(int device_type, int dtype, bool enabled, bool* prev_enabled,
                           int* prev_dtype) {
  ACCEL_TRY({
    auto device = static_cast<c10::DeviceType>(device_type);
    TORCH_CHECK(at::autocast::is_autocast_available(device), "autocast is not available for ",
                device);
    *prev_enabled = at::autocast::is_autocast_enabled(device);
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(device));
    at::autocast::set_autocast_enabled(device, enabled);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(dtype));
    at::autocast::increment_nesting();
  })
}

char* accel_autocast_exit(int device_type, bool prev_enabled, int prev_dtype) {
  ACCEL_TRY({
    auto device = static_cast<c10::DeviceType>(device_type);
    // As torch.autocast.__exit__: drop cached casts when leaving the outermost region.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device, prev_enabled);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(prev_dtype));
  })
}

char* accel_autocast_state(int device_type, bool* enabled, int* dtype) {
  ACCEL_TRY({
    auto device = static_cast<c10::DeviceType>(device_type);
    *enabled = at::autocast::is_autocast_enabled(device);
    *dtype = static_cast<int>(at::autocast::get_autocast_dtype(device));
  })
}

// ---- pinned host memory ---------------------------------------------------------
// Without the `device` argument that tch always passes (deprecated in torch 2.11, with a
// warning on every call): the current accelerator's pinned memory.

char* accel_is_pinned(at::Tensor* tensor, bool* pinned) {
  ACCEL_TRY(*pinned = tensor->is_pinned())
}

char* accel_pin_memory(at::Tensor* tensor, at::Tensor** pinned) {
  ACCEL_TRY(*pinned = new at::Tensor(tensor->pin_memory()))
}

// ---- storage -------------------------------------------------------------------

char* accel_storage_nbytes(at::Tensor* tensor, uint64_t* nbytes) {
  ACCEL_TRY(*nbytes = tensor->storage().nbytes())
}

// A released storage keeps its StorageImpl (autograd's saved views of a parameter share it
// and must see the memory a later gather gives it) but holds no memory; its data pointer
// is NULL, which ATen's untyped accessors (TensorIterator's) do not check: a kernel would
// read address 0. So a released storage is also *guarded*: StorageImpl's own
// throw_on_immutable_data_ptr_ (what PyTorch sets on storages that must not be read) makes
// every data access, const or mutable, throw a c10::Error with the storage's message, which
// tch returns as an error. Giving the storage memory again lifts the guard. The flag has a
// public setter only; this reaches it through a pointer to member made by explicit
// instantiation, where C++ does not check access ([temp.spec.general]).

}  // extern "C"

namespace {

struct ThrowOnRead {
  using type = bool c10::StorageImpl::*;
  friend type member(ThrowOnRead);
};

template <typename Tag, typename Tag::type M>
struct Reach {
  friend typename Tag::type member(Tag) { return M; }
};

template struct Reach<ThrowOnRead, &c10::StorageImpl::throw_on_immutable_data_ptr_>;

const char* const kReleasedMessage =
    "accel: this tensor's memory is released (a zero3 parameter between its unit's uses, or "
    "an offloaded weight outside its module's forward): it holds no values here. Read a "
    "sharded model after its training loop (where #[accelerate] gathers it whole), or call "
    "`accelerator.summon_full_params()?` or `accelerator.full_state_dict(&vs)?` on every "
    "process";

// Makes every read or write of the storage's data throw, with its message (set by
// accel_storage_set_message, or the general one). Storages of no element are left as they
// are: nothing reads them, and ATen asks empty tensors for their pointer.
void guard(c10::StorageImpl* storage, bool has_elements) {
  if (!has_elements) return;
  std::optional<std::string> message = storage->get_extra_meta().custom_data_ptr_error_msg_;
  if (!message) message = std::string(kReleasedMessage);
  storage->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(message));
}

// Lifts the guard; the caller then sets a data pointer (set_data_ptr_noswap recomputes the
// storage's has-a-check bit from its flags).
void unguard(c10::StorageImpl* storage) { storage->*member(ThrowOnRead()) = false; }

}  // namespace

extern "C" {

// Releases the memory behind the tensor's storage; every view of it stays valid as an
// object, and any read of its data throws (see guard) until accel_storage_allocate.
char* accel_storage_free(at::Tensor* tensor) {
  ACCEL_TRY({
    c10::StorageImpl* storage = tensor->storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
    storage->set_nbytes(0);
    guard(storage, tensor->numel() > 0);
  })
}

// Moves the memory behind `from`'s storage into `to`'s, which holds none: every view of
// `to` sees it, and `from`'s storage holds none after (as after accel_storage_free).
char* accel_storage_move(at::Tensor* from, at::Tensor* to) {
  ACCEL_TRY({
    c10::StorageImpl* src = from->storage().unsafeGetStorageImpl();
    c10::StorageImpl* dst = to->storage().unsafeGetStorageImpl();
    TORCH_CHECK(dst->nbytes() == 0, "accel_storage_move: the target storage holds ",
                dst->nbytes(), " bytes already");
    TORCH_CHECK(src->device() == dst->device(), "accel_storage_move: from ", src->device(),
                " to ", dst->device());
    size_t nbytes = src->nbytes();
    unguard(dst);
    dst->set_data_ptr_noswap(src->set_data_ptr(at::DataPtr(nullptr, src->device())));
    dst->set_nbytes(nbytes);
    src->set_nbytes(0);
    guard(src, from->numel() > 0);
  })
}

// Sets the message a read of the tensor's storage throws while it is released.
char* accel_storage_set_message(at::Tensor* tensor, const char* message) {
  ACCEL_TRY({
    c10::StorageImpl* storage = tensor->storage().unsafeGetStorageImpl();
    storage->get_extra_meta().custom_data_ptr_error_msg_ = std::string(message);
  })
}

// Whether a read of the tensor's data would throw: its storage is released (guarded).
char* accel_storage_guarded(at::Tensor* tensor, bool* guarded) {
  ACCEL_TRY({
    c10::StorageImpl* storage = tensor->storage().unsafeGetStorageImpl();
    *guarded = storage->*member(ThrowOnRead());
  })
}

// Whether `tensor` is the only handle on its TensorImpl and the only tensor on its storage
// (no view, no other handle, nothing else that could read its memory).
char* accel_storage_sole_owner(at::Tensor* tensor, bool* sole) {
  ACCEL_TRY(*sole = tensor->use_count() == 1 && tensor->storage().use_count() == 1)
}

// A tensor with `device_like`'s dtype and device and `shape_like`'s sizes whose storage
// holds no memory: a zero3 parameter placed on its device already released, so that it is
// never whole there (accel_storage_allocate gives it memory when it is gathered).
char* accel_released(at::Tensor* device_like, at::Tensor* shape_like, at::Tensor** out) {
  ACCEL_TRY({
    at::Tensor t = at::empty({0}, device_like->options());
    t.unsafeGetTensorImpl()->set_sizes_contiguous(shape_like->sizes());
    guard(t.storage().unsafeGetStorageImpl(), t.numel() > 0);
    *out = new at::Tensor(t);
  })
}

// Gives the storage fresh, uninitialised memory of `nbytes` from its own allocator, on
// the storage's own device (CUDA's allocator serves the current device, which may be
// another one on this thread).
char* accel_storage_allocate(at::Tensor* tensor, uint64_t nbytes) {
  ACCEL_TRY({
    c10::StorageImpl* storage = tensor->storage().unsafeGetStorageImpl();
    c10::OptionalDeviceGuard guard(storage->device());
    at::Allocator* allocator = storage->allocator();
    if (allocator == nullptr) allocator = c10::GetAllocator(storage->device_type());
    unguard(storage);
    storage->set_data_ptr_noswap(allocator->allocate(nbytes));
    storage->set_nbytes(nbytes);
  })
}

// The TensorImpl behind a handle: what two shallow clones of one tensor share, even
// while its storage is freed.
char* accel_tensor_impl(at::Tensor* tensor, uintptr_t* id) {
  ACCEL_TRY(*id = reinterpret_cast<uintptr_t>(tensor->unsafeGetTensorImpl()))
}

// ---- CUDA streams and events ------------------------------------------------------
// Through c10's device-generic interfaces (VirtualGuardImpl, c10::Stream, c10::Event), so
// the shim needs no CUDA headers and builds against CPU-only libtorch; on a machine or a
// build without CUDA every call returns libtorch's own error. A stream crosses the boundary
// as c10's packed triple (accel_stream), the form c10::Stream::unpack3 takes back.

struct accel_stream {
  int64_t id;
  int64_t device_index;
  int64_t device_type;
  void* native;  // the cudaStream_t, for NCCL
};

namespace {

c10::Stream unpack_stream(const accel_stream* s) {
  return c10::Stream::unpack3(s->id, static_cast<c10::DeviceIndex>(s->device_index),
                              static_cast<c10::DeviceType>(s->device_type));
}

void pack_stream(const c10::Stream& stream, accel_stream* out) {
  c10::StreamData3 data = stream.pack3();
  out->id = data.stream_id;
  out->device_index = data.device_index;
  out->device_type = static_cast<int64_t>(data.device_type);
  out->native = stream.native_handle();
}

c10::Device cuda_device(int device_index) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
}

}  // namespace

char* accel_set_cuda_device(int device_index) {
  ACCEL_TRY({
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.setDevice(cuda_device(device_index));
  })
}

// torch.cuda.current_stream(device).
char* accel_stream_current(int device_index, accel_stream* out) {
  ACCEL_TRY({
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    pack_stream(impl.getStream(cuda_device(device_index)), out);
  })
}

// A stream of torch's pool (what ProcessGroupNCCL takes for its communication streams).
char* accel_stream_from_pool(int device_index, bool high_priority, accel_stream* out) {
  ACCEL_TRY({
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    pack_stream(impl.getStreamFromGlobalPool(cuda_device(device_index), high_priority), out);
  })
}

// Makes `stream` current on its device; `previous` receives the one it replaces.
char* accel_stream_exchange(const accel_stream* stream, accel_stream* previous) {
  ACCEL_TRY({
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    pack_stream(impl.exchangeStream(unpack_stream(stream)), previous);
  })
}

char* accel_stream_synchronize(const accel_stream* stream) {
  ACCEL_TRY(unpack_stream(stream).synchronize())
}

char* accel_event_new(void** event) {
  ACCEL_TRY(*event = new c10::Event(c10::DeviceType::CUDA))
}

void accel_event_free(void* event) { delete static_cast<c10::Event*>(event); }

char* accel_event_record(void* event, const accel_stream* stream) {
  ACCEL_TRY(static_cast<c10::Event*>(event)->record(unpack_stream(stream)))
}

// Work queued on `stream` after this waits for the event (no host wait).
char* accel_event_block(void* event, const accel_stream* stream) {
  ACCEL_TRY(static_cast<c10::Event*>(event)->block(unpack_stream(stream)))
}

char* accel_event_query(void* event, bool* done) {
  ACCEL_TRY(*done = static_cast<c10::Event*>(event)->query())
}

char* accel_event_synchronize(void* event) {
  ACCEL_TRY(static_cast<c10::Event*>(event)->synchronize())
}

// Tells the caching allocator that `tensor`'s memory is in use on `stream` too, so it is
// not handed out again before the work queued there is done (tensor.record_stream()).
char* accel_record_stream(at::Tensor* tensor, const accel_stream* stream) {
  ACCEL_TRY(tensor->record_stream(unpack_stream(stream)))
}

// The most bytes of tensors the caching allocator of a device held at once since the last
// reset (torch.cuda.max_memory_allocated), for the memory checks of scripts/gpu-check.sh.
char* accel_cuda_max_memory_allocated(int device_index, uint64_t* bytes) {
  ACCEL_TRY({
    auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)
                     ->getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
    *bytes = stats.allocated_bytes[0].peak;
  })
}

char* accel_cuda_reset_peak_memory(int device_index) {
  ACCEL_TRY(c10::getDeviceAllocator(c10::DeviceType::CUDA)
                ->resetPeakStats(static_cast<c10::DeviceIndex>(device_index)))
}

// Gives the caching allocator's unused blocks back to the driver (torch.cuda.empty_cache),
// so that a retry with a smaller batch after an out-of-memory error can have them.
char* accel_cuda_empty_cache() {
  ACCEL_TRY(c10::getDeviceAllocator(c10::DeviceType::CUDA)->emptyCache())
}

// ---- profiler (Kineto) --------------------------------------------------------------

// Starts libtorch's profiler on this thread (torch.profiler.profile): CPU operators, and
// CUDA kernels with `cuda`.
char* accel_profiler_start(bool cuda, bool record_shapes, bool profile_memory,
                           bool with_stack) {
  ACCEL_TRY({
    using namespace torch::profiler::impl;
    ProfilerConfig config(ProfilerState::KINETO, record_shapes, profile_memory, with_stack);
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda) activities.insert(ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  })
}

// Stops it and writes the Chrome trace (chrome://tracing, Perfetto) to `path`.
char* accel_profiler_stop(const char* path) {
  ACCEL_TRY({
    auto result = torch::autograd::profiler::disableProfiler();
    if (result) result->save(std::string(path));
  })
}

// A worker thread joins (or leaves) the profiler the main thread runs, so that its ranges
// are recorded too; called before each of its jobs.
char* accel_profiler_follow_main() {
  ACCEL_TRY({
    thread_local bool joined = false;
    bool on = torch::autograd::profiler::isProfilerEnabledInMainThread();
    if (on != joined) {
      if (on) {
        torch::autograd::profiler::enableProfilerInChildThread();
      } else {
        torch::autograd::profiler::disableProfilerInChildThread();
      }
      joined = on;
    }
  })
}

// A named range of the trace (torch.profiler.record_function), ended by accel_range_end;
// NULL when nothing records (no profiler: no allocation).
char* accel_range_begin(const char* name, void** range) {
  ACCEL_TRY({
    *range = nullptr;
    if (!at::hasCallbacks()) return nullptr;
    auto* fn = new at::RecordFunction(at::RecordScope::USER_SCOPE);
    if (fn->isActive()) fn->before(std::string_view(name));
    *range = fn;
  })
}

void accel_range_end(void* range) { delete static_cast<at::RecordFunction*>(range); }

// Whether anything records ranges on this thread now.
bool accel_recording() { return at::hasCallbacks(); }

// ---- oneDNN ----------------------------------------------------------------------

// Turns libtorch's use of oneDNN on or off (torch.backends.mkldnn.enabled); `previous`
// receives the setting it replaces.
char* accel_set_onednn_enabled(bool enabled, bool* previous) {
  ACCEL_TRY({
    *previous = at::globalContext().userEnabledMkldnn();
    at::globalContext().setUserEnabledMkldnn(enabled);
  })
}

// ---- fused AdamW ---------------------------------------------------------------

// One AdamW step over n parameters with ATen's fused kernel. `steps` are the float
// step counters, already incremented for this step (as torch.optim.AdamW does).
// One Adam step over every parameter in one call: AdamW's decoupled weight decay
// (torch._fused_adamw_) or Adam's L2 penalty (torch._fused_adam_).
char* accel_fused_adam(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                       at::Tensor** exp_avg_sqs, at::Tensor** steps, size_t n, double lr,
                       double beta1, double beta2, double weight_decay, double eps,
                       bool maximize, bool decoupled) {
  ACCEL_TRY({
    std::vector<at::Tensor> p, g, m, v, s;
    for (size_t i = 0; i < n; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
      s.push_back(*steps[i]);
    }
    if (decoupled) {
      at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr, beta1, beta2, weight_decay,
                        eps, /*amsgrad=*/false, maximize);
    } else {
      at::_fused_adam_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr, beta1, beta2, weight_decay,
                       eps, /*amsgrad=*/false, maximize);
    }
  })
}

// One SGD step over every parameter in one call (torch._fused_sgd_). With momentum, the
// buffers are updated in place; on the first step (`is_first_step`) the kernel sets them to
// the (decayed) gradient, as torch's SGD creates them. Without momentum, no buffers.
char* accel_fused_sgd(at::Tensor** params, at::Tensor** grads, at::Tensor** buffers, size_t n,
                      size_t n_buffers, double weight_decay, double momentum, double lr,
                      double dampening, bool nesterov, bool maximize, bool is_first_step) {
  ACCEL_TRY({
    std::vector<at::Tensor> p, g, b;
    for (size_t i = 0; i < n; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
    }
    for (size_t i = 0; i < n_buffers; ++i) b.push_back(*buffers[i]);
    at::_fused_sgd_(p, g, b, weight_decay, momentum, lr, dampening, nesterov, maximize,
                    is_first_step);
  })
}

// ---- gradient scaling ------------------------------------------------------------

// torch.amp.GradScaler's unscale: grads *= inv_scale in place, found_inf set to 1.0 if any
// gradient holds an inf or NaN (one fused pass per device and dtype).
char* accel_amp_unscale(at::Tensor** grads, size_t n, at::Tensor* found_inf,
                        at::Tensor* inv_scale) {
  ACCEL_TRY({
    std::vector<at::Tensor> g;
    for (size_t i = 0; i < n; ++i) g.push_back(*grads[i]);
    at::_amp_foreach_non_finite_check_and_unscale_(g, *found_inf, *inv_scale);
  })
}

// ---- random number generators ----------------------------------------------------

// The state of the default generator of a device (CPU: device_type 0; CUDA: 1), as
// torch.get_rng_state() / torch.cuda.get_rng_state(i) return it.
char* accel_rng_get_state(int device_type, int device_index, at::Tensor** state) {
  ACCEL_TRY({
    auto device = c10::Device(static_cast<c10::DeviceType>(device_type),
                              static_cast<c10::DeviceIndex>(device_index));
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    *state = new at::Tensor(generator.get_state());
  })
}

char* accel_rng_set_state(int device_type, int device_index, at::Tensor* state) {
  ACCEL_TRY({
    auto device = c10::Device(static_cast<c10::DeviceType>(device_type),
                              static_cast<c10::DeviceIndex>(device_index));
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(*state);
  })
}

// The seed the CPU default generator was last seeded with (torch.initial_seed()).
char* accel_rng_initial_seed(uint64_t* seed) {
  ACCEL_TRY({
    at::Generator generator = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
    std::lock_guard<std::mutex> lock(generator.mutex());
    *seed = generator.current_seed();
  })
}

// A tensor's version counter (tensor._version): in-place updates advance it.
char* accel_tensor_version(at::Tensor* tensor, int64_t* version) {
  ACCEL_TRY({ *version = static_cast<int64_t>(tensor->_version()); })
}

}  // extern "C"
