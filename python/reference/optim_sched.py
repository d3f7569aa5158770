"""Reference values for accel's optimizers and schedulers, computed by torch.optim.

    .venv/bin/python python/reference/optim_sched.py OUT.safetensors

Two parameters (shapes [5, 3] and [3]) get 100 steps of seeded random gradients under each
optimizer configuration below; the file holds the start values, the gradients and every
configuration's parameters after steps 1, 10 and 100. Each schedule's learning rates (and
one-cycle's momenta) over 40 steps are stored in f64. accel-core/tests/vs_torch.rs reads it.
"""
import math
import sys

import torch
from safetensors.torch import save_file

torch.manual_seed(0)
STEPS = 100
init = [torch.randn(5, 3), torch.randn(3)]
grads = [torch.randn(STEPS, *p.shape) for p in init]
out = {f"init.{i}": p for i, p in enumerate(init)}
out.update({f"grads.{i}": g for i, g in enumerate(grads)})

# name -> (constructor, kwargs); "groups" puts each parameter in its own group with lr x 1, x 3.
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_maximize": (torch.optim.SGD, dict(lr=0.05, momentum=0.5, maximize=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "adam_betas": (torch.optim.Adam, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adamw_groups": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01, amsgrad=True)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
}
# Each SGD and Adam configuration again through torch's fused kernels (fused=True), which
# round differently from the single-tensor path: accel's `fused: true` is compared with these.
for name in ["sgd", "sgd_momentum", "sgd_nesterov", "sgd_maximize", "adam", "adam_betas"]:
    cls, kwargs = OPTIMIZERS[name]
    OPTIMIZERS[f"{name}_fused"] = (cls, dict(kwargs, fused=True))

for name, (cls, kwargs) in OPTIMIZERS.items():
    params = [p.clone().requires_grad_(True) for p in init]
    if name.endswith("_groups"):
        groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": kwargs["lr"] * 3}]
        opt = cls(groups, **kwargs)
    else:
        opt = cls(params, **kwargs)
    for step in range(STEPS):
        for p, g in zip(params, grads):
            p.grad = g[step].clone()
        opt.step()
        if step + 1 in (1, 10, STEPS):
            for i, p in enumerate(params):
                out[f"{name}.step{step + 1}.{i}"] = p.detach().clone()

# Schedules, over 40 steps, on SGD(lr=0.1, momentum=0.9).
SCHED_STEPS = 40
def lambda_schedule(fn):
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn)

def linear_warmup(warmup, total):
    return lambda s: s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))

def cosine_warmup(warmup, total, cycles=0.5):
    def f(s):
        if s < warmup:
            return s / max(1, warmup)
        progress = (s - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))
    return f

def constant_warmup(warmup):
    return lambda s: s / max(1.0, warmup) if s < warmup else 1.0

SCHEDULES = {
    "constant": lambda_schedule(lambda s: 1.0),
    "constant_warmup": lambda_schedule(constant_warmup(5)),
    "linear_warmup": lambda_schedule(linear_warmup(10, 40)),
    "cosine_warmup": lambda_schedule(cosine_warmup(8, 40)),
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=SCHED_STEPS + 1),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.3),
}
for name, make in SCHEDULES.items():
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sched = make(opt)
    lrs, momenta = [], []
    for _ in range(SCHED_STEPS + 1):
        lrs.append(opt.param_groups[0]["lr"])
        momenta.append(opt.param_groups[0]["momentum"])
        opt.step()
        sched.step()
    out[f"sched.{name}.lr"] = torch.tensor(lrs, dtype=torch.float64)
    out[f"sched.{name}.momentum"] = torch.tensor(momenta, dtype=torch.float64)

save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[1])
