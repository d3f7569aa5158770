//! From the crates.io package syntaxdot-cli 0.5.0 (`syntaxdot-cli-0.5.0.crate`):
//! `src/subcommands/finetune.rs` (`<FinetuneApp as SyntaxDotApp>::run`, with `lr_schedules`,
//! `run_epoch`, `log_epoch_stats`, `run_epoch_steps`), `src/traits.rs` (`ParameterGroup`,
//! `build_parameter_group_fun`, `build_optimizer`), `src/save.rs` (`BestEpochSaver`),
//! `src/util.rs` (`autocast_or_preserve`), `src/summary/noop.rs`; and from syntaxdot 0.5.0
//! (`syntaxdot-0.5.0.crate`) `src/optimizers/{mod,grad,grad_scale}.rs` (`Optimizer`,
//! `ZeroGrad`, `GradScaler`) and `src/lr.rs` (`ExponentialDecay`, `PlateauLearningRate`).
//! Licence: MIT OR Apache-2.0 (both `Cargo.toml`s; no licence file in either package:
//! licenses/syntaxdot-0.5.0-LICENSE-NOTE.md).
//!
//! The function: the fine-tuning driver. The optimizer is tch's AdamW over four parameter
//! groups wrapped in syntaxdot's own `GradScaler` (`self.build_optimizer(&model.vs)?`);
//! `for epoch in 0..` (no end): the epoch-level learning rates from the last validation
//! accuracy (plateau schedules), a training epoch `self.run_epoch(.., Some(&mut
//! grad_scaler), ..)` and a validation epoch (`None`), the best epoch kept, the VarStore saved
//! by a `BestEpochSaver` (`vs.save` inside `Save::save`), a summary scalar, and `break` when
//! `patience` epochs passed without improvement. The batches, the per-step learning rates
//! (`set_lr_group` on each of the four groups), the encoder frozen in epoch 0 and
//! `scaler.backward_step(&loss)?` are all in `run_epoch_steps`.
//!
//! Changed: local stand-ins for what cannot exist here, keeping the calls as written. The
//! model (`BertModel`, a pretrained transformer with sequence classifiers) is the digits MLP
//! laid out as syntaxdot names its variables (`encoder.*` and `classifiers.*`, the four
//! parameter groups chosen by `build_parameter_group_fun`, the encoder frozen by
//! `FreezeLayers` as the crate does), `Model::load_from` builds it fresh; the CoNLL-U files
//! (`File::open`) are the two splits of the digits, read in order by a `ConlluDataSet` whose
//! `sentences(..)?.filter_by_len(..).batched_tensors(..)` yields `Result<Tensors, _>`
//! batches (each digit a one-token "sentence", its label the one encoder's); `ReadProgress`
//! and indicatif's `ProgressBar`/`ProgressStyle` print nothing; `log::info!` ->
//! `eprintln!`; `BufReader::new(read_progress)` -> `read_progress`; the app's fields are set
//! in `run` instead of parsed by clap (batch size `data::batch_size()`, warmup 10000 -> 10
//! steps, patience 15 -> 2, lr patience 2 -> 1); tch 0.24 names (`f32::try_from`,
//! `Vec::<f32>::try_from`, sizes as arrays). The crate's `GradScaler`, `Optimizer`,
//! `ExponentialDecay`, `PlateauLearningRate`, `BestEpochSaver` are copied unchanged but for
//! those names.
//!
//! Expected: **Refused { line: 1192, says: "found no `loss.backward()`" }**, at the name of
//! `run`. Nothing in `run` runs backward: the step is two calls deep (`run_epoch` ->
//! `run_epoch_steps`), and the optimizer is lent to `run_epoch` inside `Some(&mut
//! grad_scaler)`, made by a helper (`self.build_optimizer(..)`), so it is not an optimizer the
//! attribute recognises as lent (that needs `config.build(..)` in the body). The attribute
//! belongs on `run_epoch_steps` (syntaxdot_run_epoch_steps.rs), where it is refused too.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs;

