//! The decoder-only families people fine-tune, as transformers 5.22 computes them:
//! `LlamaForCausalLM` (Llama 1, 2, 3.x), `Qwen2ForCausalLM`, `Qwen3ForCausalLM` and
//! `MistralForCausalLM`, with their checkpoint names, so that Hugging Face checkpoints load
//! and save by their own names. RMSNorm in fp32 with the config's eps, rotary embeddings in
//! transformers' `rotate_half` layout with every RoPE type these families use (default,
//! linear, dynamic, llama3, yarn), grouped-query attention, attention through `sdpa` (ATen's
//! fused `scaled_dot_product_attention`, transformers' default) or `eager`, with the causal
//! mask — within a sliding window on the layers that slide (Qwen2/3 per `layer_types`,
//! Mistral on all) — and padding masks (attention.rs), Qwen2's q/k/v biases, Qwen3's
//! per-head q/k norms, the SiLU-gated MLP, and the head tied to the embedding or not. Each
//! decoder layer is an `accel_core::Unit` (zero3 gathers it for its forward and backward,
//! and activation checkpointing recomputes it), and so are the embedding and the head.
//!
//! Beyond training: a key/value cache and generation as transformers' `generate`
//! (generate.rs), and big-model inference by a device map, modules offloaded to the disk
//! read just before they run (dispatch.rs, over `crate::device_map`).
//!
//! Closed world: a config.json is read only when every key is one this model honours or
//! knows to change nothing (`LlamaConfig::parse`), and a checkpoint only when its tensors are
//! exactly the model's (`Llama::check_checkpoint`); anything else is refused by name.
//!
//! The command line that trains and evaluates it is `examples/llama_cli.rs` (the `llama`
//! example).

use std::path::Path;

use accel_core::Unit;
use anyhow::{Context, Result, bail};
use tch::nn::Path as VarPath;
use tch::{Kind, Tensor};

mod attention;
mod config;
mod dispatch;
mod generate;
pub use attention::{Attention, KvCache};
use attention::{LayerCache, Pass};
pub use config::{Family, LlamaConfig, Rope};
use dispatch::Dispatch;
pub use dispatch::modules;
pub use generate::{Generated, GenerationConfig};

/// How the model's variables start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// As transformers initialises a fresh model: weights from N(0, initializer_range²), norms
    /// at 1, biases at 0.
    Fresh,
    /// Not at all: memory is reserved but not touched (`accel_core::nn::uninit`), for
    /// variables a checkpoint fills next.
    Uninit,
}

fn weight(p: &VarPath, name: &str, dims: &[i64], init: Init, std: f64) -> Tensor {
    match init {
        Init::Fresh => p.randn(name, dims, 0.0, std),
        Init::Uninit => accel_core::nn::uninit(p, name, dims),
    }
}

fn filled(p: &VarPath, name: &str, dims: &[i64], init: Init, value: f64) -> Tensor {
    match init {
        Init::Fresh => p.var(name, dims, tch::nn::Init::Const(value)),
        Init::Uninit => accel_core::nn::uninit(p, name, dims),
    }
}

/// `y = x Wᵀ + b`, plus `(x Aᵀ Bᵀ) · scale` once a LoRA adapter is attached.
#[derive(Debug)]
pub(crate) struct Linear {
    w: Tensor,
    b: Option<Tensor>,
    /// A [r, in], B [out, r] and the scale (crate::lora).
    lora: std::sync::Mutex<Option<(Tensor, Tensor, f64)>>,
}

