//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`):
//! `examples/reinforcement-learning/policy_gradient.rs` (`run`, with `model`,
//! `accumulate_rewards`) and the `GymEnv`/`Step` API of
//! `examples/reinforcement-learning/gym_env.rs`, MIT or Apache-2.0 (`Cargo.toml`:
//! `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE). Not among tch-rs's examples in tests/real_code.
//!
//! The loop: REINFORCE with rewards-to-go. `for epoch_idx in 0..50`: an inner `loop` plays
//! episodes with the current policy under `no_grad` (`multinomial` sampling), collecting
//! steps until an episode ends after more than 5000 steps, and `break`s; the epoch's average
//! reward is printed; then one loss over the whole rollout (a batch whose size is the number
//! of steps played) and `opt.backward_step(&loss)` as the loop body's tail expression.
//!
//! Changed: CartPole through Python's gym (`GymEnv::new("CartPole-v0")`) replaced by the local
//! `GymEnv` below with the same API: each observation is a training digit (64 pixels, drawn
//! with torch's generator), the two actions say "less than five" / "five or more", a right
//! answer earns 1 and the episode goes on, a wrong one ends it (as the pole falling ends
//! CartPole's), and so does the 50th step; epochs 50 -> 10, steps per rollout 5000 -> 200;
//! `run` renamed `train` (the module's entry point is `run`); `cpython::PyResult` ->
//! `anyhow::Result`; tch 0.24 names (`Tensor::from_slice`, `i64::try_from`, sizes as arrays,
//! `Some([1i64].as_slice())`); `model` returns `impl nn::Module + use<>` (Rust 2024 would
//! otherwise tie the model to the temporary `vs.root()` and the observation space).
//!
//! Expected: **Draws**. `epoch_idx` is only printed, so the loop counts and draws its own
//! batches (the inner `loop` runs no backward, so it is not a training loop; its `break`
//! leaves only itself). Every process runs every epoch on rollouts of its own (torch's
//! generator seeded with the seed + its rank when the loop starts), of different lengths;
//! gradients are averaged, so the ranks end equal.
use std::cell::Cell;

use tch::kind::INT64_CPU;
use tch::{nn, nn::OptimizerConfig, Kind::Float, Tensor};

use crate::data;

/// The return value for a step.
#[derive(Debug)]
pub struct Step<A> {
    pub obs: Tensor,
    pub action: A,
    pub reward: f64,
    pub is_done: bool,
}

impl<A: Copy> Step<A> {
    /// Returns a copy of this step changing the observation tensor.
    pub fn copy_with_obs(&self, obs: &Tensor) -> Step<A> {
        Step { obs: obs.copy(), action: self.action, reward: self.reward, is_done: self.is_done }
    }
}

/// Stand-in for `gym_env::GymEnv` (CartPole through Python): a training digit per step; the
/// action says whether it is five or more.
pub struct GymEnv {
    images: Tensor,
    labels: Tensor,
    shown: Cell<i64>,
    steps: Cell<i64>,
    action_space: i64,
    observation_space: Vec<i64>,
}

impl GymEnv {
    /// Creates a new session of the specified OpenAI Gym environment.
    pub fn new(_name: &str) -> anyhow::Result<GymEnv> {
        let d = data::load()?;
        Ok(GymEnv {
            images: d.train_x,
            labels: d.train_y,
            shown: Cell::new(0),
            steps: Cell::new(0),
            action_space: 2,
            observation_space: vec![64],
        })
    }

    fn draw(&self) -> Tensor {
        let index = Tensor::randint(data::TRAIN, [1], INT64_CPU).int64_value(&[0]);
        self.shown.set(index);
        self.images.get(index)
    }

    /// Resets the environment, returning the observation tensor.
    pub fn reset(&self) -> anyhow::Result<Tensor> {
        self.steps.set(0);
        Ok(self.draw())
    }

    /// Applies an environment step using the specified action.
    pub fn step(&self, action: i64) -> anyhow::Result<Step<i64>> {
        let label = self.labels.int64_value(&[self.shown.get()]);
        let right = (label >= 5) == (action == 1);
        self.steps.set(self.steps.get() + 1);
        Ok(Step {
            obs: self.draw(),
            reward: if right { 1.0 } else { 0.0 },
            is_done: !right || self.steps.get() >= 50,
            action,
        })
    }

    /// Returns the number of allowed actions for this environment.
    pub fn action_space(&self) -> i64 {
        self.action_space
    }

    /// Returns the shape of the observation tensors.
    pub fn observation_space(&self) -> &[i64] {
        &self.observation_space
    }
}

fn model(p: &nn::Path, input_shape: &[i64], nact: i64) -> impl nn::Module + use<> {
    let nin = input_shape.iter().product::<i64>();
    nn::seq()
        .add(nn::linear(p / "lin1", nin, 32, Default::default()))
        .add_fn(|xs| xs.tanh())
        .add(nn::linear(p / "lin2", 32, nact, Default::default()))
}

fn accumulate_rewards(steps: &[Step<i64>]) -> Vec<f64> {
    let mut rewards: Vec<f64> = steps.iter().map(|s| s.reward).collect();
    let mut acc_reward = 0f64;
    for (i, reward) in rewards.iter_mut().enumerate().rev() {
        if steps[i].is_done {
            acc_reward = 0.0;
        }
        acc_reward += *reward;
        *reward = acc_reward;
    }
    rewards
}

/// Trains an agent using the policy gradient algorithm.
#[accel_core::accelerate(strategy = "ddp")]
pub fn train() -> anyhow::Result<()> {
    let env = GymEnv::new("CartPole-v0")?;
    println!("action space: {:?}", env.action_space());
    println!("observation space: {:?}", env.observation_space());

    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = model(&vs.root(), env.observation_space(), env.action_space());
    let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();

    for epoch_idx in 0..10 {
        let mut obs = env.reset()?;
        let mut steps: Vec<Step<i64>> = vec![];
        // Perform some rollouts with the current model.
        loop {
            let action = tch::no_grad(|| {
                obs.unsqueeze(0).apply(&model).softmax(1, Float).multinomial(1, true)
            });
            let action = i64::try_from(action)?;
            let step = env.step(action)?;
            steps.push(step.copy_with_obs(&obs));
            obs = if step.is_done { env.reset()? } else { step.obs };
            if step.is_done && steps.len() > 200 {
                break;
            }
        }
        let sum_r: f64 = steps.iter().map(|s| s.reward).sum();
        let episodes: i64 = steps.iter().map(|s| s.is_done as i64).sum();
        println!(
            "epoch: {:<3} episodes: {:<5} avg reward per episode: {:.2}",
            epoch_idx,
            episodes,
            sum_r / episodes as f64
        );

        // Train the model via policy gradient on the rollout data.
        let batch_size = steps.len() as i64;
        let actions: Vec<i64> = steps.iter().map(|s| s.action).collect();
        let actions = Tensor::from_slice(&actions).unsqueeze(1);
        let rewards = accumulate_rewards(&steps);
        let rewards = Tensor::from_slice(&rewards).to_kind(Float);
        let action_mask =
            Tensor::zeros([batch_size, 2], tch::kind::FLOAT_CPU).scatter_value(1, &actions, 1.0);
        let obs: Vec<Tensor> = steps.into_iter().map(|s| s.obs).collect();
        let logits = Tensor::stack(&obs, 0).apply(&model);
        let log_probs = (action_mask * logits.log_softmax(1, Float)).sum_dim_intlist(
            Some([1i64].as_slice()),
            false,
            Float,
        );
        let loss = -(rewards * log_probs).mean(Float);
        opt.backward_step(&loss)
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
