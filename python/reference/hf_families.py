"""transformers' side of the model families the Rust Llama is extended to (Llama with its RoPE
types, Qwen2, Qwen3, Mistral): tiny random checkpoints made by transformers' own config and
model classes, and their reference logits. python/reference/MODELS.md has the math.

    make    --variant V --out DIR [--seed S] [--dtype float32|bfloat16]
    tokens  --out T.safetensors --vocab N --batch B --seq L [--seed S]        random input_ids
    logits  --model DIR --tokens T.safetensors --out O.safetensors [--adapter ADIR]
            [--attention sdpa|eager] [--mask M.safetensors]
            AutoModelForCausalLM, fp32; `logits` (f32 [B, L, vocab]); --mask: its
            `attention_mask` (int64 [B, L], 0 where padded)
    generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--do-sample] [--temperature T]
            [--top-k K] [--top-p P] [--repetition-penalty R] [--seed S] [--eos-ids 2,3]
            [--dtype bfloat16] [--attention sdpa|eager] [--adapter ADIR] [--scores-out S]
            [--offload-folder DIR --max-memory 150MiB]
            model.generate for one prompt: the new ids on one line; --scores-out: the
            processed scores of each step (output_scores), `scores` f32 [steps, vocab];
            with --offload-folder, loaded by Accelerate's device_map="auto" under the budget
            (the rest offloaded to that folder); stderr: the tokens per second
    device-map --model DIR --max-memory 150MiB [--dtype bfloat16]
            Accelerate's infer_auto_device_map of the model (on the meta device, the
            class's _no_split_modules), as JSON
    adapter --model DIR --out ADIR [--r 4] [--alpha 8] [--target q_proj,v_proj] [--seed S]
            [--rslora]   a PEFT LoRA adapter with random (non-zero) A and B (needs peft)
    verify  --work DIR   makes every variant and checks that its options change the logits,
            and that an independent implementation of the spec (`spec_logits`) matches

Several commands may run in one process, separated by a lone `;` argument (`\;` in a shell):
    make --variant llama --out M \; logits --model M --tokens T --out O

Variants: llama, llama-linear, llama-dynamic, llama3, llama-yarn, qwen2, qwen2-sliding, qwen3,
mistral, mistral-nowindow, qwen2-tied. Every one: vocab 128, hidden 64, intermediate 128,
4 heads, 2 key/value heads, initializer_range 0.1 (so attention is far from uniform and RoPE
and windows show in the logits). After transformers' own initialisation, every bias and
every RMSNorm weight is redrawn (transformers starts them at 0 and 1, which would hide a
missing bias or norm weight), from a generator seeded with `seed + 1`.
"""
import argparse
import json
import math
import os
import shutil
import sys

import commands
import torch
from safetensors.torch import load_file, save_file

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)


