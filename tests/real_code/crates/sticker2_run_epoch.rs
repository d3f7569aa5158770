//! From the crates.io package sticker2-utils 0.5.3 (`sticker2-utils-0.5.3.crate`):
//! `src/subcommands/finetune.rs` (`FinetuneApp::run_epoch`, with `lr_schedules` and the driver
//! `<FinetuneApp as StickerApp>::run`), `src/save.rs` (`BestEpochSaver`), `src/util.rs`
//! (`autocast_or_preserve`), `src/summary/mod.rs` (`SummaryWriter`, `NoopWriter`); and from
//! sticker2 0.5.1 (`sticker2-0.5.1.crate`) `src/optimizers/{mod,adamw,grad,grad_scale}.rs`
//! (`Optimizer`, `AdamW`, `AdamWConfig`, `ZeroGrad`, `GradScaler`), `src/lr.rs`
//! (`ExponentialDecay`, `PlateauLearningRate`) and `src/util.rs` (`seq_len_to_mask`).
//! Licence: Blue Oak Model License 1.0.0 (`license-file = "LICENSE.md"` in both packages:
//! licenses/sticker2-utils-0.5.3-LICENSE.md, licenses/sticker2-0.5.1-LICENSE.md); the
//! AdamW below is from `src/optimizers/adamw.rs`, which carries its own Apache-2.0 header,
//! kept with it (licenses/sticker2-0.5.1-adamw-NOTE.md).
//!
//! The function: one epoch of training or validation (sticker2 is syntaxdot's predecessor;
//! compare syntaxdot_run_epoch_steps.rs). Whether it trains is whether it is given the
//! gradient scaler (`mut grad_scaler: Option<&mut GradScaler<AdamW>>`), and the optimizer is
//! sticker2's **own AdamW**: state per variable name, over a borrowed VarStore, with no
//! learning rate of its own -- each step takes a closure that gives every variable its
//! hyper-parameters by name (`scaler.backward_step(&loss, |name| { .. config })`: weight decay
//! but for layer norms, the classifiers' or the encoder's learning rate). `for batch in
//! dataset.batches(..)?` (batches as `Result`s): the learning rates (the initial one in epoch
//! 0, where the encoder is frozen; else from two schedules at `*global_step`), the loss
//! under `autocast_or_preserve`, then only `if let Some(scaler) = &mut grad_scaler`:
//! `scaler.backward_step(..)`, a summary scalar and `*global_step += 1` (from epoch 1); the
//! per-encoder loss and accuracy summed and printed after the loop.
//!
//! Changed: local stand-ins for what cannot exist here, keeping the calls as written. The
//! model (`BertModel`, a pretrained transformer with sequence classifiers) is the digits MLP
//! laid out as sticker2 names its variables (`encoder.*`, `classifiers.*`, which the config
//! closure's `starts_with` tests need), the encoder frozen by `FreezeLayers` as the crate
//! does; `Model::load_from` builds it fresh; the CoNLL-U files (`File::open`) are the two
//! splits of the digits, read in order by a `ConlluDataSet` whose `batches(..)?` yields
//! `Result<Tensors, _>` batches (each digit a one-token sentence, its label the one
//! encoder's); `ReadProgress` and indicatif's `ProgressBar`/`ProgressStyle` print nothing;
//! the app's fields set in `run` instead of parsed by clap (batch size `data::batch_size()`,
//! warmup 10000 -> 10 steps, patience -> 2, lr patience -> 1); tch 0.24 names
//! (`f32::try_from`, `i64::try_from`, `Vec::<f32>::try_from`, sizes as arrays, `lt_tensor`
//! for `lt_1`, and `scale.internal_amp_update_scale_(..)` for the removed
//! `Tensor::internal_amp_update_scale(&growth_tracker, &scale, ..)`).
//!
//! Expected: **Refused { line: 932, says: "cannot see where the optimizer `scaler` is made" }**,
//! at `scaler` in `scaler.backward_step(..)`, as in syntaxdot_run_epoch_steps.rs: the
//! receiver of `backward_step` is bound by `if let Some(scaler) = &mut grad_scaler`, neither a
//! `let` nor an argument. Past that, a second wall: the optimizer is not tch's (a two-argument
//! `backward_step` with a per-variable config closure, no `step()`/`zero_grad()` of tch's
//! shape), so accel could neither rebuild nor drive it; and no VarStore is in scope to name.
use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result};
use tch::nn::{Init, VarStore};
use tch::{self, Device, Kind, TchError, Tensor};

use crate::data;

