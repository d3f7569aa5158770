//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`):
//! `examples/reinforcement-learning/ppo.rs` (`train`, with `model`, `FrameStack`) and the
//! `VecGymEnv` API of `examples/reinforcement-learning/vec_gym_env.rs`, MIT or Apache-2.0
//! (`Cargo.toml`: `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE). Not among tch-rs's examples in tests/real_code.
//!
//! The loop: PPO-style updates (the example's simplified objective, no ratio clipping).
//! `for update_index in 0..UPDATES`: a rollout of NSTEPS steps over NPROCS environments under
//! `no_grad`, discounted returns, then `for _index in 0..OPTIM_EPOCHS` minibatches drawn with
//! `Tensor::randint(train_size, [OPTIM_BATCHSIZE], ..)` from the rollout, each stepped with
//! `opt.backward_step_clip(&loss, 0.5)`; every 25 updates the average reward is printed and
//! the sums reset, every 1000 updates `vs.save(format!("trpo{update_index}.ot"))`.
//!
//! Changed: the Atari environment (SpaceInvaders through Python's gym, `VecGymEnv`) replaced
//! by the local `VecGymEnv` below with the same API: each of NPROCS environments shows a
//! digit of the training set (a 1x8x8 frame, drawn with torch's generator), the action is a
//! guess of its label (reward 1 when right), and every 8th step ends the episodes; the conv
//! net over 84x84 frames replaced by one hidden layer over the stacked 8x8 frames (the critic
//! and actor heads kept); NPROCS 8 -> 4, NSTEPS 256 -> 16, NSTACK 4 -> 2, UPDATES 1000000 ->
//! 10, OPTIM_BATCHSIZE 64 -> 16, printing every 25 -> 2 and saving every 1000 -> 5 updates;
//! `cpython::PyResult` -> `anyhow::Result`; tch 0.24 names (`Vec::<i64>::try_from`,
//! `f64::try_from`, sizes as arrays, `Some([-1i64].as_slice())`).
//!
//! Expected: **Draws**. Neither loop deals data: `update_index` only decides printing, the
//! reset of sums only printing reads, and saving; `_index` is not used. The innermost
//! training loop, `for _index in 0..OPTIM_EPOCHS`, is the one prepared (drawn); the update
//! loop around it is left as it is, rollout and save included. Every process runs every
//! minibatch; at the first pass of the inner loop each process's torch generator is seeded
//! with the seed + its rank, so the minibatch indexes (and every later rollout) differ, and
//! the first-step check passes (the first rollout, drawn before that, is the same on every
//! process). Gradients are averaged and clipped alike, so the ranks end equal.
use std::cell::{Cell, RefCell};

use tch::kind::{FLOAT_CPU, INT64_CPU};
use tch::{nn, nn::OptimizerConfig, Kind, Tensor};

use crate::data;

const ENV_NAME: &str = "SpaceInvadersNoFrameskip-v4";
const NPROCS: i64 = 4;
const NSTEPS: i64 = 16;
const NSTACK: i64 = 2;
const UPDATES: i64 = 10;
const OPTIM_BATCHSIZE: i64 = 16;
const OPTIM_EPOCHS: i64 = 4;

/// The return value of a step of the environments (`vec_gym_env::Step`).
#[derive(Debug)]
pub struct Step {
    pub obs: Tensor,
    pub reward: Tensor,
    pub is_done: Tensor,
}

/// Stand-in for `vec_gym_env::VecGymEnv` (Atari through Python): `nprocesses` environments,
/// each showing a training digit; the action guesses its label.
pub struct VecGymEnv {
    images: Tensor,
    labels: Tensor,
    shown: RefCell<Tensor>,
    steps: Cell<i64>,
    nprocesses: i64,
}

