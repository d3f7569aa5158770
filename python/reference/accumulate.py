"""Gradient accumulation with Hugging Face Accelerate, as the reference for accel.

    .venv/bin/python python/reference/accumulate.py OUT.safetensors

A 4-8-2 MLP (Linear, Tanh, Linear) regresses 40 random samples in 10 batches of 4 for 2
epochs with gradient_accumulation_steps=3 (windows of 3, 3, 3 and a short 1 per epoch),
SGD(lr 0.1, momentum 0.9) and a linear warm-up schedule. Saved: the start weights, the
data, and after every batch the gradients (right after backward), the learning rate, the
parameters and whether it was a sync step. accel-core/tests/vs_torch.rs replays it.
"""
import sys

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

torch.manual_seed(0)
acc = Accelerator(gradient_accumulation_steps=3, cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
x, y = torch.randn(40, 4), torch.randn(40, 2)
out = {f"init.{k}": v.clone() for k, v in model.state_dict().items()}
out["data.x"], out["data.y"] = x, y

def warmup(step, warmup_steps=2, total=8):
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return max(0.0, (total - step) / max(1, total - warmup_steps))

opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
model, opt, dl, sched = acc.prepare(model, opt, dl, sched)

step, lrs, syncs = 0, [], []
for epoch in range(2):
    for xb, yb in dl:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            for name, p in model.named_parameters():
                out[f"grad.{step}.{name}"] = p.grad.detach().clone()
            syncs.append(acc.sync_gradients)
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
        for name, p in model.named_parameters():
            out[f"param.{step}.{name}"] = p.detach().clone()
        step += 1
out["lr"] = torch.tensor(lrs, dtype=torch.float64)
out["sync"] = torch.tensor(syncs, dtype=torch.int64)
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[1])
