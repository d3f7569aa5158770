//! `accel test`: what each process runs. Every check is agreed across ranks (a rank that
//! fails makes the check fail everywhere); rank 0 prints one line per check.

use accel_core::comm::{Communicator, GroupOptions, ProcessGroup, ReduceOp};
use accel_core::data::{Sampler, ShardOptions, shard_batches};
use accel_core::split_between;
use accel_core::topology::Topology;
use tch::{Device, Kind, Tensor};

type Check = (&'static str, Box<dyn Fn(&ProcessGroup) -> accel_core::Result<bool>>);

pub(crate) fn run() -> accel_core::Result<bool> {
    let topology = Topology::from_env()?;
    let group = ProcessGroup::new(&topology, GroupOptions::from_env()?)?;
    if group.rank() == 0 {
        println!(
            "accel test: {} processes ({}), accel {}, libtorch {}",
            group.size(),
            topology.source,
            accel_core::VERSION,
            accel_core::shim::torch_version()
        );
        let token = GroupOptions::from_env()?.token.is_set();
        println!(
            "accel test: transport {}; connections {}",
            if group.size() > 1 {
                group.transport().to_string()
            } else {
                "none (one process)".into()
            },
            if token { "authenticated (ACCEL_TOKEN)" } else { "not authenticated (no token)" }
        );
    }
    let checks: Vec<Check> = vec![
        ("all_reduce sum/avg/min/max × f32, f64, f16, bf16, i64", Box::new(all_reduce)),
        ("broadcast, all_gather, reduce_scatter", Box::new(broadcast_gather_scatter)),
        ("send/recv around the ring", Box::new(send_recv_ring)),
        ("all_to_all (part j to rank j)", Box::new(all_to_all)),
        ("objects: all_gather_objects, broadcast_object", Box::new(objects)),
        ("data sharding (Accelerate's rules, every sample seen)", Box::new(sharding)),
        ("RNG agreement (seeded torch and shuffle)", Box::new(rng)),
        ("training parity: N processes = 1 process (1e-6)", Box::new(parity)),
    ];
    let mut all = true;
    for (name, check) in checks {
        let mine = match check(&group) {
            Ok(ok) => ok,
            Err(e) => {
                eprintln!("accel test: {name}: {e}");
                false
            }
        };
        let flag = Tensor::from_slice(&[i64::from(mine)]);
        group.all_reduce(&flag, ReduceOp::Min)?;
        let ok = flag.int64_value(&[0]) == 1;
        all &= ok;
        if group.rank() == 0 {
            println!("{} {name}", if ok { "PASS" } else { "FAIL" });
        }
    }
    if group.rank() == 0 {
        println!(
            "{}",
            if all { "accel test: all checks passed" } else { "accel test: some checks FAILED" }
        );
    }
    Ok(all)
}

fn close(a: &Tensor, b: &Tensor, tolerance: f64) -> bool {
    let diff = (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[]);
    diff <= tolerance
}

fn all_reduce(g: &ProcessGroup) -> accel_core::Result<bool> {
    let (r, w) = (g.rank() as f64, g.size() as f64);
    let base = Tensor::arange(100, (Kind::Double, Device::Cpu));
    let mut ok = true;
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16, Kind::Int64] {
        let tolerance = match kind {
            Kind::Half | Kind::BFloat16 => 100.0 * w * w / 64.0,
            _ => 1e-9,
        };
        let cases = [
            (ReduceOp::Sum, &base * (w * (w + 1.0) / 2.0)),
            (ReduceOp::Avg, &base * ((w + 1.0) / 2.0)),
            (ReduceOp::Min, base.shallow_clone()),
            (ReduceOp::Max, &base * w),
        ];
        for (op, expected) in cases {
            if op == ReduceOp::Avg && kind == Kind::Int64 {
                continue;
            }
            let t = (&base * (r + 1.0)).to_kind(kind);
            g.all_reduce(&t, op)?;
            ok &= close(&t, &expected, tolerance);
        }
    }
    Ok(ok)
}