impl VecGymEnv {
    pub fn new(_name: &str, _img_dir: Option<&str>, nprocesses: i64) -> anyhow::Result<VecGymEnv> {
        let d = data::load()?;
        Ok(VecGymEnv {
            images: d.train_x.view([-1, 1, 8, 8]),
            labels: d.train_y,
            shown: RefCell::new(Tensor::zeros([nprocesses], INT64_CPU)),
            steps: Cell::new(0),
            nprocesses,
        })
    }

    fn draw(&self) -> Tensor {
        let index = Tensor::randint(data::TRAIN, [self.nprocesses], INT64_CPU);
        let obs = self.images.index_select(0, &index);
        *self.shown.borrow_mut() = index;
        obs
    }

    pub fn reset(&self) -> anyhow::Result<Tensor> {
        self.steps.set(0);
        Ok(self.draw())
    }

    pub fn step(&self, action: Vec<i64>) -> anyhow::Result<Step> {
        let labels = self.labels.index_select(0, &self.shown.borrow());
        let reward = Tensor::from_slice(&action).eq_tensor(&labels).to_kind(Kind::Float);
        self.steps.set(self.steps.get() + 1);
        let done = if self.steps.get() % 8 == 0 { 1f64 } else { 0f64 };
        let is_done = Tensor::full([self.nprocesses], done, FLOAT_CPU);
        Ok(Step { obs: self.draw(), reward, is_done })
    }

    pub fn action_space(&self) -> i64 {
        10
    }

    pub fn observation_space(&self) -> Vec<i64> {
        vec![self.nprocesses, 1, 8, 8]
    }
}

type Model = Box<dyn Fn(&Tensor) -> (Tensor, Tensor)>;

fn model(p: &nn::Path, nact: i64) -> Model {
    let seq = nn::seq()
        .add_fn(|xs| xs.flat_view())
        .add(nn::linear(p / "l1", NSTACK * 8 * 8, 32, Default::default()))
        .add_fn(|xs| xs.relu());
    let critic = nn::linear(p / "cl", 32, 1, Default::default());
    let actor = nn::linear(p / "al", 32, nact, Default::default());
    let device = p.device();
    Box::new(move |xs: &Tensor| {
        let xs = xs.to_device(device).apply(&seq);
        (xs.apply(&critic), xs.apply(&actor))
    })
}

#[derive(Debug)]
struct FrameStack {
    data: Tensor,
    nprocs: i64,
    nstack: i64,
}

impl FrameStack {
    fn new(nprocs: i64, nstack: i64) -> FrameStack {
        FrameStack { data: Tensor::zeros([nprocs, nstack, 8, 8], FLOAT_CPU), nprocs, nstack }
    }

    fn update<'a>(&'a mut self, img: &Tensor, masks: Option<&Tensor>) -> &'a Tensor {
        if let Some(masks) = masks {
            self.data *= masks.view([self.nprocs, 1, 1, 1])
        };
        let slice = |i| self.data.narrow(1, i, 1);
        for i in 1..self.nstack {
            slice(i - 1).copy_(&slice(i))
        }
        slice(self.nstack - 1).copy_(img);
        &self.data
    }
}