def variant_config(name):
    """The transformers config of a variant (the classes' own constructors, nothing edited)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    b = dict(BASE)
    if name == "llama":
        return LlamaConfig(**b)
    if name == "llama-linear":
        return LlamaConfig(**b, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    if name == "llama-dynamic":
        # max_position_embeddings 16 < the test's 24 tokens: the NTK base is recomputed.
        b["max_position_embeddings"] = 16
        return LlamaConfig(**b, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    if name == "llama3":
        # original_max_position_embeddings 64, not 16: with head_dim 16 the wavelengths are
        # 2*pi*5.18^k (6.3, 32.5, 168, ...); low_freq_wavelen = 64/1, high_freq_wavelen = 64/4 = 16
        # puts one frequency in each band (kept, smoothed, divided by 8). With 16, the kept band
        # (wavelen < 16/4 = 4 < 2*pi) would be empty.
        b["max_position_embeddings"] = 128
        return LlamaConfig(
            **b,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        )
    if name == "llama-yarn":
        # original_max_position_embeddings 64 (max_position_embeddings = 4 * 64): the YaRN ramp
        # then runs over dims 0..3 (low 0, high 3: fractional 1/3, 2/3); with 16 it is a step.
        b["max_position_embeddings"] = 256
        return LlamaConfig(
            **b,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        )
    if name == "qwen2":
        return Qwen2Config(**b)
    if name == "qwen2-tied":
        return Qwen2Config(**b, tie_word_embeddings=True)
    if name == "qwen2-sliding":
        # layer i slides when i >= max_window_layers: layers 0, 1 full, 2, 3 sliding.
        b["num_hidden_layers"] = 4
        return Qwen2Config(**b, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    if name == "qwen3":
        return Qwen3Config(**b, head_dim=32)
    if name == "mistral":
        return MistralConfig(**b, sliding_window=8)
    if name == "mistral-nowindow":
        return MistralConfig(**b, sliding_window=None)
    raise SystemExit(f"unknown variant {name!r}; one of {', '.join(VARIANTS)}")


VARIANTS = [
    "llama", "llama-linear", "llama-dynamic", "llama3", "llama-yarn", "qwen2", "qwen2-sliding",
    "qwen3", "mistral", "mistral-nowindow", "qwen2-tied",
]


def build(name, seed):
    from transformers import AutoModelForCausalLM

    config = variant_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in pname:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
    return model


def make(args):
    model = build(args.variant, args.seed)
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "config.json")) as f:
        cfg = json.load(f)
    print(f"{args.out} model_type={cfg['model_type']} architectures={cfg.get('architectures')}")


def tokens(args):
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g, dtype=torch.int64)
    save_file({"input_ids": ids}, args.out)


def load(model_dir, adapter=None, attention="eager", dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attention, **overrides
    )
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def run(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits.float().contiguous()


def logits(args):
    ids = load_file(args.tokens)["input_ids"]
    extra = {"attention_mask": load_file(args.mask)["attention_mask"]} if args.mask else {}
    model = load(args.model, args.adapter, attention=args.attention)
    save_file({"logits": run(model, ids, **extra)}, args.out)


def device_map(args):
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    # As Accelerate's guide says before inferring a map, and as `from_pretrained(device_map=
    # "auto")` ends up placing them: a tied head shares the embedding's weight and its place.
    model.tie_weights()
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    # Accelerate takes a number of bytes as an int, a size with a unit as a string.
    budget = int(args.max_memory) if args.max_memory.isdigit() else args.max_memory
    found = infer_auto_device_map(model, max_memory={"cpu": budget},
                                  no_split_module_classes=model._no_split_modules, dtype=dtype)
    print(json.dumps(dict(found)))


def generate(args):
    import time

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    overrides = {}
    if args.offload_folder:
        overrides = dict(device_map="auto", max_memory={"cpu": args.max_memory},
                         offload_folder=args.offload_folder)
    model = load(args.model, args.adapter, attention=args.attention, dtype=dtype, **overrides)
    ids = torch.tensor([[int(i) for i in args.prompt_ids.split(",")]])
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                  output_scores=True, return_dict_in_generate=True)
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.eos_ids is not None:
        stops = [int(i) for i in args.eos_ids.split(",") if i]
        if stops:
            kwargs["eos_token_id"] = stops
        else:
            # No stop token: the full length, whatever the model's config says.
            model.generation_config.eos_token_id = None
    if args.seed is not None:
        torch.manual_seed(args.seed)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - started
    new = out.sequences[0, ids.shape[1]:].tolist()
    print(",".join(str(i) for i in new))
    print(f"transformers generate: {len(new)} tokens in {seconds:.3f} s "
          f"({len(new) / seconds:.1f} tokens/s, prompt included)", file=sys.stderr)
    if args.scores_out:
        save_file({"scores": torch.cat(out.scores, 0).float().contiguous()}, args.scores_out)


def adapter(args):
    from peft import LoraConfig, get_peft_model

    model = load(args.model)
    config = LoraConfig(
        r=args.r,
        lora_alpha=args.alpha,
        target_modules=args.target.split(","),
        lora_dropout=0.0,
        bias="none",
        use_rslora=args.rslora,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(args.seed)
    peft_model = get_peft_model(model, config)
    # PEFT starts B at zero (the adapter is then the identity); draw it so that it shows.
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(args.out)
    print(f"{args.out} r={args.r} alpha={args.alpha} target={args.target} rslora={args.rslora}")


# ---------------------------------------------------------------------------------------------
# An implementation of models-spec.md from config.json and the safetensors alone (no
# transformers), to check that the spec says what transformers does.


def rope_of(cfg):
    """(rope parameters dict, as transformers 5.22 standardises it)."""
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rp = dict(rp)
    rp.setdefault("rope_type", rp.get("type", "default"))
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if rp["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in cfg:
            rp["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        else:
            rp.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rp


def spec_inv_freq(cfg, head_dim, seq_len):
    """inv_freq [head_dim/2] (float64) and the cos/sin multiplier, per models-spec.md."""
    rp = rope_of(cfg)
    kind, base, d = rp["rope_type"], float(rp["rope_theta"]), head_dim
    i = torch.arange(0, d, 2, dtype=torch.float64)
    inv = 1.0 / base ** (i / d)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rp["factor"], 1.0
    if kind == "dynamic":
        mpe, factor = cfg["max_position_embeddings"], rp["factor"]
        if seq_len > mpe:
            base = base * (factor * seq_len / mpe - (factor - 1)) ** (d / (d - 2))
        return 1.0 / base ** (i / d), 1.0
    if kind == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, out), 1.0
    if kind == "yarn":
        factor = rp.get("factor")
        orig = rp["original_max_position_embeddings"]
        if factor is None:
            factor = cfg["max_position_embeddings"] / orig
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        att = rp.get("attention_factor")
        if att is None:
            att = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if (mscale and mscale_all) else get_mscale(factor)
        beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

        def corr(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr(beta_fast), corr(beta_slow)
        if rp.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp
        return (inv / factor) * (1 - extrap) + inv * extrap, att
    raise ValueError(f"spec_logits: rope_type {kind}")


def spec_logits(model_dir, ids):
    """Logits per models-spec.md, in float64, from config.json and model.safetensors."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    w = {k: v.double() for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    family = cfg["model_type"]
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    d = cfg.get("head_dim") or (128 if family == "qwen3" else H // nh)
    eps = cfg.get("rms_norm_eps", 1e-6)
    L = cfg["num_hidden_layers"]
    # Which layers slide, and the window.
    if family in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        types = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(L)
        ]
    elif family == "mistral":
        window = cfg.get("sliding_window", 4096)
        types = ["sliding_attention" if window is not None else "full_attention"] * L
    else:
        window, types = None, ["full_attention"] * L
    B, T = ids.shape
    inv, att = spec_inv_freq(cfg, d, T)
    pos = torch.arange(T, dtype=torch.float64)
    emb = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], -1)
    cos, sin = emb.cos() * att, emb.sin() * att
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    full = j <= i
    sliding = full & (i - j < window) if window is not None else full

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], -1)

    x = w["model.embed_tokens.weight"][ids]
    for layer in range(L):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = lin(h, p + "self_attn.q_proj").view(B, T, nh, d)
        k = lin(h, p + "self_attn.k_proj").view(B, T, nkv, d)
        v = lin(h, p + "self_attn.v_proj").view(B, T, nkv, d)
        if family == "qwen3":
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        allowed = sliding if types[layer] == "sliding_attention" else full
        s = (q @ k.transpose(2, 3)) * d**-0.5
        s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        a = (s @ v).transpose(1, 2).reshape(B, T, nh * d)
        x = x + lin(a, p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj")
        x = x + lin(act, p + "mlp.down_proj")
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


# ---------------------------------------------------------------------------------------------


def verify(args):
    """Every variant: make, tokens (2 x 24), logits; then the checks of the brief."""
    work = args.work
    os.makedirs(work, exist_ok=True)
    toks = os.path.join(work, "tokens.safetensors")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=g, dtype=torch.int64)
    save_file({"input_ids": ids}, toks)
    report = {}
    out = {}

    def diff(a, b):
        return float((a - b).abs().max())

    for v in VARIANTS:
        d = os.path.join(work, v)
        shutil.rmtree(d, ignore_errors=True)
        build(v, 0).save_pretrained(d, safe_serialization=True)
        model = load(d)
        out[v] = run(model, ids)
        nocache = run(model, ids, use_cache=False)
        spec = spec_logits(d, ids)
        report[v] = {
            "max_abs_logit": float(out[v].abs().max()),
            "use_cache_false_diff": diff(out[v], nocache),
            "spec_vs_transformers": diff(out[v], spec.float()),
        }

    # Sliding windows: the same weights with the window off.
    for v, off in [
        ("qwen2-sliding", dict(layer_types=["full_attention"] * 4)),
        ("mistral", dict(sliding_window=None)),
    ]:
        full = run(load(os.path.join(work, v), **off), ids)
        w = out[v]
        report[v]["window_off_diff_all"] = diff(w, full)
        report[v]["window_off_diff_pos_0_7"] = diff(w[:, :8], full[:, :8])
        report[v]["window_off_diff_pos_8"] = diff(w[:, 8], full[:, 8])
    # mistral-nowindow equals mistral with its window switched off (same seed, same weights).
    report["mistral-nowindow"]["vs_mistral_window_off"] = diff(
        out["mistral-nowindow"], run(load(os.path.join(work, "mistral"), sliding_window=None), ids)
    )

    # RoPE types: the same weights with the default RoPE.
    for v in ["llama-linear", "llama-dynamic", "llama3", "llama-yarn"]:
        theta = load(os.path.join(work, v)).config.rope_parameters["rope_theta"]
        default = run(
            load(os.path.join(work, v), rope_parameters={"rope_type": "default", "rope_theta": theta}), ids
        )
        report[v]["vs_default_rope_diff"] = diff(out[v], default)
    # Dynamic NTK is the default RoPE while the sequence fits max_position_embeddings (16).
    dyn = os.path.join(work, "llama-dynamic")
    short = ids[:, :16]
    report["llama-dynamic"]["seq16_vs_default_diff"] = diff(
        run(load(dyn), short), run(load(dyn, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), short)
    )
    # ... and it is stateful: after a 24-token forward, a 20-token one keeps the 24-token base.
    m = load(dyn)
    fresh20 = run(m, ids[:, :20])
    run(m, ids)
    after24 = run(m, ids[:, :20])
    report["llama-dynamic"]["seq20_fresh_vs_after_seq24_diff"] = diff(fresh20, after24)
    # Mistral without a window is Llama (same seed: the same weights).
    report["mistral-nowindow"]["vs_llama_diff"] = diff(out["mistral-nowindow"], out["llama"])
    # inv_freq and the cos/sin multiplier: transformers' rotary embedding against the spec.
    for v in ["llama", "llama-linear", "llama-dynamic", "llama3", "llama-yarn"]:
        m = load(os.path.join(work, v))
        run(m, ids)  # dynamic recomputes inv_freq in the forward
        rot = m.model.rotary_emb
        with open(os.path.join(work, v, "config.json")) as f:
            cfg = json.load(f)
        inv, att = spec_inv_freq(cfg, m.config.head_dim, ids.shape[1])
        default, _ = spec_inv_freq({**cfg, "rope_parameters": {"rope_theta": cfg["rope_parameters"]["rope_theta"]}},
                                   m.config.head_dim, ids.shape[1])
        report[v]["inv_freq_over_default"] = [round(x, 6) for x in (rot.inv_freq.double() / default).tolist()]
        report[v]["attention_scaling"] = rot.attention_scaling
        report[v]["inv_freq_spec_max_rel_diff"] = float(((rot.inv_freq.double() - inv) / inv).abs().max())
        report[v]["attention_scaling_spec_diff"] = abs(rot.attention_scaling - att)
    # tie_word_embeddings: one tensor fewer in the file.
    tied = load_file(os.path.join(work, "qwen2-tied", "model.safetensors"))
    report["qwen2-tied"]["has_lm_head_weight"] = "lm_head.weight" in tied

    try:
        import peft  # noqa: F401
    except ImportError:
        report["llama-lora"] = "skipped: peft is not installed"
    else:
        ad = os.path.join(work, "llama-lora")
        shutil.rmtree(ad, ignore_errors=True)
        adapter(argparse.Namespace(model=os.path.join(work, "llama"), out=ad, r=4, alpha=8,
                                   target="q_proj,v_proj", seed=0, rslora=False))
        lora = run(load(os.path.join(work, "llama"), ad), ids)
        merged = spec_merge(os.path.join(work, "llama"), ad)
        peft_merged = load(os.path.join(work, "llama"), ad).merge_and_unload().state_dict()
        spec_w = load_file(os.path.join(merged, "model.safetensors"))
        report["llama-lora"] = {
            "vs_base_diff": diff(lora, out["llama"]),
            "spec_merged_vs_peft": diff(lora, spec_logits(merged, ids).float()),
            "merge_and_unload_vs_spec_weights": max(diff(peft_merged[k], spec_w[k]) for k in spec_w),
            "merge_and_unload_keys_equal_base": sorted(peft_merged) == sorted(spec_w),
        }
    print(json.dumps(report, indent=1))


