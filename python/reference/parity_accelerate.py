"""PyTorch + Accelerate's side of examples/parity.rs: the same MLP, data, optimizer and
logging, so the two can be compared number by number.

    .venv/bin/torchrun --nproc-per-node 2 python/reference/parity_accelerate.py \
        --init W.safetensors --data D.safetensors --hidden 64,64 --optimizer adamw \
        --lr 1e-3 --weight-decay 0.01 --batch-size 8 --accumulate 2 --epochs 1 \
        --precision no --clip-grad-norm 1.0 --out final.safetensors --losses losses.jsonl

`--local-sgd K` wraps the loop in Accelerate's LocalSGD (parameters averaged every K batches).
`--precision fp8` is Accelerate's fp8 with torchao (`AORecipeKwargs`): the default
(tensor-wise) recipe, or `--fp8-recipe rowwise` (emulated, as the CPU kernel takes tensor-wise
scales only).

It can also write a fresh W and D: `parity_accelerate.py make W D --n 45 --d 10 --hidden
16,16 --classes 3 --seed 0`.

Several runs may share one torchrun, separated by a lone `;` argument (`\;` in a shell),
each with its own `--out` and `--losses`; each builds its own Accelerator.
"""
import argparse
import json
import os
import sys

import torch

import commands
import cpu_fp8  # noqa: F401 (torch._scaled_mm on CPU without oneDNN; see the module)
from safetensors.torch import load_file, save_file


def make(args):
    g = torch.Generator().manual_seed(args.seed)
    widths = [args.d] + [int(h) for h in args.hidden.split(",") if h] + [args.classes]
    weights = {}
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        weights[f"layers.{i}.weight"] = torch.randn(b, a, generator=g) / a**0.5
        weights[f"layers.{i}.bias"] = torch.randn(b, generator=g) * 0.1
    save_file(weights, args.init)
    x = torch.randn(args.n, args.d, generator=g)
    y = torch.randint(0, args.classes, (args.n,), generator=g)
    save_file({"x": x, "y": y}, args.data)


class MLP(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for o, i in shapes)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def train(args):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    handlers = []
    if args.precision == "fp8":
        import dataclasses

        from accelerate.utils import AORecipeKwargs
        from torchao.float8 import Float8LinearConfig

        if args.fp8_recipe == "rowwise":
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
        else:
            config = Float8LinearConfig()
        handlers.append(AORecipeKwargs(config=config))
    acc = Accelerator(
        gradient_accumulation_steps=args.accumulate,
        cpu=True,
        mixed_precision=args.precision,
        dataloader_config=DataLoaderConfiguration(split_batches=args.split_batches),
        **({"kwargs_handlers": handlers} if handlers else {}),
    )
    init = load_file(args.init)
    layers = sum(1 for k in init if k.endswith(".weight"))
    model = MLP([tuple(init[f"layers.{i}.weight"].shape) for i in range(layers)])
    model.load_state_dict(init)
    data = load_file(args.data)
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    dl = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data["x"], data["y"]), batch_size=args.batch_size, shuffle=False
    )
    model, opt, dl = acc.prepare(model, opt, dl)
    if args.precision == "fp8":
        from torchao.float8.float8_linear import Float8Linear

        fp8 = [n for n, m in acc.unwrap_model(model).named_modules() if isinstance(m, Float8Linear)]
        assert fp8, "Accelerate converted no layer to fp8"
        if acc.is_main_process:
            print(f"fp8 layers: {fp8}", file=sys.stderr)
    log = open(args.losses, "w") if acc.is_main_process else None
    step = 0
    # Accelerate's by_feature/local_sgd.py: LocalSGD around the loop, step() once per batch.
    from accelerate.local_sgd import LocalSGD

    local_sgd = args.local_sgd or 1
    with LocalSGD(acc, model, local_sgd_steps=local_sgd, enabled=args.local_sgd is not None) as sgd:
        for _ in range(args.epochs):
            for x, y in dl:
                with acc.accumulate(model):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    if log:
                        log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                    acc.backward(loss)
                    if acc.sync_gradients and args.clip_grad_norm > 0:
                        acc.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                    opt.step()
                    opt.zero_grad()
                    sgd.step()
                step += 1
    if acc.is_main_process:
        state = acc.unwrap_model(model).state_dict()
        # Float8Linear keeps nn.Linear's parameter names; drop any non-tensor extra state.
        state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        save_file({k: v.contiguous() for k, v in state.items()}, args.out)
    acc.wait_for_everyone()


p = argparse.ArgumentParser()
p.add_argument("mode", nargs="?", default="train", choices=["train", "make"])
p.add_argument("--init")
p.add_argument("--data")
p.add_argument("--hidden", default="64,64")
p.add_argument("--optimizer", default="adamw")
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--weight-decay", type=float, default=0.01)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--strategy", default="ddp")
p.add_argument("--precision", default="no")
p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
p.add_argument("--clip-grad-norm", type=float, default=0.0)
p.add_argument("--split-batches", action="store_true")
p.add_argument("--local-sgd", type=int, default=None)
p.add_argument("--out")
p.add_argument("--losses")
p.add_argument("--n", type=int, default=45)
p.add_argument("--d", type=int, default=10)
p.add_argument("--classes", type=int, default=3)
p.add_argument("--seed", type=int, default=0)
# Every run parsed before the first starts: a mistake in the last one costs nothing.
for i, args in enumerate([p.parse_args(argv) for argv in commands.split(sys.argv[1:])]):
    if i > 0:
        # A fresh Accelerator per run, as in a process of its own; the process group stays.
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()
        GradientState._reset_state()
    make(args) if args.mode == "make" else train(args)
# Leave without the interpreter's teardown: torch 2.11's gloo threads can abort a rank at exit
# ("terminate called without an active exception") after everything above was written.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