use anyhow::{Context, Result};
use tch::nn::{self, adamw, Init, Optimizer as TchOptimizer, OptimizerConfig, VarStore};
use tch::{self, Device, Kind, TchError, Tensor};

use crate::data;

// ---------------------------------------------------------------------------------------
// syntaxdot::error (the variants used here)

#[derive(Debug)]
pub enum SyntaxDotError {
    NoTrainableVariables,
    Tch(TchError),
}

impl std::fmt::Display for SyntaxDotError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SyntaxDotError::NoTrainableVariables => write!(f, "No trainable variables"),
            SyntaxDotError::Tch(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SyntaxDotError {}

impl From<TchError> for SyntaxDotError {
    fn from(e: TchError) -> Self {
        SyntaxDotError::Tch(e)
    }
}

// ---------------------------------------------------------------------------------------
// syntaxdot::optimizers

pub trait ZeroGrad {
    /// Zero out gradients.
    fn zero_grad(&mut self);
}

impl ZeroGrad for Vec<Tensor> {
    fn zero_grad(&mut self) {
        for tensor in self {
            if tensor.requires_grad() {
                tensor.zero_grad()
            }
        }
    }
}

pub trait Optimizer {
    /// Perform a backward step on the given loss.
    fn backward_step(&mut self, loss: &Tensor) -> Result<(), SyntaxDotError>;

    /// Set the learning rate for a parameter group.
    fn set_lr_group(&mut self, group: usize, learning_rate: f64);

    /// Set the weight decay for a parameter group.
    fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64);

    /// Perform an update step.
    fn step(&mut self);

    /// Get the trainable variables associated with the optimizer.
    fn trainable_variables(&self) -> Vec<Tensor>;
}

impl Optimizer for nn::Optimizer {
    fn backward_step(&mut self, loss: &Tensor) -> Result<(), SyntaxDotError> {
        nn::Optimizer::backward_step(self, loss);
        Ok(())
    }

    fn set_lr_group(&mut self, group: usize, learning_rate: f64) {
        nn::Optimizer::set_lr_group(self, group, learning_rate)
    }

    fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) {
        nn::Optimizer::set_weight_decay_group(self, group, weight_decay)
    }

    fn step(&mut self) {
        nn::Optimizer::step(self)
    }

    fn trainable_variables(&self) -> Vec<Tensor> {
        nn::Optimizer::trainable_variables(self)
    }
}

/// Gradient scaler: scales the loss, unscales the gradients, skips steps with infinite
/// gradients and adapts the scale (syntaxdot's, over any `Optimizer`).
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
    ) -> Result<Self, SyntaxDotError> {
        let device = match optimizer.trainable_variables().first() {
            Some(tensor) => tensor.device(),
            None => return Err(SyntaxDotError::NoTrainableVariables),
        };

        Ok(GradScaler {
            enabled,
            growth_factor,
            backoff_factor,
            growth_interval,

            optimizer,

            found_inf: Tensor::full([1], 0.0, (Kind::Float, device)),
            growth_tracker: Tensor::full([1], 0, (Kind::Int, device)),
            scale: Tensor::full([1], init_scale, (Kind::Float, device)),
        })
    }

    /// Construct a new gradient scaler.
    pub fn new_with_defaults(enabled: bool, optimizer: O) -> Result<Self, SyntaxDotError> {
        GradScaler::new(enabled, optimizer, 2f64.powi(16), 2., 0.5, 2000)
    }

    /// Get the current scale.
    pub fn current_scale(&self) -> f32 {
        Vec::<f32>::try_from(&self.scale).unwrap()[0]
    }

    /// Get a mutable reference to the wrapped optimizer.
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }

    /// Scale the given tensor.
    fn scale(&mut self, t: &Tensor) -> Result<Tensor, SyntaxDotError> {
        Ok(if !self.enabled { t.shallow_clone() } else { t.f_mul(&self.scale)? })
    }

    /// Update the scale for the next step.
    fn update(&mut self) {
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
    fn backward_step(&mut self, loss: &Tensor) -> Result<(), SyntaxDotError> {
        self.optimizer.trainable_variables().zero_grad();
        self.scale(loss)?.f_backward()?;
        tch::no_grad(|| self.step());
        self.update();
        Ok(())
    }

    fn set_lr_group(&mut self, group: usize, learning_rate: f64) {
        self.optimizer.set_lr_group(group, learning_rate)
    }

    fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) {
        self.optimizer.set_weight_decay_group(group, weight_decay)
    }

    fn step(&mut self) {
        if !self.enabled {
            return self.optimizer.step();
        }

        let inv_scale = self.scale.reciprocal().to_kind(Kind::Float);

        for tensor in &mut self.optimizer.trainable_variables() {
            if !tensor.grad().defined() {
                continue;
            }

            tensor.grad().internal_amp_non_finite_check_and_unscale(&mut self.found_inf, &inv_scale);
        }

        let found_inf = (f32::try_from(&self.found_inf).unwrap() - 1.0).abs() < f32::EPSILON;

        // Only step when there are no infinite gradients.
        if !found_inf {
            self.optimizer.step()
        }
    }

    fn trainable_variables(&self) -> Vec<Tensor> {
        self.optimizer.trainable_variables()
    }
}

