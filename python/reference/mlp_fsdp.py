"""PyTorch's side of examples/fsdp_unchanged.rs: the same MLP (LAYERS linear layers of
WIDTH, tanh between, built whole as an nn.Sequential, as users build it), each Linear and
the whole model wrapped by FSDP2's fully_shard, plain SGD, the same batches per process.
Prints one JSON line per rank with its peak resident memory above the start (the whole run,
and the steps after the first, from a reset high-water mark).

    torchrun --nproc-per-node 4 python/reference/mlp_fsdp.py [--width 1536] [--layers 24]
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def status_bytes(field):
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith(field))
    return int(line.split()[1]) * 1024


p = argparse.ArgumentParser()
p.add_argument("--width", type=int, default=1536)
p.add_argument("--layers", type=int, default=24)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--batch", type=int, default=8)
args = p.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
before = status_bytes("VmRSS:")
torch.manual_seed(0)
layers = []
for _ in range(args.layers):
    layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
model = torch.nn.Sequential(*layers)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x = torch.randn(args.steps * args.batch, args.width)
y = torch.randn(args.steps * args.batch, args.width)
# The batches dealt as the attribute deals them: batch k to rank k mod world.
first_peak = None
for k in range(rank, args.steps, world):
    xb, yb = x[k * args.batch:(k + 1) * args.batch], y[k * args.batch:(k + 1) * args.batch]
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if first_peak is None:
        first_peak = status_bytes("VmHWM:") - before
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
train_peak = status_bytes("VmHWM:") - before
print(json.dumps({
    "rank": rank,
    "parameters": sum(p.numel() for p in model.parameters()),
    "peak_bytes": max(first_peak or 0, train_peak),
    "train_peak_bytes": train_peak,
}))
dist.destroy_process_group()
