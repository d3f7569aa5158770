//! Each wrapper against an observable effect, so a wrapper that does nothing fails.

use std::sync::{Arc, Mutex};

use tch::{Device, Kind, Tensor};

use super::*;

fn leaf(shape: &[i64], seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn bf16_autocast_runs_matmul_in_bf16_and_backward_still_works() {
    let (a, b) = (leaf(&[4, 8], 0), leaf(&[8, 3], 1));
    assert_eq!(a.matmul(&b).kind(), Kind::Float, "autocast must be off by default");
    {
        let _guard = autocast(Device::Cpu, Kind::BFloat16, true).unwrap();
        assert_eq!(autocast_state(Device::Cpu).unwrap(), Some(Kind::BFloat16));
        let out = a.matmul(&b);
        assert_eq!(out.kind(), Kind::BFloat16);
        out.to_kind(Kind::Float).sum(Kind::Float).backward();
    }
    assert_eq!(autocast_state(Device::Cpu).unwrap(), None);
    assert_eq!(a.matmul(&b).kind(), Kind::Float, "leaving the guard must restore fp32");
    // Gradients reach the fp32 leaves in fp32: d(sum(a@b))/da = row sums of b.
    assert_eq!(a.grad().kind(), Kind::Float);
    let expected =
        b.sum_dim_intlist([1i64].as_slice(), false, Kind::Float).unsqueeze(0).expand([4, 8], false);
    assert!(max_abs_diff(&a.grad(), &expected) < 0.1, "bf16 gradient far from fp32 value");
}

#[test]
fn autocast_guards_nest_and_restore() {
    let outer = autocast(Device::Cpu, Kind::BFloat16, true).unwrap();
    {
        let _off = autocast(Device::Cpu, Kind::BFloat16, false).unwrap();
        assert_eq!(autocast_state(Device::Cpu).unwrap(), None);
        let (a, b) = (leaf(&[2, 2], 0), leaf(&[2, 2], 1));
        assert_eq!(a.matmul(&b).kind(), Kind::Float);
    }
    assert_eq!(autocast_state(Device::Cpu).unwrap(), Some(Kind::BFloat16));
    drop(outer);
    assert_eq!(autocast_state(Device::Cpu).unwrap(), None);
}

#[test]
fn fp16_autocast_on_cpu_runs_matmul_in_fp16() {
    let _guard = autocast(Device::Cpu, Kind::Half, true).unwrap();
    let (a, b) = (leaf(&[4, 8], 0), leaf(&[8, 3], 1));
    assert_eq!(a.matmul(&b).kind(), Kind::Half);
}

#[test]
fn autocast_rejects_integer_kinds() {
    let err = autocast(Device::Cpu, Kind::Int64, true).unwrap_err().to_string();
    assert!(err.contains("floating-point"), "{err}");
}

/// Three layers used in order 0, 1, 2; returns (weights, biases, loss).
fn three_layers() -> (Vec<Tensor>, Vec<Tensor>, Tensor) {
    let weights: Vec<Tensor> = (0..3).map(|i| leaf(&[5, 5], 10 + i)).collect();
    let biases: Vec<Tensor> = (0..3).map(|i| leaf(&[5], 20 + i)).collect();
    let mut x = leaf(&[2, 5], 30).detach();
    for (w, b) in weights.iter().zip(&biases) {
        x = x.linear(w, Some(b)).tanh();
    }
    let loss = x.sum(Kind::Float);
    (weights, biases, loss)
}

#[test]
fn post_accumulate_hook_fires_once_per_parameter_in_reverse_order_of_use() {
    let (weights, biases, loss) = three_layers();
    let fired = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for (layer, (w, b)) in weights.iter().zip(&biases).enumerate() {
        for (name, param) in [("weight", w), ("bias", b)] {
            let fired = fired.clone();
            handles.push(
                add_post_accumulate_grad_hook(param, move |p| {
                    // The hook sees the gradient already accumulated.
                    assert!(p.grad().defined(), "grad not yet accumulated in the hook");
                    fired.lock().unwrap().push((layer, name));
                })
                .unwrap(),
            );
        }
    }
    loss.backward();
    let fired = fired.lock().unwrap().clone();
    assert_eq!(fired.len(), 6, "each of the 6 parameters once: {fired:?}");
    let layers: Vec<usize> = fired.iter().map(|(l, _)| *l).collect();
    assert!(layers.windows(2).all(|w| w[0] >= w[1]), "not in reverse order of use: {fired:?}");
    assert_eq!(layers.first(), Some(&2));
    for layer in 0..3 {
        for name in ["weight", "bias"] {
            assert_eq!(fired.iter().filter(|f| **f == (layer, name)).count(), 1);
        }
    }
}

#[test]
fn removed_post_accumulate_hook_no_longer_fires() {
    let p = leaf(&[3], 0);
    let count = Arc::new(Mutex::new(0));
    let counter = count.clone();
    let hook = add_post_accumulate_grad_hook(&p, move |_| *counter.lock().unwrap() += 1).unwrap();
    (&p * 2.0).sum(Kind::Float).backward();
    (&p * 2.0).sum(Kind::Float).backward();
    assert_eq!(*count.lock().unwrap(), 2, "once per backward");
    assert!(hook.remove().unwrap());
    (&p * 2.0).sum(Kind::Float).backward();
    assert_eq!(*count.lock().unwrap(), 2);
}

#[test]
fn post_accumulate_hook_needs_a_leaf() {
    let p = leaf(&[3], 0);
    let non_leaf = &p * 2.0;
    let err = add_post_accumulate_grad_hook(&non_leaf, |_| {}).unwrap_err().to_string();
    assert!(err.contains("leaf"), "{err}");
}

#[test]
fn panic_in_a_hook_surfaces_as_an_error_from_backward() {
    let p = leaf(&[3], 0);
    let hook = add_post_accumulate_grad_hook(&p, |_| panic!("bucket 7 exploded")).unwrap();
    let err = (&p * 2.0).sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(err.contains("panicked") && err.contains("bucket 7 exploded"), "{err}");
    // The process is intact: without the hook, training goes on.
    hook.remove().unwrap();
    set_grad(&p, None).unwrap();
    (&p * 2.0).sum(Kind::Float).backward();
    assert!(max_abs_diff(&p.grad(), &Tensor::full([3], 2.0, (Kind::Float, Device::Cpu))) < 1e-7);

    let q = leaf(&[3], 1);
    let _h = add_grad_hook(&q, |_| panic!("grad hook down")).unwrap();
    let err = q.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(err.contains("grad hook down"), "{err}");
}

#[test]
fn grad_hook_can_replace_the_gradient_and_be_removed() {
    let p = leaf(&[4], 0);
    let hook = add_grad_hook(&p, |g| Some(g * 3.0)).unwrap();
    p.sum(Kind::Float).backward();
    assert!(max_abs_diff(&p.grad(), &Tensor::full([4], 3.0, (Kind::Float, Device::Cpu))) < 1e-7);
    hook.remove().unwrap();
    let mut p2 = p.shallow_clone();
    p2.zero_grad();
    p.sum(Kind::Float).backward();
    assert!(max_abs_diff(&p.grad(), &Tensor::ones([4], (Kind::Float, Device::Cpu))) < 1e-7);

    let seen = Arc::new(Mutex::new(0.0));
    let seen2 = seen.clone();
    let _keep = add_grad_hook(&p, move |g| {
        *seen2.lock().unwrap() = g.sum(Kind::Float).double_value(&[]);
        None
    })
    .unwrap();
    (&p * 5.0).sum(Kind::Float).backward();
    assert_eq!(*seen.lock().unwrap(), 20.0, "a None hook observes the gradient");
}

#[test]
fn set_grad_assigns_and_clears() {
    let p = leaf(&[2, 3], 0);
    assert!(!p.grad().defined());
    let g = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
    set_grad(&p, Some(&g)).unwrap();
    assert!(max_abs_diff(&p.grad(), &g) == 0.0);
    set_grad(&p, None).unwrap();
    assert!(!p.grad().defined());
    let err = set_grad(&p, Some(&Tensor::zeros([3], (Kind::Float, Device::Cpu)))).unwrap_err();
    assert!(err.to_string().contains("shape"), "{err}");
}

/// Every way a kernel reaches a released storage's data — through TensorIterator (`abs`,
/// `sum`, an in-place write), a typed accessor (`Vec::try_from`), a copy out — fails with the
/// storage's message, on the tensor and on its views; giving it memory lifts that.
#[test]
fn a_released_storage_refuses_every_read_and_write_with_its_message() {
    let flat = Tensor::arange(10, (Kind::Float, Device::Cpu));
    let view = flat.narrow(0, 2, 4);
    set_released_message(&flat, "`layers.0.weight` is released on rank 1").unwrap();
    // SAFETY: the test owns `flat` and its view, and reads them only to see the refusals.
    unsafe { free_storage(&flat).unwrap() };
    assert!(is_released(&flat).unwrap() && is_released(&view).unwrap());
    let refusals = [
        flat.f_abs().map(|_| ()),
        view.f_sum(Kind::Float).map(|_| ()),
        flat.f_add(&flat).map(|_| ()),
        flat.shallow_clone().f_mul_(&Tensor::ones([10], (Kind::Float, Device::Cpu))).map(|_| ()),
        flat.f_detach_copy().map(|_| ()),
        Vec::<f32>::try_from(&view).map(|_| ()),
    ];
    for (i, refused) in refusals.into_iter().enumerate() {
        let err = refused.expect_err("a read of released memory must fail").to_string();
        assert!(err.contains("`layers.0.weight` is released on rank 1"), "{i}: {err}");
    }
    allocate_storage(&flat, 40).unwrap();
    assert!(!is_released(&flat).unwrap());
    let _ = flat.shallow_clone().fill_(3.0);
    assert_eq!(view.sum(Kind::Float).double_value(&[]), 12.0);

    // Moved away (a spare block), then back: refused in between, readable after.
    let block = Tensor::empty([0], (Kind::Uint8, Device::Cpu));
    // SAFETY: as above.
    unsafe { move_storage(&flat, &block).unwrap() };
    let err = flat.f_sum(Kind::Float).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("is released on rank 1"), "{err}");
    // SAFETY: `block` is ours alone.
    unsafe { move_storage(&block, &flat).unwrap() };
    assert_eq!(flat.sum(Kind::Float).double_value(&[]), 30.0);

    // Made released: the general message, which names the fix.
    let like = Tensor::empty([0], (Kind::Float, Device::Cpu));
    let born = released(&like, &Tensor::zeros([3, 4], (Kind::Float, Device::Cpu))).unwrap();
    assert_eq!(born.size(), [3, 4]);
    let err = born.f_abs().map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("summon_full_params"), "{err}");
    // A write into it marks a new version; a released tensor of no element reads as empty.
    let v = tensor_version(&flat).unwrap();
    let _ = flat.shallow_clone().g_add_scalar_(1.0);
    assert_eq!(tensor_version(&flat).unwrap(), v + 1);
    let empty = released(&like, &Tensor::zeros([0, 4], (Kind::Float, Device::Cpu))).unwrap();
    assert_eq!(empty.sum(Kind::Float).double_value(&[]), 0.0);
}

