"""PyTorch + Accelerate's side of tests/real_code/loops/nanogpt.rs: nanoGPT's training loop
(train.py: `get_lr(iter)`, random batches from `get_batch`, an evaluation every 10
iterations, AdamW, gradient clipping at 1.0) on the same character model, with nanoGPT's
per-rank seed (`seed_offset`: 1337 + rank, as `set_seed(1337, device_specific=True)`).

    .venv/bin/torchrun --nproc-per-node 2 python/reference/nanogpt_accelerate.py \
        --text data/input.txt --init W.safetensors --iters 20 --losses DIR --out final.safetensors

`--make W --text T` writes fresh initial weights for the model instead.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

BLOCK_SIZE, BATCH_SIZE, N_EMBD = 16, 8, 24
LEARNING_RATE, WARMUP_ITERS, LR_DECAY_ITERS, MIN_LR = 3e-3, 4, 30, 3e-4
EVAL_INTERVAL = 10


class Gpt(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, N_EMBD)
        self.ln_f = torch.nn.LayerNorm(N_EMBD)
        self.lm_head = torch.nn.Linear(N_EMBD, vocab)

    def forward(self, idx):
        return self.lm_head(F.gelu(self.ln_f(self.wte(idx))))


def get_batch(data):
    ix = torch.randint(len(data) - BLOCK_SIZE - 1, (BATCH_SIZE,))
    x = torch.stack([data[i : i + BLOCK_SIZE] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + BLOCK_SIZE] for i in ix])
    return x, y


def get_lr(it):
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > LR_DECAY_ITERS:
        return MIN_LR
    decay_ratio = (it - WARMUP_ITERS) / (LR_DECAY_ITERS - WARMUP_ITERS)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return MIN_LR + coeff * (LEARNING_RATE - MIN_LR)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--text", required=True)
    p.add_argument("--make")
    p.add_argument("--init")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--losses")
    p.add_argument("--out")
    args = p.parse_args()
    text = open(args.text).read()
    chars = sorted(set(text))
    vocab = len(chars)
    if args.make:
        torch.manual_seed(0)
        save_file({k: v.contiguous() for k, v in Gpt(vocab).state_dict().items()}, args.make)
        return
    from accelerate import Accelerator

    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    n = int(0.9 * len(ids))
    train_data, val_data = ids[:n], ids[n:]
    accelerator = Accelerator(cpu=True)
    model = Gpt(vocab)
    model.load_state_dict(load_file(args.init))
    torch.manual_seed(1337 + accelerator.process_index)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
        fused=True,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for it in range(args.iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        if it % EVAL_INTERVAL == 0:
            x, y = get_batch(val_data)
            with torch.no_grad():
                val = F.cross_entropy(model(x).view(-1, vocab), y.view(-1))
            accelerator.print(f"step {it}: val loss {val.item():.4f}")
        xb, yb = get_batch(train_data)
        loss = F.cross_entropy(model(xb).view(-1, vocab), yb.view(-1))
        optimizer.zero_grad()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    if args.losses:
        with open(f"{args.losses}/losses.rank{accelerator.process_index}.json", "w") as f:
            json.dump(losses, f)
    if args.out and accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, args.out)


if __name__ == "__main__":
    main()
