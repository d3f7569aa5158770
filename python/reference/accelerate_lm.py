"""The speed benchmark's transformer with PyTorch + Accelerate: the same GPT-style model as
examples/gpt.rs (4 pre-norm blocks of width 128, 4 heads, causal SDPA, tanh-GELU MLP of 4x,
context 64, vocabulary 72), batch 16 of random tokens, AdamW, fp32, one thread, 20 warm-up
steps then 100 timed ones; prints one machine-readable line. Argument `fused`: torch's
fused AdamW kernel (the one accel's AdamW uses by default).

    .venv/bin/python python/reference/accelerate_lm.py [fused]
"""
import resource
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

VOCAB, CONTEXT, WIDTH, BLOCKS, HEADS, BATCH, WARMUP, STEPS = 72, 64, 128, 4, 4, 16, 20, 100


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.ln2 = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, 2)
        heads = lambda y: y.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.positions = torch.nn.Embedding(CONTEXT, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


acc = Accelerator(mixed_precision="no", cpu=True)
set_seed(0)
torch.set_num_threads(1)
fused = len(sys.argv) > 1 and sys.argv[1] == "fused"
model = Gpt()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
model, opt = acc.prepare(model, opt)
ids = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
x, y = ids[:, :-1], ids[:, 1:]


def step():
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss


for _ in range(WARMUP):
    step()
t0 = time.perf_counter()
for _ in range(STEPS):
    loss = step()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"fused={fused} steps={STEPS} samples_per_s={STEPS * BATCH / dt:.1f} step_ms={1e3 * dt / STEPS:.2f} peak_rss_mib={peak:.0f} loss={loss.item():.4f}")
