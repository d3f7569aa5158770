//! The sharding engine on ranks run as threads: where units come from, what each rank
//! keeps, zero3's release and re-gathering around forward and backward, and gradients
//! equal to a single process's.

use std::collections::BTreeSet;
use std::time::Duration;

use tch::{Device, Kind, Tensor, nn};

use super::engine::ShardedModel;
use super::layout::{size_based_units, unit_of};
use super::*;
use crate::shim;

fn unit_of_(name: &str, explicit: Option<&[String]>, wrapped: &BTreeSet<String>) -> String {
    unit_of(name, explicit, wrapped, None)
}
use crate::comm::tests::on_ranks;

#[test]
fn units_default_to_the_elements_of_repeated_layer_lists() {
    let none = BTreeSet::new();
    assert_eq!(unit_of_("layers.3.attn.weight", None, &none), "layers.3");
    assert_eq!(unit_of_("model.h.11.mlp.bias", None, &none), "model.h.11");
    assert_eq!(unit_of_("encoder.blocks.0.w", None, &none), "encoder.blocks.0");
    assert_eq!(unit_of_("head.weight", None, &none), "");
    // A numbered list under another name is not split by default...
    assert_eq!(unit_of_("stages.1.weight", None, &none), "");
    // ...but a wrapper or an explicit prefix list decides.
    let wrapped = BTreeSet::from(["stages.1".to_string()]);
    assert_eq!(unit_of_("stages.1.weight", None, &wrapped), "stages.1");
    let explicit = ["encoder".to_string(), "encoder.blocks.0".to_string()];
    assert_eq!(unit_of_("encoder.blocks.0.w", Some(&explicit), &none), "encoder.blocks.0");
    assert_eq!(unit_of_("encoder.norm.w", Some(&explicit), &none), "encoder");
    assert_eq!(unit_of_("layers.3.w", Some(&explicit), &none), "");
}

#[test]
fn size_based_units_take_the_innermost_module_big_enough() {
    let params = [
        ("embed.weight", 1000),
        ("encoder.a.w", 300),
        ("encoder.a.b", 10),
        ("encoder.b.w", 300),
        ("encoder.norm.w", 10),
        ("head.w", 50),
    ];
    let units = size_based_units(&params, 200);
    // embed (1000) and encoder.a / encoder.b (310, 300) qualify on their own; the norm's
    // innermost big-enough module is the encoder (630); the head is too small: root.
    assert_eq!(units, ["embed", "encoder", "encoder.a", "encoder.b"]);
    let none = BTreeSet::new();
    let unit = |name| unit_of(name, None, &none, Some(&units));
    assert_eq!(unit("encoder.a.b"), "encoder.a");
    assert_eq!(unit("encoder.norm.w"), "encoder");
    assert_eq!(unit("head.w"), "");
}

/// Values that need no random generator (the ranks are threads sharing torch's).
fn values(shape: &[i64], salt: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.7 + salt).sin().view(shape)
}

/// `[5, 3]` weight (15 elements: 2 ranks hold 8 each, the last one padded), `[5]` bias and
/// a `[2, 5]` head.
fn model(rank: usize) -> Vec<Param> {
    let make = |name: &str, shape: &[i64]| {
        // Rank 1 starts elsewhere: the broadcast from rank 0 must win.
        let t = values(shape, name.len() as f64) + rank as f64;
        Param { name: name.into(), tensor: t.set_requires_grad(true) }
    };
    vec![
        make("blocks.0.bias", &[5]),
        make("blocks.0.weight", &[5, 3]),
        make("head.weight", &[2, 5]),
    ]
}

fn batch(rank: usize) -> (Tensor, Tensor) {
    (values(&[4, 3], 10.0 + rank as f64), values(&[4, 2], 20.0 + rank as f64))
}

fn loss(params: &[Param], x: &Tensor, y: &Tensor, around_block: impl Fn(&Tensor)) -> Tensor {
    let hidden = x.linear(&params[1].tensor, Some(&params[0].tensor)).relu();
    around_block(&hidden);
    (hidden.linear::<Tensor>(&params[2].tensor, None) - y).square().mean(Kind::Float)
}

/// A sharded model of `params` over `group` alone (ranks as threads).
/// `pending`: the units made for it.
fn sharded(
    params: &[Param],
    group: &crate::comm::ProcessGroup,
    pending: &PendingUnits,
    options: ShardOptions,
) -> Arc<ShardedModel> {
    let group: Arc<dyn Communicator> = Arc::new(group.clone());
    let stage = Stage::Parameters;
    shard_model(
        params,
        pending,
        group.as_ref(),
        group.clone(),
        None,
        stage,
        options,
        true,
        tch::Device::Cpu,
        &Default::default(),
    )
    .unwrap()
}

#[test]
fn zero3_releases_a_unit_outside_its_forward_and_backward_and_gets_ddp_gradients() {
    let results = on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let params = model(rank);
        // The unit's handle is bound to the model when it is prepared.
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let unit = Unit::new(&pending, &(vs.root() / "blocks" / 0), ());
        let sharded = sharded(&params, &group, &pending, ShardOptions::default());
        let bytes = |p: &Param| shim::storage_nbytes(&p.tensor).unwrap();
        let (weight, bias, head) = (&params[1], &params[0], &params[2]);
        // At rest the block's memory is released; the root (head) stays whole.
        assert_eq!((bytes(weight), bytes(bias)), (0, 0));
        assert_eq!(bytes(head), 40);
        let master = |p: &Param| sharded.master_of(shim::tensor_id(&p.tensor).unwrap()).unwrap();
        assert_eq!(master(weight).size(), [8]);
        assert_eq!(master(bias).size(), [3]);

        let (x, y) = batch(rank);
        let hidden = unit
            .try_run(|()| {
                assert_eq!(bytes(weight), 60, "gathered for its forward");
                x.linear(&weight.tensor, Some(&bias.tensor)).relu()
            })
            .unwrap();
        assert_eq!(bytes(weight), 0, "released after its forward");
        let loss = (hidden.linear::<Tensor>(&head.tensor, None) - y).square().mean(Kind::Float);
        loss.backward();
        sharded.finish().unwrap();
        assert_eq!(bytes(weight), 0, "released again after its backward");
        // No rank keeps a full gradient: the parameter's holds no memory and refuses reads.
        let grad = weight.tensor.grad();
        assert_eq!(shim::storage_nbytes(&grad).unwrap(), 0, "no rank keeps a full gradient");
        let read = grad.f_sum(Kind::Float).map(|_| ()).unwrap_err().to_string();
        assert!(read.contains("opt.clip_grad_norm(max)"), "{read}");
        [weight, bias, head].map(|p| Vec::<f32>::try_from(master(p).grad()).unwrap())
    });

    // One process, both batches, the mean of the two losses: DDP's gradient.
    let params = model(0);
    let total = (0..2).map(|r| {
        let (x, y) = batch(r);
        loss(&params, &x, &y, |_| {})
    });
    (total.fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b) / 2.0).backward();
    for (i, p) in [&params[1], &params[0], &params[2]].iter().enumerate() {
        let full = Vec::<f32>::try_from(p.tensor.grad().reshape([-1])).unwrap();
        let sharded: Vec<f32> = results.iter().flat_map(|r| r[i].clone()).collect();
        assert!(sharded[full.len()..].iter().all(|g| *g == 0.0), "padding gets no gradient");
        for (a, b) in full.iter().zip(&sharded) {
            assert!((a - b).abs() < 1e-6, "{}: {a} vs {b}", p.name);
        }
    }
}

