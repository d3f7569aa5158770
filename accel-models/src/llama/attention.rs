//! Attention as transformers computes it: `sdpa` (its default: ATen's fused
//! `scaled_dot_product_attention`, with `is_causal` where no mask is needed and grouped-query
//! heads shared without copies) or `eager` (the scores materialised, an fp32 softmax); the
//! masks each pass needs (causal, sliding windows, padding, a cache's offset), built as
//! transformers' `masking_utils` builds them; and the key/value cache of generation.

use tch::{Kind, Tensor};

/// How attention is computed (transformers' `attn_implementation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Attention {
    /// `scaled_dot_product_attention`: fused kernels (flash attention on CPU and CUDA where
    /// the inputs allow), the T×T scores never materialised. transformers' default.
    #[default]
    Sdpa,
    /// Scores, mask and softmax as separate operations (transformers' `eager`).
    Eager,
}

impl std::str::FromStr for Attention {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sdpa" => Ok(Self::Sdpa),
            "eager" => Ok(Self::Eager),
            other => Err(format!("attention `{other}`: expected sdpa or eager")),
        }
    }
}

/// Which keys each query may see, in one pass.
#[derive(Debug)]
pub(crate) enum Mask {
    /// Causal over keys and queries of the same positions: sdpa's `is_causal`.
    Causal,
    /// Every key (one query after a cache, within any window).
    All,
    /// `[B or 1, 1, queries, keys]`, true where a query may look.
    Allowed(Tensor),
}

impl Mask {
    fn shallow_clone(&self) -> Self {
        match self {
            Self::Causal => Self::Causal,
            Self::All => Self::All,
            Self::Allowed(m) => Self::Allowed(m.shallow_clone()),
        }
    }
}

/// What every layer of one forward pass shares: the rotary tables of its positions and the
/// masks of its full and sliding layers.
#[derive(Debug)]
pub(crate) struct Pass {
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    pub(crate) full: Mask,
    pub(crate) sliding: Mask,
    pub(crate) attention: Attention,
}

impl Pass {
    /// The same on `device` (a layer on another GPU).
    pub(crate) fn to_device(&self, device: tch::Device) -> Self {
        let mask = |m: &Mask| match m {
            Mask::Allowed(t) => Mask::Allowed(t.to_device(device)),
            other => other.shallow_clone(),
        };
        Self {
            cos: self.cos.to_device(device),
            sin: self.sin.to_device(device),
            full: mask(&self.full),
            sliding: mask(&self.sliding),
            attention: self.attention,
        }
    }

    /// Another handle on the same tensors (a checkpointed layer runs its forward again in
    /// backward, and must own what it reads).
    pub(crate) fn shallow_clone(&self) -> Self {
        Self {
            cos: self.cos.shallow_clone(),
            sin: self.sin.shallow_clone(),
            full: self.full.shallow_clone(),
            sliding: self.sliding.shallow_clone(),
            attention: self.attention,
        }
    }
}

/// The masks of a pass of `queries` new positions after `past` cached ones: for full layers
/// (`window` None) or sliding ones. `padding`: [B, past + queries], 1 for real tokens. As
/// transformers' `sdpa_mask`: nothing materialised where `is_causal` (or no mask) says the
/// same and nothing is padded; under `eager` always materialised.
pub(crate) fn mask(
    queries: i64,
    past: i64,
    window: Option<i64>,
    padding: Option<&Tensor>,
    attention: Attention,
    device: tch::Device,
) -> Mask {
    let keys = past + queries;
    let unpadded = padding.is_none_or(|p| p.all().int64_value(&[]) != 0);
    let window_matters = window.is_some_and(|w| keys >= w);
    if attention == Attention::Sdpa && unpadded && !window_matters {
        if queries == 1 {
            return Mask::All;
        }
        if keys == queries {
            return Mask::Causal;
        }
    }
    // Query i (at position past + i) sees key j when j <= past + i, within the window
    // (j > past + i - window), and j is not padding.
    let q = (Tensor::arange(queries, (Kind::Int64, device)) + past).unsqueeze(-1);
    let k = Tensor::arange(keys, (Kind::Int64, device)).unsqueeze(0);
    let mut allowed = k.le_tensor(&q);
    if let Some(w) = window {
        allowed = allowed.logical_and(&k.gt_tensor(&(&q - w)));
    }
    let mut allowed = allowed.view([1, 1, queries, keys]);
    if let Some(p) = padding {
        let p = p.to_kind(Kind::Bool).view([-1, 1, 1, keys]);
        allowed = allowed.logical_and(&p);
    }
    Mask::Allowed(allowed)
}