#[test]
fn freed_storage_reports_zero_bytes_and_reallocated_views_see_new_data() {
    let flat = Tensor::arange(10, (Kind::Float, Device::Cpu));
    let (head, tail) = (flat.narrow(0, 0, 4), flat.narrow(0, 4, 6));
    let saved = flat.copy();
    assert_eq!(storage_nbytes(&flat).unwrap(), 40);
    // SAFETY: the test owns `flat` and its views.
    unsafe { free_storage(&flat).unwrap() };
    assert_eq!(storage_nbytes(&flat).unwrap(), 0);
    assert_eq!(storage_nbytes(&tail).unwrap(), 0, "views share the freed storage");
    allocate_storage(&flat, 40).unwrap();
    assert_eq!(storage_nbytes(&head).unwrap(), 40);
    let mut target = flat.shallow_clone();
    target.copy_(&saved);
    // The views kept their identity and read the re-materialised data.
    assert_eq!(Vec::<f32>::try_from(&head).unwrap(), [0.0, 1.0, 2.0, 3.0]);
    assert_eq!(Vec::<f32>::try_from(&tail).unwrap(), [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
}

#[test]
fn cuda_streams_and_events_order_work_on_gpus_and_are_clear_errors_elsewhere() {
    use super::cuda_runtime::{Event, Stream, record_stream};
    crate::cuda::load_libtorch_cuda();
    if !tch::Cuda::is_available() {
        // Every entry point fails with libtorch's own reason, naming the operation.
        for (op, e) in [
            ("stream", Stream::current(0).unwrap_err()),
            ("stream_from_pool", Stream::from_pool(0, false).unwrap_err()),
            ("max_memory_allocated", super::cuda_runtime::max_memory_allocated(0).unwrap_err()),
        ] {
            assert!(e.to_string().starts_with(&format!("libtorch ({op}): ")), "{e}");
        }
        return;
    }
    // On a GPU: work queued on a side stream after an event of the current stream sees the
    // current stream's result; the host sees the side stream's after its event.
    let device = tch::Device::Cuda(0);
    let current = Stream::current(0).unwrap();
    let side = Stream::from_pool(0, false).unwrap();
    assert_ne!(current, side);
    let x = Tensor::ones([1 << 20], (Kind::Float, device)) * 2.0;
    let ready = Event::record(&current).unwrap();
    ready.block(&side).unwrap();
    let y = {
        let _on_side = side.make_current().unwrap();
        assert_eq!(Stream::current(0).unwrap(), side);
        &x * 3.0
    };
    assert_eq!(Stream::current(0).unwrap(), current);
    record_stream(&x, &side).unwrap();
    let done = Event::record(&side).unwrap();
    done.synchronize().unwrap();
    assert!(done.query().unwrap());
    assert_eq!(y.sum(Kind::Float).double_value(&[]), 6.0 * (1 << 20) as f64);
}

/// torch.optim.AdamW's single-tensor update, written with plain tensor ops.
fn reference_adamw(
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    t: i32,
    hp: AdamWStep,
) {
    tch::no_grad(|| {
        let _ = p.f_mul_(&Tensor::from(1.0 - hp.lr * hp.weight_decay)).unwrap();
        let _ = m.f_mul_(&Tensor::from(hp.beta1)).unwrap().f_add_(&(g * (1.0 - hp.beta1))).unwrap();
        let _ =
            v.f_mul_(&Tensor::from(hp.beta2)).unwrap().f_add_(&(g * g * (1.0 - hp.beta2))).unwrap();
        let bc1 = 1.0 - hp.beta1.powi(t);
        let bc2 = 1.0 - hp.beta2.powi(t);
        let denom = v.sqrt() / bc2.sqrt() + hp.eps;
        let _ = p.f_sub_(&(&*m / denom * (hp.lr / bc1))).unwrap();
    });
}

#[test]
fn fused_adamw_equals_the_unfused_update() {
    let hp = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        weight_decay: 0.01,
        eps: 1e-8,
        maximize: false,
    };
    let shapes: [&[i64]; 3] = [&[7, 3], &[3], &[1]];
    let params: Vec<Tensor> = shapes.iter().enumerate().map(|(i, s)| leaf(s, i as i64)).collect();
    let mut reference: Vec<Tensor> = params.iter().map(|p| p.detach().copy()).collect();
    let zeros = |ts: &[Tensor]| ts.iter().map(|p| p.zeros_like()).collect::<Vec<_>>();
    let (m, v) = (zeros(&params), zeros(&params));
    let (mut rm, mut rv) = (zeros(&params), zeros(&params));
    let steps: Vec<Tensor> =
        params.iter().map(|_| Tensor::zeros([], (Kind::Float, Device::Cpu))).collect();
    for t in 1..=10 {
        let grads: Vec<Tensor> = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                tch::manual_seed(100 * t + i as i64);
                Tensor::randn(p.size(), (Kind::Float, Device::Cpu))
            })
            .collect();
        for s in &steps {
            let mut s = s.shallow_clone();
            let _ = s.f_add_scalar_(1.0).unwrap();
        }
        fused_adamw(&params, &grads, &m, &v, &steps, hp).unwrap();
        for i in 0..params.len() {
            reference_adamw(&mut reference[i], &grads[i], &mut rm[i], &mut rv[i], t as i32, hp);
        }
    }
    for (p, r) in params.iter().zip(&reference) {
        let diff = max_abs_diff(p, r);
        assert!(diff < 1e-6, "fused and unfused AdamW differ by {diff}");
        assert!(max_abs_diff(p, &r.zeros_like()) > 0.0);
    }
    // The update really happened (a no-op would leave the start values).
    let start = leaf(shapes[0], 0);
    assert!(max_abs_diff(&params[0], &start) > 1e-3);
}