#[test]
fn zero3_prefetches_the_next_unit_in_forward_and_the_previous_in_backward() {
    let results = on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let params = vec![
            Param {
                name: "stack.0.w".into(),
                tensor: values(&[4, 3], 1.0).set_requires_grad(true),
            },
            Param {
                name: "stack.1.w".into(),
                tensor: values(&[2, 4], 2.0).set_requires_grad(true),
            },
        ];
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let _units = [0, 1].map(|i| Unit::new(&pending, &(vs.root() / "stack" / i), ()));
        let model = sharded(&params, &group, &pending, ShardOptions::default());
        let (first, second) = (model.unit("stack.0").unwrap(), model.unit("stack.1").unwrap());
        let pending = |u: usize| model.prefetch_pending(u);
        let (x, y) = batch(rank);
        let mut grads = Vec::new();
        for iteration in 0..2 {
            model.before_forward(first).unwrap();
            // The order is learnt in the first pass; from the second on, the next unit's
            // all-gather is already on its way while this one computes.
            assert_eq!(pending(second), iteration == 1, "forward prefetch, pass {iteration}");
            let hidden = x.matmul(&params[0].tensor.tr()).relu();
            model.after_forward(first, &hidden, true).unwrap();
            model.before_forward(second).unwrap();
            let out = hidden.matmul(&params[1].tensor.tr());
            model.after_forward(second, &out, true).unwrap();
            let loss = (out - y.narrow(1, 0, 2)).square().mean(Kind::Float);
            loss.backward();
            // Unit 1's backward prefetched unit 0, which its own backward then used.
            assert!(!pending(first) && !pending(second), "every prefetch consumed");
            model.finish().unwrap();
            let master = model.master_of(shim::tensor_id(&params[0].tensor).unwrap()).unwrap();
            grads.push(Vec::<f32>::try_from(master.grad()).unwrap());
            shim::set_grad(&master, None).unwrap();
        }
        assert_eq!(grads[0], grads[1], "the same gradients with and without prefetch");
        grads.remove(0)
    });
    // The shards of both ranks form the gradient of the mean loss over both batches.
    let (w0, w1) = (values(&[4, 3], 1.0).set_requires_grad(true), values(&[2, 4], 2.0));
    let total = (0..2).fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |acc, r| {
        let (x, y) = batch(r);
        let out = x.matmul(&w0.tr()).relu().matmul(&w1.tr());
        acc + (out - y.narrow(1, 0, 2)).square().mean(Kind::Float)
    });
    (total / 2.0).backward();
    let full = Vec::<f32>::try_from(w0.grad().reshape([-1])).unwrap();
    let sharded: Vec<f32> = results.concat();
    for (a, b) in full.iter().zip(&sharded) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}

/// The head fused into the loss (`Unit::linear_cross_entropy`) computes its gradients in
/// the forward pass: under zero3 its backward finds the head released and leaves it so
/// (the head's size less in memory where backward starts), still prefetching the unit
/// before it, and the gradients equal one process's logits and cross-entropy. (5 rows over
/// 2 ranks do not split into whole rows: the head is gathered for its forward.)
#[test]
fn zero3_does_not_gather_a_fused_head_again_for_its_backward() {
    let results = on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let (model, params, body, head) = head_model(&group, 5);
        let bytes = |t: &Tensor| shim::storage_nbytes(t).unwrap();
        let (x, targets) = (values(&[4, 3], 10.0 + rank as f64), fused_targets(rank));
        let mut grads = Vec::new();
        for pass in 0..2 {
            let hidden = body.run(|()| x.matmul(&params[0].tensor.tr()).relu());
            let loss = head.linear_cross_entropy(&hidden, &targets, -100, |w| w).unwrap();
            assert_eq!(bytes(&params[1].tensor), 0, "released after its forward");
            // As backward starts: the head's bytes and the body's prefetch.
            let body_unit = model.unit("body").unwrap();
            let (_hook, seen) = probe_backward(&model, &loss, &params[1].tensor, body_unit);
            loss.backward();
            let (head_bytes, prefetched) = seen.lock().unwrap().take().unwrap();
            assert_eq!(head_bytes, 0, "the head was gathered again for its backward");
            assert!(prefetched, "pass {pass}: the body's gather was not started ahead");
            model.finish().unwrap();
            grads.push(take_master_grads(&model, &params));
        }
        assert_eq!(grads[0], grads[1], "the second pass differs");
        grads.remove(0)
    });
    // One process: both ranks' losses from the whole logits, averaged.
    let (w0, w1) = (values(&[5, 3], 1.0), values(&[5, 5], 2.0));
    let (w0, w1) = (w0.set_requires_grad(true), w1.set_requires_grad(true));
    let loss = (0..2).fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |total, r| {
        let hidden = values(&[4, 3], 10.0 + r as f64).matmul(&w0.tr()).relu();
        let logits = hidden.matmul(&w1.tr());
        total + cross_entropy(&logits, &fused_targets(r))
    }) / 2.0;
    loss.backward();
    assert_shards_equal(&results, &[&w0, &w1]);
}

