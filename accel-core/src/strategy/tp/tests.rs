//! Tensor-parallel layers on ranks run as threads, against the same computation done whole:
//! outputs, input gradients and each rank's slice of the weight gradients, with and without
//! sequence parallelism, on 2 and 3 ranks.

use std::sync::Arc;
use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};

use super::*;
use crate::comm::ReduceOp;
use crate::comm::tests::on_ranks;

/// Deterministic values of `shape` (no generator: the test threads share torch's).
fn values(shape: &[i64], phase: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + phase).sin().view(shape)
}

fn part(t: &Tensor, dim: i64, rank: usize, ranks: usize) -> Tensor {
    let size = t.size()[dim as usize] / ranks as i64;
    t.narrow(dim, rank as i64 * size, size)
}

fn assert_close(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let diff = (a - b).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "{what}: differs by {diff}");
}

const SEQ: i64 = 6;
const IN: i64 = 4;
const HIDDEN: i64 = 6;

struct Whole {
    x: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    y: Tensor,
}

/// A column-parallel then row-parallel MLP, `tanh` between, on inputs `[2, SEQ, IN]`,
/// with every gradient of `(y · c).sum()`.
fn whole_mlp() -> Whole {
    let leaf = |t: Tensor| t.set_requires_grad(true);
    let x = leaf(values(&[2, SEQ, IN], 0.0));
    let (w1, b1) = (leaf(values(&[HIDDEN, IN], 1.0)), leaf(values(&[HIDDEN], 2.0)));
    let (w2, b2) = (leaf(values(&[IN, HIDDEN], 3.0)), leaf(values(&[IN], 4.0)));
    let y = x.linear(&w1, Some(&b1)).tanh().linear(&w2, Some(&b2));
    (&y * values(&[2, SEQ, IN], 5.0)).sum(Kind::Float).backward();
    Whole { x, w1, b1, w2, b2, y }
}

#[test]
fn column_then_row_parallel_linear_equal_the_whole_mlp_with_and_without_sequence_parallelism() {
    for (ranks, sequence_parallel) in [(2, false), (3, false), (2, true), (3, true)] {
        on_ranks(ranks, Duration::from_secs(20), move |group| {
            // Tensors cannot be shared between threads: each rank computes the reference.
            let whole = whole_mlp();
            let rank = group.rank();
            let what =
                |s: &str| format!("{ranks} ranks, sequence parallel {sequence_parallel}: {s}");
            let tp = TensorParallel::new(Arc::new(group), sequence_parallel);
            let vs = nn::VarStore::new(Device::Cpu);
            let options = LinearOptions::default();
            let up =
                ColumnParallelLinear::new(&tp, &(vs.root() / "up"), IN, HIDDEN, options).unwrap();
            let down =
                RowParallelLinear::new(&tp, &(vs.root() / "down"), HIDDEN, IN, options).unwrap();
            up.load_whole(&whole.w1.detach(), Some(&whole.b1.detach())).unwrap();
            down.load_whole(&whole.w2.detach(), Some(&whole.b2.detach())).unwrap();
            // Under sequence parallelism each rank holds its part of the sequence.
            let mine = |t: &Tensor| match sequence_parallel {
                true => part(t, 1, rank, ranks),
                false => t.shallow_clone(),
            };
            let x = mine(&whole.x.detach()).copy().set_requires_grad(true);
            let y = down.forward(&up.forward(&x).tanh());
            assert_close(&y, &mine(&whole.y.detach()), &what("output"));
            (&y * mine(&values(&[2, SEQ, IN], 5.0))).sum(Kind::Float).backward();
            assert_close(&x.grad(), &mine(&whole.x.grad()), &what("input gradient"));
            let w1 = part(&whole.w1.grad(), 0, rank, ranks);
            assert_close(&up.weight.grad(), &w1, &what("column weight gradient"));
            let b1 = part(&whole.b1.grad(), 0, rank, ranks);
            assert_close(&up.bias.as_ref().unwrap().grad(), &b1, &what("column bias gradient"));
            let w2 = part(&whole.w2.grad(), 1, rank, ranks);
            assert_close(&down.weight.grad(), &w2, &what("row weight gradient"));
            // The row bias is whole on every rank; under sequence parallelism each rank's
            // gradient covers its positions only, and the accelerator sums them (it is
            // registered for that).
            let b2 = down.bias.as_ref().unwrap();
            let id = crate::shim::tensor_id(b2).unwrap();
            assert_eq!(tp.is_sequence(id), sequence_parallel, "{}", what("bias registered"));
            let grad = b2.grad().detach_copy();
            if sequence_parallel {
                tp.comm().all_reduce(&grad, ReduceOp::Sum).unwrap();
            }
            assert_close(&grad, &whole.b2.grad(), &what("row bias gradient"));
            // Checkpoints and full weights put the slices back by this record.
            let split = tp.split_of(crate::shim::tensor_id(&up.weight).unwrap()).unwrap();
            assert_eq!(split, Split { dim: 0, whole: vec![HIDDEN, IN] });
            let split = tp.split_of(crate::shim::tensor_id(&down.weight).unwrap()).unwrap();
            assert_eq!(split, Split { dim: 1, whole: vec![IN, HIDDEN] });
        });
    }
}

