//! From the crates.io package border-tch-agent 0.0.6 (`border-tch-agent-0.0.6.crate`):
//! `src/dqn/base.rs` (`Dqn::opt_`, with `Dqn::update_critic` and `Agent::opt`),
//! `src/dqn/model/base.rs` (`DqnModel`), `src/opt.rs` (`OptimizerConfig`, `Optimizer`),
//! `src/util.rs` (`track`), `src/model/base.rs` (`ModelBase`, `SubModel`). Licence: MIT OR
//! Apache-2.0 (`Cargo.toml`; the package ships no licence file:
//! licenses/border-tch-agent-0.0.6-LICENSE-NOTE.md).
//!
//! The loop: the DQN agent's optimisation, called by border-core's trainer every few
//! environment steps once the replay buffer holds `min_transitions_warmup` transitions:
//! `for _ in 0..self.n_updates_per_opt { let loss = self.update_critic(buffer); loss_critic
//! += loss; }`, then a soft update of the target network every `soft_update_interval` calls
//! (`track`), and a `Record` of the mean loss. `update_critic` samples a batch from the
//! buffer, computes the (double) DQN target under `no_grad`, a smooth-L1 loss (weighted, with
//! clipped TD errors and a priority update, when the buffer is prioritised) and steps with
//! `self.qnet.backward_step(&loss)`: the Q network (`DqnModel`) owns its VarStore **and** its
//! optimizer (border's `Optimizer::Adam(nn::Optimizer)`, built in `DqnModel::_build`), and
//! `backward_step` is the model's method.
//!
//! Changed: local stand-ins for border-core (`Record`, `RecordValue`, the replay buffer and
//! batch traits `ReplayBufferBase`/`StdBatchBase`, reduced to what `opt_` uses) and for the
//! `Env`/`Policy` parts of the agent (the `E` parameter dropped from `Dqn<E, Q, R>`); the Q
//! network (`Mlp` of border's `mlp` module) is the digits MLP (`SubModel` over
//! `data::mlp`); the environment (border's examples run gym's CartPole or Atari through
//! Python) replaced in `run` by a stand-in: the observation is a training digit, the action
//! a guess of its label, reward 1 when right; the trainer's loop in `run` pushes transitions
//! and calls `agent.opt(&mut buffer)` every step, as border-core's `Trainer` does with
//! `opt_interval = 1`; the configs (`DqnConfig`, `DqnModelConfig`, serde) are flattened
//! into arguments and fields; `Tensor::of_slice` -> `Tensor::from_slice`, `f32::from` ->
//! `f32::try_from(..).unwrap()` (tch 0.24). Sizes small.
//!
//! Expected: **Refused { line: 436, says: "found no `loss.backward()`" }**, at the name of
//! `opt_`: the backward pass is one call down (`update_critic`) and, there, inside the
//! model's own `backward_step`, so the function holding the loop runs none. Also at that
//! line: "needs a function returning `()` or a `Result`" (`opt_` returns a `Record`). Moving
//! the attribute to `update_critic` would not help: it has no loop, and its optimizer is two
//! structs deep (`self.qnet.opt`), its VarStore likewise (`model = self.qnet.var_store`
//! would name it, but `self.qnet.backward_step(..)` is a method of the model, not of an
//! optimizer the attribute can drive).
use std::collections::HashMap;
use std::marker::PhantomData;

use anyhow::Result;
use tch::nn::{Adam, Optimizer as Optimizer_, OptimizerConfig as OptimizerConfig_, VarStore};
use tch::{nn, no_grad, Device, Kind, Tensor};

use crate::data;

// ---------------------------------------------------------------------------------------
// border-core stand-ins: records, batches, replay buffers

#[derive(Debug, Clone)]
pub enum RecordValue {
    Scalar(f32),
}

#[derive(Debug, Clone, Default)]
pub struct Record(HashMap<String, RecordValue>);

impl Record {
    pub fn from_slice<K: Into<String> + Clone>(s: &[(K, RecordValue)]) -> Self {
        Self(s.iter().map(|(k, v)| (k.clone().into(), v.clone())).collect())
    }
}

/// A batch of transitions (border-core's `StdBatchBase`).
pub trait StdBatchBase {
    type ObsBatch;
    type ActBatch;

    #[allow(clippy::type_complexity)]
    fn unpack(
        self,
    ) -> (
        Self::ObsBatch,
        Self::ActBatch,
        Self::ObsBatch,
        Vec<f32>,
        Vec<i8>,
        Option<Vec<usize>>,
        Option<Vec<f32>>,
    );
}

/// A replay buffer (border-core's `ReplayBufferBase`).
pub trait ReplayBufferBase {
    type Batch;