// ---------------------------------------------------------------------------------------
// sticker2::error (the variant used here)

#[derive(Debug)]
pub enum StickerError {
    Tch(TchError),
}

impl std::fmt::Display for StickerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StickerError::Tch(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for StickerError {}

impl From<TchError> for StickerError {
    fn from(e: TchError) -> Self {
        StickerError::Tch(e)
    }
}

// ---------------------------------------------------------------------------------------
// sticker2::optimizers

pub trait ZeroGrad {
    /// Zero out gradients.
    fn zero_grad(&self);
}

impl ZeroGrad for VarStore {
    fn zero_grad(&self) {
        for (_, mut tensor) in self.variables() {
            if tensor.requires_grad() {
                tensor.zero_grad()
            }
        }
    }
}

pub trait Optimizer {
    type Config;

    /// Perform a backward step on the given loss.
    ///
    /// The provided configuration function is given the full name of
    /// the variable and should return the Adam configuration. This
    /// makes it possible to use different Adam hyper parameters for
    /// different parts of a model.
    fn backward_step<F>(&mut self, loss: &Tensor, config_fun: F)
    where
        F: Fn(&str) -> Self::Config;

    /// Perform an update step.
    fn step<F>(&mut self, config_fun: F)
    where
        F: Fn(&str) -> Self::Config;

    /// Get the variable store used by the optimizer.
    fn var_store(&self) -> &VarStore;
}

// copyright 2018 the google ai language team authors and the huggingface inc. team.
// copyright (c) 2018, nvidia corporation.  all rights reserved.
// copyright (c) 2019 the sticker developers.
//
// licensed under the apache license, version 2.0 (the "license");
// you may not use this file except in compliance with the license.
// you may obtain a copy of the license at
//
//     http://www.apache.org/licenses/license-2.0
//
// unless required by applicable law or agreed to in writing, software
// distributed under the license is distributed on an "as is" basis,
// without warranties or conditions of any kind, either express or implied.
// see the license for the specific language governing permissions and
// limitations under the license.

/// Internal Adam state.
struct AdamWState {
    step: usize,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// Adam optimizer configuration.
#[derive(Clone, Copy, Debug)]
pub struct AdamWConfig {
    pub betas: (f64, f64),
    pub correct_bias: bool,
    pub eps: f64,
    pub lr: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { betas: (0.9, 0.999), correct_bias: false, eps: 1e-6, lr: 1e-3, weight_decay: 0. }
    }
}

/// Adam algorithm with weight decay fix.
pub struct AdamW<'a> {
    state: HashMap<String, AdamWState>,
    vs: &'a VarStore,
}

impl<'a> AdamW<'a> {
    pub fn new(vs: &'a VarStore) -> Self {
        AdamW { state: HashMap::new(), vs }
    }
}

impl<'a> Optimizer for AdamW<'a> {
    type Config = AdamWConfig;

    fn backward_step<F>(&mut self, loss: &Tensor, config_fun: F)
    where
        F: Fn(&str) -> Self::Config,
    {
        self.vs.zero_grad();
        loss.backward();
        tch::no_grad(|| self.step(config_fun));
    }

    fn step<F>(&mut self, config_fun: F)
    where
        F: Fn(&str) -> Self::Config,
    {
        for (name, mut tensor) in self.vs.variables() {
            if !tensor.grad().defined() {
                continue;
            }

            let config = config_fun(&name);

            let grad = tensor.grad();

            let state = self.state.entry(name.to_string()).or_insert(AdamWState {
                step: 0,
                exp_avg: Tensor::zeros_like(&tensor),
                exp_avg_sq: Tensor::zeros_like(&tensor),
            });

            state.step += 1;

            // Decay the first and second moment running average coefficient
            // In-place operations to update the averages at the same time
            state.exp_avg *= config.betas.0;
            state.exp_avg += (1. - config.betas.0) * &grad;
            state.exp_avg_sq *= config.betas.1;
            state.exp_avg_sq += (1. - config.betas.1) * &grad * &grad;
            let mut denom = state.exp_avg_sq.sqrt();
            denom += config.eps;

            let mut step_size = config.lr;
            if config.correct_bias {
                let bias_correction1 = 1.0 - config.betas.0.powf(state.step as f64);
                let bias_correction2 = 1.0 - config.betas.1.powf(state.step as f64);
                step_size *= bias_correction2.sqrt() / bias_correction1;
            }

            tensor += -step_size * (&state.exp_avg / denom);

            if config.weight_decay > 0. {
                tensor += -config.lr * config.weight_decay * &tensor;
            }
        }
    }

