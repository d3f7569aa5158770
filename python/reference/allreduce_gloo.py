"""All-reduce time and bandwidth of torch.distributed's gloo backend, for `accel bench
allreduce --compare-gloo`, which runs it with torchrun right after its own measurement.

    .venv/bin/torchrun --nproc-per-node 2 python/reference/allreduce_gloo.py 1048576 16777216

Arguments are message sizes in bytes (f32 elements = bytes / 4). One thread per process, as
shared/reference/allreduce_gloo.py measures it. Rank 0 prints one JSON line per size.
"""
import json
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
for size in [int(s) for s in sys.argv[1:]]:
    t = torch.ones(size // 4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    iterations = max(5, min(200, int(4e8 // size)))
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(t)
    seconds = (time.perf_counter() - start) / iterations
    worst = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"bytes": size, "seconds": worst.item()}), flush=True)
dist.destroy_process_group()