#[accel_core::accelerate(strategy = "ddp")]
pub fn train() -> anyhow::Result<()> {
    let env = VecGymEnv::new(ENV_NAME, None, NPROCS)?;
    println!("action space: {}", env.action_space());
    println!("observation space: {:?}", env.observation_space());

    let device = tch::Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let model = model(&vs.root(), env.action_space());
    let mut opt = nn::Adam::default().build(&vs, 1e-4).unwrap();

    let mut sum_rewards = Tensor::zeros([NPROCS], FLOAT_CPU);
    let mut total_rewards = 0f64;
    let mut total_episodes = 0f64;

    let mut frame_stack = FrameStack::new(NPROCS, NSTACK);
    let _ = frame_stack.update(&env.reset()?, None);
    let s_states = Tensor::zeros([NSTEPS + 1, NPROCS, NSTACK, 8, 8], FLOAT_CPU);

    let train_size = NSTEPS * NPROCS;
    for update_index in 0..UPDATES {
        s_states.get(0).copy_(&s_states.get(-1));
        let s_values = Tensor::zeros([NSTEPS, NPROCS], FLOAT_CPU);
        let s_rewards = Tensor::zeros([NSTEPS, NPROCS], FLOAT_CPU);
        let s_actions = Tensor::zeros([NSTEPS, NPROCS], INT64_CPU);
        let s_masks = Tensor::zeros([NSTEPS, NPROCS], FLOAT_CPU);
        for s in 0..NSTEPS {
            let (critic, actor) = tch::no_grad(|| model(&s_states.get(s)));
            let probs = actor.softmax(-1, Kind::Float);
            let actions = probs.multinomial(1, true).squeeze_dim(-1);
            let step = env.step(Vec::<i64>::try_from(&actions)?)?;

            sum_rewards += &step.reward;
            total_rewards += f64::try_from((&sum_rewards * &step.is_done).sum(Kind::Float))?;
            total_episodes += f64::try_from(step.is_done.sum(Kind::Float))?;

            let masks = Tensor::from(1f32) - step.is_done;
            sum_rewards *= &masks;
            let obs = frame_stack.update(&step.obs, Some(&masks));
            s_actions.get(s).copy_(&actions);
            s_values.get(s).copy_(&critic.squeeze_dim(-1));
            s_states.get(s + 1).copy_(obs);
            s_rewards.get(s).copy_(&step.reward);
            s_masks.get(s).copy_(&masks);
        }
        let states = s_states.narrow(0, 0, NSTEPS).view([train_size, NSTACK, 8, 8]);
        let returns = {
            let r = Tensor::zeros([NSTEPS + 1, NPROCS], FLOAT_CPU);
            let critic = tch::no_grad(|| model(&s_states.get(-1)).0);
            r.get(-1).copy_(&critic.view([NPROCS]));
            for s in (0..NSTEPS).rev() {
                let r_s = s_rewards.get(s) + r.get(s + 1) * s_masks.get(s) * 0.99;
                r.get(s).copy_(&r_s);
            }
            r.narrow(0, 0, NSTEPS).view([train_size, 1])
        };
        let actions = s_actions.view([train_size]);
        for _index in 0..OPTIM_EPOCHS {
            let batch_indexes = Tensor::randint(train_size, [OPTIM_BATCHSIZE], INT64_CPU);
            let states = states.index_select(0, &batch_indexes);
            let actions = actions.index_select(0, &batch_indexes);
            let returns = returns.index_select(0, &batch_indexes);
            let (critic, actor) = model(&states);
            let log_probs = actor.log_softmax(-1, Kind::Float);
            let probs = actor.softmax(-1, Kind::Float);
            let action_log_probs = {
                let index = actions.unsqueeze(-1).to_device(device);
                log_probs.gather(-1, &index, false).squeeze_dim(-1)
            };
            let dist_entropy = (-log_probs * probs)
                .sum_dim_intlist(Some([-1i64].as_slice()), false, Kind::Float)
                .mean(Kind::Float);
            let advantages = returns.to_device(device) - critic;
            let value_loss = (&advantages * &advantages).mean(Kind::Float);
            let action_loss = (-advantages.detach() * action_log_probs).mean(Kind::Float);
            let loss = value_loss * 0.5 + action_loss - dist_entropy * 0.01;
            opt.backward_step_clip(&loss, 0.5);
        }
        if update_index > 0 && update_index % 2 == 0 {
            println!("{} {:.0} {}", update_index, total_episodes, total_rewards / total_episodes);
            total_rewards = 0.;
            total_episodes = 0.;
        }
        if update_index > 0 && update_index % 5 == 0 {
            if let Err(err) = vs.save(format!("trpo{update_index}.ot")) {
                println!("error while saving {err}")
            }
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