    fn len(&self) -> usize;
    fn batch(&mut self, size: usize) -> Result<Self::Batch>;
    fn update_priority(&mut self, ixs: &Option<Vec<usize>>, td_err: &Option<Vec<f32>>);
}

pub struct TensorBatch {
    obs: Tensor,
    act: Tensor,
    next_obs: Tensor,
    reward: Vec<f32>,
    is_done: Vec<i8>,
}

impl StdBatchBase for TensorBatch {
    type ObsBatch = Tensor;
    type ActBatch = Tensor;

    fn unpack(
        self,
    ) -> (Tensor, Tensor, Tensor, Vec<f32>, Vec<i8>, Option<Vec<usize>>, Option<Vec<f32>>) {
        (self.obs, self.act, self.next_obs, self.reward, self.is_done, None, None)
    }
}

/// A uniform replay buffer (border-core's `SimpleReplayBuffer`), batches drawn with torch's
/// generator.
pub struct SimpleReplayBuffer {
    obs: Vec<Tensor>,
    act: Vec<i64>,
    next_obs: Vec<Tensor>,
    reward: Vec<f32>,
    is_done: Vec<i8>,
}

impl SimpleReplayBuffer {
    pub fn push(&mut self, obs: Tensor, act: i64, next_obs: Tensor, reward: f32, is_done: i8) {
        self.obs.push(obs);
        self.act.push(act);
        self.next_obs.push(next_obs);
        self.reward.push(reward);
        self.is_done.push(is_done);
    }
}

impl ReplayBufferBase for SimpleReplayBuffer {
    type Batch = TensorBatch;

    fn len(&self) -> usize {
        self.obs.len()
    }

    fn batch(&mut self, size: usize) -> Result<TensorBatch> {
        let ixs = Tensor::randint(self.len() as i64, [size as i64], (Kind::Int64, Device::Cpu));
        let ixs: Vec<i64> = Vec::try_from(&ixs)?;
        let pick = |v: &Vec<Tensor>| {
            let rows: Vec<Tensor> = ixs.iter().map(|&i| v[i as usize].shallow_clone()).collect();
            Tensor::stack(&rows, 0)
        };
        Ok(TensorBatch {
            obs: pick(&self.obs),
            act: Tensor::from_slice(&ixs.iter().map(|&i| self.act[i as usize]).collect::<Vec<_>>())
                .unsqueeze(-1),
            next_obs: pick(&self.next_obs),
            reward: ixs.iter().map(|&i| self.reward[i as usize]).collect(),
            is_done: ixs.iter().map(|&i| self.is_done[i as usize]).collect(),
        })
    }

    fn update_priority(&mut self, _ixs: &Option<Vec<usize>>, _td_err: &Option<Vec<f32>>) {}
}

// ---------------------------------------------------------------------------------------
// border-tch-agent: opt.rs, model/base.rs, util.rs

/// Configures an optimizer for training neural networks in an RL agent.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    /// Adam optimizer.
    Adam {
        /// Learning rate.
        lr: f64,
    },
}

impl OptimizerConfig {
    /// Constructs an optimizer.
    pub fn build(&self, vs: &VarStore) -> Result<Optimizer> {
        match &self {
            OptimizerConfig::Adam { lr } => {
                let opt = Adam::default().build(vs, *lr)?;
                Ok(Optimizer::Adam(opt))
            }
        }
    }
}

/// Optimizers. This is a thin wrapper of [tch::nn::Optimizer].
pub enum Optimizer {
    /// Adam optimizer.
    Adam(Optimizer_),
}

impl Optimizer {
    /// Applies a backward step pass.
    pub fn backward_step(&mut self, loss: &Tensor) {
        match self {
            Self::Adam(opt) => {
                opt.backward_step(loss);
            }
        }
    }
}

/// Base interface.
pub trait ModelBase {
    /// Trains the network given a loss.
    fn backward_step(&mut self, loss: &Tensor);

    /// Returns `var_store`.
    fn get_var_store(&self) -> &nn::VarStore;
}

/// Neural network model that can be initialized with [VarStore] and configuration.
pub trait SubModel {
    type Config;
    type Input;
    type Output;

    fn build(var_store: &VarStore, config: Self::Config) -> Self;
    fn clone_with_var_store(&self, var_store: &VarStore) -> Self;
    fn forward(&self, input: &Self::Input) -> Self::Output;
}

/// Apply soft update on a model.
///
/// Variables are identified by their names.
pub fn track<M: ModelBase>(dest: &mut M, src: &mut M, tau: f64) {
    let src = &mut src.get_var_store().variables();
    let dest = &mut dest.get_var_store().variables();
    debug_assert_eq!(src.len(), dest.len());

    let names = src.keys();
    tch::no_grad(|| {
        for name in names {
            let src = src.get(name).unwrap();
            let dest = dest.get_mut(name).unwrap();
            dest.copy_(&(tau * src + (1.0 - tau) * &*dest));
        }
    });
}