def spec_merge(model_dir, adapter_dir):
    """W + (alpha / r) * B @ A (alpha / sqrt(r) with use_rslora), written as a model folder."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        ac = json.load(f)
    scale = ac["lora_alpha"] / (math.sqrt(ac["r"]) if ac.get("use_rslora") else ac["r"])
    w = load_file(os.path.join(model_dir, "model.safetensors"))
    a = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    prefix = "base_model.model."
    for key in a:
        if key.endswith(".lora_A.weight"):
            module = key[len(prefix):-len(".lora_A.weight")]
            B = a[f"{prefix}{module}.lora_B.weight"]
            w[module + ".weight"] = w[module + ".weight"] + scale * (B @ a[key])
    out = adapter_dir + "-merged-spec"
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(model_dir, "config.json"), out)
    save_file(w, os.path.join(out, "model.safetensors"))
    return out


p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("mode", choices=["make", "tokens", "logits", "adapter", "verify", "generate",
                                "device-map"])
p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
p.add_argument("--mask")
p.add_argument("--prompt-ids")
p.add_argument("--max-new-tokens", type=int)
p.add_argument("--do-sample", action="store_true")
p.add_argument("--temperature", type=float)
p.add_argument("--top-k", type=int)
p.add_argument("--top-p", type=float)
p.add_argument("--repetition-penalty", type=float)
p.add_argument("--eos-ids")
p.add_argument("--scores-out")
p.add_argument("--offload-folder")
p.add_argument("--max-memory", default="150MiB")
p.add_argument("--variant", choices=VARIANTS)
p.add_argument("--out")
p.add_argument("--seed", type=int)
p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
p.add_argument("--vocab", type=int, default=128)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--seq", type=int, default=24)
p.add_argument("--model")
p.add_argument("--tokens")
p.add_argument("--adapter")
p.add_argument("--r", type=int, default=4)
p.add_argument("--alpha", type=lambda s: int(s) if float(s).is_integer() else float(s), default=8)
p.add_argument("--target", default="q_proj,v_proj")
p.add_argument("--rslora", action="store_true")
p.add_argument("--work")
modes = {"make": make, "tokens": tokens, "logits": logits, "adapter": adapter, "verify": verify,
         "generate": generate, "device-map": device_map}
required = {
    "make": ["variant", "out"], "tokens": ["out"], "logits": ["model", "tokens", "out"],
    "adapter": ["model", "out"], "verify": ["work"],
    "generate": ["model", "prompt_ids", "max_new_tokens"], "device-map": ["model"],
}
# Every command checked before the first runs: a mistake in the last one costs nothing.
parsed = [p.parse_args(argv) for argv in commands.split(sys.argv[1:])]
for args in parsed:
    missing = [f"--{k}" for k in required[args.mode] if getattr(args, k) is None]
    if missing:
        p.error(f"{args.mode} needs {' '.join(missing)}")
    if args.seed is None and args.mode not in ("generate", "device-map"):
        args.seed = 0
for args in parsed:
    modes[args.mode](args)
    sys.stdout.flush()
