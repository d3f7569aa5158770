//! Collectives between ranks run as threads of one process (every byte still crosses TCP),
//! checked against values computed locally.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::{Device, Kind, Tensor};

use super::*;
use crate::topology::Topology;

/// Rank `rank` of `world` on this machine, the store at `port`.
pub(crate) fn topology(rank: usize, world: usize, port: u16) -> Topology {
    Topology {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        source: "test",
    }
}

/// Runs `body(group)` on `world` ranks at once; returns their results in rank order.
pub(crate) fn on_ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    body: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_ranks_with(world, GroupOptions { timeout, direct_copy: true, ..Default::default() }, body)
}

fn on_ranks_with<T: Send + 'static>(
    world: usize,
    options: GroupOptions,
    body: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_ranks_each(world, |_| options.clone(), body)
}

/// Like [`on_ranks_with`], with rank `r` on the machine named `machines[r]`.
fn on_machines<T: Send + 'static>(
    machines: &[&str],
    body: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let options = |rank: usize| GroupOptions {
        timeout: SECOND,
        direct_copy: true,
        machine: Some(machines[rank].to_owned()),
        ..Default::default()
    };
    on_ranks_each(machines.len(), options, body)
}

/// Runs `body(group)` on `world` ranks at once, rank `r` joining with `options(r)`.
fn on_ranks_each<T: Send + 'static>(
    world: usize,
    options: impl Fn(usize) -> GroupOptions,
    body: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_port("127.0.0.1").unwrap();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (body, options) = (body.clone(), options(rank));
            std::thread::spawn(move || {
                let group = ProcessGroup::new(&topology(rank, world, port), options).unwrap();
                body(group)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn values(rank: usize, n: i64, kind: Kind) -> Tensor {
    (Tensor::arange(n, (Kind::Double, Device::Cpu)) * (rank as f64 + 1.0) - 3.0 * rank as f64)
        .to_kind(kind)
}

const SECOND: Duration = Duration::from_secs(20);

#[test]
fn all_reduce_every_op_and_dtype_on_2_3_and_4_ranks_by_direct_copy_and_by_tcp() {
    for (world, direct_copy) in [(2, true), (3, true), (4, true), (2, false), (3, false)] {
        let options = GroupOptions { timeout: SECOND, direct_copy, ..Default::default() };
        let results = on_ranks_with(world, options, move |g| {
            assert_eq!(g.direct_copy(), direct_copy, "the path under test is in use");
            let mut failures = Vec::new();
            for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16, Kind::Int64] {
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
                    if op == ReduceOp::Avg && kind == Kind::Int64 {
                        continue;
                    }
                    // 1000 elements do not divide evenly into 3 chunks; 3 is smaller than 4.
                    for n in [1000, 3] {
                        let t = values(g.rank(), n, kind);
                        g.all_reduce(&t, op).unwrap();
                        let all: Vec<Tensor> =
                            (0..world).map(|r| values(r, n, kind).to_kind(Kind::Double)).collect();
                        let stacked = Tensor::stack(&all, 0);
                        let expected = match op {
                            ReduceOp::Sum => {
                                stacked.sum_dim_intlist([0i64].as_slice(), false, Kind::Double)
                            }
                            ReduceOp::Avg => {
                                stacked.mean_dim([0i64].as_slice(), false, Kind::Double)
                            }
                            ReduceOp::Min => stacked.amin([0i64].as_slice(), false),
                            ReduceOp::Max => stacked.amax([0i64].as_slice(), false),
                        }
                        .to_kind(kind)
                        .to_kind(Kind::Double);
                        let diff =
                            (t.to_kind(Kind::Double) - &expected).abs().max().double_value(&[]);
                        // Half types round each partial sum; allow a few ulps of the largest value.
                        let scale = expected.abs().max().double_value(&[]);
                        let tolerance = match kind {
                            Kind::BFloat16 => scale * 3.0 / 256.0,
                            Kind::Half => scale * 3.0 / 2048.0,
                            _ => 1e-9,
                        };
                        if diff > tolerance {
                            failures.push(format!("{kind:?} {op:?} n={n}: off by {diff}"));
                        }
                    }
                }
            }
            failures
        });
        for (rank, failures) in results.iter().enumerate() {
            assert!(
                failures.is_empty(),
                "world {world} direct {direct_copy} rank {rank}: {failures:?}"
            );
        }
    }
}