fn broadcast_gather_scatter(g: &ProcessGroup) -> accel_core::Result<bool> {
    let (r, w) = (g.rank() as i64, g.size() as i64);
    let t = Tensor::full([7], r as f64, (Kind::Float, Device::Cpu));
    g.broadcast(&t, (w - 1) as usize)?;
    let mut ok = close(&t, &Tensor::full([7], (w - 1) as f64, (Kind::Float, Device::Cpu)), 0.0);
    let gathered = g.all_gather(&Tensor::from_slice(&[r, r * r]))?;
    let expected: Vec<i64> = (0..w).flat_map(|i| [i, i * i]).collect();
    ok &= Vec::<i64>::try_from(&gathered).map_err(accel_core::Error::from)? == expected;
    let input = Tensor::arange(2 * w, (Kind::Int64, Device::Cpu)) + r;
    let mine = g.reduce_scatter(&input, ReduceOp::Sum)?;
    let sum_r = w * (w - 1) / 2;
    let expected: Vec<i64> = (2 * r..2 * r + 2).map(|i| w * i + sum_r).collect();
    ok &= Vec::<i64>::try_from(&mine).map_err(accel_core::Error::from)? == expected;
    Ok(ok)
}

fn send_recv_ring(g: &ProcessGroup) -> accel_core::Result<bool> {
    let (r, w) = (g.rank(), g.size());
    let out = Tensor::from_slice(&[r as f32; 4]);
    let got = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
    if r % 2 == 0 {
        g.send(&out, next)?;
        g.recv(&got, prev)?;
    } else {
        g.recv(&got, prev)?;
        g.send(&out, next)?;
    }
    Ok(close(&got, &Tensor::full([4], prev as f64, (Kind::Float, Device::Cpu)), 0.0))
}

/// Part j of rank r holds 100·r + j; afterwards part i of rank r holds 100·i + r.
fn all_to_all_parts(r: i64, w: i64, device: Device) -> (Tensor, Tensor) {
    let parts = |f: &dyn Fn(i64) -> i64| {
        Tensor::from_slice(&(0..w).flat_map(|i| [f(i); 3]).collect::<Vec<_>>()).to_device(device)
    };
    (parts(&|j| 100 * r + j), parts(&|i| 100 * i + r))
}

fn all_to_all(g: &ProcessGroup) -> accel_core::Result<bool> {
    let (input, expected) = all_to_all_parts(g.rank() as i64, g.size() as i64, Device::Cpu);
    Ok(close(&g.all_to_all(&input)?, &expected, 0.0))
}

fn objects(g: &ProcessGroup) -> accel_core::Result<bool> {
    let names = g.all_gather_objects(&format!("rank-{}", g.rank()))?;
    let expected: Vec<String> = (0..g.size()).map(|r| format!("rank-{r}")).collect();
    let value = (g.rank() == 0).then(|| vec![1.5f64, 2.5]);
    let shared: Vec<f64> = g.broadcast_object(value.as_ref(), 0)?;
    Ok(names == expected && shared == [1.5, 2.5])
}

fn sharding(g: &ProcessGroup) -> accel_core::Result<bool> {
    let (r, w) = (g.rank(), g.size());
    let all: Vec<usize> = (0..22).collect();
    let batches: Vec<Vec<usize>> = all.chunks(3).map(<[usize]>::to_vec).collect();
    let options = ShardOptions {
        rank: r,
        world: w,
        batch_size: 3,
        drop_last: false,
        even_batches: true,
        split_batches: false,
    };
    let mine = shard_batches(&batches, options);
    let everyone: Vec<Vec<Vec<usize>>> = g.all_gather_objects(&mine)?;
    let same_count = everyone.iter().all(|b| b.len() == mine.len());
    let mut seen: Vec<usize> = everyone.iter().flatten().flatten().copied().collect();
    seen.sort();
    seen.dedup();
    Ok(same_count && seen == all)
}

fn rng(g: &ProcessGroup) -> accel_core::Result<bool> {
    tch::manual_seed(1234);
    let t = Tensor::randn([5], (Kind::Float, Device::Cpu));
    let all = g.all_gather_list(&t)?;
    let torch_agrees = all.iter().all(|x| close(x, &all[0], 0.0));
    let order = Sampler::Shuffled { seed: 7 }.indices(3, 50);
    let orders = g.all_gather_objects(&order)?;
    Ok(torch_agrees && orders.iter().all(|o| *o == order))
}