/// A head whose rows split evenly over the ranks is never gathered under zero3: each rank
/// computes its slice of the vocabulary for every rank's rows (`vocab.rs`). Ranks of
/// different batch sizes, ignored targets and a loss scaled in backward: the losses, the
/// gradient shards and the hidden states' gradients (through the body's) equal one
/// process's `cross_entropy(x @ w.T)`; the head holds no memory at any point, the body's
/// gather starts as backward reaches the loss, and two passes agree.
#[test]
fn zero3_computes_a_head_on_its_shards_without_gathering_it() {
    let rows = |rank: usize| 4 - rank as i64;
    let targets =
        |rank: usize| Tensor::from_slice(&[5i64, -100, 0, 3]).narrow(0, 0, 4 - rank as i64);
    let results = on_ranks(2, Duration::from_secs(20), move |group| {
        let rank = group.rank();
        let (model, params, body, head) = head_model(&group, 6);
        let bytes = |t: &Tensor| shim::storage_nbytes(t).unwrap();
        let x = values(&[rows(rank), 3], 10.0 + rank as f64);
        let mut passes = Vec::new();
        for pass in 0..2 {
            let hidden = body.run(|()| x.matmul(&params[0].tensor.tr()).relu());
            let loss = head.linear_cross_entropy(&hidden, &targets(rank), -100, |w| w).unwrap();
            assert_eq!(bytes(&params[1].tensor), 0, "pass {pass}: the head was gathered");
            let value = loss.double_value(&[]);
            let body_unit = model.unit("body").unwrap();
            let (_hook, seen) = probe_backward(&model, &loss, &params[1].tensor, body_unit);
            (loss * 0.5).backward();
            let (head_bytes, prefetched) = seen.lock().unwrap().take().unwrap();
            assert_eq!(head_bytes, 0, "pass {pass}: the head was gathered for its backward");
            assert!(prefetched, "pass {pass}: the body's gather was not started ahead");
            model.finish().unwrap();
            passes.push((value, take_master_grads(&model, &params)));
        }
        assert_eq!(passes[0], passes[1], "the second pass differs");
        passes.remove(0)
    });
    let (w0, w1) = (values(&[5, 3], 1.0), values(&[6, 5], 2.0));
    let (w0, w1) = (w0.set_requires_grad(true), w1.set_requires_grad(true));
    let losses: Vec<Tensor> = (0..2)
        .map(|r| {
            let hidden = values(&[rows(r), 3], 10.0 + r as f64).matmul(&w0.tr()).relu();
            let logits = hidden.matmul(&w1.tr());
            cross_entropy(&logits, &targets(r))
        })
        .collect();
    for (r, (value, _)) in results.iter().enumerate() {
        let expected = losses[r].double_value(&[]);
        assert!(
            (value - expected).abs() < 1e-6 * expected.abs(),
            "rank {r}: {value} vs {expected}"
        );
    }
    ((&losses[0] + &losses[1]) / 2.0 * 0.5).backward();
    let grads: Vec<_> = results.into_iter().map(|(_, g)| g).collect();
    assert_shards_equal(&grads, &[&w0, &w1]);
}

/// A rank whose targets are all ignored (a batch of prompt tokens only) gets a NaN loss and
/// contributes nothing to the head's gradient, as torch's backward gives it: the other
/// rank's gradient is not poisoned, and the shards equal one process's gradient of rank 0's
/// loss, averaged over both ranks as DDP averages.
#[test]
fn a_rank_with_every_target_ignored_adds_nothing_to_the_head_on_its_shards() {
    let targets = |rank: usize| match rank {
        0 => Tensor::from_slice(&[5i64, -100, 0, 3]),
        _ => Tensor::from_slice(&[-100i64; 4]),
    };
    let results = on_ranks(2, Duration::from_secs(20), move |group| {
        let rank = group.rank();
        let (model, params, body, head) = head_model(&group, 6);
        let x = values(&[4, 3], 10.0 + rank as f64);
        let hidden = body.run(|()| x.matmul(&params[0].tensor.tr()).relu());
        let loss = head.linear_cross_entropy(&hidden, &targets(rank), -100, |w| w).unwrap();
        assert_eq!(loss.double_value(&[]).is_nan(), rank == 1, "rank {rank}'s loss");
        loss.backward();
        model.finish().unwrap();
        take_master_grads(&model, &params)
    });
    let (w0, w1) = (values(&[5, 3], 1.0), values(&[6, 5], 2.0));
    let (w0, w1) = (w0.set_requires_grad(true), w1.set_requires_grad(true));
    let hidden = values(&[4, 3], 10.0).matmul(&w0.tr()).relu();
    (cross_entropy(&hidden.matmul(&w1.tr()), &targets(0)) / 2.0).backward();
    assert_shards_equal(&results, &[&w0, &w1]);
}

/// The head's gradient shard sums every rank's rows, so the loss's gradient must be the same
/// on every rank: where it is not, backward's error says so, and no update is applied.
#[test]
fn a_head_on_its_shards_refuses_a_loss_scaled_differently_per_rank() {
    let errors = on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let (model, params, body, head) = head_model(&group, 6);
        let x = values(&[4, 3], 10.0 + rank as f64);
        let hidden = body.run(|()| x.matmul(&params[0].tensor.tr()).relu());
        let loss = head.linear_cross_entropy(&hidden, &fused_targets(rank), -100, |w| w).unwrap();
        (loss * (1.0 + rank as f64)).backward();
        model.finish().unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("head.w") && e.contains("[1.0, 2.0]"), "{e}");
    }
}