/// Ranks on several machines (interleaved, as a launcher may number them) copy directly
/// within each machine and go over TCP between them: all-reduce (every op), reduce-scatter
/// and all-gather give what the collectives mean, the same bits on every rank; machines with
/// unequal numbers of ranks go all over TCP, and say why.
#[test]
fn across_machines_ranks_copy_directly_within_each_and_over_tcp_between() {
    for machines in [&["a", "b", "a", "b"][..], &["a", "a", "b", "b", "c", "c"], &["a", "a", "b"]] {
        let world = machines.len();
        let count = {
            let mut m = machines.to_vec();
            m.sort();
            m.dedup();
            m.len()
        };
        let results = on_machines(machines, move |g| {
            let transport = g.transport().clone();
            let mut reduced = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
                for n in [1001, 5] {
                    let t = values(g.rank(), n, Kind::Float);
                    g.all_reduce(&t, op).unwrap();
                    reduced.push(t);
                }
            }
            let input = Tensor::arange(4 * world as i64, (Kind::Double, Device::Cpu))
                * (g.rank() as f64 + 1.0);
            let scattered = g.reduce_scatter(&input, ReduceOp::Avg).unwrap();
            let gathered = g.all_gather(&Tensor::from_slice(&[g.rank() as i64; 3])).unwrap();
            (transport, reduced, scattered, gathered)
        });
        let expected_transport = if count == 2 && world == 3 {
            None
        } else {
            Some(Transport::Mixed { machines: count })
        };
        for (rank, (transport, reduced, scattered, gathered)) in results.iter().enumerate() {
            match &expected_transport {
                Some(t) => assert_eq!(transport, t, "{machines:?}"),
                None => assert!(
                    matches!(transport, Transport::Tcp(why) if why.contains("unequal numbers")),
                    "{machines:?}: {transport}"
                ),
            }
            let mut i = 0;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
                for n in [1001, 5] {
                    let all: Vec<Tensor> = (0..world).map(|r| values(r, n, Kind::Double)).collect();
                    let stacked = Tensor::stack(&all, 0);
                    let dim = [0i64];
                    let expected = match op {
                        ReduceOp::Sum => {
                            stacked.sum_dim_intlist(dim.as_slice(), false, Kind::Double)
                        }
                        ReduceOp::Avg => stacked.mean_dim(dim.as_slice(), false, Kind::Double),
                        ReduceOp::Min => stacked.amin(dim.as_slice(), false),
                        ReduceOp::Max => stacked.amax(dim.as_slice(), false),
                    };
                    let got = &reduced[i];
                    let diff = (got.to_kind(Kind::Double) - expected).abs().max().double_value(&[]);
                    assert!(diff < 1e-3, "{machines:?} rank {rank} {op:?} n={n}: off by {diff}");
                    // Every rank holds the same bits.
                    assert!(got.equal(&results[0].1[i]), "{machines:?} rank {rank} {op:?}");
                    i += 1;
                }
            }
            // mean over ranks of (r + 1) · i for i in this rank's 4 elements
            let mean_factor = (world as f64 + 1.0) / 2.0;
            let expected: Vec<f64> =
                (4 * rank..4 * rank + 4).map(|i| i as f64 * mean_factor).collect();
            let scattered = Vec::<f64>::try_from(scattered).unwrap();
            for (got, want) in scattered.iter().zip(&expected) {
                assert!((got - want).abs() < 1e-9, "{machines:?} rank {rank}: {scattered:?}");
            }
            let expected: Vec<i64> = (0..world as i64).flat_map(|r| [r; 3]).collect();
            assert_eq!(Vec::<i64>::try_from(gathered).unwrap(), expected, "{machines:?}");
        }
    }
}

/// A scalar (0-dim) is averaged too, by direct copy and by TCP (a loss, a metric).
#[test]
fn a_scalar_is_averaged_by_direct_copy_and_by_tcp() {
    for direct_copy in [true, false] {
        let options = GroupOptions { timeout: SECOND, direct_copy, ..Default::default() };
        let results = on_ranks_with(2, options, |g| {
            let t = Tensor::from(g.rank() as f64 + 1.0);
            g.all_reduce(&t, ReduceOp::Avg).map(|()| t.double_value(&[])).map_err(|e| e.to_string())
        });
        assert_eq!(results, vec![Ok(1.5), Ok(1.5)], "direct copy {direct_copy}");
    }
}

