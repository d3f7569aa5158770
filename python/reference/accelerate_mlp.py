"""MLP 784-1024-1024-10, batch 64, AdamW, fp32, one thread per process, with Accelerate: the
reference side of `cargo xtask bench` (shared/reference/accelerate_mlp.py, printing one
machine-readable line).

    .venv/bin/python python/reference/accelerate_mlp.py
    .venv/bin/torchrun --nproc-per-node 2 python/reference/accelerate_mlp.py
"""
import resource
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

acc = Accelerator(mixed_precision="no", gradient_accumulation_steps=1, cpu=True)
set_seed(0)
torch.set_num_threads(1)
X = torch.randn(64 * 400, 784)
Y = torch.randint(0, 10, (64 * 400,))
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=64)
model = torch.nn.Sequential(
    torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
)
# `fused` as argument 1: torch's fused AdamW kernel, the one accel's AdamW uses by default.
fused = len(sys.argv) > 1 and sys.argv[1] == "fused"
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
model, opt, dl = acc.prepare(model, opt, dl)
t0 = time.perf_counter()
n = 0
for x, y in dl:
    with acc.accumulate(model):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    n += 1
dt = time.perf_counter() - t0
if acc.is_main_process:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    print(f"fused={fused} procs={acc.num_processes} steps_per_proc={n} samples_per_s={n * 64 * acc.num_processes / dt:.1f} peak_rss_mib={peak:.0f} loss={loss.item():.4f}")