/// y = 2x + 3 + noise, plain gradient descent: each rank's gradient on its share of the
/// data, averaged, must equal the full-batch gradient one process computes.
fn parity(g: &ProcessGroup) -> accel_core::Result<bool> {
    tch::manual_seed(0);
    let n = 16 * g.size() as i64;
    let x = Tensor::randn([n, 1], (Kind::Float, Device::Cpu));
    let y = &x * 2.0 + 3.0 + Tensor::randn([n, 1], (Kind::Float, Device::Cpu)) * 0.1;
    let indices: Vec<i64> = (0..n).collect();
    let share = Tensor::from_slice(&split_between(&indices, g.rank(), g.size(), false));
    let (xs, ys) = (x.index_select(0, &share), y.index_select(0, &share));
    let step = |w: &Tensor, b: &Tensor, x: &Tensor, y: &Tensor| -> (Tensor, Tensor) {
        let err = x * w + b - y;
        ((&err * x).mean(Kind::Float) * 2.0, err.mean(Kind::Float) * 2.0)
    };
    let (mut w1, mut b1) = (
        Tensor::zeros([], (Kind::Float, Device::Cpu)),
        Tensor::zeros([], (Kind::Float, Device::Cpu)),
    );
    let (mut wn, mut bn) = (w1.copy(), b1.copy());
    for _ in 0..20 {
        let (gw, gb) = step(&w1, &b1, &x, &y);
        w1 = &w1 - gw * 0.1;
        b1 = &b1 - gb * 0.1;
        let (gw, gb) = step(&wn, &bn, &xs, &ys);
        let grads = Tensor::stack(&[gw, gb], 0);
        g.all_reduce(&grads, ReduceOp::Avg)?;
        wn = &wn - grads.get(0) * 0.1;
        bn = &bn - grads.get(1) * 0.1;
    }
    Ok(close(&w1, &wn, 1e-6) && close(&b1, &bn, 1e-6) && close(&w1, &Tensor::from(2.0f32), 0.5))
}

/// For the launcher's fault tests: writes its pid to `$ACCEL_PID_DIR/$RANK`, then
/// all-reduces forever, over the cpu backend or (`nccl`; scripts/gpu-check.sh kills a rank
/// in the middle of it) over NCCL, each all-reduce waited for by the host.
pub(crate) fn spin(nccl: bool) -> accel_core::Result<bool> {
    let topology = Topology::from_env()?;
    let group = ProcessGroup::new(&topology, GroupOptions::from_env()?)?;
    if let Some(dir) = std::env::var_os(accel_core::config::env::PID_DIR) {
        let path = std::path::Path::new(&dir).join(topology.rank.to_string());
        let _ = std::fs::write(path, std::process::id().to_string());
    }
    if !nccl {
        let t = Tensor::ones([1 << 20], (Kind::Float, Device::Cpu));
        loop {
            group.all_reduce(&t, ReduceOp::Avg)?;
        }
    }
    let device = Device::Cuda(topology.local_rank);
    let comm = accel_core::comm::nccl::NcclComm::new(&group, device)?;
    let t = Tensor::ones([1 << 24], (Kind::Float, device));
    loop {
        comm.all_reduce(&t, ReduceOp::Avg)?;
        tch::Cuda::synchronize(topology.local_rank as i64);
    }
}

/// DDP's checks, on the processes `accel test` launched: loaders and `gather_for_metrics`,
/// replicas and accumulation, checkpoints, then DDP's options. Whether all passed.
pub(crate) fn ddp() -> accel_core::Result<bool> {
    use accel_core::Accelerator;
    use accel_core::strategy::ddp::DdpOptions;

    // Tiny buckets: the MLP's four parameters land in several buckets.
    let ddp = DdpOptions { bucket_bytes: 200, ..Default::default() };
    // The checks below give each rank batches of its own (and deal loaders themselves).
    let acc = Accelerator::builder()
        .accumulate(2)
        .cpu(true)
        .ddp(ddp)
        .data(accel_core::DataSharding::Manual)
        .build()?;
    let mut ok = true;
    let mut report = |name: &str, pass: bool| {
        ok &= pass;
        acc.print(format!("{} {name}", if pass { "PASS" } else { "FAIL" }));
    };
    ddp_loaders(&acc, &mut report)?;
    ddp_training(&acc, &mut report)?;
    ddp_options(&acc, &mut report)?;
    Ok(ok)
}

/// What `report` is told: a check's name and whether it passed.
type Report<'a> = dyn FnMut(&str, bool) + 'a;