/// The Q network: the digits MLP (border's `Mlp`, config = output dimension).
pub struct Mlp {
    net: nn::Sequential,
    out_dim: i64,
}

impl SubModel for Mlp {
    type Config = i64;
    type Input = Tensor;
    type Output = Tensor;

    fn build(var_store: &VarStore, config: i64) -> Self {
        Mlp { net: data::mlp(&var_store.root()), out_dim: config }
    }

    fn clone_with_var_store(&self, var_store: &VarStore) -> Self {
        Self::build(var_store, self.out_dim)
    }

    fn forward(&self, input: &Tensor) -> Tensor {
        input.apply(&self.net)
    }
}

/// Represents value functions for DQN agents.
pub struct DqnModel<Q>
where
    Q: SubModel<Output = Tensor, Config = i64>,
{
    device: Device,
    var_store: nn::VarStore,

    // Dimension of the output vector (equal to the number of actions).
    pub(super) out_dim: i64,

    // Action-value function
    q: Q,

    // Optimizer
    opt_config: OptimizerConfig,
    opt: Optimizer,

    phantom: PhantomData<Q>,
}

impl<Q> DqnModel<Q>
where
    Q: SubModel<Output = Tensor, Config = i64>,
{
    pub fn build(out_dim: i64, opt_config: OptimizerConfig, device: Device) -> Self {
        let var_store = nn::VarStore::new(device);
        let q = Q::build(&var_store, out_dim);

        Self::_build(device, out_dim, opt_config, q, var_store, None)
    }

    fn _build(
        device: Device,
        out_dim: i64,
        opt_config: OptimizerConfig,
        q: Q,
        mut var_store: nn::VarStore,
        var_store_src: Option<&nn::VarStore>,
    ) -> Self {
        // Optimizer
        let opt = opt_config.build(&var_store).unwrap();

        // Copy var_store
        if let Some(var_store_src) = var_store_src {
            var_store.copy(var_store_src).unwrap();
        }

        Self { device, out_dim, opt_config, var_store, opt, q, phantom: PhantomData }
    }

    /// Outputs the action-value given an observation.
    pub fn forward(&self, x: &Q::Input) -> Tensor {
        let a = self.q.forward(x);
        debug_assert_eq!(a.size().as_slice()[1], self.out_dim);
        a
    }
}

impl<Q> Clone for DqnModel<Q>
where
    Q: SubModel<Output = Tensor, Config = i64>,
{
    fn clone(&self) -> Self {
        let device = self.device;
        let out_dim = self.out_dim;
        let opt_config = self.opt_config.clone();
        let var_store = nn::VarStore::new(device);
        let q = self.q.clone_with_var_store(&var_store);

        Self::_build(device, out_dim, opt_config, q, var_store, Some(&self.var_store))
    }
}

impl<Q> ModelBase for DqnModel<Q>
where
    Q: SubModel<Output = Tensor, Config = i64>,
{
    fn backward_step(&mut self, loss: &Tensor) {
        self.opt.backward_step(loss);
    }

    fn get_var_store(&self) -> &nn::VarStore {
        &self.var_store
    }
}

// ---------------------------------------------------------------------------------------
// border-tch-agent: dqn/base.rs

/// DQN agent implemented with tch-rs.
pub struct Dqn<Q, R>
where
    Q: SubModel<Output = Tensor, Config = i64>,
    R: ReplayBufferBase,
{
    soft_update_interval: usize,
    soft_update_counter: usize,
    n_updates_per_opt: usize,
    min_transitions_warmup: usize,
    batch_size: usize,
    qnet: DqnModel<Q>,
    qnet_tgt: DqnModel<Q>,
    phantom: PhantomData<R>,
    discount_factor: f64,
    tau: f64,
    device: Device,
    n_opts: usize,
    double_dqn: bool,
    clip_td_err: Option<(f64, f64)>,
}