/// A head tied to the embedding (one unit) computed on its shards under the update inside
/// backward: the head's part of the gradient waits for the embedding's (while the layers
/// between them are reduced and updated), and the update is applied once, on their sum,
/// which equals one process's gradient.
#[test]
fn a_head_tied_to_the_embedding_gets_one_update_of_both_parts() {
    let ids = |rank: usize| Tensor::from_slice(&[1i64, 4, rank as i64, 5]);
    let targets = |rank: usize| Tensor::from_slice(&[4i64, 0, -100, 2 + rank as i64]);
    let results = on_ranks(2, Duration::from_secs(20), move |group| {
        let rank = group.rank();
        // Three layers: two reductions stay in flight, so the first completes (and its
        // update is applied) before the embedding's gradient comes.
        let mut params: Vec<Param> = (0..3)
            .map(|i| Param {
                name: format!("body.{i}.w"),
                tensor: values(&[5, 5], i as f64).set_requires_grad(true),
            })
            .collect();
        let w = values(&[6, 5], 2.0).set_requires_grad(true);
        params.push(Param { name: "tied.w".into(), tensor: w.shallow_clone() });
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let body = [0, 1, 2].map(|i| Unit::new(&pending, &(vs.root() / "body" / i), ()));
        let tied = Unit::new(&pending, &(vs.root() / "tied"), w.shallow_clone());
        let options = ShardOptions { step_in_backward: true, ..Default::default() };
        let model = sharded(&params, &group, &pending, options);
        let master = model.master_of(shim::tensor_id(&w).unwrap()).unwrap();
        let updates = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (seen, tied_master) = (updates.clone(), std::sync::Mutex::new(master));
        model
            .update_in_backward(Arc::new(move || {
                let master = tied_master.lock().unwrap();
                if master.grad().defined() {
                    seen.lock().unwrap().push(Vec::<f32>::try_from(master.grad()).unwrap());
                    shim::set_grad(&master, None)?;
                }
                Ok(())
            }))
            .unwrap();
        let mut hidden = tied.embedding(&ids(rank), -1, |w| w);
        for (unit, p) in body.iter().zip(&params) {
            hidden = unit.run(|()| hidden.matmul(&p.tensor.tr()).tanh());
        }
        let loss = tied.linear_cross_entropy(&hidden, &targets(rank), -100, |w| w).unwrap();
        assert_eq!(shim::storage_nbytes(&w).unwrap(), 0, "gathered for the head");
        loss.backward();
        model.finish().unwrap();
        let updates = updates.lock().unwrap().clone();
        assert_eq!(updates.len(), 1, "rank {rank}: the tied weight's updates");
        vec![updates[0].clone()]
    });
    let layers: Vec<Tensor> = (0..3).map(|i| values(&[5, 5], i as f64)).collect();
    let w = values(&[6, 5], 2.0).set_requires_grad(true);
    let loss = (0..2).fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |total, r| {
        let rows = Tensor::embedding(&w, &ids(r), -1, false, false);
        let hidden = layers.iter().fold(rows, |h, l| h.matmul(&l.tr()).tanh());
        let logits = hidden.matmul(&w.tr());
        total + cross_entropy(&logits, &targets(r))
    }) / 2.0;
    loss.backward();
    assert_shards_equal(&results, &[&w]);
}

/// A zero3 model of a `[5, 3]` body and a `[vocab, 5]` head, one unit each.
fn head_model(
    group: &crate::comm::ProcessGroup,
    vocab: i64,
) -> (Arc<ShardedModel>, Vec<Param>, Unit<()>, Unit<Tensor>) {
    let params = vec![
        Param { name: "body.w".into(), tensor: values(&[5, 3], 1.0).set_requires_grad(true) },
        Param { name: "head.w".into(), tensor: values(&[vocab, 5], 2.0).set_requires_grad(true) },
    ];
    let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
    let body = Unit::new(&pending, &(vs.root() / "body"), ());
    let head = Unit::new(&pending, &(vs.root() / "head"), params[1].tensor.shallow_clone());
    let model = sharded(&params, group, &pending, ShardOptions::default());
    (model, params, body, head)
}

/// torch's `cross_entropy(logits, targets, ignore_index=-100)`: one process's reference.
fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    logits.cross_entropy_loss::<Tensor>(targets, None, tch::Reduction::Mean, -100, 0.0)
}

/// The bytes a parameter's storage held and whether a gather was pending, when seen.
type Seen = Arc<std::sync::Mutex<Option<(u64, bool)>>>;

/// What a hook on `t`'s gradient sees as backward reaches it (after the engine's own hook
/// on `t`): the bytes `param`'s storage holds, and whether unit `unit`'s gather is pending.
/// Read after backward; the hook lives as long as the first value.
fn probe_backward(
    model: &Arc<ShardedModel>,
    t: &Tensor,
    param: &Tensor,
    unit: usize,
) -> (shim::GradHook, Seen) {
    let seen = Arc::new(std::sync::Mutex::new(None));
    let (w, s, probe) = (std::sync::Mutex::new(param.shallow_clone()), seen.clone(), model.clone());
    let hook = shim::add_grad_hook(t, move |_| {
        let pending = probe.prefetch_pending(unit);
        *s.lock().unwrap() = Some((shim::storage_nbytes(&w.lock().unwrap()).unwrap(), pending));
        None
    })
    .unwrap();
    (hook, seen)
}

/// This rank's gradient of each parameter's master shard, cleared for the next pass.
fn take_master_grads(model: &ShardedModel, params: &[Param]) -> Vec<Vec<f32>> {
    params
        .iter()
        .map(|p| {
            let master = model.master_of(shim::tensor_id(&p.tensor).unwrap()).unwrap();
            let grad = Vec::<f32>::try_from(master.grad()).unwrap();
            shim::set_grad(&master, None).unwrap();
            grad
        })
        .collect()
}

/// The ranks' gradient shards of each parameter (`results[rank][i]`), side by side, equal
/// the 1-process gradient of `wholes[i]` (1e-6; padding past its end left out).
fn assert_shards_equal(results: &[Vec<Vec<f32>>], wholes: &[&Tensor]) {
    for (i, w) in wholes.iter().enumerate() {
        let full = Vec::<f32>::try_from(w.grad().reshape([-1])).unwrap();
        let sharded: Vec<f32> = results.iter().flat_map(|r| r[i].clone()).collect();
        for (a, b) in full.iter().zip(&sharded) {
            assert!((a - b).abs() < 1e-6, "parameter {i}: {a} vs {b}");
        }
    }
}

#[test]
fn zero3_does_not_gather_an_embedding_again_for_its_backward() {
    let ids = |rank: usize| Tensor::from_slice(&[1i64, 4, rank as i64, 1, 5]);
    let results = on_ranks(2, Duration::from_secs(20), move |group| {
        let rank = group.rank();
        let params = vec![
            Param { name: "embed.w".into(), tensor: values(&[6, 3], 1.0).set_requires_grad(true) },
            Param { name: "body.w".into(), tensor: values(&[4, 3], 2.0).set_requires_grad(true) },
        ];
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let embed = Unit::new(&pending, &(vs.root() / "embed"), params[0].tensor.shallow_clone());
        let body = Unit::new(&pending, &(vs.root() / "body"), params[1].tensor.shallow_clone());
        let model = sharded(&params, &group, &pending, ShardOptions::default());
        let mut grads = Vec::new();
        for _ in 0..2 {
            // Padding row 4: no gradient.
            let e = embed.embedding(&ids(rank), 4, |w| w);
            // As the embedding's backward comes: its bytes and its own prefetch.
            let embed_unit = model.unit("embed").unwrap();
            let (_hook, seen) = probe_backward(&model, &e, &params[0].tensor, embed_unit);
            let out = body.run(|w| e.matmul(&w.tr()).relu());
            out.square().mean(Kind::Float).backward();
            let (embed_bytes, prefetched) = seen.lock().unwrap().take().unwrap();
            assert_eq!(embed_bytes, 0, "gathered for its backward");
            assert!(!prefetched, "its gather was started ahead for a backward that reads none");
            model.finish().unwrap();
            grads.push(take_master_grads(&model, &params));
        }
        assert_eq!(grads[0], grads[1], "the second pass differs");
        grads.remove(0)
    });
    // One process: both ranks' losses, averaged.
    let (w0, w1) = (values(&[6, 3], 1.0), values(&[4, 3], 2.0));
    let (w0, w1) = (w0.set_requires_grad(true), w1.set_requires_grad(true));
    let loss = (0..2).fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |total, r| {
        let e = Tensor::embedding(&w0, &ids(r), 4, false, false);
        total + e.matmul(&w1.tr()).relu().square().mean(Kind::Float)
    }) / 2.0;
    loss.backward();
    for (i, w) in [&w0, &w1].iter().enumerate() {
        let shards: usize = results.iter().map(|r| r[i].len()).sum();
        assert_eq!(w.numel(), shards);
    }
    assert_shards_equal(&results, &[&w0, &w1]);
}