#[test]
fn non_contiguous_tensors_are_reduced_in_place() {
    let results = on_ranks(2, SECOND, |g| {
        let base = Tensor::ones([4, 6], (Kind::Float, Device::Cpu)) * (g.rank() as f64 + 1.0);
        let view = base.transpose(0, 1);
        assert!(!view.is_contiguous());
        g.all_reduce(&view, ReduceOp::Sum).unwrap();
        base.sum(Kind::Float).double_value(&[])
    });
    assert_eq!(results, [72.0, 72.0]);
}

#[test]
fn broadcast_all_gather_reduce_scatter_send_recv_and_objects() {
    for direct_copy in [true, false] {
        check_the_other_collectives(direct_copy);
    }
}

fn check_the_other_collectives(direct_copy: bool) {
    let results = on_ranks_with(
        3,
        GroupOptions { timeout: SECOND, direct_copy, ..Default::default() },
        |g| {
            let r = g.rank() as i64;
            let t = Tensor::full([5], r as f64, (Kind::Float, Device::Cpu));
            g.broadcast(&t, 2).unwrap();
            let broadcast = Vec::<f32>::try_from(&t).unwrap();

            let gathered = g.all_gather(&Tensor::from_slice(&[r, 10 * r]).view([1, 2])).unwrap();
            let list = g.all_gather_list(&Tensor::from_slice(&[r])).unwrap();

            let input = Tensor::arange(6, (Kind::Int64, Device::Cpu)) + r;
            let scattered = g.reduce_scatter(&input, ReduceOp::Sum).unwrap();

            let received = Tensor::zeros([2], (Kind::Float, Device::Cpu));
            if g.rank() == 0 {
                g.send(&Tensor::from_slice(&[7.0f32, 8.0]), 1).unwrap();
            } else if g.rank() == 1 {
                g.recv(&received, 0).unwrap();
            }
            let words = g.all_gather_objects(&format!("rank{r}")).unwrap();
            let config: (u32, String) =
                g.broadcast_object((g.rank() == 1).then_some(&(5u32, "x".to_owned())), 1).unwrap();
            g.barrier().unwrap();
            (
                broadcast,
                gathered,
                list.len(),
                scattered,
                Vec::<f32>::try_from(&received).unwrap(),
                words,
                config,
            )
        },
    );
    for (rank, (broadcast, gathered, list, scattered, received, words, config)) in
        results.into_iter().enumerate()
    {
        assert_eq!(broadcast, [2.0; 5]);
        assert_eq!(gathered.size(), [3, 2]);
        assert_eq!(Vec::<i64>::try_from(gathered.flatten(0, -1)).unwrap(), [0, 0, 1, 10, 2, 20]);
        assert_eq!(list, 3);
        // sum over ranks of (i + r) for i in rank's slice [2·rank, 2·rank+2): 3i + 3
        let expected: Vec<i64> =
            (2 * rank as i64..2 * rank as i64 + 2).map(|i| 3 * i + 3).collect();
        assert_eq!(Vec::<i64>::try_from(&scattered).unwrap(), expected);
        if rank == 1 {
            assert_eq!(received, [7.0, 8.0]);
        }
        assert_eq!(words, ["rank0", "rank1", "rank2"]);
        assert_eq!(config, (5, "x".to_owned()));
    }
}