fn ddp_loaders(acc: &accel_core::Accelerator, report: &mut Report) -> accel_core::Result<()> {
    use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};

    // gather_for_metrics: 82 samples in batches of 16 come back as exactly 82, in order.
    let x = Tensor::arange(82, (Kind::Int64, Device::Cpu));
    let options = LoaderOptions { batch_size: 16, prefetch: 0, ..Default::default() };
    let mut loader = acc.prepare_loader(DataLoader::new(TensorDataset::new(vec![x])?, options)?)?;
    let mut seen = Vec::new();
    for batch in loader.iter() {
        let gathered = acc.gather_for_metrics(&batch?[0])?;
        seen.extend(Vec::<i64>::try_from(&gathered).map_err(accel_core::Error::from)?);
    }
    seen.sort();
    report(
        "gather_for_metrics returns exactly 82 of 82 samples",
        seen == (0..82).collect::<Vec<_>>(),
    );

    // Accelerate's oracle: 22 samples, batch 3, 2 ranks: the last round [18..21, 0, 1] → [18..21].
    if acc.num_processes() == 2 {
        let x = Tensor::arange(22, (Kind::Int64, Device::Cpu));
        let options = LoaderOptions { batch_size: 3, prefetch: 0, ..Default::default() };
        let mut loader =
            acc.prepare_loader(DataLoader::new(TensorDataset::new(vec![x])?, options)?)?;
        let mut last = Vec::new();
        for batch in loader.iter() {
            last = Vec::<i64>::try_from(acc.gather_for_metrics(&batch?[0])?)
                .map_err(accel_core::Error::from)?;
        }
        report(
            "gather_for_metrics drops the padding: last round [18, 19, 20, 21]",
            last == [18, 19, 20, 21],
        );
    }
    Ok(())
}

fn ddp_training(acc: &accel_core::Accelerator, report: &mut Report) -> accel_core::Result<()> {
    use accel_core::optim::{Sgd, SgdConfig, named_params};
    use tch::nn::{self, Module};

    let group = acc.process_group().expect("launched with several processes").clone();
    // Replicas start equal (rank 0's initial values are broadcast).
    tch::manual_seed(100 + acc.process_index() as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "layers" / 0, 4, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "layers" / 1, 8, 1, Default::default()));
    acc.prepare_model(&vs)?;
    let w = vs.variables()["layers.0.weight"].shallow_clone();
    let all = acc.gather(&w.unsqueeze(0))?;
    report(
        "parameters are broadcast from rank 0 at prepare",
        close(&all.get(0), &all.get(group.size() as i64 - 1), 0.0),
    );

    // Accumulation: no communication on the first micro-step, averaged gradients on the
    // second, equal on every rank; the average of the ranks' local gradients.
    let mut opt = acc.prepare_optimizer(Sgd::new(
        named_params(&vs),
        SgdConfig { lr: 0.1, ..Default::default() },
    )?);
    let r = acc.process_index() as f64;
    let batch = |k: f64| Tensor::full([4, 4], r + k, (Kind::Float, Device::Cpu));
    let before = group.collectives_issued();
    acc.backward(&net.forward(&batch(0.0)).mean(Kind::Float))?;
    let silent = group.collectives_issued() == before;
    acc.backward(&net.forward(&batch(1.0)).mean(Kind::Float))?;
    let spoke = group.collectives_issued() > before;
    report(
        "no communication on accumulation steps; buckets all-reduced on sync steps",
        silent && spoke && acc.sync_gradients(),
    );
    let grad = w.grad();
    let grads = acc.gather(&grad.unsqueeze(0))?;
    report(
        "gradients are equal on every rank after a sync step",
        close(&grads.get(0), &grads.get(group.size() as i64 - 1), 1e-7),
    );
    opt.step()?;
    opt.zero_grad()?;

    // The same optimizer not prepared, stepped directly: an error naming the rank and the
    // cure, and the weights untouched (its step would apply this rank's gradients alone).
    let before = w.copy();
    let mut raw = Sgd::new(named_params(&vs), SgdConfig { lr: 0.1, ..Default::default() })?;
    // DDP zeroes gradients in place (they are views of its buckets), so one is defined.
    let _ = w.grad().fill_(1.0);
    let refused = match accel_core::optim::Optimizer::step(&mut raw) {
        Err(e) => e.to_string(),
        Ok(()) => String::new(),
    };
    report(
        "an unprepared optimizer stepped directly is refused, naming the rank",
        refused.contains(&format!("on rank {} of {}", acc.process_index(), group.size()))
            && refused.contains("prepare_optimizer")
            && close(&w, &before, 0.0),
    );
    opt.zero_grad()?;

    // A checkpoint of a multi-process run: one folder, every rank's RNG state in it.
    let dir = std::env::temp_dir()
        .join(format!("accel-ddp-{}", std::env::var("MASTER_PORT").unwrap_or_default()));
    acc.save_state(&dir)?;
    let files: Vec<bool> = (0..group.size())
        .map(|r| dir.join(format!("rng_state_{r}.safetensors")).exists())
        .collect();
    acc.load_state(&dir)?;
    acc.wait_for_everyone()?;
    if acc.is_main_process() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    report(
        "save_state/load_state with several processes (one folder, each rank's RNG state)",
        files.iter().all(|f| *f),
    );
    Ok(())
}