/// Units of one shape, one after the other: on the CPU the second unit's gather takes the
/// memory the first one's release gave up (no fresh pages to fault in), in forward once the
/// order of units is known and in backward, and nothing is kept past the forward pass's
/// last unit or the backward pass.
#[test]
fn zero3_hands_a_released_units_memory_to_the_next_gather_and_keeps_none_after_a_pass() {
    on_ranks(2, Duration::from_secs(20), |group| {
        let shape = [5, 5];
        let params: Vec<Param> = (0..2)
            .map(|i| Param {
                name: format!("blocks.{i}.w"),
                tensor: values(&shape, i as f64).set_requires_grad(true),
            })
            .collect();
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let units: Vec<_> = (0..2)
            .map(|i| {
                let path = vs.root() / "blocks" / i;
                Unit::new(&pending, &path, params[i].tensor.shallow_clone())
            })
            .collect();
        let model = sharded(&params, &group, &pending, ShardOptions::default());
        let x = values(&[4, 5], 10.0 + group.rank() as f64);
        for pass in 0..2 {
            let address = std::sync::Mutex::new(Vec::new());
            let first = units[0].run(|w| {
                address.lock().unwrap().push(w.data_ptr() as usize);
                x.matmul(&w.tr()).relu()
            });
            // (Not in the first pass, whose last unit is not known.)
            let kept = if pass == 0 { 0 } else { 100 };
            assert_eq!(model.spare_bytes(), kept, "pass {pass}: the released unit was not kept");
            let out = units[1].run(|w| {
                address.lock().unwrap().push(w.data_ptr() as usize);
                first.matmul(&w.tr())
            });
            let [a, b] = address.lock().unwrap()[..] else { panic!("two forwards") };
            if pass == 1 {
                assert_eq!(a, b, "the second unit's gather got fresh memory");
            }
            assert_eq!(model.spare_bytes(), 0, "pass {pass}: kept after the last unit");
            // In backward the second unit is gathered first, then released into the first's.
            // (Each hook runs after the engine's own on the same tensor.)
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let _hooks: Vec<_> = [(&out, 1), (&first, 0)]
                .into_iter()
                .map(|(t, i)| {
                    let w = std::sync::Mutex::new(params[i].tensor.shallow_clone());
                    let s = seen.clone();
                    shim::add_grad_hook(t, move |_| {
                        s.lock().unwrap().push(w.lock().unwrap().data_ptr() as usize);
                        None
                    })
                    .unwrap()
                })
                .collect();
            out.square().mean(Kind::Float).backward();
            let [b, a] = seen.lock().unwrap()[..] else { panic!("two backward hooks") };
            assert_eq!(a, b, "pass {pass}: the first unit's backward gather got fresh memory");
            model.finish().unwrap();
            assert_eq!(model.spare_bytes(), 0, "pass {pass}: kept after the backward pass");
        }
    });
}

/// Rank `rank`'s targets for the fused head's test, one of them ignored.
fn fused_targets(rank: usize) -> Tensor {
    Tensor::from_slice(&[1i64, 4, -100, (rank as i64 + 2) % 5])
}

/// A unit waits in the registry of the accelerator it was made for: two models of the same
/// names, built on one thread before either is prepared, each bind their own unit (its
/// memory released at rest, gathered in its forward); the other's stays unbound. One
/// registry holding two units of one name cannot tell them apart, and says so.
#[test]
fn units_bind_to_the_model_of_the_accelerator_they_were_made_for() {
    let results = on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let bytes = |p: &Param| shim::storage_nbytes(&p.tensor).unwrap();
        let (first, second) = (PendingUnits::default(), PendingUnits::default());
        let (vs_a, vs_b) = (nn::VarStore::new(Device::Cpu), nn::VarStore::new(Device::Cpu));
        let unit_a = Unit::new(&first, &(vs_a.root() / "blocks" / 0), ());
        let unit_b = Unit::new(&second, &(vs_b.root() / "blocks" / 0), ());
        let (params_a, params_b) = (model(rank), model(rank));
        let _a = sharded(&params_a, &group, &first, ShardOptions::default());
        assert_eq!(bytes(&params_a[1]), 0, "the first model's unit is bound: released");
        let gathered = unit_a.run(|()| Tensor::from(bytes(&params_a[1]) as i64));
        assert_eq!(gathered.int64_value(&[]), 60, "and gathered in its forward");
        assert_eq!(bytes(&params_b[1]), 60, "the second model is not prepared yet");
        let _b = sharded(&params_b, &group, &second, ShardOptions::default());
        assert_eq!(bytes(&params_b[1]), 0, "the second model's unit is bound to it");
        let gathered = unit_b.run(|()| Tensor::from(bytes(&params_b[1]) as i64));
        assert_eq!(gathered.int64_value(&[]), 60);

        let both = PendingUnits::default();
        let _units = [&vs_a, &vs_b].map(|vs| Unit::new(&both, &(vs.root() / "blocks" / 0), ()));
        let group: Arc<dyn Communicator> = Arc::new(group.clone());
        let stage = Stage::Parameters;
        let options = ShardOptions::default();
        let params = model(rank);
        shard_model(
            &params,
            &both,
            group.as_ref(),
            group.clone(),
            None,
            stage,
            options,
            true,
            tch::Device::Cpu,
            &Default::default(),
        )
        .unwrap_err()
        .to_string()
    });
    for e in results {
        assert!(e.contains("two units named `blocks.0`"), "{e}");
    }
}