#[test]
fn all_to_all_sends_part_j_to_rank_j_by_direct_copy_by_tcp_and_by_pairwise_send_recv() {
    for direct_copy in [true, false] {
        let options = GroupOptions { timeout: SECOND, direct_copy, ..Default::default() };
        let results = on_ranks_with(3, options, |g| {
            // Part j of rank r holds 100·r + 10·j, 100·r + 10·j + 1.
            let r = g.rank() as i64;
            let input = Tensor::from_slice(
                &(0..3).flat_map(|j| [100 * r + 10 * j, 100 * r + 10 * j + 1]).collect::<Vec<_>>(),
            )
            .view([3, 2]);
            let out = g.all_to_all(&input).unwrap();
            // The trait's own pairwise exchange, as backends without one of their own run it.
            let default = Tensor::zeros([3, 2], (Kind::Int64, Device::Cpu));
            struct Plain<'a>(&'a ProcessGroup);
            impl std::fmt::Debug for Plain<'_> {
                fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("Plain")
                }
            }
            impl Communicator for Plain<'_> {
                fn rank(&self) -> usize {
                    self.0.rank()
                }
                fn size(&self) -> usize {
                    self.0.size()
                }
                fn backend(&self) -> Backend {
                    Backend::Cpu
                }
                fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
                    self.0.all_reduce_async(t, op)
                }
                fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Work> {
                    self.0.broadcast_async(t, root)
                }
                fn all_gather_in_place_async(&self, t: &Tensor) -> Result<Work> {
                    self.0.all_gather_in_place_async(t)
                }
                fn reduce_scatter_in_place_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
                    self.0.reduce_scatter_in_place_async(t, op)
                }
                fn send_async(&self, t: &Tensor, to: usize) -> Result<Work> {
                    self.0.send_async(t, to)
                }
                fn recv_async(&self, t: &Tensor, from: usize) -> Result<Work> {
                    self.0.recv_async(t, from)
                }
                fn send_recv_async(
                    &self,
                    s: &Tensor,
                    to: usize,
                    r: &Tensor,
                    from: usize,
                ) -> Result<Work> {
                    self.0.send_recv_async(s, to, r, from)
                }
                fn abort(&self) {}
            }
            Plain(&g)
                .all_to_all_async(&default, &input.transpose(0, 1).contiguous().transpose(0, 1))
                .unwrap()
                .wait()
                .unwrap();
            let wrong = g.all_to_all_async(&Tensor::zeros([5], (Kind::Int64, Device::Cpu)), &input);
            (
                Vec::<i64>::try_from(out.view([-1])).unwrap(),
                Vec::<i64>::try_from(default.view([-1])).unwrap(),
                wrong.map(|_| ()).unwrap_err().to_string(),
            )
        });
        for (rank, (out, default, wrong)) in results.into_iter().enumerate() {
            let j = rank as i64;
            let expected: Vec<i64> =
                (0..3).flat_map(|i| [100 * i + 10 * j, 100 * i + 10 * j + 1]).collect();
            assert_eq!(out, expected, "rank {rank}, direct copy {direct_copy}");
            assert_eq!(default, expected, "rank {rank}: the pairwise default");
            assert!(wrong.contains("as many elements as the input"), "{wrong}");
        }
    }
    // One rank: the part it sends itself.
    let one = LocalComm.all_to_all(&Tensor::from_slice(&[1.0f32, 2.0])).unwrap();
    assert_eq!(Vec::<f32>::try_from(one).unwrap(), [1.0, 2.0]);
}

#[test]
fn async_handles_complete_in_order() {
    let results = on_ranks(2, SECOND, |g| {
        let a = Tensor::ones([1 << 16], (Kind::Float, Device::Cpu));
        let b = Tensor::full([3], 2.0, (Kind::Float, Device::Cpu));
        let wa = g.all_reduce_async(&a, ReduceOp::Sum).unwrap();
        let wb = g.all_reduce_async(&b, ReduceOp::Max).unwrap();
        wb.wait().unwrap();
        wa.wait().unwrap();
        (a.sum(Kind::Float).double_value(&[]), b.sum(Kind::Float).double_value(&[]))
    });
    assert_eq!(results, [(131072.0, 6.0), (131072.0, 6.0)]);
}

#[test]
fn subgroups_run_their_own_collectives() {
    let results = on_ranks(4, SECOND, |g| {
        let even = g.new_subgroup(&[0, 2]).unwrap();
        let odd = g.new_subgroup(&[1, 3]).unwrap();
        let mine = even.or(odd).unwrap();
        let t = Tensor::from_slice(&[g.rank() as f32]);
        mine.all_reduce(&t, ReduceOp::Sum).unwrap();
        (mine.members().to_vec(), t.double_value(&[0]))
    });
    assert_eq!(results[0], (vec![0, 2], 2.0));
    assert_eq!(results[3], (vec![1, 3], 4.0));
}

