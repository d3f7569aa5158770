"""transformers + Accelerate's side of examples/llama_cli.rs (the `llama` example).

    make   --out DIR [--tied] [--max-shard-size 40KB]   a random Llama, save_pretrained (shards)
    tokens --out T.safetensors --rows 16 --len 12 --vocab 64   random input_ids
    logits --model DIR --eval T.safetensors --logits-out OUT.safetensors   fp32

Every mode loads the model with --attention (sdpa, transformers' default, or eager).
    train  --model DIR --data T.safetensors --steps K --batch-size B --lr LR --weight-decay WD \
           --out DIR2 --losses L.jsonl        (under torchrun: Accelerate DDP)
           [--lora-adapter ADIR]   peft: the adapter trained on the frozen base, saved as PEFT does
    load   --model DIR2 --eval T.safetensors --logits-out OUT.safetensors   from_pretrained works
           (any family AutoModelForCausalLM loads; a load report with anything missing,
           unexpected or mismatched is an error)
    memory --model DIR --data T.safetensors --steps 3 --batch-size 1 [--checkpointing]
           [--optimizer-in-backward]
           [--ddp | --lora-r R]
           (under torchrun) PyTorch FSDP2: fully_shard on every decoder layer, the embedding,
           the head and the root, checkpoint_wrapper on every decoder layer with
           --checkpointing; torch DDP with --ddp; a peft LoRA of rank R on q_proj and v_proj
           prepared by Accelerate (DDP on CPU) with --lora-r; one JSON line per rank with the
           llama example's memory keys.
    make --size 100m: the ~100M-parameter Llama of `cargo xtask bench memory`.
Several commands may run in one process, separated by a lone `;` (commands.py).

`train` is what the example does: AdamW (betas 0.9/0.999, eps 1e-8) on the rows in order,
dealt by Accelerate's prepared DataLoader, epochs repeating until K steps, loss with
labels=input_ids; rank 0 logs its own loss per step; the main process saves the model.
"""
import argparse
import json
import sys

import commands
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def make(args):
    torch.manual_seed(args.seed)
    if args.size == "100m":
        # 106M parameters: the embedding and the head 24.6M each, 8 layers of 7.1M.
        config = LlamaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        LlamaForCausalLM(config).save_pretrained(args.out, max_shard_size="100MB")
        return
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=128,
        tie_word_embeddings=args.tied,
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)


def tokens(args):
    g = torch.Generator().manual_seed(args.seed)
    save_file({"input_ids": torch.randint(0, args.vocab, (args.rows, args.len), generator=g)}, args.out)


def load(path):
    """Any family's checkpoint (Llama, Qwen2, Qwen3, Mistral: AutoModelForCausalLM), refused
    when transformers' load report has anything MISSING, UNEXPECTED or MISMATCHED."""
    model, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=ATTENTION, dtype=torch.float32, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise SystemExit(f"{path}: transformers' load report: {info}")
    return model


def logits(args):
    model = load(args.model).eval()
    ids = load_file(args.eval)["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids).logits.float().contiguous()
    save_file({"logits": out}, args.logits_out)


def train(args):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = load(args.model)
    if args.lora_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.lora_adapter, is_trainable=True)
    ids = load_file(args.data)["input_ids"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay
    )
    dl = torch.utils.data.DataLoader(ids, batch_size=args.batch_size)
    model, opt, dl = acc.prepare(model, opt, dl)
    model.train()
    log = open(args.losses, "w") if acc.is_main_process else None
    step = 0
    while step < args.steps:
        for batch in dl:
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if log:
                log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            step += 1
            if step == args.steps:
                break
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.unwrap_model(model).save_pretrained(args.out)
    acc.wait_for_everyone()


def status_bytes(field):
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith(field))
    return int(line.split()[1]) * 1024


def optimizer_in_backward(model):
    """torchtune's optimizer_in_bwd: one AdamW per parameter, stepped and zeroed by the
    parameter's post-accumulate-grad hook (FSDP2 runs it on the sharded parameter once its
    gradient shard is reduced); the returned optimizer's step and zero_grad do nothing."""
    optims = {p: torch.optim.AdamW([p], lr=1e-4, eps=1e-8, weight_decay=0.0, fused=True)
              for p in model.parameters()}

    def step(param):
        optims[param].step()
        optims[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)

    class Applied:
        def step(self):
            pass

        def zero_grad(self):
            pass

    return Applied()