    fn var_store(&self) -> &VarStore {
        self.vs
    }
}

pub struct GradScaler<O> {
    enabled: bool,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,

    optimizer: O,

    found_inf: Tensor,
    growth_tracker: Tensor,
    scale: Tensor,
}

impl<O> GradScaler<O>
where
    O: Optimizer,
{
    fn new(
        enabled: bool,
        optimizer: O,
        init_scale: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: i64,
    ) -> Self {
        let device = optimizer.var_store().device();

        GradScaler {
            enabled,
            growth_factor,
            backoff_factor,
            growth_interval,

            optimizer,

            found_inf: Tensor::full([1], 0.0, (Kind::Float, device)),
            growth_tracker: Tensor::full([1], 0, (Kind::Int, device)),
            scale: Tensor::full([1], init_scale, (Kind::Float, device)),
        }
    }

    pub fn new_with_defaults(enabled: bool, optimizer: O) -> Self {
        GradScaler::new(enabled, optimizer, 2f64.powi(16), 2., 0.5, 2000)
    }

    pub fn current_scale(&self) -> f32 {
        Vec::<f32>::try_from(&self.scale).unwrap()[0]
    }

    pub fn scale(&mut self, t: &Tensor) -> Tensor {
        if !self.enabled {
            t.shallow_clone()
        } else {
            t * &self.scale
        }
    }

    pub fn update(&mut self) {
        if !self.enabled {
            return;
        };

        self.scale = self.scale.internal_amp_update_scale_(
            &self.growth_tracker,
            &self.found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        );

        // Clear infinity found status.
        self.found_inf = self.found_inf.zeros_like();
    }
}

impl<O> Optimizer for GradScaler<O>
where
    O: Optimizer,
{
    type Config = O::Config;

    fn backward_step<F>(&mut self, loss: &Tensor, config_fun: F)
    where
        F: Fn(&str) -> Self::Config,
    {
        self.var_store().zero_grad();
        self.scale(loss).backward();
        tch::no_grad(|| self.step(config_fun));
        self.update();
    }

    fn step<F>(&mut self, config_fun: F)
    where
        F: Fn(&str) -> Self::Config,
    {
        if !self.enabled {
            return self.optimizer.step(config_fun);
        }

        let inv_scale = self.scale.reciprocal().to_kind(Kind::Float);

        for (_, tensor) in self.optimizer.var_store().variables() {
            if !tensor.grad().defined() {
                continue;
            }

            tensor.grad().internal_amp_non_finite_check_and_unscale(&mut self.found_inf, &inv_scale);
        }

        let found_inf = Vec::<f32>::try_from(&self.found_inf).unwrap() == [1.0];

        // Only step when there are no infinite gradients.
        if !found_inf {
            self.optimizer.step(config_fun)
        }
    }

    fn var_store(&self) -> &VarStore {
        self.optimizer.var_store()
    }
}

// ---------------------------------------------------------------------------------------
// sticker2::lr (identical to syntaxdot 0.5.0's)

pub trait LearningRateSchedule {
    fn compute_epoch_learning_rate(&mut self, epoch: usize, last_score: f32) -> f32;
    fn compute_step_learning_rate(&mut self, global_step: usize) -> f32;
    fn initial_lr(&self) -> f32;
    fn set_initial_lr(&mut self, lr: f32);
}

#[derive(Clone)]
pub struct ExponentialDecay {
    initial_lr: f32,
    lr: f32,
    decay_rate: f32,
    decay_steps: usize,
    warmup_steps: usize,
    staircase: bool,
}

impl ExponentialDecay {
    pub fn new(
        initial_lr: f32,
        decay_rate: f32,
        decay_steps: usize,
        staircase: bool,
        warmup_steps: usize,
    ) -> Self {
        assert!(initial_lr > 0.0, "The initial learning rate must be a positive value.");
        assert!(decay_rate > 0.0 && decay_rate < 1.0, "The decay rate must be in (0, 1).");
        assert!(decay_steps > 0, "The number decay steps should be non-zero.");

        ExponentialDecay { lr: initial_lr, initial_lr, decay_rate, decay_steps, staircase, warmup_steps }
    }
}

impl LearningRateSchedule for ExponentialDecay {
    fn compute_step_learning_rate(&mut self, global_step: usize) -> f32 {
        if global_step < self.warmup_steps {
            return (self.initial_lr / (self.warmup_steps as f32)) * global_step as f32;
        }

        // start decay after warmup
        let step = global_step - self.warmup_steps;
        let exponent = if self.staircase {
            (step / self.decay_steps) as f32
        } else {
            step as f32 / self.decay_steps as f32
        };
        self.lr = self.initial_lr * self.decay_rate.powf(exponent);
        self.lr
    }