/// One layer's cached keys and values, after RoPE and before any repetition:
/// `[B, key/value heads, positions, head_dim]` each.
#[derive(Debug, Default)]
pub struct LayerCache {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerCache {
    /// `k`, `v` of the new positions appended; the keys and values of every position so far.
    pub(crate) fn append(&mut self, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let (k, v) = match self.kv.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2), Tensor::cat(&[&pv, &v], 2)),
            None => (k, v),
        };
        self.kv = Some((k.shallow_clone(), v.shallow_clone()));
        (k, v)
    }
}

/// The key/value cache of generation: every layer's keys and values of the positions seen
/// so far, grown as tokens are added (transformers' `DynamicCache`).
#[derive(Debug, Default)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    /// Positions cached.
    pub(crate) len: i64,
}

impl KvCache {
    /// An empty cache for a model of `layers` decoder layers.
    pub fn new(layers: usize) -> Self {
        Self { layers: (0..layers).map(|_| LayerCache::default()).collect(), len: 0 }
    }

    /// Positions cached so far.
    pub fn len(&self) -> i64 {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the cached keys and values.
    pub fn bytes(&self) -> u64 {
        let size = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        self.layers.iter().filter_map(|l| l.kv.as_ref()).map(|(k, v)| size(k) + size(v)).sum()
    }
}

/// `repeat_kv`: each key/value head serves `groups` consecutive query heads.
fn repeat_kv(y: &Tensor, groups: i64) -> Tensor {
    if groups == 1 {
        return y.shallow_clone();
    }
    let [b, kv, t, d] = y.size()[..] else { unreachable!("[B, heads, T, head_dim]") };
    y.unsqueeze(2).expand([b, kv, groups, t, d], false).reshape([b, kv * groups, t, d])
}

/// Attention of `q` [B, heads, T, D] over `k`, `v` [B, kv_heads, S, D] under `mask`:
/// [B, heads, T, D], as transformers' `sdpa_attention_forward` or `eager_attention_forward`.
pub(crate) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, how: Attention) -> Tensor {
    let (heads, kv_heads, head_dim) = (q.size()[1], k.size()[1], q.size()[3]);
    let groups = heads / kv_heads;
    let scale = (head_dim as f64).powf(-0.5);
    match how {
        Attention::Sdpa => {
            // Grouped-query heads shared by the kernel where there is no mask (as
            // transformers' `use_gqa_in_sdpa`); repeated otherwise.
            let shared = groups > 1 && !matches!(mask, Mask::Allowed(_)) && head_dim <= 256;
            let (k, v) = if shared || groups == 1 {
                (k.shallow_clone(), v.shallow_clone())
            } else {
                (repeat_kv(k, groups), repeat_kv(v, groups))
            };
            let (attn_mask, causal) = match mask {
                Mask::Causal => (None, true),
                Mask::All => (None, false),
                Mask::Allowed(m) => (Some(m), false),
            };
            Tensor::scaled_dot_product_attention(q, &k, &v, attn_mask, 0.0, causal, scale, shared)
        }
        Attention::Eager => {
            let (k, v) = (repeat_kv(k, groups), repeat_kv(v, groups));
            let scores = q.matmul(&k.transpose(2, 3)) * scale;
            let scores = match mask {
                Mask::All => scores,
                Mask::Causal => {
                    let (t, s) = (q.size()[2], k.size()[2]);
                    let keep = Tensor::ones([t, s], (Kind::Bool, q.device())).tril(s - t);
                    masked(&scores, &keep)
                }
                Mask::Allowed(m) => masked(&scores, m),
            };
            let weights = scores.softmax(-1, Kind::Float).to_kind(q.kind());
            weights.matmul(&v)
        }
    }
}

/// `scores` plus the dtype's lowest value where `allowed` is false (transformers' eager mask).
fn masked(scores: &Tensor, allowed: &Tensor) -> Tensor {
    // torch.finfo(dtype).min
    let lowest = match scores.kind() {
        Kind::BFloat16 => -3.389_531_389_251_535_5e38,
        Kind::Half => -65504.0,
        Kind::Double => f64::MIN,
        _ => f64::from(f32::MIN),
    };
    let bias = Tensor::zeros_like(scores).masked_fill(&allowed.logical_not(), lowest);
    scores + bias
}
