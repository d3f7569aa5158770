//! The sharding engine on ranks run as threads: where units come from, what each rank
//! keeps, zero3's release and re-gathering around forward and backward, and gradients
//! equal to a single process's.

use std::collections::BTreeSet;
use std::time::Duration;

use tch::{Device, Kind, Tensor};

use super::*;
use crate::comm::tests::on_ranks;

#[test]
fn units_default_to_the_elements_of_repeated_layer_lists() {
    let none = BTreeSet::new();
    assert_eq!(unit_of("layers.3.attn.weight", None, &none), "layers.3");
    assert_eq!(unit_of("model.h.11.mlp.bias", None, &none), "model.h.11");
    assert_eq!(unit_of("encoder.blocks.0.w", None, &none), "encoder.blocks.0");
    assert_eq!(unit_of("head.weight", None, &none), "");
    // A numbered list under another name is not split by default...
    assert_eq!(unit_of("stages.1.weight", None, &none), "");
    // ...but a wrapper or an explicit prefix list decides.
    let wrapped = BTreeSet::from(["stages.1".to_string()]);
    assert_eq!(unit_of("stages.1.weight", None, &wrapped), "stages.1");
    let explicit = ["encoder".to_string(), "encoder.blocks.0".to_string()];
    assert_eq!(unit_of("encoder.blocks.0.w", Some(&explicit), &none), "encoder.blocks.0");
    assert_eq!(unit_of("encoder.norm.w", Some(&explicit), &none), "encoder");
    assert_eq!(unit_of("layers.3.w", Some(&explicit), &none), "");
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

#[test]
fn zero3_releases_a_unit_outside_its_forward_and_backward_and_gets_ddp_gradients() {
    wrapped().insert("blocks.0".into());
    let results = on_ranks(2, Duration::from_secs(20), |group| {
        let rank = group.rank();
        let params = model(rank);
        let sharded = Arc::new(
            ShardedModel::new(
                &params,
                &group,
                (group.clone(), None),
                Stage::Parameters,
                ShardOptions::default(),
            )
            .unwrap(),
        );
        let bytes = |p: &Param| shim::storage_nbytes(&p.tensor).unwrap();
        let block = sharded.unit("blocks.0").unwrap();
        let (weight, bias, head) = (&params[1], &params[0], &params[2]);
        // At rest the block's memory is released; the root (head) stays whole.
        assert_eq!((bytes(weight), bytes(bias)), (0, 0));
        assert_eq!(bytes(head), 40);
        let master = |p: &Param| sharded.master_of(shim::tensor_id(&p.tensor).unwrap()).unwrap();
        assert_eq!(master(weight).size(), [8]);
        assert_eq!(master(bias).size(), [3]);

        let (x, y) = batch(rank);
        sharded.before_forward(block).unwrap();
        assert_eq!(bytes(weight), 60);
        let loss = loss(&params, &x, &y, |hidden| {
            sharded.after_forward(block, hidden).unwrap();
        });
        assert_eq!(bytes(weight), 0, "released after its forward");
        loss.backward();
        sharded.finish().unwrap();
        assert_eq!(bytes(weight), 0, "released again after its backward");
        assert!(!weight.tensor.grad().defined(), "no rank keeps a full gradient");
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