    fn compute_epoch_learning_rate(&mut self, _epoch: usize, _last_score: f32) -> f32 {
        self.lr
    }

    fn initial_lr(&self) -> f32 {
        self.initial_lr
    }

    fn set_initial_lr(&mut self, lr: f32) {
        self.initial_lr = lr;
    }
}

#[derive(Clone)]
pub struct PlateauLearningRate<I> {
    scale: f32,
    best_score: f32,
    patience: usize,
    max_patience: usize,
    lr_schedule: I,
}

impl<I> PlateauLearningRate<I> {
    pub fn new(lr_schedule: I, scale: f32, max_patience: usize) -> Self {
        PlateauLearningRate {
            lr_schedule,
            scale,
            best_score: -f32::INFINITY,
            patience: 0,
            max_patience,
        }
    }
}

impl<I> LearningRateSchedule for PlateauLearningRate<I>
where
    I: LearningRateSchedule,
{
    fn compute_epoch_learning_rate(&mut self, epoch: usize, last_score: f32) -> f32 {
        if last_score > self.best_score {
            self.best_score = last_score;
            self.patience = 0;
        } else {
            self.patience += 1;

            if self.patience == self.max_patience {
                let mut lr = self.lr_schedule.initial_lr();
                lr *= self.scale;
                self.lr_schedule.set_initial_lr(lr);
                self.patience = 0;
            }
        }

        self.lr_schedule.compute_epoch_learning_rate(epoch, last_score)
    }

    fn compute_step_learning_rate(&mut self, global_step: usize) -> f32 {
        self.lr_schedule.compute_step_learning_rate(global_step)
    }

    fn initial_lr(&self) -> f32 {
        self.lr_schedule.initial_lr()
    }

    fn set_initial_lr(&mut self, lr: f32) {
        self.lr_schedule.set_initial_lr(lr);
    }
}

// ---------------------------------------------------------------------------------------
// sticker2-utils: summary, save, util

pub trait SummaryWriter {
    fn write_scalar(&self, tag: &str, step: i64, value: f32) -> Result<()>;
}

pub struct NoopWriter;

impl SummaryWriter for NoopWriter {
    fn write_scalar(&self, _tag: &str, _step: i64, _value: f32) -> Result<()> {
        Ok(())
    }
}

#[derive(Copy, Clone, Eq, PartialEq)]
pub enum CompletedUnit<P> {
    /// A batch is completed with the given performance.
    Batch(P),
    /// An epoch is completed with the given performance.
    Epoch(P),
}

pub trait Save<P> {
    fn save(&mut self, vs: &VarStore, completed: CompletedUnit<P>) -> Result<()>;
}

/// Save best epochs with the best performance so far.
#[derive(Clone)]
pub struct BestEpochSaver<P> {
    best_epoch_performance: Option<P>,
    epoch: usize,
    prefix: String,
}

impl<P> BestEpochSaver<P> {
    pub fn new(prefix: impl Into<String>) -> Self {
        BestEpochSaver { best_epoch_performance: None, epoch: 0, prefix: prefix.into() }
    }
}

impl<P> Save<P> for BestEpochSaver<P>
where
    P: PartialOrd,
{
    fn save(&mut self, vs: &VarStore, completed: CompletedUnit<P>) -> Result<()> {
        if let CompletedUnit::Epoch(perf) = completed {
            let improvement = match self.best_epoch_performance {
                Some(ref mut best) => {
                    if perf > *best {
                        *best = perf;
                        true
                    } else {
                        false
                    }
                }
                None => {
                    self.best_epoch_performance = Some(perf);
                    true
                }
            };

            if improvement {
                vs.save(format!("{}epoch-{}", self.prefix, self.epoch))
                    .context(format!("Cannot save variable store for epoch {}", self.epoch))?;
            }

            self.epoch += 1;
        }

        Ok(())
    }
}

/// Runs a closure with autocast.
pub fn autocast_or_preserve<F, T>(enabled: bool, f: F) -> T
where
    F: FnOnce() -> T,
{
    if enabled {
        tch::autocast(true, f)
    } else {
        f()
    }
}