#[test]
fn fused_adamw_rejects_lists_of_different_lengths() {
    let p = vec![leaf(&[2], 0)];
    let err = fused_adamw(
        &p,
        &[],
        &[],
        &[],
        &[],
        AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            weight_decay: 0.0,
            eps: 1e-8,
            maximize: false,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("lengths differ"), "{err}");
}

#[test]
fn amp_unscale_divides_and_flags_non_finite_gradients() {
    let grads = vec![Tensor::from_slice(&[2.0f32, 4.0]), Tensor::from_slice(&[8.0f32])];
    let found_inf = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    let inv_scale = Tensor::from_slice(&[0.5f32]);
    amp_unscale(&grads, &found_inf, &inv_scale).unwrap();
    assert_eq!(Vec::<f32>::try_from(&grads[0]).unwrap(), [1.0, 2.0]);
    assert_eq!(found_inf.double_value(&[0]), 0.0);
    let bad = vec![Tensor::from_slice(&[1.0f32, f32::INFINITY])];
    amp_unscale(&bad, &found_inf, &inv_scale).unwrap();
    assert_eq!(found_inf.double_value(&[0]), 1.0);
}

#[test]
fn rng_state_round_trips_the_cpu_generator() {
    tch::manual_seed(42);
    let state = rng_state(Device::Cpu).unwrap();
    let first = Tensor::randn([5], (Kind::Float, Device::Cpu));
    let _ = Tensor::randn([100], (Kind::Float, Device::Cpu));
    set_rng_state(Device::Cpu, &state).unwrap();
    let again = Tensor::randn([5], (Kind::Float, Device::Cpu));
    assert_eq!(max_abs_diff(&first, &again), 0.0);
    assert!(state.numel() > 0 && state.kind() == Kind::Uint8);
}

