//! From the crates.io package reinforcex 0.0.5 (`reinforcex-0.0.5.crate`): `src/agents/ppo.rs`
//! (`PPO::_update`, with `PPO::new`, `act_and_train`, `stop_episode_and_train`), using
//! `src/memory/onpolicy_buffer.rs`, `src/memory/experience.rs`, `src/misc/cumsum.rs`
//! (`cumsum_rev`), `src/misc/batch_states.rs`, `src/prob_distributions/softmax.rs` and
//! `src/models/policy_based/fc_softmax_policy.rs` (`FCSoftmaxPolicyWithValue`). Licence: MIT
//! (`Cargo.toml`: `license = "MIT"`; the package ships no licence file:
//! licenses/reinforcex-0.0.5-LICENSE-NOTE.md).
//!
//! The loop: PPO's update of an on-policy buffer, a method `&mut self` of the agent, which
//! owns its model (`Box<dyn BasePolicy>`, the VarStore inside it) and its optimizer (a
//! field, built by the caller and moved into `PPO::new`). The episodes are flushed from the
//! buffer, an index list shuffled `ceil(n_data / total)` times with `thread_rng()` and
//! concatenated; old values, log-probabilities and GAE (a discounted reverse cumulative sum
//! cut at episode ends, standardised) computed once; then `for i in 0..self.epoch { for j in
//! 0..n_iter { .. } }`, each minibatch `all_indice[i * n_data_per_epoch + j *
//! minibatch_size..]`: a forward of every state, the minibatch taken with `index_select`,
//! clipped ratio, clipped value loss, entropy bonus, NaN `assert!`s, then
//! `self.optimizer.zero_grad(); loss.backward(); self.optimizer.step();`. `act_and_train`
//! calls it every `update_interval` steps.
//!
//! Changed: local re-implementations of the crate's types the update uses, keeping their
//! behaviour: `Experience` (the fields read here), `OnPolicyBuffer` (a `HashMap` of episodes
//! drained in the map's order, as the crate's), `BaseDistribution`/`SoftmaxDistribution`
//! (beta, min_prob), `BasePolicy`/`FCSoftmaxPolicyWithValue` (He-initialised layers at the
//! VarStore's root, as the crate's); the episode id (`ulid::Ulid`) is a counter; `rand`
//! 0.8's `thread_rng()` -> rand 0.9's `rng()`. The environment (the crate's examples use
//! CartPole over HTTP) replaced in `run` by a stand-in: each observation a training digit,
//! reward 1 when the action names it, episodes of 16 steps; sizes small.
//!
//! Expected: **Refused { line: 429, says: "is kept in a field" }**, at `self.optimizer` of
//! `self.optimizer.zero_grad()`: "`self.optimizer` is stepped in the training loop, but it is
//! kept in a field, so #[accelerate] cannot see which model it trains ... name the model's
//! VarStore: #[accelerate(model = self.vs)]". And that advice cannot be followed as the code
//! stands: the VarStore is inside `Box<dyn BasePolicy>`, which exposes no place to name.
//! (Were the model named, the inner loop `for j in 0..n_iter` would be dealt -- `j` picks the
//! minibatch through `all_indice[..]` -- and each process would shuffle its own index list
//! with its own `thread_rng()`: ranks equal, but no parity with one process.)
use std::collections::HashMap;
use std::sync::Arc;

use rand::rng;
use rand::seq::SliceRandom;
use tch::nn::{linear, Init, Linear, LinearConfig, Module, OptimizerConfig, VarStore};
use tch::{nn, no_grad, Device, Kind, Tensor};

use crate::data;

const POLICY_LOG_PROB_RATIO_CLAMP_RANGE: f64 = 8.0;

pub struct Experience {
    pub state: Tensor,
    pub action: Option<Tensor>,
    pub reward: f64,
    pub is_episode_terminal: bool,
}

pub struct OnPolicyBuffer {
    experiences_by_episode: HashMap<u64, Vec<Arc<Experience>>>,
}

impl OnPolicyBuffer {
    pub fn new() -> Self {
        Self { experiences_by_episode: HashMap::new() }
    }

    pub fn append(
        &mut self,
        episode_id: u64,
        state: Tensor,
        action: Option<Tensor>,
        reward: f64,
        is_episode_terminal: bool,
    ) -> Arc<Experience> {
        let experience = Arc::new(Experience { state, action, reward, is_episode_terminal });
        self.experiences_by_episode.entry(episode_id).or_default().push(experience.clone());
        experience
    }

    pub fn flush(&mut self) -> Vec<Vec<Arc<Experience>>> {
        self.experiences_by_episode.drain().map(|(_k, v)| v.to_vec()).collect()
    }
}