pub fn seq_len_to_mask(seq_lens: &Tensor, max_len: i64) -> Tensor {
    let batch_size = seq_lens.size()[0];
    Tensor::arange(max_len, (Kind::Int, seq_lens.device()))
        // Construct a matrix [batch_size, max_len] where each row
        // is 0..(max_len - 1).
        .repeat([batch_size])
        .view_([batch_size, max_len])
        // Time steps less than the length in seq_lens are active.
        .lt_tensor(&seq_lens.unsqueeze(1))
}

pub trait StickerApp
where
    Self: Sized,
{
    fn run(&self) -> Result<()>;
}

// ---------------------------------------------------------------------------------------
// Stand-ins for the data, tokenizer, encoders and model (see the header)

/// Stand-in for `std::fs::File` over a CoNLL-U file: a split of the digits.
pub struct File {
    x: Tensor,
    y: Tensor,
}

impl File {
    pub fn open(path: &str) -> std::io::Result<File> {
        let d = data::load().map_err(std::io::Error::other)?;
        match path {
            "train.conllu" => Ok(File { x: d.train_x, y: d.train_y }),
            "validation.conllu" => Ok(File { x: d.test_x, y: d.test_y }),
            _ => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        }
    }
}

/// Stand-in for indicatif's `ProgressStyle` (0.15).
pub struct ProgressStyle;

impl ProgressStyle {
    pub fn default_bar() -> ProgressStyle {
        ProgressStyle
    }

    pub fn template(self, _template: &str) -> ProgressStyle {
        self
    }
}

/// Stand-in for indicatif's `ProgressBar`: shows nothing.
#[derive(Clone)]
pub struct ProgressBar;

impl ProgressBar {
    pub fn set_style(&self, _style: ProgressStyle) {}
    pub fn set_message(&self, _message: &str) {}
    pub fn finish(&self) {}
}

/// Stand-in for `crate::progress::ReadProgress`.
pub struct ReadProgress<'a> {
    file: &'a mut File,
    progress_bar: ProgressBar,
}

impl<'a> ReadProgress<'a> {
    pub fn new(file: &'a mut File) -> std::io::Result<Self> {
        Ok(ReadProgress { file, progress_bar: ProgressBar })
    }

    pub fn progress_bar(&self) -> &ProgressBar {
        &self.progress_bar
    }
}

#[derive(Clone, Copy)]
pub enum SequenceLength {
    Tokens(usize),
    Pieces(usize),
}

/// Stand-in for `sticker2::input::Tokenize`.
pub trait Tokenize {}

pub struct DigitTokenizer;

impl Tokenize for DigitTokenizer {}

/// Stand-in for `sticker2::encoders::Encoders`: the names of the sequence encoders.
pub struct Encoders(Vec<String>);

impl Encoders {
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// A batch (`sticker2::tensor::Tensors`).
pub struct Tensors {
    pub inputs: Tensor,
    pub labels: Option<HashMap<String, Tensor>>,
    pub token_mask: Tensor,
    pub seq_lens: Tensor,
}

/// Stand-in for `ConlluDataSet`: the digits of a split, each a one-token sentence, in order.
pub struct ConlluDataSet<'a>(ReadProgress<'a>);

impl<'a> ConlluDataSet<'a> {
    pub fn new(read: ReadProgress<'a>) -> Self {
        ConlluDataSet(read)
    }

    pub fn batches(
        &mut self,
        _encoders: &Encoders,
        _tokenizer: &dyn Tokenize,
        batch_size: usize,
        _max_len: Option<SequenceLength>,
        _shuffle_buffer_size: Option<usize>,
        _labels: bool,
    ) -> Result<impl Iterator<Item = Result<Tensors, StickerError>>, StickerError> {
        let (x, y) = (self.0.file.x.shallow_clone(), self.0.file.y.shallow_clone());
        let bs = batch_size as i64;
        let n = x.size()[0] / bs;
        Ok((0..n).map(move |i| {
            let mut labels = HashMap::new();
            labels.insert("digit".to_string(), y.narrow(0, i * bs, bs));
            Ok(Tensors {
                inputs: x.narrow(0, i * bs, bs),
                labels: Some(labels),
                token_mask: Tensor::ones([bs, 1], (Kind::Int64, Device::Cpu)),
                seq_lens: Tensor::full([bs], 64, (Kind::Int64, Device::Cpu)),
            })
        }))
    }
}

#[derive(Clone, Copy)]
pub struct FreezeLayers {
    pub embeddings: bool,
    pub encoder: bool,
    pub classifiers: bool,
}

pub struct SequenceClassifiersLoss {
    pub summed_loss: Tensor,
    pub encoder_losses: HashMap<String, Tensor>,
    pub encoder_accuracies: HashMap<String, Tensor>,
}