impl<Q, R> Dqn<Q, R>
where
    Q: SubModel<Output = Tensor, Config = i64>,
    R: ReplayBufferBase,
    R::Batch: StdBatchBase,
    <R::Batch as StdBatchBase>::ObsBatch: Into<Q::Input>,
    <R::Batch as StdBatchBase>::ActBatch: Into<Tensor>,
{
    fn update_critic(&mut self, buffer: &mut R) -> f32 {
        let batch = buffer.batch(self.batch_size).unwrap();
        let (obs, act, next_obs, reward, is_done, ixs, weight) = batch.unpack();
        let obs = obs.into();
        let act = act.into().to(self.device);
        let next_obs = next_obs.into();
        let reward = Tensor::from_slice(&reward[..]).to(self.device);
        let is_done = Tensor::from_slice(&is_done[..]).to(self.device);

        let pred = {
            let x = self.qnet.forward(&obs);
            x.gather(-1, &act, false).squeeze()
        };

        let tgt = no_grad(|| {
            let q = if self.double_dqn {
                let x = self.qnet.forward(&next_obs);
                let y = x.argmax(-1, false).unsqueeze(-1);
                self.qnet_tgt.forward(&next_obs).gather(-1, &y, false).squeeze()
            } else {
                let x = self.qnet_tgt.forward(&next_obs);
                let y = x.argmax(-1, false).unsqueeze(-1);
                x.gather(-1, &y, false).squeeze()
            };
            reward + (1 - is_done) * self.discount_factor * q
        });

        let loss = if let Some(ws) = weight {
            let n = ws.len() as i64;
            let td_errs = match self.clip_td_err {
                None => (&pred - &tgt).abs(),
                Some((min, max)) => (&pred - &tgt).abs().clip(min, max),
            };
            let loss = Tensor::from_slice(&ws[..]).to(self.device) * &td_errs;
            let loss = loss.smooth_l1_loss(
                &Tensor::zeros([n], tch::kind::FLOAT_CPU).to(self.device),
                tch::Reduction::Mean,
                1.0,
            );
            self.qnet.backward_step(&loss);
            let td_errs = Vec::<f32>::try_from(td_errs).unwrap();
            buffer.update_priority(&ixs, &Some(td_errs));
            loss
        } else {
            let loss = pred.smooth_l1_loss(&tgt, tch::Reduction::Mean, 1.0);
            self.qnet.backward_step(&loss);
            loss
        };

        f32::try_from(loss).unwrap()
    }

    #[accel_core::accelerate(strategy = "ddp")]
    fn opt_(&mut self, buffer: &mut R) -> Record {
        let mut loss_critic = 0f32;

        for _ in 0..self.n_updates_per_opt {
            let loss = self.update_critic(buffer);
            loss_critic += loss;
        }

        self.soft_update_counter += 1;
        if self.soft_update_counter == self.soft_update_interval {
            self.soft_update_counter = 0;
            track(&mut self.qnet_tgt, &mut self.qnet, self.tau);
        }

        loss_critic /= self.n_updates_per_opt as f32;

        self.n_opts += 1;

        Record::from_slice(&[("loss_critic", RecordValue::Scalar(loss_critic))])
    }

    /// `Agent::opt`: optimises once the buffer holds enough transitions.
    fn opt(&mut self, buffer: &mut R) -> Option<Record> {
        if buffer.len() >= self.min_transitions_warmup {
            Some(self.opt_(buffer))
        } else {
            None
        }
    }
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let d = data::load()?;
    let device = Device::Cpu;
    let qnet: DqnModel<Mlp> = DqnModel::build(10, OptimizerConfig::Adam { lr: 1e-3 }, device);
    let qnet_tgt = qnet.clone();
    let mut agent: Dqn<Mlp, SimpleReplayBuffer> = Dqn {
        soft_update_interval: 4,
        soft_update_counter: 0,
        n_updates_per_opt: 2,
        min_transitions_warmup: data::batch_size() as usize,
        batch_size: data::batch_size() as usize,
        qnet,
        qnet_tgt,
        phantom: PhantomData,
        discount_factor: 0.99,
        tau: 0.01,
        device,
        n_opts: 0,
        double_dqn: true,
        clip_td_err: None,
    };
    let mut buffer = SimpleReplayBuffer {
        obs: vec![],
        act: vec![],
        next_obs: vec![],
        reward: vec![],
        is_done: vec![],
    };
    // border-core's Trainer: act, step the environment, push the transition, optimise.
    for step in 0..(4 * data::TRAIN) {
        let row = step % data::TRAIN;
        let obs = d.train_x.get(row);
        let act = no_grad(|| agent.qnet.forward(&obs.unsqueeze(0)).argmax(-1, false));
        // Epsilon-greedy with epsilon 0.1 (border's `EpsilonGreedy` at its final value).
        let act = if f64::try_from(Tensor::rand([1], (Kind::Float, device)))? < 0.1 {
            Tensor::randint(10, [1], (Kind::Int64, device)).int64_value(&[0])
        } else {
            act.int64_value(&[0])
        };
        let reward = if act == d.train_y.int64_value(&[row]) { 1.0 } else { 0.0 };
        let next_obs = d.train_x.get((row + 1) % data::TRAIN);
        buffer.push(obs, act, next_obs, reward, (step % 16 == 15) as i8);
        if let Some(record) = agent.opt(&mut buffer) {
            if step % 100 == 0 {
                println!("{step}: {record:?}");
            }
        }
    }
    Ok(())
}