impl Linear {
    fn new(p: VarPath, n_in: i64, n_out: i64, bias: bool, init: Init, std: f64) -> Self {
        let w = weight(&p, "weight", &[n_out, n_in], init, std);
        let b = bias.then(|| filled(&p, "bias", &[n_out], init, 0.0));
        Self { w, b, lora: Default::default() }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let y = x.linear(&self.w, self.b.as_ref());
        match &*self.lora.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((a, b, scale)) => {
                y + x.linear::<Tensor>(a, None).linear::<Tensor>(b, None) * *scale
            }
            None => y,
        }
    }

    /// (out, in).
    pub(crate) fn shape(&self) -> (i64, i64) {
        let size = self.w.size();
        (size[0], size[1])
    }

    pub(crate) fn attach(&self, a: Tensor, b: Tensor, scale: f64) -> Result<()> {
        let mut lora = self.lora.lock().unwrap_or_else(|e| e.into_inner());
        if lora.is_some() {
            bail!("this projection already has an adapter");
        }
        *lora = Some((a, b, scale));
        Ok(())
    }

    /// `W ← W + scale · B A`; the adapter is detached.
    pub(crate) fn merge(&self) -> Result<()> {
        if let Some((a, b, scale)) = self.lora.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let delta = b.to_kind(self.w.kind()).matmul(&a.to_kind(self.w.kind())) * scale;
            let _ = self.w.shallow_clone().f_add_(&delta)?;
        }
        Ok(())
    }
}

/// transformers' `LlamaRMSNorm`: in fp32, then back to the input's dtype, times the weight.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let h = x.to_kind(Kind::Float);
    let variance = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let h = h * (variance + eps).rsqrt();
    weight * h.to_kind(kind)
}

/// transformers' `rotate_half`: `cat(-x2, x1)` of the two halves of the last dimension.
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let (x1, x2) = (x.narrow(-1, 0, half), x.narrow(-1, half, half));
    Tensor::cat(&[-x2, x1], -1)
}

/// One decoder layer: attention and MLP, each after an RMSNorm and added to the residual.
#[derive(Debug)]
pub struct DecoderLayer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
    /// Qwen3's per-head RMSNorm weights of queries and keys ([head_dim] each).
    qk_norm: Option<(Tensor, Tensor)>,
    /// This layer's sliding window (index into the masks `forward` gets).
    sliding: bool,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    eps: f64,
}

impl DecoderLayer {
    fn new(p: &VarPath, c: &LlamaConfig, index: usize, init: Init) -> Self {
        let (h, d, std) = (c.hidden_size, c.head_dim(), c.initializer_range);
        let attn = p / "self_attn";
        let mlp = p / "mlp";
        let (qkv, o, m) = (c.qkv_bias, c.o_bias, c.mlp_bias);
        let qk_norm = c.qk_norm.then(|| {
            (
                filled(&(&attn / "q_norm"), "weight", &[d], init, 1.0),
                filled(&(&attn / "k_norm"), "weight", &[d], init, 1.0),
            )
        });
        Self {
            q: Linear::new(&attn / "q_proj", h, c.num_attention_heads * d, qkv, init, std),
            k: Linear::new(&attn / "k_proj", h, c.kv_heads() * d, qkv, init, std),
            v: Linear::new(&attn / "v_proj", h, c.kv_heads() * d, qkv, init, std),
            o: Linear::new(&attn / "o_proj", c.num_attention_heads * d, h, o, init, std),
            gate: Linear::new(&mlp / "gate_proj", h, c.intermediate_size, m, init, std),
            up: Linear::new(&mlp / "up_proj", h, c.intermediate_size, m, init, std),
            down: Linear::new(&mlp / "down_proj", c.intermediate_size, h, m, init, std),
            input_norm: filled(&(p / "input_layernorm"), "weight", &[h], init, 1.0),
            post_norm: filled(&(p / "post_attention_layernorm"), "weight", &[h], init, 1.0),
            qk_norm,
            sliding: c.windows.get(index).copied().flatten().is_some(),
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: d,
            eps: c.rms_norm_eps,
        }
    }