/// Stand-in for `BertModel`: an encoder layer and one classifier ("digit"), named as
/// sticker2 names its variables.
pub struct BertModel {
    encoder_weight: Tensor,
    encoder_bias: Tensor,
    classifier_weight: Tensor,
    classifier_bias: Tensor,
}

impl BertModel {
    pub fn new(vs: &VarStore) -> BertModel {
        let (encoder, classifiers) = (vs.root().sub("encoder"), vs.root().sub("classifiers"));
        let (wi, bi) = (tch::nn::init::DEFAULT_KAIMING_UNIFORM, Init::Const(0.));
        BertModel {
            encoder_weight: encoder.var("weight", &[32, 64], wi),
            encoder_bias: encoder.var("bias", &[32], bi),
            classifier_weight: classifiers.var("weight", &[10, 32], wi),
            classifier_bias: classifiers.var("bias", &[10], bi),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn loss(
        &self,
        inputs: &Tensor,
        _attention_mask: &Tensor,
        _token_mask: &Tensor,
        targets: &HashMap<String, Tensor>,
        _label_smoothing: Option<f64>,
        _train: bool,
        freeze_layers: FreezeLayers,
        _include_continuations: bool,
    ) -> SequenceClassifiersLoss {
        let hidden = inputs.linear(&self.encoder_weight, Some(&self.encoder_bias)).relu();
        let encoding = if freeze_layers.encoder { hidden.detach() } else { hidden };
        let classify = || {
            let logits = encoding.linear(&self.classifier_weight, Some(&self.classifier_bias));
            let loss = logits.cross_entropy_for_logits(&targets["digit"]);
            let accuracy = logits.accuracy_for_logits(&targets["digit"]);
            SequenceClassifiersLoss {
                summed_loss: loss.shallow_clone(),
                encoder_losses: HashMap::from([("digit".to_string(), loss)]),
                encoder_accuracies: HashMap::from([("digit".to_string(), accuracy)]),
            }
        };
        if freeze_layers.classifiers {
            tch::no_grad(classify)
        } else {
            classify()
        }
    }
}

/// Stand-in for `crate::io::Model`.
pub struct Model {
    pub encoders: Encoders,
    pub tokenizer: Box<dyn Tokenize>,
    pub model: BertModel,
    pub vs: VarStore,
}

impl Model {
    pub fn load_from(_config: &str, _pretrained: &str, device: Device, _freeze: bool) -> Result<Model> {
        let vs = VarStore::new(device);
        let model = BertModel::new(&vs);
        Ok(Model { encoders: Encoders(vec!["digit".to_string()]), tokenizer: Box::new(DigitTokenizer), model, vs })
    }

    pub fn load_from_hdf5(config: &str, pretrained: &str, device: Device) -> Result<Model> {
        Model::load_from(config, pretrained, device, false)
    }
}

// ---------------------------------------------------------------------------------------
// sticker2-utils: src/subcommands/finetune.rs

pub struct LrSchedule {
    pub initial_lr_encoder: f32,
    pub initial_lr_classifier: f32,
    pub lr_decay_rate: f32,
    pub lr_scale: f32,
    pub lr_patience: usize,
    pub warmup_steps: usize,
}

pub struct FinetuneApp {
    batch_size: usize,
    config: String,
    continue_finetune: bool,
    device: Device,
    finetune_embeds: bool,
    max_len: Option<SequenceLength>,
    label_smoothing: Option<f64>,
    mixed_precision: bool,
    summary_writer: Box<dyn SummaryWriter>,
    include_continuations: bool,
    lr_schedule: LrSchedule,
    patience: usize,
    pretrained_model: String,
    saver: BestEpochSaver<f32>,
    train_data: String,
    validation_data: String,
    weight_decay: f64,
}

pub struct LearningRateSchedules {
    pub classifier: PlateauLearningRate<ExponentialDecay>,
    pub encoder: PlateauLearningRate<ExponentialDecay>,
}

impl FinetuneApp {
    pub fn lr_schedules(&self) -> LearningRateSchedules {
        let exp_decay = ExponentialDecay::new(
            self.lr_schedule.initial_lr_classifier,
            self.lr_schedule.lr_decay_rate,
            1,
            false,
            self.lr_schedule.warmup_steps,
        );

        let classifier = PlateauLearningRate::new(
            exp_decay,
            self.lr_schedule.lr_scale,
            self.lr_schedule.lr_patience,
        );

        let mut encoder = classifier.clone();
        encoder.set_initial_lr(self.lr_schedule.initial_lr_encoder);

        LearningRateSchedules { classifier, encoder }
    }

    #[allow(clippy::too_many_arguments)]
    #[accel_core::accelerate(strategy = "ddp")]
    fn run_epoch(
        &self,
        encoders: &Encoders,
        tokenizer: &dyn Tokenize,
        model: &BertModel,
        file: &mut File,
        mut grad_scaler: Option<&mut GradScaler<AdamW>>,
        lr_schedulers: &mut LearningRateSchedules,
        global_step: &mut usize,
        epoch: usize,
    ) -> Result<f32> {
        let epoch_type = if grad_scaler.is_some() {
            "train"
        } else {
            "validation"
        };

        let read_progress = ReadProgress::new(file).context("Cannot create progress bar")?;
        let progress_bar = read_progress.progress_bar().clone();
        progress_bar.set_style(ProgressStyle::default_bar().template(&format!(
            "[Time: {{elapsed_precise}}, ETA: {{eta_precise}}] {{bar}} {{percent}}% {} {{msg}}",
            epoch_type
        )));

        let mut dataset = ConlluDataSet::new(read_progress);

        let mut encoder_accuracy = BTreeMap::new();
        let mut encoder_loss = BTreeMap::new();

        let mut n_tokens = 0;

        // Freeze the encoder during the first epoch.
        let freeze_encoder = epoch == 0;

        for batch in dataset.batches(
            encoders,
            tokenizer,
            self.batch_size,
            self.max_len,
            None,
            true,
        )? {
            let batch = batch?;

            let (lr_classifier, lr_encoder) = if epoch == 0 {
                (self.lr_schedule.initial_lr_classifier, 0.)
            } else {
                (
                    lr_schedulers.classifier.compute_step_learning_rate(*global_step),
                    lr_schedulers.encoder.compute_step_learning_rate(*global_step),
                )
            };

            let attention_mask = seq_len_to_mask(&batch.seq_lens, batch.inputs.size()[1]);

            let n_batch_tokens = i64::try_from(batch.token_mask.sum(Kind::Int64))?;

            let model_loss = autocast_or_preserve(self.mixed_precision, || {
                model.loss(
                    &batch.inputs.to_device(self.device),
                    &attention_mask.to_device(self.device),
                    &batch.token_mask.to_device(self.device),
                    &batch
                        .labels
                        .expect("Batch without labels.")
                        .into_iter()
                        .map(|(encoder_name, labels)| (encoder_name, labels.to_device(self.device)))
                        .collect(),
                    self.label_smoothing,
                    grad_scaler.is_some(),
                    FreezeLayers {
                        embeddings: !self.finetune_embeds || freeze_encoder,
                        encoder: freeze_encoder,
                        classifiers: grad_scaler.is_none(),
                    },
                    self.include_continuations,
                )
            });

            n_tokens += n_batch_tokens;

            let scalar_loss: f32 = f32::try_from(model_loss.summed_loss.sum(Kind::Float))?;

            if let Some(scaler) = &mut grad_scaler {
                scaler.backward_step(&model_loss.summed_loss.sum(Kind::Float), |name| {
                    let mut config = AdamWConfig::default();

                    // Use weight decay for all variables, except for
                    // layer norm variables.
                    if !name.contains("layer_norm") {
                        config.weight_decay = self.weight_decay;
                    }

                    // Use separate learning rates for the encoder and classifiers.
                    if name.starts_with("classifiers") {
                        config.lr = lr_classifier.into();
                    } else if name.starts_with("encoder") || name.starts_with("embeddings") {
                        config.lr = lr_encoder.into();
                    } else {
                        unreachable!();
                    }

                    config
                });

                if epoch != 0 {
                    self.summary_writer.write_scalar(
                        "gradient_scale",
                        *global_step as i64,
                        scaler.current_scale(),
                    )?;
                }

                if epoch != 0 {
                    *global_step += 1;
                }
            };

            for (encoder_name, loss) in model_loss.encoder_losses {
                *encoder_accuracy.entry(encoder_name.clone()).or_insert(0f32) +=
                    f32::try_from(&model_loss.encoder_accuracies[&encoder_name])?
                        * n_batch_tokens as f32;
                *encoder_loss.entry(encoder_name).or_insert(0f32) +=
                    f32::try_from(loss)? * n_batch_tokens as f32;
            }

            progress_bar.set_message(&format!(
                "classifier lr: {:.1e}, encoder lr: {:.1e}, batch loss: {:.4}, global step: {}",
                lr_classifier, lr_encoder, scalar_loss, global_step
            ));
        }

        progress_bar.finish();

        eprintln!();
        let mut acc_sum = 0.0;
        for (encoder_name, loss) in encoder_loss {
            let acc = encoder_accuracy[&encoder_name] / n_tokens as f32;
            let loss = loss / n_tokens as f32;

            eprintln!("{} loss: {} accuracy: {:.4}", encoder_name, loss, acc);

            self.summary_writer.write_scalar(
                &format!("loss:{},layer:{}", epoch_type, &encoder_name),
                *global_step as i64,
                loss,
            )?;

            self.summary_writer.write_scalar(
                &format!("acc:{},layer:{}", epoch_type, &encoder_name),
                *global_step as i64,
                acc,
            )?;

            acc_sum += acc;
        }
        eprintln!();

        Ok(acc_sum / encoders.len() as f32)
    }
}

impl StickerApp for FinetuneApp {
    fn run(&self) -> Result<()> {
        let model = if self.continue_finetune {
            Model::load_from(&self.config, &self.pretrained_model, self.device, false)?
        } else {
            Model::load_from_hdf5(&self.config, &self.pretrained_model, self.device)?
        };

        let mut train_file = File::open(&self.train_data)
            .context(format!("Cannot open train data file: {}", self.train_data))?;
        let mut validation_file = File::open(&self.validation_data).context(format!(
            "Cannot open validation data file: {}",
            self.validation_data
        ))?;

        let mut saver = self.saver.clone();
        let opt = AdamW::new(&model.vs);
        let mut grad_scaler = GradScaler::new_with_defaults(self.mixed_precision, opt);

        let mut lr_schedules = self.lr_schedules();

        let mut last_acc = 0.0;
        let mut best_acc = 0.0;
        let mut best_epoch = 0;

        let mut global_step = 1;

        for epoch in 0.. {
            eprintln!("Epoch {}", epoch);

            let _ = lr_schedules.classifier.compute_epoch_learning_rate(epoch, last_acc);
            let _ = lr_schedules.encoder.compute_epoch_learning_rate(epoch, last_acc);

            self.run_epoch(
                &model.encoders,
                &*model.tokenizer,
                &model.model,
                &mut train_file,
                Some(&mut grad_scaler),
                &mut lr_schedules,
                &mut global_step,
                epoch,
            )
            .context("Cannot run train epoch")?;

            last_acc = self
                .run_epoch(
                    &model.encoders,
                    &*model.tokenizer,
                    &model.model,
                    &mut validation_file,
                    None,
                    &mut lr_schedules,
                    &mut global_step,
                    epoch,
                )
                .context("Cannot run valdidation epoch")?;

            if last_acc > best_acc {
                best_epoch = epoch;
                best_acc = last_acc;
            }

            saver.save(&model.vs, CompletedUnit::Epoch(last_acc)).context("Error saving model")?;

            let epoch_status = if best_epoch == epoch { "🎉" } else { "" };
            eprintln!(
                "Epoch {} (validation): acc: {:.4}, best epoch: {}, best acc: {:.4} {}",
                epoch, last_acc, best_epoch, best_acc, epoch_status
            );

            self.summary_writer.write_scalar("acc:validation,avg", global_step as i64, last_acc)?;

            if epoch - best_epoch == self.patience {
                eprintln!(
                    "Lost my patience! Best epoch: {} with accuracy: {:.4}",
                    best_epoch, best_acc
                );
                break;
            }
        }

        Ok(())
    }
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    // What `FinetuneApp::parse` reads from the command line, at its defaults.
    let app = FinetuneApp {
        batch_size: data::batch_size() as usize,
        config: "sticker.conf".to_string(),
        continue_finetune: false,
        device: Device::Cpu,
        finetune_embeds: false,
        max_len: None,
        label_smoothing: None,
        mixed_precision: false,
        summary_writer: Box::new(NoopWriter),
        include_continuations: false,
        lr_schedule: LrSchedule {
            initial_lr_encoder: 5e-5,
            initial_lr_classifier: 1e-3,
            lr_decay_rate: 0.99998,
            lr_scale: 0.9,
            lr_patience: 1,
            warmup_steps: 10,
        },
        patience: 2,
        pretrained_model: "pretrained.hdf5".to_string(),
        saver: BestEpochSaver::new(""),
        train_data: "train.conllu".to_string(),
        validation_data: "validation.conllu".to_string(),
        weight_decay: 0.0,
    };
    app.run()
}
