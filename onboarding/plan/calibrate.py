"""``onboard plan --calibrate``: this GPU's kernel rates, measured in a few seconds.

GEMM: a bf16 [8192, 8192] x [8192, 8192] product; attention: fused SDPA forward + backward at
``seq`` (capped at 8192) with 16 heads of 128; HBM: a 2 GiB copy (read + write); host time per
op: 2,000 small adds back to back, synchronised once. Each is the median of 5 timed runs after a
warm-up, with CUDA events.
"""

from __future__ import annotations

import statistics

from onboarding.errors import InputError
from onboarding.plan.config import Rates


def _time(fn, reps: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def calibrate(*, seq: int = 4096) -> Rates:
    import torch
    from torch.nn import functional as F

    if not torch.cuda.is_available():
        raise InputError("--calibrate: needs a GPU (none is visible here); give measured rates "
                         "in --cluster FILE's [rates] instead")
    from onboarding.train.flops import peak_flops

    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    gemm = 2 * n ** 3 / _time(lambda: a @ b) / 1e12
    t, h, d = min(seq, 8192), 16, 128
    q, k, v = (torch.randn(1, h, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def attn():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    # causal: half the T x T products; forward 2 products, backward 5 (flash's recompute)
    attn_flops = 7 * 2 * h * d * t * t / 2
    attn_rate = attn_flops / _time(attn) / 1e12
    x = torch.empty(2 * 2 ** 30 // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    hbm = 2 * x.numel() * 2 / _time(lambda: y.copy_(x)) / 1e12
    small = torch.zeros(16, device=dev)

    def launches():
        for _ in range(2000):
            small.add_(1.0)

    launch = _time(launches, reps=3) / 2000 * 1e6
    del a, b, x, y
    peak = (peak_flops(dev) or 989e12) / 1e12
    return Rates(gemm_tflops=round(gemm, 1), attn_tflops=round(attn_rate, 1),
                 hbm_tbps=round(hbm, 2), launch_us=round(launch, 2), peak_tflops=peak,
                 source=f"measured on {torch.cuda.get_device_name(dev)} (--calibrate)")
