"""The memory benchmark's PyTorch side: the same 52.5M-parameter model as
examples/memory_bench.rs (8 Linear 2560x2560 + ReLU), AdamW (fused), fp32, batch 8, one
thread, 4 steps; peak RSS above the process's baseline during steps 2-4. The strategy is
argument 1: ddp (DistributedDataParallel), zero1 (DDP + ZeroRedundancyOptimizer), zero2
(FSDP2 fully_shard with reshard_after_forward=False, i.e. SHARD_GRAD_OP), zero3 (FSDP2
fully_shard, FULL_SHARD). Prints one JSON line per rank, with memory_bench's keys.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/torchrun --nproc-per-node 2 python/reference/torch_memory.py zero3

With a second argument `cuda` (scripts/gpu-check.sh), each process trains on its GPU over
NCCL and also reports the GPU's peak of allocated tensor bytes during those steps, beside
examples/memory_bench.rs --device cuda.
"""
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

WIDTH, LAYERS, STEPS = 2560, 8, 4


def status_bytes(field):
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith(field))
    return int(line.split()[1]) * 1024


strategy = sys.argv[1]
cuda = len(sys.argv) > 2 and sys.argv[2] == "cuda"
if cuda:
    local = int(__import__("os").environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
x, y = torch.randn(8, WIDTH, device=device), torch.randn(8, WIDTH, device=device)
before = status_bytes("VmRSS:")
model = torch.nn.Sequential(
    *[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()) for _ in range(LAYERS)]
)
model = model.to(device)
params = sum(p.numel() for p in model.parameters())
if strategy in ("ddp", "zero1"):
    model = DistributedDataParallel(model)
    if strategy == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, fused=True)
elif strategy in ("zero2", "zero3"):
    reshard = strategy == "zero3"
    for layer in model:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
else:
    sys.exit(f"unknown strategy {strategy}; use ddp, zero1, zero2 or zero3")


def step():
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def synchronize():
    if cuda:
        torch.cuda.synchronize()


step()
synchronize()
dist.barrier()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
if cuda:
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
for _ in range(STEPS - 1):
    step()
synchronize()
dist.barrier()
step_s = (time.perf_counter() - t0) / (STEPS - 1)
print(json.dumps({
    "rank": dist.get_rank(),
    "processes": dist.get_world_size(),
    "strategy": strategy,
    "params": params,
    "peak_bytes": status_bytes("VmHWM:") - before,
    "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    "step_s": step_s,
}))
dist.destroy_process_group()