    /// `x` [B, T, hidden] → [B, T, hidden], its positions' rotary tables and masks in `pass`;
    /// with a `cache`, after the positions cached there (which it then holds too).
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        pass: &Pass,
        cache: Option<&mut LayerCache>,
    ) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        let h = rms_norm(x, &self.input_norm, self.eps);
        let split = |y: Tensor, n: i64| y.view([b, t, n, self.head_dim]).transpose(1, 2);
        let (mut q, mut k) =
            (split(self.q.forward(&h), self.heads), split(self.k.forward(&h), self.kv_heads));
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            // Over each head's width, before RoPE (Qwen3).
            q = rms_norm(&q, q_norm, self.eps);
            k = rms_norm(&k, k_norm, self.eps);
        }
        let v = split(self.v.forward(&h), self.kv_heads);
        let (cos, sin) = (pass.cos.to_kind(q.kind()), pass.sin.to_kind(q.kind()));
        let q = &q * &cos + rotate_half(&q) * &sin;
        let k = &k * &cos + rotate_half(&k) * &sin;
        let (k, v) = match cache {
            Some(cache) => cache.append(k, v),
            None => (k, v),
        };
        let mask = if self.sliding { &pass.sliding } else { &pass.full };
        let attn = attention::attend(&q, &k, &v, mask, pass.attention);
        let attn = attn.transpose(1, 2).contiguous().reshape([b, t, -1]);
        let x = x + self.o.forward(&attn);
        let h = rms_norm(&x, &self.post_norm, self.eps);
        let mlp = self.down.forward(&(self.gate.forward(&h).silu() * self.up.forward(&h)));
        x + mlp
    }
}

/// `LlamaForCausalLM`.
#[derive(Debug)]
pub struct Llama {
    /// The configuration it was built from.
    pub config: LlamaConfig,
    /// The embedding's weight, a unit of its own (zero3 shards it like a layer's).
    embed: Unit<Tensor>,
    layers: Vec<Unit<DecoderLayer>>,
    norm: Tensor,
    /// `None` when tied to the embedding.
    lm_head: Option<Unit<Tensor>>,
    /// How attention is computed: `sdpa` unless set otherwise (as transformers).
    pub attention: Attention,
    /// Where each module runs, and what waits on the disk, once dispatched by a device map.
    dispatch: Option<Dispatch>,
}