#[test]
fn a_gather_that_fails_inside_module_forward_comes_back_as_an_error_not_a_panic() {
    let results = on_ranks(2, Duration::from_secs(5), |group| {
        let rank = group.rank();
        let params = vec![
            Param {
                name: "stack.0.w".into(),
                tensor: values(&[4, 3], 1.0).set_requires_grad(true),
            },
            Param {
                name: "stack.1.w".into(),
                tensor: values(&[2, 4], 2.0).set_requires_grad(true),
            },
        ];
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let units = [0, 1].map(|i| Unit::new(&pending, &(vs.root() / "stack" / i), ()));
        let model = sharded(&params, &group, &pending, ShardOptions::default());
        if rank == 1 {
            // Leaves the run: rank 0's next all-gather has no partner.
            return None;
        }
        let (x, _) = batch(rank);
        let started = std::time::Instant::now();
        // `Unit::run` is what `Module::forward` calls: it cannot return the error.
        let hidden = units[0].run(|()| x.matmul(&params[0].tensor.tr()));
        let out = units[1].run(|()| hidden.matmul(&params[1].tensor.tr()));
        let first = model.take_error().unwrap_err().to_string();
        let later = model.take_error().unwrap_err().to_string();
        Some((out.size(), first, later, started.elapsed()))
    });
    let (shape, first, later, took) = results[0].clone().expect("rank 0 reports");
    assert_eq!(shape, [4, 2], "the forward completed");
    assert!(first.contains("all_gather") && first.contains("rank 0"), "{first}");
    assert!(later.contains("failed earlier"), "the model stays unusable: {later}");
    // One failed collective, not one timeout per unit.
    assert!(took < Duration::from_secs(9), "{took:?}");
}

/// What preparing a model places on the process's device, counted as it is placed: under
/// zero3 a unit's parameters as this rank's chunks only (the block's 20 elements as 8 + 3),
/// the root (which no unit holds) whole beside its chunk; zero2 keeps every parameter whole
/// beside its chunk (a view of it where no padding is needed). A prepare that placed the unit
/// whole would count its 80 bytes more.
#[test]
fn zero3_places_a_units_chunks_on_the_device_never_the_unit_whole() {
    for (stage, expect) in [(Stage::Parameters, [104u64, 104]), (Stage::Gradients, [120, 164])] {
        let placed = on_ranks(2, Duration::from_secs(20), move |group| {
            let params = model(group.rank());
            let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
            let _unit = Unit::new(&pending, &(vs.root() / "blocks" / 0), ());
            let counter = std::sync::atomic::AtomicU64::new(0);
            let group: Arc<dyn Communicator> = Arc::new(group.clone());
            let options = ShardOptions::default();
            let model = shard_model(
                &params,
                &pending,
                group.as_ref(),
                group.clone(),
                None,
                stage,
                options,
                true,
                Device::Cpu,
                &counter,
            );
            model.unwrap();
            counter.load(std::sync::atomic::Ordering::Relaxed)
        });
        // Zero3: the block's 8 + 3 elements of chunks, the 10-element head and its 5-element
        // chunk, in fp32. Zero2: the whole model (30 elements), plus rank 1's padded chunks of
        // the block (8 + 3; rank 0's chunks and the head's are views of the parameters).
        assert_eq!(placed, expect, "{stage:?}");
    }
}

/// LoRA's case under zero3: a unit's frozen parameters are sharded too (released at rest,
/// gathered with the unit in their own dtype, never given a gradient or reduced), and the
/// trainable ones beside them get DDP's gradients; the whole frozen weight comes back
/// unchanged.
#[test]
fn zero3_shards_a_units_frozen_parameters_and_gathers_them_with_it() {
    fn frozen_value() -> Tensor {
        values(&[5, 3], 3.0).to_kind(Kind::BFloat16)
    }
    let build = move |rank: usize| {
        let mut params = model(rank);
        // The block's weight is a frozen bf16 base; its bias trains.
        params[1].tensor = frozen_value() + rank as f64;
        params
    };
    let results = on_ranks(2, Duration::from_secs(20), move |group| {
        let rank = group.rank();
        let params = build(rank);
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let unit = Unit::new(&pending, &(vs.root() / "blocks" / 0), ());
        let sharded = sharded(&params, &group, &pending, ShardOptions::default());
        let bytes = |p: &Param| shim::storage_nbytes(&p.tensor).unwrap();
        let (base, bias, head) = (&params[1], &params[0], &params[2]);
        assert_eq!((bytes(base), bytes(bias)), (0, 0), "the whole unit is released at rest");
        let master = |p: &Param| sharded.master_of(shim::tensor_id(&p.tensor).unwrap()).unwrap();
        assert_eq!((master(base).size(), master(base).kind()), (vec![8], Kind::BFloat16));
        let (x, y) = batch(rank);
        let hidden = unit
            .try_run(|()| {
                assert_eq!(bytes(base), 30, "the frozen base gathered, in bf16");
                x.linear(&base.tensor.to_kind(Kind::Float), Some(&bias.tensor)).relu()
            })
            .unwrap();
        let loss = (hidden.linear::<Tensor>(&head.tensor, None) - y).square().mean(Kind::Float);
        loss.backward();
        sharded.finish().unwrap();
        assert_eq!(bytes(base), 0, "released after its backward");
        assert!(!master(base).grad().defined(), "a frozen shard has no gradient");
        let whole = sharded.full_parameters().unwrap();
        let id = shim::tensor_id(&base.tensor).unwrap();
        let base_whole = whole.iter().find(|(i, _)| *i == id).unwrap().1.shallow_clone();
        assert!(base_whole.equal(&frozen_value()), "rank 0's frozen base comes back whole");
        Vec::<f32>::try_from(master(bias).grad()).unwrap()
    });
    // One process, both batches: the bias's gradient.
    let params = build(0);
    let total = (0..2).map(|r| {
        let (x, y) = batch(r);
        let base = params[1].tensor.to_kind(Kind::Float);
        let hidden = x.linear(&base, Some(&params[0].tensor)).relu();
        (hidden.linear::<Tensor>(&params[2].tensor, None) - y).square().mean(Kind::Float)
    });
    (total.fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b) / 2.0).backward();
    let full = Vec::<f32>::try_from(params[0].tensor.grad()).unwrap();
    let sharded: Vec<f32> = results.concat();
    for (a, b) in full.iter().zip(&sharded) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}