pub fn cumsum_rev(seq: &[f64], gamma: &[f64]) -> Vec<f64> {
    assert_eq!(seq.len(), gamma.len());
    seq.iter()
        .zip(gamma.iter())
        .rev()
        .scan(0.0, |cumsum_x, (&x, &g)| {
            *cumsum_x *= g;
            *cumsum_x += x;
            Some(*cumsum_x)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect()
}

pub(crate) fn batch_states(states: &Vec<Tensor>, device: Device) -> Tensor {
    Tensor::stack(&states, 0).to(device)
}

pub trait BaseDistribution {
    fn entropy(&self) -> Tensor;
    fn sample(&self) -> Tensor;
    fn log_prob(&self, x: &Tensor) -> Tensor;
    fn all_prob(&self) -> Tensor;
    fn all_log_prob(&self) -> Tensor;
    fn most_probable(&self) -> Tensor;
}

pub struct SoftmaxDistribution {
    logits: Tensor,
    beta: f64,
    min_prob: f64,
    n_classes: i64,
}

impl SoftmaxDistribution {
    pub fn new(logits: Tensor, beta: f64, min_prob: f64) -> Self {
        assert!(logits.dim() == 2, "Logits must be 2D: (batch_size, n_classes)");
        let n_classes = logits.size()[1];
        assert!(min_prob * (n_classes as f64) <= 1.0, "Invalid min_prob value");
        Self { logits, beta, min_prob, n_classes }
    }
}

impl BaseDistribution for SoftmaxDistribution {
    fn all_prob(&self) -> Tensor {
        let scaled_logits = &self.logits * self.beta;
        let softmax = scaled_logits.softmax(-1, Kind::Float);
        softmax * (1.0 - self.min_prob * (self.n_classes as f64)) + self.min_prob
    }

    fn all_log_prob(&self) -> Tensor {
        self.all_prob().log()
    }

    fn entropy(&self) -> Tensor {
        -(self.all_prob() * self.all_log_prob()).sum_dim_intlist(
            [-1i64].as_slice(),
            false,
            Kind::Float,
        )
    }

    fn sample(&self) -> Tensor {
        self.all_prob().multinomial(1, true).squeeze_dim(-1)
    }

    fn log_prob(&self, x: &Tensor) -> Tensor {
        self.all_log_prob().gather(-1, x, false).squeeze_dim(-1)
    }

    fn most_probable(&self) -> Tensor {
        self.all_prob().argmax(-1, false)
    }
}

pub trait BasePolicy {
    fn forward(&self, x: &Tensor) -> (Box<dyn BaseDistribution>, Option<Tensor>);
    fn device(&self) -> Device;
}

/// He initialisation (`misc/weight_initializer.rs`).
pub fn he_init(nin: i64) -> Init {
    Init::Randn { mean: 0.0, stdev: (2.0 / nin as f64).sqrt() }
}

/// `FCSoftmaxPolicyWithValue`: hidden layers, a softmax policy head (beta 0.1) and a value
/// head, every layer at the VarStore's root, which it owns.
pub struct FCSoftmaxPolicyWithValue {
    vs: VarStore,
    layers: Vec<Linear>,
    logits_layer: Linear,
    value_layer: Linear,
    n_input_channels: i64,
    min_prob: f64,
}

impl FCSoftmaxPolicyWithValue {
    pub fn new(
        vs: VarStore,
        n_input_channels: i64,
        n_actions: i64,
        n_hidden_layers: usize,
        n_hidden_channels: i64,
        min_prob: f64,
    ) -> Self {
        let root = vs.root();
        let config = |nin| LinearConfig {
            ws_init: he_init(nin),
            bs_init: Some(Init::Const(0.0)),
            bias: true,
        };
        let value_layer = linear(&root, n_hidden_channels, 1, config(n_hidden_channels));
        let mut layers =
            vec![linear(&root, n_input_channels, n_hidden_channels, config(n_input_channels))];
        for _ in 0..n_hidden_layers {
            layers.push(linear(
                &root,
                n_hidden_channels,
                n_hidden_channels,
                config(n_hidden_channels),
            ));
        }
        let logits_layer = linear(&root, n_hidden_channels, n_actions, config(n_hidden_channels));
        Self { vs, layers, logits_layer, value_layer, n_input_channels, min_prob }
    }
}

impl BasePolicy for FCSoftmaxPolicyWithValue {
    fn forward(&self, x: &Tensor) -> (Box<dyn BaseDistribution>, Option<Tensor>) {
        let mut h = x.view([-1, self.n_input_channels]);
        for layer in &self.layers {
            h = (layer.forward(&h)).relu();
        }
        let value = self.value_layer.forward(&h);
        let logits = self.logits_layer.forward(&h);
        (Box::new(SoftmaxDistribution::new(logits, 0.1, self.min_prob)), Some(value))
    }

    fn device(&self) -> Device {
        self.vs.device()
    }
}

pub struct PPO {
    model: Box<dyn BasePolicy>,
    optimizer: nn::Optimizer,
    buffer: OnPolicyBuffer,
    gamma: f64,
    lambda: f64,
    update_interval: usize,
    epoch: usize,
    minibatch_size: usize,
    policy_clip_epsilon: f64,
    value_clip_range: f64,
    value_coef: f64,
    entropy_coef: f64,
    gae_std: bool,
    t: usize,
    current_episode_id: u64,
}

impl PPO {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Box<dyn BasePolicy>,
        optimizer: nn::Optimizer,
        gamma: f64,
        lambda: f64,
        update_interval: usize,
        epoch: usize,
        minibatch_size: usize,
        policy_clip_epsilon: f64,
        value_clip_range: f64,
        value_coef: f64,
        entropy_coef: f64,
        gae_std: bool,
    ) -> Self {
        assert!(minibatch_size <= update_interval);
        PPO {
            model,
            optimizer,
            buffer: OnPolicyBuffer::new(),
            gamma,
            lambda,
            update_interval,
            epoch,
            minibatch_size,
            policy_clip_epsilon,
            value_clip_range,
            value_coef,
            entropy_coef,
            gae_std,
            t: 0,
            current_episode_id: 0,
        }
    }

    #[accel_core::accelerate(strategy = "ddp")]
    fn _update(&mut self) {
        let experiences_per_episode: Vec<Vec<Arc<Experience>>> = self.buffer.flush();

        let total_transitions = experiences_per_episode.iter().map(|v| v.len()).sum::<usize>()
            - experiences_per_episode.len();
        let n_iter = total_transitions.div_ceil(self.minibatch_size);
        let n_data_per_epoch = n_iter * self.minibatch_size;
        let n_data = n_data_per_epoch * self.epoch;

        // Create shuffled indice for minibatch.
        let mut rng = rng();
        let mut batch_indice = (0..total_transitions).collect::<Vec<usize>>();
        let mut all_indice =
            Vec::with_capacity(total_transitions * n_data.div_ceil(total_transitions));
        for _ in 0..n_data.div_ceil(total_transitions) {
            batch_indice.shuffle(&mut rng);
            all_indice.extend(batch_indice.iter().cloned());
        }
        let all_indice = all_indice.into_iter().map(|x| x as i64).collect::<Vec<i64>>();

        // Create data.
        let _skip_first = experiences_per_episode
            .iter()
            .flat_map(|v| v.iter().skip(1))
            .cloned()
            .collect::<Vec<Arc<Experience>>>();
        let _skip_last = experiences_per_episode
            .iter()
            .flat_map(|v| v.iter().take(v.len().saturating_sub(1)))
            .cloned()
            .collect::<Vec<Arc<Experience>>>();
        let state = batch_states(
            &_skip_last.iter().map(|e| e.state.shallow_clone()).collect::<Vec<Tensor>>(),
            self.model.device(),
        );
        let next_state = batch_states(
            &_skip_first.iter().map(|e| e.state.shallow_clone()).collect::<Vec<Tensor>>(),
            self.model.device(),
        );
        let _action = batch_states(
            &_skip_last
                .iter()
                .map(|e| e.action.as_ref().unwrap().shallow_clone())
                .collect::<Vec<Tensor>>(),
            self.model.device(),
        );
        let action = _action.view([total_transitions as i64, *_action.size().last().unwrap()]);
        let reward =
            Tensor::from_slice(&_skip_first.iter().map(|e| e.reward).collect::<Vec<f64>>())
                .to_device(self.model.device());

        let (old_action_distrib, old_value) = self.model.forward(&state);
        let old_value = old_value.unwrap().flatten(0, 1).detach();
        let old_log_prob = old_action_distrib.log_prob(&action.detach()).detach();

        let (_, old_next_value) = self.model.forward(&next_state);
        let old_next_value = old_next_value.unwrap().flatten(0, 1).detach();

        let non_terminal: Tensor = 1.0
            - Tensor::from_slice(
                &_skip_first
                    .iter()
                    .map(|e| if e.is_episode_terminal { 1.0 } else { 0.0 })
                    .collect::<Vec<f64>>(),
            )
            .to_device(self.model.device());

        let old_next_value = (old_next_value * non_terminal).detach();

        // Compute GAE
        let td_error = (reward + self.gamma * &old_next_value - &old_value).to_device(Device::Cpu);
        let _gae = Tensor::from_slice(&cumsum_rev(
            &(0..td_error.size()[0]).map(|i| td_error.double_value(&[i])).collect::<Vec<f64>>(),
            &_skip_first
                .iter()
                .map(|e| {
                    if e.is_episode_terminal {
                        0.0 // For preventing td_error from passing through between different episodes.
                    } else {
                        self.gamma * self.lambda
                    }
                })
                .collect::<Vec<f64>>(),
        ))
        .to_device(self.model.device())
        .detach();
        let gae = if self.gae_std {
            (&_gae - (&_gae).mean(Kind::Float)) / ((&_gae).std(false) + 1e-8)
        } else {
            _gae
        };

        // Compute value target
        let value_target = &gae + &old_value;

        for i in 0..self.epoch {
            for j in 0..n_iter {
                let minibatch_indice = Tensor::from_slice(
                    &all_indice[i * n_data_per_epoch + j * self.minibatch_size
                        ..i * n_data_per_epoch + (j + 1) * self.minibatch_size],
                )
                .to_device(self.model.device());

                // Forward
                let (action_distrib, value) = self.model.forward(&state);
                let value = value.unwrap().flatten(0, 1).index_select(0, &minibatch_indice);

                // Compute policy ratio.
                let log_prob = action_distrib.log_prob(&action.detach());
                let policy_ratio = (log_prob - &old_log_prob)
                    .index_select(0, &minibatch_indice)
                    .clamp(-POLICY_LOG_PROB_RATIO_CLAMP_RANGE, POLICY_LOG_PROB_RATIO_CLAMP_RANGE)
                    .exp();
                let clipped_policy_ratio = policy_ratio
                    .clamp(1.0 - self.policy_clip_epsilon, 1.0 + self.policy_clip_epsilon);

                // Compute value ratio.
                let _old_value = old_value.index_select(0, &minibatch_indice).detach();
                let clipped_value = &_old_value
                    + (&value - &_old_value).clamp(-self.value_clip_range, self.value_clip_range);

                let minibatch_gae = gae.index_select(0, &minibatch_indice).detach();

                // Compute loss
                let _value_target = (&value_target).index_select(0, &minibatch_indice).detach();
                let policy_loss: Tensor = -1.0
                    * (policy_ratio * &minibatch_gae)
                        .minimum(&(clipped_policy_ratio * &minibatch_gae))
                        .mean(Kind::Float);
                let value_loss = (&_value_target - value)
                    .square()
                    .maximum(&(&_value_target - clipped_value).square())
                    .mean(Kind::Float);
                let entropy_regularized =
                    action_distrib.entropy().index_select(0, &minibatch_indice).mean(Kind::Float);

                // Check Nan
                assert!(policy_loss.isnan().any().int64_value(&[]) == 0);
                assert!(value_loss.isnan().any().int64_value(&[]) == 0);
                assert!(entropy_regularized.isnan().any().int64_value(&[]) == 0);

                let loss: Tensor = policy_loss + self.value_coef * value_loss
                    - self.entropy_coef * entropy_regularized;

                // Backward
                self.optimizer.zero_grad();
                loss.backward();
                self.optimizer.step();
            }
        }
    }

    pub fn act_and_train(&mut self, obs: &Tensor, reward: f64) -> Tensor {
        self.t += 1;

        let state = batch_states(&vec![obs.shallow_clone()], self.model.device());
        let action_distrib = no_grad(|| {
            let (action_distrib, _) = self.model.forward(&state);
            action_distrib
        });
        let action = action_distrib.sample().detach().to_device(Device::Cpu);

        self.buffer.append(
            self.current_episode_id,
            state,
            Some(action.shallow_clone()),
            reward,
            false,
        );

        if self.t % self.update_interval == 0 {
            self._update();
        }

        action
    }

    pub fn stop_episode_and_train(&mut self, obs: &Tensor, reward: f64) {
        let state = batch_states(&vec![obs.shallow_clone()], self.model.device());
        self.buffer.append(self.current_episode_id, state, None, reward, true);
        self.current_episode_id += 1;
    }
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let optimizer = nn::Adam::default().build(&vs, 1e-3)?;
    let model = FCSoftmaxPolicyWithValue::new(vs, 64, 10, 1, 32, 0.0);
    let minibatch_size = data::batch_size() as usize;
    let mut ppo = PPO::new(
        Box::new(model),
        optimizer,
        0.9,
        0.95,
        4 * minibatch_size,
        2,
        minibatch_size,
        0.2,
        0.2,
        0.5,
        0.01,
        true,
    );
    let mut reward = 0.0;
    for t in 0..(8 * minibatch_size as i64) {
        let row = t % data::TRAIN;
        let obs = d.train_x.get(row);
        if t % 16 == 15 {
            ppo.stop_episode_and_train(&obs, reward);
            reward = 0.0;
            continue;
        }
        let action = ppo.act_and_train(&obs, reward);
        reward = if action.int64_value(&[0]) == d.train_y.int64_value(&[row]) { 1.0 } else { 0.0 };
    }
    Ok(())
}