#[test]
fn mismatched_collectives_are_reported_not_corrupted() {
    let results = on_ranks(2, Duration::from_secs(5), |g| {
        if g.rank() == 0 {
            g.all_reduce(&Tensor::ones([10], (Kind::Float, Device::Cpu)), ReduceOp::Sum)
        } else {
            g.all_reduce(&Tensor::ones([12], (Kind::Float, Device::Cpu)), ReduceOp::Sum)
        }
        .unwrap_err()
        .to_string()
    });
    for err in &results {
        assert!(err.contains("collective #1 all_reduce"), "{err}");
        assert!(err.contains("of 10 × f32") && err.contains("of 12 × f32"), "{err}");
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_with_its_name() {
    let results = on_ranks(3, Duration::from_millis(1500), |g| {
        if g.rank() == 2 {
            // Rank 2 skips the collective, then lingers so that its sockets stay open.
            std::thread::sleep(Duration::from_millis(2500));
            return String::new();
        }
        g.all_reduce(&Tensor::ones([4], (Kind::Float, Device::Cpu)), ReduceOp::Sum)
            .unwrap_err()
            .to_string()
    });
    for err in &results[..2] {
        assert!(err.contains("timed out"), "{err}");
        assert!(
            err.contains("rank 2 (last at #0)") || err.contains("rank 2 (no progress posted yet)"),
            "{err}"
        );
        assert!(
            err.contains("all_reduce") && err.contains("[4]") && err.contains("Float"),
            "{err}"
        );
    }
}

/// The direct path waits on its mailboxes, not on a socket: a peer that leaves (its group
/// dropped, as when its process dies) must still end the wait at once, not at the timeout.
#[test]
fn a_peer_that_leaves_while_another_waits_in_a_direct_collective_is_named_at_once() {
    let results = on_ranks(2, SECOND, |g| {
        assert!(g.direct_copy(), "the path under test is in use");
        if g.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
            return (String::new(), Duration::ZERO);
        }
        let started = std::time::Instant::now();
        let err = g.all_reduce(&Tensor::ones([4], (Kind::Float, Device::Cpu)), ReduceOp::Sum);
        (err.unwrap_err().to_string(), started.elapsed())
    });
    let (err, waited) = &results[0];
    assert!(err.contains("rank 1") && err.contains("closed"), "{err}");
    assert!(*waited < Duration::from_secs(5), "waited {waited:?} of a 20 s timeout: {err}");
}

/// A rank in a collective that goes over TCP (a broadcast it roots) while its peer waits on
/// the mailbox in a direct one: the peer reads the header it sent and names both sides.
#[test]
fn a_tcp_collective_against_a_direct_one_is_named_on_both_sides_at_once() {
    let results = on_ranks(2, SECOND, |g| {
        let t = Tensor::ones([6], (Kind::Float, Device::Cpu));
        let started = std::time::Instant::now();
        let outcome =
            if g.rank() == 0 { g.all_reduce(&t, ReduceOp::Sum) } else { g.broadcast(&t, 1) };
        // Rank 1's broadcast only sends; it stays until rank 0 has read what it sent.
        std::thread::sleep(Duration::from_millis(300));
        (outcome.map_err(|e| e.to_string()), started.elapsed())
    });
    let (outcome, waited) = &results[0];
    let err = outcome.clone().unwrap_err();
    assert!(err.contains("collective #1 broadcast") && err.contains("#1 all_reduce"), "{err}");
    assert!(*waited < Duration::from_secs(5), "waited {waited:?} of a 20 s timeout: {err}");
}

#[test]
fn a_rank_that_never_starts_is_named_at_rendezvous() {
    let port = free_port("127.0.0.1").unwrap();
    let options = GroupOptions {
        timeout: Duration::from_millis(800),
        direct_copy: true,
        ..Default::default()
    };
    let err = ProcessGroup::new(&topology(0, 2, port), options).unwrap_err().to_string();
    assert!(err.contains("rank(s) [1] of 2 never arrived"), "{err}");
}

#[test]
fn a_run_with_a_token_forms_its_mesh_and_subgroups_and_reduces() {
    let token = auth::Token::from_bytes(b"0123456789abcdef0123").unwrap();
    let options = GroupOptions { timeout: SECOND, direct_copy: false, token, machine: None };
    let sums = on_ranks_with(3, options, |g| {
        let t = Tensor::from_slice(&[g.rank() as f64 + 1.0]);
        g.all_reduce(&t, ReduceOp::Sum).unwrap();
        t.double_value(&[0])
    });
    assert_eq!(sums, [6.0, 6.0, 6.0]);
}

/// A sequence checker for a thread rank whose divergence reports land in `reports`.
fn checker_of(g: &ProcessGroup, reports: &Arc<Mutex<Vec<String>>>) -> ledger::SequenceChecker {
    let reports = reports.clone();
    ledger::SequenceChecker::start(
        g.new_store_connection().unwrap(),
        SECOND,
        Arc::new(move |m: &str| reports.lock().unwrap().push(m.to_owned())),
    )
    .unwrap()
}

fn wait_for_report(reports: &Mutex<Vec<String>>, within: Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(r) = reports.lock().unwrap().first() {
            return r.clone();
        }
        assert!(std::time::Instant::now() < deadline, "no divergence reported in {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn collectives_reordered_between_ranks_are_reported_at_the_next_step_with_both_call_sites() {
    let results = on_ranks(2, SECOND, |g| {
        let reports = Arc::new(Mutex::new(Vec::new()));
        let checker = checker_of(&g, &reports);
        let comm: Arc<dyn Communicator> = Arc::new(g.clone());
        let (a, b) = (
            Tensor::ones([4], (Kind::Float, Device::Cpu)),
            Tensor::ones([4], (Kind::Float, Device::Cpu)),
        );
        // Step 1: the same collectives everywhere.
        g.all_reduce(&a, ReduceOp::Sum).unwrap();
        g.broadcast(&b, 0).unwrap();
        checker.submit(1, ledger::distinct([comm.clone()])).unwrap();
        // Step 2: equal shapes, swapped order — the data would be combined wrongly without
        // a word, since every header matches.
        let sites = if g.rank() == 0 {
            let first = line!() + 1;
            g.all_reduce(&a, ReduceOp::Sum).unwrap();
            let second = line!() + 1;
            g.all_reduce(&b, ReduceOp::Sum).unwrap();
            (first, second)
        } else {
            let first = line!() + 1;
            g.all_reduce(&b, ReduceOp::Sum).unwrap();
            let second = line!() + 1;
            g.all_reduce(&a, ReduceOp::Sum).unwrap();
            (first, second)
        };
        checker.submit(2, ledger::distinct([comm.clone()])).unwrap();
        let report = wait_for_report(&reports, Duration::from_secs(5));
        let later = checker.submit(3, ledger::distinct([comm])).unwrap_err().to_string();
        (report, sites, later)
    });
    let (site0, site1) = (results[0].1.0, results[1].1.0);
    for (report, _, later) in &results {
        assert!(
            report.contains("before optimizer step 2 in the group of ranks [0, 1]"),
            "{report}"
        );
        assert!(report.contains("the 1st collective of the step differs"), "{report}");
        assert!(
            report.contains(&format!(
                "collective #3 all_reduce(sum) of [4] Float at src/comm/tests.rs:{site0}"
            )),
            "{report}"
        );
        assert!(report.contains(&format!("at src/comm/tests.rs:{site1}")), "{report}");
        assert_eq!(later, report, "the next step returns the divergence");
    }
}

#[test]
fn a_rank_that_skipped_a_collective_is_named_with_the_one_the_other_waits_in_within_5_s() {
    let started = std::time::Instant::now();
    let results = on_ranks(2, SECOND, move |g| {
        let reports = Arc::new(Mutex::new(Vec::new()));
        let checker = checker_of(&g, &reports);
        let comm: Arc<dyn Communicator> = Arc::new(g.clone());
        let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
        g.all_reduce(&x, ReduceOp::Sum).unwrap();
        checker.submit(1, ledger::distinct([comm.clone()])).unwrap();
        let waited_in = line!() + 5;
        if g.rank() == 0 {
            // Rank 1 skips this one, so rank 0's next collective waits for a partner that
            // never comes; the check, not the 20 s timeout, ends it.
            g.all_reduce(&x, ReduceOp::Sum).unwrap();
            let blocked = g.all_reduce(&x, ReduceOp::Sum).map_err(|e| e.to_string());
            (blocked.unwrap_err(), waited_in, started.elapsed())
        } else {
            g.all_reduce(&x, ReduceOp::Sum).unwrap();
            checker.submit(2, ledger::distinct([comm])).unwrap();
            (wait_for_report(&reports, Duration::from_secs(5)), waited_in, started.elapsed())
        }
    });
    let (report, site, elapsed) = &results[1];
    assert!(*elapsed < Duration::from_secs(6), "reported after {elapsed:?}");
    assert!(
        report.contains(&format!(
            "rank 0 is in its collective #3 (all_reduce(sum) of [4] Float at src/comm/tests.rs:{site}), which rank 1 never issued"
        )),
        "{report}"
    );
    assert!(report.contains("rank 1 reached the step after collective #2"), "{report}");
    // The check aborted rank 1's side, so rank 0's wait failed at once instead of timing out.
    let (blocked, _, elapsed) = &results[0];
    assert!(*elapsed < Duration::from_secs(8), "{blocked} after {elapsed:?}");
}
