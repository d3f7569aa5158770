"""PyTorch + Accelerate's side of examples/batchnorm.rs: a model with batch norm, trained
data-parallel with plain SGD, whose every variable (weights and running statistics) is
compared with accel's.

    .venv/bin/torchrun --nproc-per-node 2 python/reference/batchnorm_accelerate.py \
        --model conv --init W.safetensors --data D.safetensors --batch-size 8 \
        --accumulate 2 --epochs 2 --out final.safetensors

`make` writes fresh W and D: `batchnorm_accelerate.py make --model mlp --init W --data D`.

Rank 0 writes its state (torch's DDP broadcasts rank 0's buffers before each forward pass
that follows a synchronising one, so rank 0's running statistics are the run's).

torch's SyncBatchNorm cannot run here: its kernels (`batch_norm_stats`,
`batch_norm_gather_stats_with_counts`) exist for CUDA only. What it computes is defined as one
process's BatchNorm over every process's batch together, so accel's SyncBatchNorm on 2
processes with batches of 8 is compared with this script on 1 process with batches of 16.
"""
import argparse

import torch
from safetensors.torch import load_file, save_file


class Mlp(torch.nn.Module):
    """6 → 16 → batch norm 1d → tanh → 3."""

    def __init__(self, bn):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.bn1 = bn(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn1(self.fc1(x))))


class Conv(torch.nn.Module):
    """1×6×6 → conv 3×3 to 4 channels → batch norm 2d → relu → 3."""

    def __init__(self, bn):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = bn(4)
        self.fc2 = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn1(self.conv1(x))).flatten(1))


def model_of(name):
    return Mlp(torch.nn.BatchNorm1d) if name == "mlp" else Conv(torch.nn.BatchNorm2d)


def make(args):
    torch.manual_seed(args.seed)
    model = model_of(args.model)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k.split(".")[-1] != "num_batches_tracked"}
    # Start from running statistics that are not the defaults, so a load that forgot them shows.
    for k in state:
        if k.endswith("running_mean"):
            state[k] = torch.randn_like(state[k]) * 0.1
        if k.endswith("running_var"):
            state[k] = torch.rand_like(state[k]) + 0.5
    save_file(state, args.init)
    g = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.n, 6) if args.model == "mlp" else (args.n, 1, 6, 6)
    x = torch.randn(*shape, generator=g) * 2 + 0.5
    y = torch.randint(0, 3, (args.n,), generator=g)
    save_file({"x": x, "y": y}, args.data)


def train(args):
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=True)
    model = model_of(args.model)
    model.load_state_dict(load_file(args.init), strict=False)
    data = load_file(args.data)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    dl = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data["x"], data["y"]), batch_size=args.batch_size
    )
    model, opt, dl = acc.prepare(model, opt, dl)
    for _ in range(args.epochs):
        model.train()
        for x, y in dl:
            with acc.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
    if acc.is_main_process:
        state = acc.unwrap_model(model).state_dict()
        state = {k: v.contiguous() for k, v in state.items() if not k.endswith("num_batches_tracked")}
        save_file(state, args.out)
    acc.wait_for_everyone()


p = argparse.ArgumentParser()
p.add_argument("mode", nargs="?", default="train", choices=["train", "make"])
p.add_argument("--model", default="mlp", choices=["mlp", "conv"])
p.add_argument("--init")
p.add_argument("--data")
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--out")
p.add_argument("--n", type=int, default=40)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
make(args) if args.mode == "make" else train(args)