// ---------------------------------------------------------------------------------------
// syntaxdot::lr

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
// syntaxdot-cli: summary, save, util, traits

pub trait ScalarWriter {
    fn write_scalar(&self, tag: &str, step: i64, value: f32) -> Result<()>;
}

pub struct NoopWriter;

impl ScalarWriter for NoopWriter {
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
    best_epoch_paths: Option<VecDeque<String>>,
    epoch: usize,
    keep_best_epochs: Option<usize>,
    prefix: String,
}

impl<P> BestEpochSaver<P> {
    pub fn new(prefix: impl Into<String>, keep_best_epochs: Option<usize>) -> Self {
        BestEpochSaver {
            best_epoch_performance: None,
            best_epoch_paths: keep_best_epochs.map(VecDeque::with_capacity),
            epoch: 0,
            keep_best_epochs,
            prefix: prefix.into(),
        }
    }

    fn cleanup_old_best_steps(&mut self, step_path: String) {
        if let Some(best_epoch_paths) = &mut self.best_epoch_paths {
            if best_epoch_paths.len() == self.keep_best_epochs.unwrap() {
                let cleanup_step = best_epoch_paths.pop_front().expect("No steps?");
                if let Err(err) = fs::remove_file(&cleanup_step) {
                    eprintln!("Cannot remove step parameters {}: {}", cleanup_step, err);
                }
            }

            best_epoch_paths.push_back(step_path);
        }
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
                let path = format!("{}epoch-{}", self.prefix, self.epoch);
                vs.save(&path)
                    .context(format!("Cannot save variable store for epoch {}", self.epoch))?;

                self.cleanup_old_best_steps(path)
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

pub enum ParameterGroup {
    Encoder = 0,
    Classifier = 1,
    EncoderNoWeightDecay = 2,
    ClassifierNoWeightDecay = 3,
}

pub trait SyntaxDotApp
where
    Self: Sized,
{
    fn run(&self) -> Result<()>;
}

pub trait SyntaxDotTrainApp: SyntaxDotApp {
    fn build_parameter_group_fun() -> fn(&str) -> usize {
        |name: &str| {
            if name.starts_with("classifiers") || name.starts_with("biaffine") {
                if name.contains("layer_norm") || name.contains("bias") {
                    ParameterGroup::ClassifierNoWeightDecay as usize
                } else {
                    ParameterGroup::Classifier as usize
                }
            } else if name.starts_with("encoder") || name.starts_with("embeddings") {
                if name.contains("layer_norm") || name.contains("bias") {
                    ParameterGroup::EncoderNoWeightDecay as usize
                } else {
                    ParameterGroup::Encoder as usize
                }
            } else {
                unreachable!();
            }
        }
    }

    fn build_optimizer(&self, var_store: &VarStore) -> Result<GradScaler<TchOptimizer>> {
        let opt = adamw(0.9, 0.999, self.weight_decay()).build(var_store, 1e-3)?;
        let mut grad_scaler = GradScaler::new_with_defaults(self.mixed_precision(), opt)?;
        grad_scaler.set_weight_decay_group(ParameterGroup::EncoderNoWeightDecay as usize, 0.);
        grad_scaler.set_weight_decay_group(ParameterGroup::ClassifierNoWeightDecay as usize, 0.);
        Ok(grad_scaler)
    }

    fn mixed_precision(&self) -> bool;

    fn weight_decay(&self) -> f64;
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

/// Stand-in for indicatif's `ProgressStyle` (0.16).
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
    pub fn set_message(&self, _message: String) {}
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
    Unbounded,
}

/// Stand-in for syntaxdot-tokenizers' `Tokenize`.
pub trait Tokenize {}

pub struct DigitTokenizer;

impl Tokenize for DigitTokenizer {}

/// Stand-in for syntaxdot-encoders' `ImmutableDependencyEncoder` (no parser here).
pub struct ImmutableDependencyEncoder;

/// Stand-in for `syntaxdot::encoders::Encoders`: the names of the sequence encoders.
pub struct Encoders(Vec<String>);

/// Sequence lengths, in pieces (`syntaxdot::tensor::SequenceLengths`).
pub struct SeqLens(Tensor);

impl SeqLens {
    pub fn attention_mask(&self) -> Result<Tensor, SyntaxDotError> {
        let max_len = i64::try_from(self.0.max())?;
        Ok(Tensor::arange(max_len, (Kind::Int64, self.0.device()))
            .unsqueeze(0)
            .f_lt_tensor(&self.0.unsqueeze(1))?)
    }
}

/// Token spans (`syntaxdot::tensor::TokenSpans`): the first piece of each token, -1 where
/// there is none.
pub struct TokenSpans(Tensor);

impl TokenSpans {
    pub fn token_mask(&self) -> Result<Tensor, SyntaxDotError> {
        Ok(self.0.f_ne(-1)?)
    }

    pub fn to_device(&self, device: Device) -> TokenSpans {
        TokenSpans(self.0.to_device(device))
    }
}

pub struct BiaffineTensors<T> {
    pub heads: T,
    pub relations: T,
}

impl BiaffineTensors<Tensor> {
    pub fn to_device(&self, device: Device) -> Self {
        BiaffineTensors { heads: self.heads.to_device(device), relations: self.relations.to_device(device) }
    }
}

/// A batch (`syntaxdot::tensor::Tensors`).
pub struct Tensors {
    pub inputs: Tensor,
    pub labels: Option<HashMap<String, Tensor>>,
    pub seq_lens: SeqLens,
    pub token_spans: TokenSpans,
    pub biaffine_encodings: Option<BiaffineTensors<Tensor>>,
}

/// Stand-in for `ConlluDataSet`: the digits of a split, each a one-token sentence.
pub struct ConlluDataSet<'a>(ReadProgress<'a>);

impl<'a> ConlluDataSet<'a> {
    pub fn new(read: ReadProgress<'a>) -> Self {
        ConlluDataSet(read)
    }

