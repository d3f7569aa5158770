//! From the crates.io package syntaxdot-cli 0.5.0 (`syntaxdot-cli-0.5.0.crate`):
//! `src/subcommands/distill.rs` (`DistillApp::train_steps`, with the driver
//! `DistillApp::distill_model`, `cleanup_old_best_steps`, `open_dataset`,
//! `create_lr_schedules`, `TrainDuration::as_steps`, `run`), `src/traits.rs`
//! (`ParameterGroup`, `build_parameter_group_fun`, `build_optimizer`), `src/util.rs`
//! (`autocast_or_preserve`), `src/summary/noop.rs`; and from syntaxdot 0.5.0
//! (`syntaxdot-0.5.0.crate`) `src/optimizers/{mod,grad,grad_scale}.rs` (`Optimizer`,
//! `ZeroGrad`, `GradScaler`) and `src/lr.rs` (`ExponentialDecay`). Licence: MIT OR
//! Apache-2.0 (both `Cargo.toml`s; no licence file in either package:
//! licenses/syntaxdot-0.5.0-LICENSE-NOTE.md).
//!
//! The function: a chunk of distillation steps, a method of the app given the teacher's and
//! the student's batches as two iterators of `Result`s and the gradient scaler by `&mut`
//! (syntaxdot's `GradScaler` around tch's AdamW over the student's VarStore, built by the
//! caller). `for (teacher_batch, student_batch) in teacher_batches.zip(student_batches)`:
//! both batches unwrapped with `?`, the student's loss against the frozen teacher, learning
//! rates from two schedules kept in a `RefCell` on the app (`self.lr_schedules.borrow_mut()`)
//! at `*global_step`, `set_lr_group` on the four parameter groups through
//! `grad_scaler.optimizer_mut()`, `grad_scaler.backward_step(&distill_loss.loss)?`, a summary
//! scalar, the progress bar's message and `inc(1)`, `*global_step += 1`. The driver
//! (`distill_model`, in the file, unannotated) cuts the data into chunks of `eval_steps`
//! batches (itertools' `chunks`), calls `train_steps` on each, validates, saves the student's
//! VarStore on a new best accuracy, and stops at `n_steps`.
//!
//! Changed: local stand-ins for what cannot exist here, keeping the calls as written. Teacher
//! and student (`BertModel`, transformers with sequence classifiers) are two digits MLPs
//! laid out as syntaxdot names its variables (`encoder.*`, `classifiers.*`; the student's in
//! the four parameter groups of `build_parameter_group_fun`), the teacher's random (it is
//! not trained here); `student_loss` is reduced to the soft loss, the teacher's softmax
//! against the student's log-softmax, as the crate's `seq_encoders_loss` computes it (the
//! attention and hidden-layer losses and the biaffine loss are off, as without
//! `--attention-loss`/`--hidden-loss` and a parser); the plain-text training file
//! (`File::open`, `PlainTextDataSet`) is the training digits, read in order, each a one-token
//! sentence; `validation_epoch` is the student's accuracy on the held-out digits (the
//! crate's runs the student over a CoNLL-U file); itertools' `chunks` is the local `Chunks`;
//! indicatif's `ProgressBar`/`ProgressStyle` print nothing; `log::info!` -> `eprintln!`;
//! `BufReader::new(..)` dropped; the app's fields set in `run` instead of parsed by clap
//! (batch size `data::batch_size()`, 2 epochs, evaluation every 4 steps, warmup 10000 ->
//! 10 steps); tch 0.24 names (`f32::try_from`, `Vec::<f32>::try_from`, sizes as arrays).
//!
//! Expected: **Refused { line: 834, says: "is passed in" }**, at `grad_scaler` in the
//! signature: "`grad_scaler` is stepped in the training loop, but it is passed in, so
//! #[accelerate] cannot see which model it trains: build the optimizer in this function, or
//! name the model's VarStore: #[accelerate(model = vs)]". No VarStore can be named here (the
//! student is a `&BertModel`; its VarStore is in the caller's `StudentModel`), and the
//! scaler is syntaxdot's type, which accel could not drive anyway. The loop itself would be
//! dealt (a `for` over a zip of two iterators).
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
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
// Stand-ins for the data, tokenizer, progress bars and models (see the header)

/// Stand-in for `std::fs::File` over a data file: a split of the digits.
pub struct File {
    x: Tensor,
    y: Tensor,
}

