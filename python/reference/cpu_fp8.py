"""Imported for its effect: torch._scaled_mm on CPU runs with oneDNN turned off.

On CPUs with AMX, torch's CPU _scaled_mm hands fp8 products to oneDNN's reference kernel,
hundreds of times slower than torch's own path, which gives the same values. accel's fp8
layers go around it on CPU (accel_core::shim::without_onednn); the reference scripts do the
same here, so that both sides run the same kernel and stay comparable bit for bit.
"""

import torch

_scaled_mm = torch._scaled_mm


def _scaled_mm_without_onednn(*args, **kwargs):
    if args[0].device.type != "cpu":
        return _scaled_mm(*args, **kwargs)
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return _scaled_mm(*args, **kwargs)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


torch._scaled_mm = _scaled_mm_without_onednn