fn ddp_options(acc: &accel_core::Accelerator, report: &mut Report) -> accel_core::Result<()> {
    use accel_core::strategy::ddp::DdpOptions;
    use tch::nn::{self, Module};

    let r = acc.process_index() as f64;
    // bf16 gradient compression: close to the fp32 average, but not equal to it.
    let twin = |seed: i64| -> (nn::VarStore, nn::Linear) {
        tch::manual_seed(seed);
        let vs = nn::VarStore::new(Device::Cpu);
        let lin = nn::linear(vs.root() / "lin", 64, 64, Default::default());
        (vs, lin)
    };
    let (plain_vs, plain) = twin(5);
    let (packed_vs, packed) = twin(5);
    acc.prepare_model_with(&plain_vs, DdpOptions::default())?;
    let compressed = DdpOptions { compression: Some(Kind::BFloat16), ..Default::default() };
    acc.prepare_model_with(&packed_vs, compressed)?;
    let input = (Tensor::arange(64 * 64, (Kind::Float, Device::Cpu)).view([64, 64])
        * (0.01 * (r + 1.0)))
        .sin();
    for _ in 0..2 {
        let loss = plain.forward(&input).square().mean(Kind::Float)
            + packed.forward(&input).square().mean(Kind::Float);
        acc.backward(&loss)?;
    }
    let (a, b) =
        (plain_vs.variables()["lin.weight"].grad(), packed_vs.variables()["lin.weight"].grad());
    let scale = a.abs().max().double_value(&[]);
    let diff = (&a - &b).abs().max().double_value(&[]);
    report(
        "bf16 gradient compression: within bf16 rounding of the fp32 average",
        diff > 0.0 && diff < scale * 2e-2,
    );

    // allow_unused: a parameter without a gradient contributes zeros instead of failing.
    let lenient_vs = nn::VarStore::new(Device::Cpu);
    let used = lenient_vs.root().var("used", &[2], nn::Init::Const(1.0));
    let idle = lenient_vs.root().var("idle", &[2], nn::Init::Const(1.0));
    acc.prepare_model_with(&lenient_vs, DdpOptions { allow_unused: true, ..Default::default() })?;
    acc.backward(&used.sum(Kind::Float))?;
    acc.backward(&used.sum(Kind::Float))?;
    let idle_grad = idle.grad();
    let zero = idle_grad.defined() && idle_grad.abs().sum(Kind::Float).double_value(&[]) == 0.0;
    report("allow_unused: an unused parameter gets a zero gradient", zero);

    // A parameter without a gradient is named.
    let unused_vs = nn::VarStore::new(Device::Cpu);
    let used = unused_vs.root().var("used", &[2], nn::Init::Const(1.0));
    let _unused = unused_vs.root().var("unused", &[2], nn::Init::Const(1.0));
    acc.prepare_model(&unused_vs)?;
    let _ = acc.backward(&used.sum(Kind::Float)); // micro-step 1 of 2: nothing to check yet
    let err = acc
        .backward(&used.sum(Kind::Float))
        .map(|_| String::new())
        .unwrap_or_else(|e| e.to_string());
    report(
        "a parameter that got no gradient is an error naming it",
        err.contains("parameter(s) [\"unused\"] received no gradient"),
    );
    Ok(())
}

