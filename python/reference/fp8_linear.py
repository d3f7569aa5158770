"""torchao's Float8Linear on fixed tensors, for a bit-for-bit comparison with accel's fp8
linear layer (examples/tests/parity.rs). Writes OUT.safetensors holding the inputs
(x [2,16,48], w [32,48], b [32], gy [2,16,32]) and, for each case, the output `{case}.y` and
the gradients `{case}.gx`, `{case}.gw`, `{case}.gb`:

- tensorwise:          torchao's default recipe, fp32, no autocast;
- tensorwise_autocast: the same under CPU bf16 autocast (as Accelerate's fp8 runs it);
- rowwise:             the row-wise recipe, emulated (the CPU kernel takes tensor-wise scales).

    .venv/bin/python python/reference/fp8_linear.py OUT.safetensors
"""
import dataclasses
import sys

import torch

import cpu_fp8  # noqa: F401 (torch._scaled_mm on CPU without oneDNN; see the module)
from safetensors.torch import save_file
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

g = torch.Generator().manual_seed(0)
x = torch.randn(2, 16, 48, generator=g)
x[0, 0, 0] = 37.5  # an outlier, so that most values use few fp8 bits
w = torch.randn(32, 48, generator=g) / 7
b = torch.randn(32, generator=g)
gy = torch.randn(2, 16, 32, generator=g)
out = {"x": x, "w": w, "b": b, "gy": gy}

cases = {
    "tensorwise": (Float8LinearConfig(), False),
    "tensorwise_autocast": (Float8LinearConfig(), True),
    "rowwise": (dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True), False),
}
for name, (config, autocast) in cases.items():
    linear = torch.nn.Linear(48, 32)
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    layer = Float8Linear.from_float(linear, config=config)
    xi = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(xi)
    y.backward(gy.to(y.dtype))
    out[f"{name}.y"] = y.detach().float()
    out[f"{name}.gx"] = xi.grad
    out[f"{name}.gw"] = layer.weight.grad
    out[f"{name}.gb"] = layer.bias.grad
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[1])