impl File {
    pub fn open(path: &str) -> std::io::Result<File> {
        let d = data::load().map_err(std::io::Error::other)?;
        match path {
            "train.txt" => Ok(File { x: d.train_x, y: d.train_y }),
            "validation.conllu" => Ok(File { x: d.test_x, y: d.test_y }),
            _ => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        }
    }

    pub fn try_clone(&self) -> std::io::Result<File> {
        Ok(File { x: self.x.shallow_clone(), y: self.y.shallow_clone() })
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
pub struct ProgressBar;

impl ProgressBar {
    pub fn new(_len: u64) -> ProgressBar {
        ProgressBar
    }
    pub fn set_style(&self, _style: ProgressStyle) {}
    pub fn set_message(&self, _message: String) {}
    pub fn inc(&self, _delta: u64) {}
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

/// A batch (`syntaxdot::tensor::Tensors`); distillation batches carry no labels.
pub struct Tensors {
    pub inputs: Tensor,
    pub labels: Option<HashMap<String, Tensor>>,
    pub seq_lens: SeqLens,
    pub token_spans: TokenSpans,
}

/// Stand-in for `PlainTextDataSet`: the digits of a file, each a one-token sentence.
pub struct PlainTextDataSet(File);

impl PlainTextDataSet {
    pub fn new(file: File) -> Self {
        PlainTextDataSet(file)
    }

    pub fn sentences(&mut self, _tokenizer: &dyn Tokenize) -> Result<Sentences, SyntaxDotError> {
        Ok(Sentences { x: self.0.x.shallow_clone() })
    }
}

/// The sentences of a data set, in order (`SentenceIterTools` and `BatchedTensors`).
pub struct Sentences {
    x: Tensor,
}

impl Sentences {
    pub fn filter_by_len(self, _max_len: SequenceLength) -> Sentences {
        self
    }

    pub fn batched_tensors(
        self,
        _biaffine_encoder: Option<&()>,
        _encoders: Option<&()>,
        batch_size: usize,
    ) -> impl Iterator<Item = Result<Tensors, SyntaxDotError>> {
        let bs = batch_size as i64;
        let n = self.x.size()[0] / bs;
        (0..n).map(move |i| {
            Ok(Tensors {
                inputs: self.x.narrow(0, i * bs, bs),
                labels: None,
                seq_lens: SeqLens(Tensor::ones([bs], (Kind::Int64, Device::Cpu))),
                token_spans: TokenSpans(Tensor::zeros([bs, 1], (Kind::Int64, Device::Cpu))),
            })
        })
    }
}

/// itertools' `chunks`, for the driver: consecutive groups of `size` items.
pub trait Chunks: Iterator + Sized {
    fn chunks(self, size: usize) -> Vec<std::vec::IntoIter<Self::Item>> {
        let mut chunks = Vec::new();
        let mut current = Vec::new();
        for item in self {
            current.push(item);
            if current.len() == size {
                chunks.push(std::mem::take(&mut current).into_iter());
            }
        }
        if !current.is_empty() {
            chunks.push(current.into_iter());
        }
        chunks
    }
}

impl<I: Iterator> Chunks for I {}

#[derive(Clone, Copy)]
pub struct FreezeLayers {
    pub embeddings: bool,
    pub encoder: bool,
    pub classifiers: bool,
}

/// Stand-in for `BertModel`: an encoder layer and one classifier ("digit"), named as
/// syntaxdot names them and put in the groups `parameter_group_fun` gives them.
pub struct BertModel {
    encoder_weight: Tensor,
    encoder_bias: Tensor,
    classifier_weight: Tensor,
    classifier_bias: Tensor,
}

impl BertModel {
    pub fn new(vs: &VarStore, parameter_group_fun: impl Fn(&str) -> usize) -> BertModel {
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

    /// The classifier's logits (`encode` then `encoder_logits_from_encoding`).
    pub fn logits(&self, inputs: &Tensor, freeze_layers: FreezeLayers) -> Tensor {
        let hidden = inputs.linear(&self.encoder_weight, Some(&self.encoder_bias)).relu();
        let hidden = if freeze_layers.encoder { hidden.detach() } else { hidden };
        let logits = hidden.linear(&self.classifier_weight, Some(&self.classifier_bias));
        if freeze_layers.classifiers {
            logits.detach()
        } else {
            logits
        }
    }
}

/// Stand-in for `crate::io::Model` (the teacher).
pub struct Model {
    pub tokenizer: Box<dyn Tokenize>,
    pub model: BertModel,
    pub vs: VarStore,
}

impl Model {
    pub fn load(_config_path: &str, device: Device) -> Result<Model> {
        let vs = VarStore::new(device);
        let model = BertModel::new(&vs, |_| 0);
        Ok(Model { tokenizer: Box::new(DigitTokenizer), model, vs })
    }
}

struct StudentModel {
    inner: BertModel,
    tokenizer: Box<dyn Tokenize>,
    vs: VarStore,
}

// ---------------------------------------------------------------------------------------
// syntaxdot-cli: src/subcommands/distill.rs

struct DistillLoss {
    pub loss: Tensor,
    pub attention_loss: Tensor,
    pub hidden_loss: Tensor,
    pub soft_loss: Tensor,
}

/// Auxiliary model parameters used during distillation (none without `--hidden-loss`).
struct AuxiliaryParameters {}

pub struct DistillApp {
    batch_size: usize,
    device: Device,
    eval_steps: usize,
    keep_best_steps: Option<usize>,
    max_len: SequenceLength,
    mixed_precision: bool,
    lr_schedules: RefCell<LearningRateSchedules>,
    summary_writer: Box<dyn ScalarWriter>,
    train_data: String,
    train_duration: TrainDuration,
    validation_data: String,
    weight_decay: f64,
}

pub struct LearningRateSchedules {
    pub classifier: ExponentialDecay,
    pub encoder: ExponentialDecay,
}

impl DistillApp {
    #[allow(clippy::too_many_arguments)]
    fn distill_model(
        &self,
        grad_scaler: &mut GradScaler<impl Optimizer>,
        auxiliary_params: &AuxiliaryParameters,
        teacher: &Model,
        student: &StudentModel,
        teacher_train_file: &File,
        student_train_file: &File,
        validation_file: &mut File,
    ) -> Result<()> {
        let mut best_step = 0;
        let mut best_acc = 0.0;

        let mut global_step = 0;

        let mut best_step_paths = self.keep_best_steps.map(VecDeque::with_capacity);

        let n_steps = self
            .train_duration
            .as_steps(teacher_train_file, self.batch_size)
            .context("Cannot determine number of training steps")?;

        let train_progress = ProgressBar::new(n_steps as u64);
        train_progress.set_style(ProgressStyle::default_bar().template(
            "[Time: {elapsed_precise}, ETA: {eta_precise}] {bar} {percent}% train {msg}",
        ));

        while global_step < n_steps - 1 {
            let mut teacher_train_dataset = Self::open_dataset(teacher_train_file)?;
            let mut student_train_dataset = Self::open_dataset(student_train_file)?;

            let teacher_train_batches = teacher_train_dataset
                .sentences(&*teacher.tokenizer)?
                .filter_by_len(self.max_len)
                .batched_tensors(None, None, self.batch_size);

            let student_train_batches = student_train_dataset
                .sentences(&*student.tokenizer)?
                .filter_by_len(self.max_len)
                .batched_tensors(None, None, self.batch_size);

            for (teacher_steps, student_steps) in teacher_train_batches
                .chunks(self.eval_steps)
                .into_iter()
                .zip(student_train_batches.chunks(self.eval_steps).into_iter())
            {
                self.train_steps(
                    auxiliary_params,
                    &train_progress,
                    teacher_steps,
                    student_steps,
                    &mut global_step,
                    grad_scaler,
                    &teacher.model,
                    &student.inner,
                )?;

                let acc = self.validation_epoch(&student.inner, validation_file, global_step)?;

                self.summary_writer.write_scalar("acc:validation,avg", global_step as i64, acc)?;

                if acc > best_acc {
                    best_step = global_step;
                    best_acc = acc;

                    let step_path = format!("distill-step-{}", global_step);

                    student
                        .vs
                        .save(&step_path)
                        .context(format!("Cannot save variable store for step {}", global_step))?;

                    self.cleanup_old_best_steps(&mut best_step_paths, step_path);
                }

                let step_status = if best_step == global_step { "🎉" } else { "" };

                eprintln!(
                    "Step {} (validation): acc: {:.4}, best step: {}, best acc: {:.4} {}\n",
                    global_step, acc, best_step, best_acc, step_status
                );

                if global_step >= n_steps - 1 {
                    break;
                }
            }
        }

        Ok(())
    }

    fn cleanup_old_best_steps(
        &self,
        best_step_paths: &mut Option<VecDeque<String>>,
        step_path: String,
    ) {
        if let Some(best_step_paths) = best_step_paths.as_mut() {
            if best_step_paths.len() == self.keep_best_steps.unwrap() {
                let cleanup_step = best_step_paths.pop_front().expect("No steps?");
                if let Err(err) = fs::remove_file(&cleanup_step) {
                    eprintln!("Cannot remove step parameters {}: {}", cleanup_step, err);
                }
            }

            best_step_paths.push_back(step_path);
        }
    }

    /// The soft loss of the student against the teacher (see the header).
    fn student_loss(
        &self,
        _auxiliary_params: &AuxiliaryParameters,
        teacher: &BertModel,
        student: &BertModel,
        teacher_batch: Tensors,
        student_batch: Tensors,
    ) -> Result<DistillLoss> {
        let teacher_token_spans = teacher_batch.token_spans.to_device(self.device);
        let _token_mask = teacher_token_spans.token_mask()?;

        let teacher_logits = teacher.logits(
            &teacher_batch.inputs.to_device(self.device),
            FreezeLayers { embeddings: true, encoder: true, classifiers: true },
        );

        autocast_or_preserve(self.mixed_precision, || -> Result<DistillLoss> {
            let student_logits = student.logits(
                &student_batch.inputs.to_device(self.device),
                FreezeLayers { embeddings: false, encoder: false, classifiers: false },
            );

            let teacher_probs = teacher_logits.softmax(-1, Kind::Float);
            let student_logprobs = student_logits.log_softmax(-1, Kind::Float);
            let soft_loss = (-(&teacher_probs * &student_logprobs))
                .sum_dim_intlist(-1, false, Kind::Float)
                .mean(Kind::Float);

            let attention_loss = Tensor::zeros([] as [i64; 0], (Kind::Float, self.device));
            let hidden_loss = Tensor::zeros([] as [i64; 0], (Kind::Float, self.device));

            Ok(DistillLoss {
                loss: soft_loss.f_add(&attention_loss)?.f_add(&hidden_loss)?,
                attention_loss,
                hidden_loss,
                soft_loss,
            })
        })
    }

    #[allow(clippy::too_many_arguments)]
    #[accel_core::accelerate(strategy = "ddp")]
    fn train_steps(
        &self,
        auxiliary_params: &AuxiliaryParameters,
        progress: &ProgressBar,
        teacher_batches: impl Iterator<Item = Result<Tensors, SyntaxDotError>>,
        student_batches: impl Iterator<Item = Result<Tensors, SyntaxDotError>>,
        global_step: &mut usize,
        grad_scaler: &mut GradScaler<impl Optimizer>,
        teacher: &BertModel,
        student: &BertModel,
    ) -> Result<()> {
        for (teacher_batch, student_batch) in teacher_batches.zip(student_batches) {
            let teacher_batch = teacher_batch.context("Cannot read teacher batch")?;
            let student_batch = student_batch.context("Cannot read student batch")?;

            let distill_loss = self.student_loss(
                auxiliary_params,
                teacher,
                student,
                teacher_batch,
                student_batch,
            )?;

            let lr_classifier = self
                .lr_schedules
                .borrow_mut()
                .classifier
                .compute_step_learning_rate(*global_step);
            let lr_encoder = self
                .lr_schedules
                .borrow_mut()
                .encoder
                .compute_step_learning_rate(*global_step);

            let optimizer = grad_scaler.optimizer_mut();

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

            grad_scaler.backward_step(&distill_loss.loss)?;

            self.summary_writer.write_scalar(
                "gradient_scale",
                *global_step as i64,
                grad_scaler.current_scale(),
            )?;

            progress.set_message(format!(
                "step: {} | lr enc: {:+.1e}, class: {:+.1e} | loss soft: {:+.1e}, attention: {:+.1e}, hidden: {:+.1e}",
                global_step,
                lr_encoder,
                lr_classifier,
                f32::try_from(distill_loss.soft_loss)?,
                f32::try_from(distill_loss.attention_loss)?,
                f32::try_from(distill_loss.hidden_loss)?
            ));
            progress.inc(1);

            *global_step += 1;
        }

        Ok(())
    }

    fn open_dataset(file: &File) -> Result<PlainTextDataSet> {
        let read = file.try_clone().context("Cannot open data set for reading")?;
        Ok(PlainTextDataSet::new(read))
    }

    fn fresh_student(&self, teacher: &Model) -> Result<StudentModel> {
        let _ = teacher;
        let vs = VarStore::new(self.device);
        let inner = BertModel::new(&vs, Self::build_parameter_group_fun());
        Ok(StudentModel { inner, tokenizer: Box::new(DigitTokenizer), vs })
    }

    pub fn create_lr_schedules(
        initial_lr_classifier: f32,
        initial_lr_encoder: f32,
        lr_decay_rate: f32,
        lr_decay_steps: usize,
        warmup_steps: usize,
    ) -> LearningRateSchedules {
        let classifier = ExponentialDecay::new(
            initial_lr_classifier,
            lr_decay_rate,
            lr_decay_steps,
            false,
            warmup_steps,
        );

        let mut encoder = classifier.clone();
        encoder.set_initial_lr(initial_lr_encoder);

        LearningRateSchedules { classifier, encoder }
    }

    /// The student's accuracy on the validation file (see the header).
    fn validation_epoch(&self, model: &BertModel, file: &mut File, global_step: usize) -> Result<f32> {
        let logits = tch::no_grad(|| {
            model.logits(
                &file.x.to_device(self.device),
                FreezeLayers { embeddings: true, encoder: true, classifiers: true },
            )
        });
        let acc = f32::try_from(logits.accuracy_for_logits(&file.y.to_device(self.device)))?;
        eprintln!("step {} digit accuracy: {:.4}", global_step, acc);
        Ok(acc)
    }
}

impl SyntaxDotApp for DistillApp {
    fn run(&self) -> Result<()> {
        let teacher = Model::load("teacher.conf", self.device)?;

        let teacher_train_file = File::open(&self.train_data)
            .context(format!("Cannot open train data file: {}", self.train_data))?;
        let student_train_file = File::open(&self.train_data)
            .context(format!("Cannot open train data file: {}", self.train_data))?;
        let mut validation_file = File::open(&self.validation_data).context(format!(
            "Cannot open validation data file: {}",
            self.validation_data
        ))?;

        let student = self.fresh_student(&teacher)?;

        let mut grad_scaler = self.build_optimizer(&student.vs)?;

        let auxiliary_params = AuxiliaryParameters {};

        self.distill_model(
            &mut grad_scaler,
            &auxiliary_params,
            &teacher,
            &student,
            &teacher_train_file,
            &student_train_file,
            &mut validation_file,
        )
        .context("Model distillation failed")
    }
}

impl SyntaxDotTrainApp for DistillApp {
    fn mixed_precision(&self) -> bool {
        self.mixed_precision
    }

    fn weight_decay(&self) -> f64 {
        self.weight_decay
    }
}

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum TrainDuration {
    Epochs(usize),
    Steps(usize),
}

impl TrainDuration {
    fn as_steps(&self, train_file: &File, batch_size: usize) -> Result<usize> {
        use TrainDuration::*;

        match *self {
            Epochs(epochs) => {
                eprintln!("Counting number of steps in an epoch...");
                let n_sentences = train_file.x.size()[0] as usize;

                // Compute number of steps of the given batch size.
                let steps_per_epoch = (n_sentences + batch_size - 1) / batch_size;
                eprintln!(
                    "sentences: {}, steps_per epoch: {}, total_steps: {}",
                    n_sentences,
                    steps_per_epoch,
                    epochs * steps_per_epoch
                );
                Ok(epochs * steps_per_epoch)
            }
            Steps(steps) => Ok(steps),
        }
    }
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    // What `DistillApp::parse` reads from the command line.
    let app = DistillApp {
        batch_size: data::batch_size() as usize,
        device: Device::Cpu,
        eval_steps: 4,
        keep_best_steps: Some(1),
        max_len: SequenceLength::Unbounded,
        mixed_precision: false,
        lr_schedules: RefCell::new(DistillApp::create_lr_schedules(1e-3, 5e-5, 0.99998, 1, 10)),
        summary_writer: Box::new(NoopWriter),
        train_data: "train.txt".to_string(),
        train_duration: TrainDuration::Epochs(2),
        validation_data: "validation.conllu".to_string(),
        weight_decay: 0.0,
    };
    app.run()
}
