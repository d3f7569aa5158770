"""All-reduce time and bandwidth of torch.distributed (gloo, or NCCL on GPUs), for `accel
bench allreduce --compare`, which runs it with torchrun right after its own measurement on
the same sizes.

    .venv/bin/torchrun --nproc-per-node 2 python/reference/allreduce_torch.py 1048576 16777216
    torchrun --nproc-per-node 8 python/reference/allreduce_torch.py --backend nccl 1048576

Arguments are message sizes in bytes (f32 elements = bytes / 4). On CPU one thread per
process, as shared/reference/allreduce_gloo.py measures it. Rank 0 prints one JSON line per
size.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

args = sys.argv[1:]
backend = "gloo"
if args[:1] == ["--backend"]:
    backend, args = args[1], args[2:]
if backend == "nccl":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()


def synchronize():
    if backend == "nccl":
        torch.cuda.synchronize()


for size in [int(s) for s in args]:
    t = torch.ones(size // 4, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    synchronize()
    dist.barrier()
    iterations = max(5, min(200, int(4e8 // size)))
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(t)
    synchronize()
    seconds = (time.perf_counter() - start) / iterations
    worst = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"bytes": size, "seconds": worst.item()}), flush=True)
dist.destroy_process_group()
