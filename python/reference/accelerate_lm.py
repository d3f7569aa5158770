"""The speed benchmark's transformer with PyTorch + Accelerate: the same GPT-style model as
examples/gpt.rs (pre-norm blocks, causal SDPA, tanh-GELU MLP of 4x, vocabulary 72; by default
4 blocks of width 128, 4 heads, context 64), batch 16 of random tokens, AdamW, one thread on
CPU, 20 warm-up steps then 100 timed ones; prints one machine-readable line. `--fused`:
torch's fused AdamW kernel (the one accel's AdamW uses by default); `--precision bf16|fp8`:
Accelerate's mixed precision (fp8 with torchao's default recipe, `AORecipeKwargs`). Where
Accelerate is not installed (a bare GPU machine with torch only), plain PyTorch does the same
(torch.autocast; torchao's convert_to_float8_training for fp8) and the line says so.

    .venv/bin/python python/reference/accelerate_lm.py [--fused] [--precision fp8] \
        [--width 2048 --heads 16 --device cuda]
"""
import argparse
import resource
import time

import torch

import cpu_fp8  # noqa: F401 (torch._scaled_mm on CPU without oneDNN; see the module)
import torch.nn.functional as F

try:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
except ImportError:
    Accelerator = None

VOCAB, WARMUP = 72, 20

p = argparse.ArgumentParser()
p.add_argument("--fused", action="store_true")
p.add_argument("--precision", default="no", choices=["no", "bf16", "fp8"])
p.add_argument("--width", type=int, default=128)
p.add_argument("--blocks", type=int, default=4)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--context", type=int, default=64)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
args = p.parse_args()
WIDTH, HEADS, CONTEXT = args.width, args.heads, args.context


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
        self.blocks = torch.nn.ModuleList(Block() for _ in range(args.blocks))
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class PlainTorch:
    """What the script needs of Accelerate, in plain PyTorch (one process)."""

    def __init__(self, precision, cpu):
        self.device = torch.device("cpu" if cpu else "cuda")
        self.precision = precision

    def prepare(self, thing):
        if not isinstance(thing, torch.nn.Module):
            return thing
        thing = thing.to(self.device)
        if self.precision == "fp8":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(thing)
        if self.precision in ("bf16", "fp8"):
            forward = thing.forward

            def autocast_forward(*a, **k):
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    return forward(*a, **k)

            thing.forward = autocast_forward
        return thing

    def backward(self, loss):
        loss.backward()


cpu = args.device == "cpu"
if Accelerator is not None:
    handlers = []
    if args.precision == "fp8":
        from accelerate.utils import AORecipeKwargs

        handlers.append(AORecipeKwargs())
    acc = Accelerator(mixed_precision=args.precision, cpu=cpu, kwargs_handlers=handlers)
    set_seed(0)
    reference = "accelerate"
else:
    acc = PlainTorch(args.precision, cpu)
    torch.manual_seed(0)
    reference = "torch"
if cpu:
    torch.set_num_threads(1)
model = Gpt()
# The model first, then an optimizer of its prepared parameters: with fp8 (Accelerate 1.15,
# torchao 0.18) preparing both at once leaves this model's fp8 layers with new weight
# objects that an optimizer made beforehand does not hold, so they would never train.
model = acc.prepare(model)
opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=args.fused))
ids = torch.randint(0, VOCAB, (args.batch, CONTEXT + 1), device=acc.device)
x, y = ids[:, :-1], ids[:, 1:]


def step():
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss


for _ in range(WARMUP):
    step()
step().item()  # the GPU's queue drained before timing
t0 = time.perf_counter()
for _ in range(args.steps):
    loss = step()
last = loss.item()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(
    f"reference={reference} fused={args.fused} precision={args.precision} steps={args.steps} "
    f"samples_per_s={args.steps * args.batch / dt:.1f} step_ms={1e3 * dt / args.steps:.2f} "
    f"peak_rss_mib={peak:.0f} loss={last:.4f}"
)