    pub fn sentences(&mut self, _tokenizer: &dyn Tokenize) -> Result<Sentences, SyntaxDotError> {
        Ok(Sentences { x: self.0.file.x.shallow_clone(), y: self.0.file.y.shallow_clone() })
    }
}

/// The sentences of a data set, in order (`SentenceIterTools` and `BatchedTensors`).
pub struct Sentences {
    x: Tensor,
    y: Tensor,
}

impl Sentences {
    pub fn filter_by_len(self, _max_len: SequenceLength) -> Sentences {
        self
    }

    pub fn batched_tensors(
        self,
        _biaffine_encoder: Option<&ImmutableDependencyEncoder>,
        _encoders: Option<&Encoders>,
        batch_size: usize,
    ) -> impl Iterator<Item = Result<Tensors, SyntaxDotError>> {
        let bs = batch_size as i64;
        let n = self.x.size()[0] / bs;
        (0..n).map(move |i| {
            let inputs = self.x.narrow(0, i * bs, bs);
            let mut labels = HashMap::new();
            labels.insert("digit".to_string(), self.y.narrow(0, i * bs, bs));
            Ok(Tensors {
                inputs,
                labels: Some(labels),
                seq_lens: SeqLens(Tensor::ones([bs], (Kind::Int64, Device::Cpu))),
                token_spans: TokenSpans(Tensor::zeros([bs, 1], (Kind::Int64, Device::Cpu))),
                biaffine_encodings: None,
            })
        })
    }
}

#[derive(Clone, Copy)]
pub struct FreezeLayers {
    pub embeddings: bool,
    pub encoder: bool,
    pub classifiers: bool,
}

pub struct BiaffineAccuracy {
    pub las: Tensor,
    pub ls: Tensor,
    pub uas: Tensor,
}

pub struct BiaffineLoss {
    pub acc: BiaffineAccuracy,
    pub head_loss: Tensor,
    pub relation_loss: Tensor,
}

pub struct SequenceClassifiersLoss {
    pub summed_loss: Tensor,
    pub encoder_losses: HashMap<String, Tensor>,
    pub encoder_accuracies: HashMap<String, Tensor>,
}

pub struct BertLoss {
    pub biaffine: Option<BiaffineLoss>,
    pub seq_classifiers: SequenceClassifiersLoss,
}

/// Stand-in for `BertModel`: an encoder layer and one classifier ("digit"), their variables
/// named as syntaxdot's and put in the groups `parameter_group_fun` gives them.
pub struct BertModel {
    encoder_weight: Tensor,
    encoder_bias: Tensor,
    classifier_weight: Tensor,
    classifier_bias: Tensor,
}

impl BertModel {
    pub fn new(vs: &VarStore, parameter_group_fun: fn(&str) -> usize) -> BertModel {
        let root = vs.root();
        let var = |name: &str, dims: &[i64], init: Init| {
            let (sub, leaf) = name.split_once('.').unwrap();
            root.sub(sub).set_group(parameter_group_fun(name)).var(leaf, dims, init)
        };
        let (wi, bi) = (nn::init::DEFAULT_KAIMING_UNIFORM, Init::Const(0.));
        BertModel {
            encoder_weight: var("encoder.weight", &[32, 64], wi),
            encoder_bias: var("encoder.bias", &[32], bi),
            classifier_weight: var("classifiers.weight", &[10, 32], wi),
            classifier_bias: var("classifiers.bias", &[10], bi),
        }
    }