/// The head fused with its cross-entropy, chunk by chunk: the loss and the gradients of
/// both inputs are torch's `cross_entropy(x @ w.T, targets, ignore_index=-100)`'s, with
/// ignored rows, a short last chunk and a scaled upstream gradient.
#[test]
fn linear_cross_entropy_in_chunks_equals_the_whole_logits_cross_entropy() {
    let values = |shape: &[i64], salt: f64| {
        let n: i64 = shape.iter().product();
        ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + salt).sin() * 2.0).view(shape)
    };
    let targets = Tensor::from_slice(&[3i64, -100, 0, 6, 6, 1, -100, 2, 5, 4]);
    let run = |fused: bool| {
        let x = values(&[10, 5], 0.3).set_requires_grad(true);
        let w = values(&[7, 5], 1.1).set_requires_grad(true);
        let loss = if fused {
            super::linear_cross_entropy(&x, &w, &targets, -100, 3).unwrap()
        } else {
            x.matmul(&w.tr()).cross_entropy_loss::<Tensor>(
                &targets,
                None,
                tch::Reduction::Mean,
                -100,
                0.0,
            )
        };
        (&loss * 0.5).backward();
        (loss.double_value(&[]), x.grad(), w.grad())
    };
    let (loss, gx, gw) = run(true);
    let (expected, ex, ew) = run(false);
    // Relative: the loss is ~11.5, where one fp32 ulp is ~1e-6, and the chunked sum rounds
    // in another order (which BLAS kernel runs differs between CPUs).
    assert!((loss - expected).abs() < 1e-6 * expected.abs(), "loss {loss} vs {expected}");
    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    assert!(diff(&gx, &ex) < 1e-6, "x's gradient differs by {}", diff(&gx, &ex));
    assert!(diff(&gw, &ew) < 1e-6, "w's gradient differs by {}", diff(&gw, &ew));
    assert!(ew.abs().sum(Kind::Float).double_value(&[]) > 0.1, "no gradient to compare");
}