/// A unit of frozen parameters only (a LoRA base layer) has no gradient whose reduction
/// would release it after its backward: given its input, it is released as soon as the
/// input's gradient arrives, before the backward pass ends — a frozen base is never
/// gathered whole during backward.
#[test]
fn a_frozen_unit_is_released_as_soon_as_its_backward_is_done() {
    on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let mut params = model(rank);
        // blocks.0 frozen; the head trains (after it), an input that needs a gradient
        // flows into the block.
        params[0].tensor = params[0].tensor.detach();
        params[1].tensor = params[1].tensor.detach();
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let unit = Unit::new(&pending, &(vs.root() / "blocks" / 0), ());
        let sharded = sharded(&params, &group, &pending, ShardOptions::default());
        let bytes = |p: &Param| shim::storage_nbytes(&p.tensor).unwrap();
        let (weight, bias) = (params[1].tensor.shallow_clone(), params[0].tensor.shallow_clone());
        let (x, y) = batch(rank);
        let x = x.set_requires_grad(true);
        let released_in_backward = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = released_in_backward.clone();
        let weight_probe = std::sync::Mutex::new(params[1].tensor.shallow_clone());
        // A hook on the input of the block's input: it runs after the block's backward.
        let upstream = &x * 1.0;
        let _hook = shim::add_grad_hook(&x, move |_| {
            let released = shim::storage_nbytes(&weight_probe.lock().unwrap()).unwrap() == 0;
            seen.store(released, std::sync::atomic::Ordering::SeqCst);
            None
        });
        let hidden = unit.run_with(&upstream, |(), x| x.linear(&weight, Some(&bias)).relu());
        let loss =
            (hidden.linear::<Tensor>(&params[2].tensor, None) - y).square().mean(Kind::Float);
        loss.backward();
        assert!(
            released_in_backward.load(std::sync::atomic::Ordering::SeqCst),
            "released before the backward pass ended"
        );
        assert_eq!(bytes(&params[1]), 0);
        sharded.finish().unwrap();
        assert!(x.grad().defined(), "the gradient reached the input");
    });
}

#[test]
fn param_dtype_gathers_and_computes_in_bf16_while_masters_and_full_weights_stay_fp32() {
    let results = on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let params = model(rank);
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let unit = Unit::new(&pending, &(vs.root() / "blocks" / 0), ());
        let options = ShardOptions { param_dtype: Some(Kind::BFloat16), ..Default::default() };
        let sharded = sharded(&params, &group, &pending, options);
        let (weight, bias, head) = (&params[1], &params[0], &params[2]);
        assert_eq!(weight.tensor.kind(), Kind::BFloat16, "the unit computes in bf16");
        assert_eq!(head.tensor.kind(), Kind::Float, "the root is not a unit: it stays fp32");
        let master = |p: &Param| sharded.master_of(shim::tensor_id(&p.tensor).unwrap()).unwrap();
        assert_eq!(master(weight).kind(), Kind::Float);

        let (x, y) = batch(rank);
        let hidden = unit
            .try_run(|()| {
                // Half the bytes of fp32: the all-gather moved bf16.
                assert_eq!(shim::storage_nbytes(&weight.tensor).unwrap(), 30);
                x.to_kind(Kind::BFloat16)
                    .linear(&weight.tensor, Some(&bias.tensor))
                    .relu()
                    .to_kind(Kind::Float)
            })
            .unwrap();
        let loss = (hidden.linear::<Tensor>(&head.tensor, None) - y).square().mean(Kind::Float);
        loss.backward();
        sharded.finish().unwrap();
        let grad = master(weight).grad();
        assert_eq!(grad.kind(), Kind::Float, "the master's gradient is fp32");
        // The whole weights come from the fp32 masters, not from a bf16 gather.
        let full = sharded.full_parameters().unwrap();
        let whole = &full.iter().find(|(id, _)| *id == shim::tensor_id(&weight.tensor).unwrap());
        let whole = whole.expect("the weight is sharded").1.shallow_clone();
        assert_eq!(whole.kind(), Kind::Float);
        (Vec::<f32>::try_from(grad).unwrap(), Vec::<f32>::try_from(whole.reshape([-1])).unwrap())
    });
    let params = model(0);
    let exact = Vec::<f32>::try_from(params[1].tensor.reshape([-1])).unwrap();
    assert_eq!(results[0].1, exact, "full weights equal rank 0's fp32 values bit for bit");
    let total = (0..2).map(|r| {
        let (x, y) = batch(r);
        loss(&params, &x, &y, |_| {})
    });
    (total.fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b) / 2.0).backward();
    let full = Vec::<f32>::try_from(params[1].tensor.grad().reshape([-1])).unwrap();
    let sharded: Vec<f32> = results.iter().flat_map(|r| r.0.clone()).collect();
    let scale = full.iter().fold(0f32, |m, g| m.max(g.abs()));
    for (a, b) in full.iter().zip(&sharded) {
        // bf16 has 8 bits of mantissa: within a few hundredths of the largest gradient.
        assert!((a - b).abs() <= 0.03 * scale, "{a} vs {b} (largest {scale})");
    }
}

/// A unit learns from the accelerator that prepared its model whether to checkpoint
/// activations, under any strategy (one process's, and zero3 on 2 thread ranks, which binds
/// the unit): with it on, the unit's forward runs again in backward; off, or with the model
/// never prepared, once.
#[test]
fn a_units_forward_runs_again_in_backward_when_its_accelerator_checkpoints_activations() {
    use crate::config::Strategy as Name;
    let cases = [(true, true, 2), (false, true, 1), (true, false, 1)];
    for (on, prepared, runs) in cases {
        let acc = crate::Accelerator::builder().cpu(true).activation_checkpointing(on).build();
        let calls = forward_passes(&acc.unwrap(), prepared);
        let what = format!("checkpointing {on}, model prepared {prepared}");
        assert_eq!(calls, runs, "forward passes of the unit, one process: {what}");
        let sharded = on_ranks(2, Duration::from_secs(20), move |g| {
            let acc = crate::strategy::tests::thread_accelerator(
                Name::Zero3,
                g.clone(),
                std::sync::Arc::new(g),
                |b| b.activation_checkpointing(on),
            );
            forward_passes(&acc, prepared)
        });
        assert_eq!(sharded, [runs, runs], "forward passes of the unit, zero3 on 2 ranks: {what}");
    }
}