    fn encode(&self, inputs: &Tensor, freeze_layers: FreezeLayers) -> Tensor {
        let hidden = inputs.linear(&self.encoder_weight, Some(&self.encoder_bias)).relu();
        if freeze_layers.encoder {
            hidden.detach()
        } else {
            hidden
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn loss(
        &self,
        inputs: &Tensor,
        _attention_mask: &Tensor,
        token_spans: &TokenSpans,
        _biaffine_tensors: Option<BiaffineTensors<Tensor>>,
        targets: &HashMap<String, Tensor>,
        _label_smoothing: Option<f64>,
        _train: bool,
        freeze_layers: FreezeLayers,
    ) -> Result<BertLoss, SyntaxDotError> {
        let encoding = self.encode(inputs, freeze_layers);
        let _token_mask = token_spans.token_mask()?;
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
        let seq_classifiers =
            if freeze_layers.classifiers { tch::no_grad(classify) } else { classify() };
        Ok(BertLoss { biaffine: None, seq_classifiers })
    }
}

/// Stand-in for `crate::io::Model`.
pub struct Model {
    pub biaffine_encoder: Option<ImmutableDependencyEncoder>,
    pub encoders: Encoders,
    pub tokenizer: Box<dyn Tokenize>,
    pub model: BertModel,
    pub vs: VarStore,
}

impl Model {
    pub fn load_from(
        _config_path: &str,
        _parameters_path: &str,
        device: Device,
        _freeze: bool,
        _load_partial: bool,
        parameter_group_fun: fn(&str) -> usize,
    ) -> Result<Model> {
        let vs = VarStore::new(device);
        let model = BertModel::new(&vs, parameter_group_fun);
        Ok(Model {
            biaffine_encoder: None,
            encoders: Encoders(vec!["digit".to_string()]),
            tokenizer: Box::new(DigitTokenizer),
            model,
            vs,
        })
    }
}

// ---------------------------------------------------------------------------------------
// syntaxdot-cli: src/subcommands/finetune.rs

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
    max_len: SequenceLength,
    label_smoothing: Option<f64>,
    mixed_precision: bool,
    summary_writer: Box<dyn ScalarWriter>,
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

struct BiaffineEpochStats {
    las: f32,
    ls: f32,
    uas: f32,
    head_loss: f32,
    relation_loss: f32,
}

struct EpochStats {
    biaffine: Option<BiaffineEpochStats>,
    encoder_accuracy: BTreeMap<String, f32>,
    encoder_loss: BTreeMap<String, f32>,
    n_tokens: i64,
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
    fn run_epoch(
        &self,
        biaffine_encoder: Option<&ImmutableDependencyEncoder>,
        encoders: &Encoders,
        tokenizer: &dyn Tokenize,
        model: &BertModel,
        file: &mut File,
        mut grad_scaler: Option<&mut GradScaler<impl Optimizer>>,
        lr_schedulers: &mut LearningRateSchedules,
        global_step: &mut usize,
        epoch: usize,
    ) -> Result<f32> {
        let epoch_stats = self.run_epoch_steps(
            biaffine_encoder,
            encoders,
            tokenizer,
            model,
            file,
            &mut grad_scaler,
            lr_schedulers,
            global_step,
            epoch,
        )?;

        self.log_epoch_stats(global_step, epoch_stats, grad_scaler.is_some())
    }

    fn log_epoch_stats(
        &self,
        global_step: &usize,
        epoch_stats: EpochStats,
        train: bool,
    ) -> Result<f32> {
        let epoch_type = if train { "train" } else { "validation" };

        let mut accs = Vec::new();

        if let Some(biaffine_stats) = epoch_stats.biaffine {
            accs.push(biaffine_stats.las / epoch_stats.n_tokens as f32);

            eprintln!(
                "biaffine head loss: {:.4}, rel loss: {:.4}, las: {:.4}, uas: {:.4}, ls: {:.4}",
                biaffine_stats.head_loss / epoch_stats.n_tokens as f32,
                biaffine_stats.relation_loss / epoch_stats.n_tokens as f32,
                biaffine_stats.las / epoch_stats.n_tokens as f32,
                biaffine_stats.uas / epoch_stats.n_tokens as f32,
                biaffine_stats.ls / epoch_stats.n_tokens as f32
            );

            self.summary_writer.write_scalar(
                &format!("loss:{},biaffine:head", epoch_type),
                *global_step as i64,
                biaffine_stats.head_loss,
            )?;

            self.summary_writer.write_scalar(
                &format!("loss:{},biaffine:relation", epoch_type),
                *global_step as i64,
                biaffine_stats.relation_loss,
            )?;

            self.summary_writer.write_scalar(
                &format!("las:{},biaffine", epoch_type),
                *global_step as i64,
                biaffine_stats.las / epoch_stats.n_tokens as f32,
            )?;

            self.summary_writer.write_scalar(
                &format!("ls:{},biaffine", epoch_type),
                *global_step as i64,
                biaffine_stats.ls / epoch_stats.n_tokens as f32,
            )?;

            self.summary_writer.write_scalar(
                &format!("uas:{},biaffine", epoch_type),
                *global_step as i64,
                biaffine_stats.uas / epoch_stats.n_tokens as f32,
            )?;
        }

        for (encoder_name, loss) in epoch_stats.encoder_loss {
            let acc = epoch_stats.encoder_accuracy[&encoder_name] / epoch_stats.n_tokens as f32;
            let loss = loss / epoch_stats.n_tokens as f32;

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

            accs.push(acc);
        }

        Ok(accs.iter().sum::<f32>() / accs.len() as f32)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_epoch_steps(
        &self,
        biaffine_encoder: Option<&ImmutableDependencyEncoder>,
        encoders: &Encoders,
        tokenizer: &dyn Tokenize,
        model: &BertModel,
        file: &mut File,
        mut grad_scaler: &mut Option<&mut GradScaler<impl Optimizer>>,
        lr_schedulers: &mut LearningRateSchedules,
        global_step: &mut usize,
        epoch: usize,
    ) -> Result<EpochStats> {
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

        let mut n_tokens = 0;

        // Freeze the encoder during the first epoch.
        let freeze_encoder = epoch == 0;

        let mut biaffine_las = 0f32;
        let mut biaffine_ls = 0f32;
        let mut biaffine_uas = 0f32;
        let mut biaffine_head_loss = 0f32;
        let mut biaffine_relation_loss = 0f32;
        let mut encoder_accuracy = BTreeMap::new();
        let mut encoder_loss = BTreeMap::new();

        for batch in dataset
            .sentences(tokenizer)?
            .filter_by_len(self.max_len)
            .batched_tensors(biaffine_encoder, Some(encoders), self.batch_size)
        {
            let batch = batch?;

            let (lr_classifier, lr_encoder) = if epoch == 0 {
                (self.lr_schedule.initial_lr_classifier, 0.)
            } else {
                (
                    lr_schedulers.classifier.compute_step_learning_rate(*global_step),
                    lr_schedulers.encoder.compute_step_learning_rate(*global_step),
                )
            };

            let attention_mask = batch.seq_lens.attention_mask()?;

            let n_batch_tokens =
                i64::try_from(batch.token_spans.token_mask()?.f_sum(Kind::Int64)?)?;

            let model_loss = autocast_or_preserve(self.mixed_precision, || {
                model.loss(
                    &batch.inputs.to_device(self.device),
                    &attention_mask.to_device(self.device),
                    &batch.token_spans.to_device(self.device),
                    batch.biaffine_encodings.map(|tensors| tensors.to_device(self.device)),
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
                )
            })?;

            n_tokens += n_batch_tokens;

            let scalar_loss: f32 =
                f32::try_from(model_loss.seq_classifiers.summed_loss.f_sum(Kind::Float)?)?;

            if let Some(scaler) = &mut grad_scaler {
                let optimizer = scaler.optimizer_mut();

                optimizer.set_lr_group(ParameterGroup::Encoder as usize, lr_encoder.into());
                optimizer.set_lr_group(
                    ParameterGroup::EncoderNoWeightDecay as usize,
                    lr_encoder.into(),
                );
                optimizer.set_lr_group(ParameterGroup::Classifier as usize, lr_classifier.into());
                optimizer.set_lr_group(
                    ParameterGroup::ClassifierNoWeightDecay as usize,
                    lr_classifier.into(),
                );

                let mut loss = model_loss.seq_classifiers.summed_loss.f_sum(Kind::Float)?;
                if let Some(biaffine_loss) = model_loss.biaffine.as_ref() {
                    let _ = loss.f_add_(&biaffine_loss.head_loss.f_add(&biaffine_loss.relation_loss)?)?;
                }

                scaler.backward_step(&loss)?;

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

            for (encoder_name, loss) in model_loss.seq_classifiers.encoder_losses {
                *encoder_accuracy.entry(encoder_name.clone()).or_insert(0f32) +=
                    f32::try_from(&model_loss.seq_classifiers.encoder_accuracies[&encoder_name])?
                        * n_batch_tokens as f32;
                *encoder_loss.entry(encoder_name).or_insert(0f32) +=
                    f32::try_from(loss)? * n_batch_tokens as f32;
            }

            if let Some(biaffine_loss) = model_loss.biaffine.as_ref() {
                let head_loss = f32::try_from(&biaffine_loss.head_loss)?;
                let relation_loss = f32::try_from(&biaffine_loss.relation_loss)?;

                biaffine_las += f32::try_from(&biaffine_loss.acc.las)? * n_batch_tokens as f32;
                biaffine_ls += f32::try_from(&biaffine_loss.acc.ls)? * n_batch_tokens as f32;
                biaffine_uas += f32::try_from(&biaffine_loss.acc.uas)? * n_batch_tokens as f32;
                biaffine_head_loss += head_loss * n_batch_tokens as f32;
                biaffine_relation_loss += relation_loss * n_batch_tokens as f32;

                progress_bar.set_message(format!(
                    "classifier lr: {:.1e}, encoder lr: {:.1e}, seq loss: {:.4}, head loss: {:.4}, rel loss: {:.4}, global step: {}",
                    lr_classifier, lr_encoder, scalar_loss, head_loss, relation_loss, global_step
                ));
            } else {
                progress_bar.set_message(format!(
                    "classifier lr: {:.1e}, encoder lr: {:.1e}, seq loss: {:.4}, global step: {}",
                    lr_classifier, lr_encoder, scalar_loss, global_step
                ));
            }
        }

        progress_bar.finish();

        let biaffine_stats = biaffine_encoder.map(|_| BiaffineEpochStats {
            las: biaffine_las,
            ls: biaffine_ls,
            uas: biaffine_uas,
            head_loss: biaffine_head_loss,
            relation_loss: biaffine_relation_loss,
        });

        Ok(EpochStats { biaffine: biaffine_stats, encoder_accuracy, encoder_loss, n_tokens })
    }
}

impl SyntaxDotApp for FinetuneApp {
    #[accel_core::accelerate(strategy = "ddp")]
    fn run(&self) -> Result<()> {
        let model = if self.continue_finetune {
            Model::load_from(
                &self.config,
                &self.pretrained_model,
                self.device,
                false,
                false,
                Self::build_parameter_group_fun(),
            )?
        } else {
            Model::load_from(
                &self.config,
                &self.pretrained_model,
                self.device,
                false,
                true,
                Self::build_parameter_group_fun(),
            )?
        };

        let mut train_file = File::open(&self.train_data)
            .context(format!("Cannot open train data file: {}", self.train_data))?;
        let mut validation_file = File::open(&self.validation_data).context(format!(
            "Cannot open validation data file: {}",
            self.validation_data
        ))?;

        let mut saver = self.saver.clone();
        let mut grad_scaler = self.build_optimizer(&model.vs)?;

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
                model.biaffine_encoder.as_ref(),
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
                    model.biaffine_encoder.as_ref(),
                    &model.encoders,
                    &*model.tokenizer,
                    &model.model,
                    &mut validation_file,
                    None as Option<&mut GradScaler<nn::Optimizer>>,
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

impl SyntaxDotTrainApp for FinetuneApp {
    fn mixed_precision(&self) -> bool {
        self.mixed_precision
    }

    fn weight_decay(&self) -> f64 {
        self.weight_decay
    }
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    // What `FinetuneApp::parse` reads from the command line, at its defaults.
    let app = FinetuneApp {
        batch_size: data::batch_size() as usize,
        config: "syntaxdot.conf".to_string(),
        continue_finetune: false,
        device: Device::Cpu,
        finetune_embeds: false,
        max_len: SequenceLength::Unbounded,
        label_smoothing: None,
        mixed_precision: false,
        summary_writer: Box::new(NoopWriter),
        lr_schedule: LrSchedule {
            initial_lr_encoder: 5e-5,
            initial_lr_classifier: 1e-3,
            lr_decay_rate: 0.99998,
            lr_scale: 0.9,
            lr_patience: 1,
            warmup_steps: 10,
        },
        patience: 2,
        pretrained_model: "pretrained.pt".to_string(),
        saver: BestEpochSaver::new("", Some(1)),
        train_data: "train.conllu".to_string(),
        validation_data: "validation.conllu".to_string(),
        weight_decay: 0.0,
    };
    app.run()
}