/// For GPU machines: NCCL collectives between the processes, one GPU each, through the
/// same communicator the strategies use (`scripts/gpu-check.sh` runs it); every result is
/// compared with the value computed locally. Fails with the reason on machines without.
pub(crate) fn nccl() -> accel_core::Result<bool> {
    use accel_core::comm::nccl::NcclComm;
    let topology = Topology::from_env()?;
    let group = ProcessGroup::new(&topology, GroupOptions::from_env()?)?;
    let device = Device::Cuda(topology.local_rank);
    let comm = NcclComm::new(&group, device)?;
    let (r, w) = (group.rank() as f64, group.size() as f64);
    let main = group.rank() == 0;
    let mut ok = true;
    let mut report = |name: String, passed: bool| {
        ok &= passed;
        if main {
            println!("{} {name}", if passed { "PASS" } else { "FAIL" });
        }
    };
    if main {
        let (path, version) = comm.library();
        println!("     NCCL {version} from {}", path.display());
    }
    // Values that every dtype holds exactly before the sum (< 256), and whose sum over
    // the ranks stays far below f16's largest finite value (65504).
    let base = || Tensor::arange(1 << 20, (Kind::Float, device)).remainder(256);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double, Kind::Int64, Kind::Int] {
        let t = (base() * (r + 1.0)).to_kind(kind);
        comm.all_reduce(&t, ReduceOp::Sum)?;
        let expected = base() * (w * (w + 1.0) / 2.0);
        let scale = expected.abs().max().double_value(&[]);
        let tolerance =
            if matches!(kind, Kind::BFloat16 | Kind::Half) { scale * 1e-2 } else { 0.0 };
        let diff = (t.to_kind(Kind::Float) - &expected).abs().max().double_value(&[]);
        report(format!("nccl all_reduce sum {kind:?} (max diff {diff:.3e})"), diff <= tolerance);
    }
    let t = Tensor::full([4096], r + 1.0, (Kind::Float, device));
    comm.all_reduce(&t, ReduceOp::Avg)?;
    let avg = t.mean(Kind::Float).double_value(&[]);
    report(format!("nccl all_reduce avg f32 ({avg})"), avg == (w + 1.0) / 2.0);
    let t = Tensor::full([4096], r, (Kind::Float, device));
    comm.all_reduce(&t, ReduceOp::Max)?;
    report("nccl all_reduce max f32".into(), t.min().double_value(&[]) == w - 1.0);
    let b = Tensor::full([1000], r + 7.0, (Kind::Float, device));
    comm.broadcast(&b, 0)?;
    report("nccl broadcast".into(), (b - 7.0).abs().max().double_value(&[]) == 0.0);
    let gathered = comm.all_gather(&Tensor::full([2], r, (Kind::Float, device)))?;
    let expected = Tensor::arange(group.size() as i64, (Kind::Float, device))
        .repeat_interleave_self_int(2, 0, None);
    let gather_ok = gathered.size() == expected.size()
        && (gathered - expected).abs().max().double_value(&[]) == 0.0;
    report("nccl all_gather (values in rank order)".into(), gather_ok);
    let rows = Tensor::arange(group.size() as i64 * 3, (Kind::Float, device)) * (r + 1.0);
    let mine = comm.reduce_scatter(&rows, ReduceOp::Sum)?;
    let expected = Tensor::arange(group.size() as i64 * 3, (Kind::Float, device)).narrow(
        0,
        3 * group.rank() as i64,
        3,
    ) * (w * (w + 1.0) / 2.0);
    report(
        "nccl reduce_scatter sum".into(),
        (mine - expected).abs().max().double_value(&[]) == 0.0,
    );
    let (input, expected) = all_to_all_parts(group.rank() as i64, group.size() as i64, device);
    let exchanged = comm.all_to_all(&input.to_kind(Kind::Float))?;
    let diff = (exchanged - expected.to_kind(Kind::Float)).abs().max().double_value(&[]);
    report("nccl all_to_all (part j to rank j)".into(), diff == 0.0);
    if group.size() > 1 {
        let next = (group.rank() + 1) % group.size();
        let prev = (group.rank() + group.size() - 1) % group.size();
        let out = Tensor::full([256], r, (Kind::Float, device));
        let into = Tensor::zeros([256], (Kind::Float, device));
        comm.send_recv_async(&out, next, &into, prev)?.wait()?;
        report(
            "nccl send/recv around the ring".into(),
            into.min().double_value(&[]) == prev as f64,
        );
    }
    comm.barrier()?;
    Ok(ok)
}