impl Llama {
    /// The model's variables under `root`, by transformers' names (`model.layers.{i}.…`,
    /// `lm_head.weight`), started as `init` says; the embedding, each decoder layer and the
    /// head are units of `acc`, the accelerator that prepares the model.
    pub fn new(
        acc: &impl AsRef<accel_core::PendingUnits>,
        root: &VarPath,
        config: &LlamaConfig,
        init: Init,
    ) -> Self {
        let model = root / "model";
        let (h, std) = (config.hidden_size, config.initializer_range);
        let embed_path = &model / "embed_tokens";
        let embed = weight(&embed_path, "weight", &[config.vocab_size, h], init, std);
        let embed = Unit::new(acc, &embed_path, embed);
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = &model / "layers" / i;
                Unit::new(acc, &p, DecoderLayer::new(&p, config, i as usize, init))
            })
            .collect();
        let norm = filled(&(&model / "norm"), "weight", &[h], init, 1.0);
        let lm_head = (!config.tie_word_embeddings).then(|| {
            let path = root / "lm_head";
            Unit::new(acc, &path, weight(&path, "weight", &[config.vocab_size, h], init, std))
        });
        Self {
            config: config.clone(),
            embed,
            layers,
            norm,
            lm_head,
            attention: Attention::Sdpa,
            dispatch: None,
        }
    }

    /// Logits [B, T, vocab] of `input_ids` [B, T] (int64).
    pub fn forward(&self, input_ids: &Tensor) -> Tensor {
        self.forward_padded(input_ids, None)
    }

    /// [`Llama::forward`] of rows padded where `attention_mask` [B, T] is 0 (transformers'
    /// `attention_mask`): no query looks at a padded key. Positions count from 0 at the
    /// first column, as transformers' forward counts them.
    pub fn forward_padded(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Tensor {
        self.project(&self.normed(input_ids, attention_mask))
    }

    /// The training loss of `input_ids` [B, T] as transformers computes it with
    /// `labels = input_ids` ([`Llama::loss`] of [`Llama::forward`]'s logits), with the head
    /// fused into the cross-entropy ([`accel_core::nn::linear_cross_entropy`]): the
    /// B × T × vocab logits are never in memory whole, in forward or backward (at 2 × 1024
    /// tokens of a 32000-entry vocabulary they, their log-softmax and its gradient are 250
    /// MiB each). The same loss and gradients, to fp32 rounding.
    pub fn forward_loss(&self, input_ids: &Tensor) -> Tensor {
        let x = self.normed(input_ids, None);
        let (b, t, d) = (x.size()[0], x.size()[1], x.size()[2]);
        let targets = shifted_labels(input_ids);
        let x = x.reshape([b * t, d]);
        // Under zero3 the head is not gathered again for this backward, which reads no weight.
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        head.linear_cross_entropy(&x, &targets, -100, |w| w)
            .unwrap_or_else(|e| panic!("the head's cross-entropy: {e}"))
    }

    /// The hidden states of `input_ids` after the final norm, [B, T, hidden].
    fn normed(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Tensor {
        assert!(
            self.dispatch.is_none(),
            "a model dispatched by a device map runs through forward_cached or generate"
        );
        let x = self.embed_tokens(input_ids);
        let pass = self.pass(input_ids.size()[1], 0, attention_mask, input_ids.device());
        let mut x = x;
        for layer in &self.layers {
            // Owned: a checkpointed layer runs its forward again in backward.
            let pass = pass.shallow_clone();
            x = layer.run_on(&x, move |l, x| l.forward(x, &pass, None));
        }
        rms_norm(&x, &self.norm, self.config.rms_norm_eps)
    }

    /// Logits [B, T, vocab] of `input_ids` [B, T] that follow the positions in `cache`, which
    /// then holds these too: a step of generation. `attention_mask` [B, cached + T] as in
    /// [`Llama::forward_padded`]. No gradient flows through the cache. A model dispatched by
    /// a device map runs each module where the map put it, reading those on the disk just
    /// before they run (hence the error: a read that failed).
    pub fn forward_cached(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let t = input_ids.size()[1];
        let mut x = self.stage("model.embed_tokens", |device| {
            self.embed_tokens(&input_ids.to_device(device))
        })?;
        let first = self.stage_device("model.layers.0", x.device());
        let mask = attention_mask.map(|m| m.to_device(first));
        let mut pass = self.pass(t, cache.len, mask.as_ref(), first);
        for (i, (layer, cache)) in self.layers.iter().zip(&mut cache.layers).enumerate() {
            x = self.stage(&format!("model.layers.{i}"), |device| {
                if pass.cos.device() != device {
                    pass = pass.to_device(device);
                }
                layer.run_with(&x.to_device(device), |l, x| l.forward(x, &pass, Some(cache)))
            })?;
        }
        cache.len += t;
        let eps = self.config.rms_norm_eps;
        let x =
            self.stage("model.norm", |device| rms_norm(&x.to_device(device), &self.norm, eps))?;
        // A tied head computes with the embedding's weight: fetched again if offloaded.
        let head = if self.lm_head.is_some() { "lm_head" } else { "model.embed_tokens" };
        self.stage(head, |device| self.project(&x.to_device(device)))
    }

    /// `run(device)` for module `prefix`: on its device, its weights read first if they
    /// wait on the disk, and released after.
    fn stage<T>(&self, prefix: &str, run: impl FnOnce(tch::Device) -> T) -> Result<T> {
        let Some(dispatch) = &self.dispatch else { return Ok(run(self.embed.inner().device())) };
        let device = dispatch.device(prefix).unwrap_or(tch::Device::Cpu);
        dispatch.fetch(prefix, device)?;
        let out = run(device);
        dispatch.release(prefix)?;
        Ok(out)
    }

    /// The device module `prefix` computes on (`default` for a model not dispatched).
    fn stage_device(&self, prefix: &str, default: tch::Device) -> tch::Device {
        self.dispatch.as_ref().and_then(|d| d.device(prefix)).unwrap_or(default)
    }

    fn embed_tokens(&self, input_ids: &Tensor) -> Tensor {
        let padding = self.config.pad_token_id.unwrap_or(-1);
        self.embed.embedding(input_ids, padding, |w| w)
    }

    /// The head (the embedding's weight when tied) on the normed `x`.
    fn project(&self, x: &Tensor) -> Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed).run_with(x, |w, x| x.linear::<Tensor>(w, None))
    }

    /// What the layers of a pass over `t` positions after `past` share: RoPE's cos/sin of
    /// positions past..past + t (positions × inv_freq, emb = cat(freqs, freqs)) and the
    /// masks of full and sliding layers.
    fn pass(&self, t: i64, past: i64, padding: Option<&Tensor>, device: tch::Device) -> Pass {
        let (inv_freq, scale) = self.config.inv_freq(past + t, device);
        let positions = Tensor::arange_start(past, past + t, (Kind::Float, device));
        let freqs = positions.unsqueeze(-1) * inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        let (cos, sin) = if scale == 1.0 {
            (emb.cos(), emb.sin())
        } else {
            (emb.cos() * scale, emb.sin() * scale)
        };
        let window = self.config.windows.iter().flatten().next().copied();
        let how = self.attention;
        Pass {
            cos,
            sin,
            full: attention::mask(t, past, None, padding, how, device),
            sliding: attention::mask(t, past, window, padding, how, device),
            attention: how,
        }
    }

    /// The model of folder `dir`'s config.json, its variables in `vs` without memory, checked
    /// against the checkpoint's names and shapes: what every loading path starts from.
    fn unloaded(acc: &accel_core::Accelerator, vs: &tch::nn::VarStore, dir: &Path) -> Result<Self> {
        let model = Self::new(acc, &vs.root(), &LlamaConfig::read(dir)?, Init::Uninit);
        model.check_checkpoint(vs, dir)?;
        Ok(model)
    }

    /// The model of Hugging Face folder `dir` (config.json, `model.safetensors` or an index
    /// and its shards), its variables in `vs`, prepared by `acc` for training: under zero3
    /// each process reads only its shards' bytes. The family comes from config.json; what
    /// the model does not compute exactly is refused ([`LlamaConfig::parse`],
    /// [`Llama::check_checkpoint`]). Every process calls it.
    pub fn from_pretrained(
        acc: &accel_core::Accelerator,
        vs: &tch::nn::VarStore,
        dir: impl AsRef<Path>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let model = Self::unloaded(acc, vs, dir)?;
        acc.prepare_model_from_checkpoint(vs, dir)?;
        Ok(model)
    }

    /// The base of a LoRA fine-tune: the model of folder `dir` (as
    /// [`Llama::from_pretrained`]) with every variable frozen before `acc` prepares it, so
    /// that under zero3/fsdp the base is sharded at rest — each process reads and keeps only
    /// its shards, and gathers one layer at a time — and gets no gradient or optimizer
    /// state. Attach the adapters to it ([`Llama::attach_lora`]) in a VarStore of their own.
    pub fn from_pretrained_frozen(
        acc: &accel_core::Accelerator,
        vs: &mut tch::nn::VarStore,
        dir: impl AsRef<Path>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let model = Self::unloaded(acc, vs, dir)?;
        vs.freeze();
        acc.prepare_model_from_checkpoint(vs, dir)?;
        Ok(model)
    }

    /// [`Llama::from_pretrained`] without preparing: each process holds the whole model
    /// (evaluation).
    pub fn load_pretrained(
        acc: &accel_core::Accelerator,
        vs: &tch::nn::VarStore,
        dir: impl AsRef<Path>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let model = Self::unloaded(acc, vs, dir)?;
        acc.load_checkpoint_in_model(vs, dir)?;
        Ok(model)
    }

    /// Writes the model in `vs` as a folder transformers' `from_pretrained` loads: the
    /// weights by their names (in files of at most `max_shard_size` bytes, with an index
    /// beyond one), and the config.json it came from, its `dtype` saying what the files
    /// hold. Every process calls it; the main process writes.
    pub fn save_pretrained(
        &self,
        acc: &accel_core::Accelerator,
        vs: &tch::nn::VarStore,
        out: impl AsRef<Path>,
        max_shard_size: u64,
    ) -> Result<()> {
        let out = out.as_ref();
        acc.save_model(vs, out, max_shard_size)?;
        if acc.is_main_process() {
            let saved = vs.variables().values().next().map_or(Kind::Float, |t| t.kind());
            let dtype = match saved {
                Kind::BFloat16 => "bfloat16",
                Kind::Half => "float16",
                _ => "float32",
            };
            let mut json = self.config.raw.clone();
            if let Some(map) = json.as_object_mut() {
                map.insert("dtype".into(), dtype.into());
                if map.contains_key("torch_dtype") {
                    map.insert("torch_dtype".into(), dtype.into());
                }
            }
            let path = out.join("config.json");
            std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// Every projection by its module name (`model.layers.0.self_attn.q_proj`), in order.
    pub(crate) fn projections(&self) -> Vec<(String, &Linear)> {
        let mut all = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let l = layer.inner();
            let attn = format!("model.layers.{i}.self_attn");
            let mlp = format!("model.layers.{i}.mlp");
            for (name, linear) in
                [("q_proj", &l.q), ("k_proj", &l.k), ("v_proj", &l.v), ("o_proj", &l.o)]
            {
                all.push((format!("{attn}.{name}"), linear));
            }
            for (name, linear) in
                [("gate_proj", &l.gate), ("up_proj", &l.up), ("down_proj", &l.down)]
            {
                all.push((format!("{mlp}.{name}"), linear));
            }
        }
        all
    }

    /// Refuses a checkpoint folder whose tensors are not exactly this model's: every tensor
    /// of the folder must be a variable of `vs` (built by [`Llama::new`], before preparing)
    /// and every variable must be in the folder — named as transformers' load report names
    /// them (`model.layers.{0, 1}.self_attn.q_norm.weight`). transformers drops unexpected
    /// tensors and initialises missing ones at random; a model that computes something else
    /// than its checkpoint says is refused here instead. (`rotary_emb.inv_freq`, which old
    /// checkpoints hold and transformers ignores, is ignored too.) With tied embeddings, an
    /// `lm_head.weight` equal to the embedding is accepted.
    pub fn check_checkpoint(&self, vs: &tch::nn::VarStore, dir: &Path) -> Result<()> {
        let checkpoint = accel_core::HfCheckpoint::open(dir)?;
        let variables = vs.variables();
        let mut unexpected: Vec<String> = checkpoint
            .names()
            .filter(|n| !variables.contains_key(*n) && !n.ends_with("rotary_emb.inv_freq"))
            .map(str::to_owned)
            .collect();
        if self.config.tie_word_embeddings && unexpected.iter().any(|n| n == "lm_head.weight") {
            let head = checkpoint.read("lm_head.weight")?;
            let embed = checkpoint.read("model.embed_tokens.weight")?;
            if head.size() == embed.size() && head.equal(&embed) {
                unexpected.retain(|n| n != "lm_head.weight");
            }
        }
        let mut missing: Vec<String> =
            variables.keys().filter(|n| checkpoint.shape(n).is_none()).cloned().collect();
        missing.sort();
        if unexpected.is_empty() && missing.is_empty() {
            return Ok(());
        }
        let mut why = Vec::new();
        if !unexpected.is_empty() {
            why.push(format!(
                "UNEXPECTED (in the checkpoint, not in this {} model): {}",
                self.config.family.class(),
                group_layers(&unexpected)
            ));
        }
        if !missing.is_empty() {
            why.push(format!(
                "MISSING (in the model, not in the checkpoint): {}",
                group_layers(&missing)
            ));
        }
        bail!(
            "{}: the checkpoint's tensors are not this model's; {}. Nothing was loaded",
            dir.display(),
            why.join("; ")
        )
    }

    /// transformers' loss with `labels = input_ids`: the mean cross-entropy of the logits at
    /// positions 0..T-1 against the ids at 1..T, in fp32.
    pub fn loss(logits: &Tensor, input_ids: &Tensor) -> Tensor {
        let (b, t, v) = (logits.size()[0], logits.size()[1], logits.size()[2]);
        // The labels shifted rather than the logits cut: cutting off their last position
        // would copy all B×T×V of them, and their gradient again.
        let targets = shifted_labels(input_ids);
        let logits = logits.to_kind(Kind::Float).reshape([b * t, v]);
        logits.cross_entropy_loss::<Tensor>(&targets, None, tch::Reduction::Mean, -100, 0.0)
    }
}