def memory(args):
    import time

    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    baseline = status_bytes("VmRSS:")
    model = load(args.model)
    params = sum(p.numel() for p in model.parameters())
    backward = torch.Tensor.backward
    if args.lora_r and args.checkpointing:
        raise SystemExit("memory: --lora-r runs without --checkpointing (the bench's LoRA rows)")
    if args.lora_r:
        # transformers + peft + Accelerate, as a LoRA fine-tune is written; on CPU
        # Accelerate prepares the model as DDP (over the process group made above).
        from accelerate import Accelerator
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_r, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                          lora_dropout=0.0)
        model = get_peft_model(model, lora)
        acc = Accelerator(cpu=True)
        trained = [p for p in model.parameters() if p.requires_grad]
        params = sum(p.numel() for p in trained)
        opt = torch.optim.AdamW(trained, lr=1e-4, eps=1e-8, weight_decay=0.0, fused=True)
        model, opt = acc.prepare(model, opt)
        backward = acc.backward
        strategy = f"accelerate ({acc.distributed_type}) + peft lora r{args.lora_r}"
    else:
        layers = model.model.layers
        if args.checkpointing:
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
        if args.ddp:
            # torch's DDP, what Accelerate runs on CPU (it keeps FSDP for GPUs: with cpu=True
            # its FSDP plugin gives DistributedType.MULTI_CPU, i.e. DDP).
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            for layer in layers:
                fully_shard(layer)
            fully_shard(model.model.embed_tokens)
            fully_shard(model.lm_head)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-8, weight_decay=0.0,
                                fused=True)
        strategy = "ddp" if args.ddp else "fsdp2"
        if args.optimizer_in_backward:
            if args.ddp:
                raise SystemExit("memory: --optimizer-in-backward runs under FSDP2")
            opt = optimizer_in_backward(model)
            strategy = "fsdp2 + optimizer_in_bwd"
    load_peak = status_bytes("VmHWM:") - baseline
    resume_peak = None
    if args.resume:
        # torch.distributed.checkpoint, as torchtitan resumes FSDP2: each rank reads its
        # own shards' chunks into the state dicts, then sets them.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        del state, model_state, optim_state
        resume_peak = status_bytes("VmHWM:") - baseline
    ids = load_file(args.data)["input_ids"]
    rank, world = dist.get_rank(), dist.get_world_size()
    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        rows = [(step * world + rank) * args.batch_size + i for i in range(args.batch_size)]
        batch = ids[[r % ids.shape[0] for r in rows]]
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        backward(loss)
        opt.step()
        opt.zero_grad()
        if step == 0:
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            t0 = time.perf_counter()
    dist.barrier()
    peak = status_bytes("VmHWM:") - baseline
    if args.save_state:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.save_state)
    print(json.dumps({
        "rank": rank,
        "strategy": strategy,
        "activation_checkpointing": args.checkpointing,
        "params": params,
        "load_peak_bytes": load_peak,
        "resume_peak_bytes": resume_peak,
        "peak_bytes": peak,
        "step_s": (time.perf_counter() - t0) / max(args.steps - 1, 1),
    }))
    dist.destroy_process_group()


p = argparse.ArgumentParser()
p.add_argument("mode", choices=["make", "tokens", "logits", "train", "load", "memory"])
p.add_argument("--size", default="small", choices=["small", "100m"])
p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
p.add_argument("--checkpointing", action="store_true")
p.add_argument("--optimizer-in-backward", action="store_true",
               help="memory: torchtune's optimizer_in_bwd under FSDP2")
how = p.add_mutually_exclusive_group()
how.add_argument("--ddp", action="store_true", help="memory: torch DDP instead of FSDP2")
how.add_argument("--lora-r", type=int, help="memory: a peft LoRA (q_proj, v_proj) under Accelerate")
p.add_argument("--out")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--tied", action="store_true")
p.add_argument("--max-shard-size", default="40KB")
p.add_argument("--rows", type=int, default=16)
p.add_argument("--len", type=int, default=12)
p.add_argument("--vocab", type=int, default=64)
p.add_argument("--model")
p.add_argument("--eval")
p.add_argument("--logits-out")
p.add_argument("--data")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--batch-size", type=int, default=2)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--weight-decay", type=float, default=0.0)
p.add_argument("--losses")
p.add_argument("--lora-adapter", help="train: a PEFT adapter folder trained on the frozen base")
p.add_argument("--save-state", help="memory: save the model and optimizer state here (DCP)")
p.add_argument("--resume", help="memory: load the state saved there (DCP) before training")
modes = {"make": make, "tokens": tokens, "logits": logits, "train": train, "load": logits, "memory": memory}
# Every command parsed before the first runs: a mistake in the last one costs nothing.
for args in [p.parse_args(argv) for argv in commands.split(sys.argv[1:])]:
    ATTENTION = args.attention
    modes[args.mode](args)
    sys.stdout.flush()