const VOCAB: i64 = 6;

/// Embeddings then a head over the whole vocabulary, with the gradients of the mean
/// cross-entropy: ids, targets, table, head, per-token losses.
fn whole_vocab() -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    let leaf = |t: Tensor| t.set_requires_grad(true);
    let ids = Tensor::from_slice(&[0i64, 5, 2, 3, 3, 1, 4, 0, 5, 2, 1, 1]).view([2, SEQ]);
    let targets = Tensor::from_slice(&[5i64, 2, 3, 3, 1, 4, 0, 5, 2, 1, 1, 0]).view([2, SEQ]);
    let (table, head) = (leaf(values(&[VOCAB, IN], 6.0)), leaf(values(&[VOCAB, IN], 7.0)));
    let logits = Tensor::embedding(&table, &ids, -1, false, false).linear::<Tensor>(&head, None);
    let token_losses = logits.view([-1, VOCAB]).cross_entropy_loss::<Tensor>(
        &targets.view([-1]),
        None,
        Reduction::None,
        -100,
        0.0,
    );
    token_losses.mean(Kind::Float).backward();
    (ids, targets, table, head, token_losses.detach().view([2, SEQ]))
}

#[test]
fn vocab_parallel_embedding_and_cross_entropy_equal_the_whole_vocabulary() {
    for (ranks, sequence_parallel) in [(2, false), (3, false), (2, true), (3, true)] {
        on_ranks(ranks, Duration::from_secs(20), move |group| {
            let (ids, targets, table, head, token_losses) = &whole_vocab();
            let rank = group.rank();
            let what =
                |s: &str| format!("{ranks} ranks, sequence parallel {sequence_parallel}: {s}");
            let tp = TensorParallel::new(Arc::new(group), sequence_parallel);
            let vs = nn::VarStore::new(Device::Cpu);
            let embedding =
                VocabParallelEmbedding::new(&tp, &(vs.root() / "tokens"), VOCAB, IN, 1).unwrap();
            let options = LinearOptions { bias: false, ..Default::default() };
            let out =
                ColumnParallelLinear::new(&tp, &(vs.root() / "head"), IN, VOCAB, options).unwrap();
            tch::no_grad(|| embedding.weight.shallow_clone().copy_(&part(table, 0, rank, ranks)));
            out.load_whole(&head.detach(), None).unwrap();
            // The embedding's output is this rank's positions under sequence parallelism;
            // the head gathers them back, and each rank has its slice of the vocabulary.
            let local_logits = out.forward(&embedding.forward(ids));
            assert_eq!(local_logits.size(), [2, SEQ, VOCAB / ranks as i64]);
            let losses = vocab_parallel_token_losses(&tp, &local_logits, targets).unwrap();
            assert_close(&losses, token_losses, &what("per-token losses"));
            let loss = vocab_parallel_cross_entropy(&tp, &local_logits, targets).unwrap();
            assert_close(&loss, &token_losses.mean(Kind::Float), &what("mean loss"));
            loss.backward();
            let grad = part(&table.grad(), 0, rank, ranks);
            assert_close(&embedding.weight.grad(), &grad, &what("embedding gradient"));
            let grad = part(&head.grad(), 0, rank, ranks);
            assert_close(&out.weight.grad(), &grad, &what("head gradient"));
        });
    }
}

#[test]
fn widths_that_do_not_divide_among_the_ranks_are_refused_with_the_numbers() {
    on_ranks(2, Duration::from_secs(20), |group| {
        let tp = TensorParallel::new(Arc::new(group), false);
        let vs = nn::VarStore::new(Device::Cpu);
        let err = ColumnParallelLinear::new(&tp, &(vs.root() / "up"), 4, 5, Default::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("5 does not divide among the 2 tensor-parallel ranks"), "{err}");
        let err = VocabParallelEmbedding::new(&tp, &(vs.root() / "tokens"), 7, 4, 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("vocabulary") && err.contains("7"), "{err}");
    });
}