/// The targets of `input_ids` [B, T] as transformers' `ForCausalLMLoss` makes them from
/// `labels = input_ids`: shifted left, the ignored index (-100) after each row's last, [B·T].
fn shifted_labels(input_ids: &Tensor) -> Tensor {
    let (b, t) = (input_ids.size()[0], input_ids.size()[1]);
    let ignored = input_ids.narrow(1, 0, 1).full_like(-100);
    Tensor::cat(&[input_ids.narrow(1, 1, t - 1), ignored], 1).reshape([b * t])
}

/// `model.layers.{0, 1}.self_attn.q_norm.weight`: names that differ only in the layer index,
/// merged as transformers' load report merges them.
fn group_layers(names: &[String]) -> String {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for name in names {
        let (pattern, index) = match name.split_once(".layers.") {
            Some((head, rest)) => match rest.split_once('.') {
                Some((i, tail)) if i.parse::<usize>().is_ok() => {
                    (format!("{head}.layers.{{}}.{tail}"), Some(i.to_owned()))
                }
                _ => (name.clone(), None),
            },
            None => (name.clone(), None),
        };
        match groups.iter_mut().find(|(p, _)| *p == pattern) {
            Some((_, indices)) => indices.extend(index),
            None => groups.push((pattern, index.into_iter().collect())),
        }
    }
    groups
        .into_iter()
        .map(|(pattern, indices)| {
            if indices.is_empty() {
                pattern
            } else {
                pattern.replace("{}", &format!("{{{}}}", indices.join(", ")))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// meta-llama/Llama-3.1-8B's config.json as published (transformers 4 keys).
    const LLAMA_3_1_8B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
      "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
      "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
      "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256}"#;

    /// Qwen/Qwen2.5-0.5B's config.json as published.
    const QWEN2_5_0_5B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
      "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
      "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
      "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
      "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 151936}"#;

    #[test]
    fn published_configs_read_as_transformers_reads_them() {
        let c = LlamaConfig::parse(LLAMA_3_1_8B).unwrap();
        assert_eq!(
            (c.family, c.head_dim, c.num_key_value_heads, c.rope_theta),
            (Family::Llama, 128, 8, 5e5)
        );
        assert_eq!(
            c.rope,
            Rope::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original: 8192.0
            }
        );
        assert!(!c.qkv_bias && c.windows.iter().all(Option::is_none));
        let c = LlamaConfig::parse(QWEN2_5_0_5B).unwrap();
        assert_eq!((c.family, c.head_dim, c.num_key_value_heads), (Family::Qwen2, 64, 2));
        // use_sliding_window false: no layer slides, whatever sliding_window says.
        assert!(c.qkv_bias && !c.o_bias && c.tie_word_embeddings);
        assert!(c.windows.iter().all(Option::is_none));
    }

    #[test]
    fn absent_keys_take_each_familys_defaults() {
        let base = |t: &str| {
            format!(
                r#"{{"model_type": "{t}", "hidden_size": 64, "num_attention_heads": 32,
                "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 8}}"#
            )
        };
        let c = LlamaConfig::parse(&base("llama")).unwrap();
        assert_eq!((c.num_key_value_heads, c.head_dim, c.max_position_embeddings), (32, 2, 2048));
        let c = LlamaConfig::parse(&base("mistral")).unwrap();
        assert_eq!((c.num_key_value_heads, c.windows[0]), (8, Some(4096)));
        let c = LlamaConfig::parse(&base("qwen3")).unwrap();
        assert_eq!((c.num_key_value_heads, c.head_dim, c.qk_norm), (32, 128, true));
    }

    #[test]
    fn what_the_model_does_not_compute_is_refused_by_name() {
        let refused = |edit: &str| {
            let text = LLAMA_3_1_8B.replacen('{', &format!("{{{edit},"), 1);
            format!("{:#}", LlamaConfig::parse(&text).unwrap_err())
        };
        assert!(refused(r#""logits_scaling": 8"#).contains("`logits_scaling` is not a key"));
        let e = format!(
            "{:#}",
            LlamaConfig::parse(&LLAMA_3_1_8B.replace("\"llama\"", "\"gemma\"")).unwrap_err()
        );
        assert!(e.contains("model_type \"gemma\" is not a family"), "{e}");
        let e = format!(
            "{:#}",
            LlamaConfig::parse(
                &LLAMA_3_1_8B.replace("\"rope_type\": \"llama3\"", "\"rope_type\": \"longrope\"")
            )
            .unwrap_err()
        );
        assert!(e.contains("\"longrope\" is not implemented"), "{e}");
        let e = format!(
            "{:#}",
            LlamaConfig::parse(
                &LLAMA_3_1_8B.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5")
            )
            .unwrap_err()
        );
        assert!(e.contains("not a multiple of num_key_value_heads = 5"), "{e}");
        assert!(refused(r#""partial_rotary_factor": 0.5"#).contains("partial_rotary_factor = 0.5"));
    }

    /// The head fused into the loss gives `loss(forward(..))`'s value and every gradient,
    /// with the head its own and tied to the embedding (600 rows: two chunks of 512).
    #[test]
    fn the_fused_loss_equals_the_loss_of_the_logits() {
        for tied in [false, true] {
            let text = format!(
                r#"{{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                "vocab_size": 16384, "tie_word_embeddings": {tied}}}"#
            );
            let config = LlamaConfig::parse(&text).unwrap();
            let pending = accel_core::PendingUnits::default();
            let run = |fused: bool| {
                tch::manual_seed(7);
                let vs = tch::nn::VarStore::new(tch::Device::Cpu);
                let model = Llama::new(&pending, &vs.root(), &config, Init::Fresh);
                let ids = Tensor::arange(2 * 300, (Kind::Int64, tch::Device::Cpu))
                    .remainder(16383)
                    .view([2, 300]);
                let loss = match fused {
                    true => model.forward_loss(&ids),
                    false => Llama::loss(&model.forward(&ids), &ids),
                };
                loss.backward();
                let grads: std::collections::BTreeMap<String, Tensor> =
                    vs.variables().into_iter().map(|(n, t)| (n, t.grad())).collect();
                (loss.double_value(&[]), grads)
            };
            let ((fused, fused_grads), (plain, plain_grads)) = (run(true), run(false));
            assert!((fused - plain).abs() < 1e-6, "tied {tied}: loss {fused} vs {plain}");
            for (name, a) in &fused_grads {
                let diff = (a - &plain_grads[name]).abs().max().double_value(&[]);
                assert!(diff < 1e-6, "tied {tied}: {name}'s gradient differs by {diff}");
            }
        }
    }

    #[test]
    fn load_report_names_merge_layer_indices() {
        let names: Vec<String> = ["model.layers.0.a.bias", "model.layers.1.a.bias", "model.extra"]
            .map(String::from)
            .to_vec();
        assert_eq!(group_layers(&names), "model.layers.{0, 1}.a.bias, model.extra");
    }
}