/// How many times a unit's forward runs in one forward and backward pass, its model prepared
/// by `acc` or not.
fn forward_passes(acc: &crate::Accelerator, prepared: bool) -> usize {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tch::nn::Module;
    let vs = nn::VarStore::new(Device::Cpu);
    let path = vs.root() / "blocks" / 0;
    let unit = Unit::new(acc, &path, nn::linear(&path, 3, 2, Default::default()));
    if prepared {
        acc.prepare_model(&vs).unwrap();
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = unit.run_on(&x, move |m, x| {
        counted.fetch_add(1, SeqCst);
        m.forward(x).relu()
    });
    y.sum(Kind::Float).backward();
    assert!(x.grad().defined(), "the gradient reaches the input");
    calls.load(SeqCst)
}

/// The GPU half of "never whole on the device" (runs in scripts/gpu-check.sh): a model of
/// 4 units of 1 MiB built on the CPU, prepared under zero3 with rank 0's device cuda:0 (rank
/// 1 keeps to the CPU, so that only rank 0's bytes reach the GPU). The GPU's peak of
/// allocated bytes during prepare stays at rank 0's chunks (half of each unit), far from the
/// model's 4 MiB; the parameters there are placed released. On a machine without CUDA it
/// checks that the CPU path places the same chunks.
#[test]
fn zero3_prepare_never_holds_the_model_whole_on_the_gpu_cuda() {
    crate::cuda::load_libtorch_cuda();
    let cuda = tch::Cuda::is_available();
    let peaks = on_ranks(2, Duration::from_secs(60), move |group| {
        let rank = group.rank();
        let device = if cuda && rank == 0 { Device::Cuda(0) } else { Device::Cpu };
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let params: Vec<Param> = (0..4)
            .map(|i| {
                let tensor = values(&[512, 512], i as f64).set_requires_grad(true);
                Param { name: format!("blocks.{i}.weight"), tensor }
            })
            .collect();
        let _units: Vec<Unit<()>> =
            (0..4).map(|i| Unit::new(&pending, &(vs.root() / "blocks" / i), ())).collect();
        if device != Device::Cpu {
            crate::shim::cuda_runtime::reset_peak_memory(0).unwrap();
        }
        let group: Arc<dyn Communicator> = Arc::new(group.clone());
        let placed = std::sync::atomic::AtomicU64::new(0);
        let model = shard_model(
            &params,
            &pending,
            group.as_ref(),
            group.clone(),
            None,
            Stage::Parameters,
            ShardOptions::default(),
            false,
            device,
            &placed,
        )
        .unwrap();
        for p in &params {
            assert_eq!(p.tensor.device(), device, "placed on the process's device");
            assert_eq!(shim::storage_nbytes(&p.tensor).unwrap(), 0, "placed released");
        }
        let gpu_peak = match device {
            Device::Cuda(_) => Some(crate::shim::cuda_runtime::max_memory_allocated(0).unwrap()),
            _ => None,
        };
        drop(model);
        (placed.load(std::sync::atomic::Ordering::Relaxed), gpu_peak)
    });
    let model_bytes = 4 * 512 * 512 * 4u64;
    for (placed, gpu_peak) in peaks {
        assert_eq!(placed, model_bytes / 2, "each rank places its chunks: half the model");
        if let Some(peak) = gpu_peak {
            assert!(peak <= model_bytes / 2 + (1 << 20), "GPU peak {peak} during prepare");
        }
    }
}

/// zero3 refuses to release a parameter that shares its storage, and says what usually
/// causes it (tied weights) and what to do.
#[test]
fn a_parameter_sharing_its_storage_is_refused_with_the_way_out() {
    let whole = Tensor::zeros([4, 3], (Kind::Float, Device::Cpu));
    assert!(flat::own_storage(&whole, "lm_head.weight").is_ok());
    let part = whole.narrow(0, 0, 2);
    let message = flat::own_storage(&part, "lm_head.weight").unwrap_err().to_string();
    for says in ["`lm_head.weight`", "tied weight", "storage of its own (`.copy()`)", "one Unit"] {
        assert!(message.contains(says), "{says:?} missing from: {message}");
    }
}

/// `step_in_backward`: the update is called while autograd runs, as soon as a unit's
/// reduced shards are in the masters' gradients (at most two reductions in flight behind
/// it), with only those ready; one update per model.
#[test]
fn the_update_inside_backward_comes_as_units_are_reduced() {
    use std::sync::atomic::{AtomicBool, Ordering};
    on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let params: Vec<Param> = (0..4)
            .map(|i| Param {
                name: format!("stack.{i}.w"),
                tensor: values(&[4, 4], i as f64).set_requires_grad(true),
            })
            .collect();
        let (vs, pending) = (nn::VarStore::new(Device::Cpu), PendingUnits::default());
        let _units = [0, 1, 2, 3].map(|i| Unit::new(&pending, &(vs.root() / "stack" / i), ()));
        let options = ShardOptions { step_in_backward: true, ..Default::default() };
        let model = sharded(&params, &group, &pending, options);
        let masters: Vec<Tensor> = params
            .iter()
            .map(|p| model.master_of(shim::tensor_id(&p.tensor).unwrap()).unwrap())
            .collect();
        let finishing = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (seen, during) = (calls.clone(), finishing.clone());
        let masters = std::sync::Mutex::new(masters);
        let update: crate::strategy::UpdateInBackward = Arc::new(move || {
            let masters = masters.lock().unwrap();
            let ready: Vec<usize> = (0..4).filter(|&i| masters[i].grad().defined()).collect();
            for &i in &ready {
                shim::set_grad(&masters[i], None)?;
            }
            seen.lock().unwrap().push((ready, during.load(Ordering::SeqCst)));
            Ok(())
        });
        model.update_in_backward(update.clone()).unwrap();
        let err = model.update_in_backward(update).unwrap_err().to_string();
        assert!(err.contains("an optimizer over this model was prepared already"), "{err}");
        let (x, _) = batch(rank);
        let mut hidden = x.narrow(1, 0, 3).pad([0, 1], "constant", Some(0.0));
        for (u, p) in params.iter().enumerate() {
            let unit = model.unit(&format!("stack.{u}")).unwrap();
            model.before_forward(unit).unwrap();
            hidden = hidden.matmul(&p.tensor.tr()).tanh();
            model.after_forward(unit, &hidden, true).unwrap();
        }
        hidden.square().mean(Kind::Float).backward();
        finishing.store(true, Ordering::SeqCst);
        model.finish().unwrap();
        let calls = calls.lock().unwrap().clone();
        // Backward reduces stack.3 first; two reductions stay in flight behind the newest.
        assert_eq!(
            calls,
            [(vec![3], false), (vec![2], false), (vec![0, 1], true)],
            "rank {rank}: the updates and the masters ready at each"
        );
    });
}
