"""SwiGLU's benchmark cases (the spec's `bench_cases`): `split` at 8192x14336 and 16384x5632
bf16 against silu(g) * u in eager, its `torch.compile` and Liger's op."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from onboarding.bench.cases import N_SETS, anchors, bf16_check, kernel, leaf
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec


def cases() -> list[BenchCase]:
    def eager(g, u):
        return F.silu(g) * u

    out = []
    for n, f in ((8192, 14336), (16384, 5632)):
        def setup(device, n=n, f=f):
            _, ours = kernel("swiglu", "split")
            sets = [tuple(leaf(torch.randn(n, f, device=device, dtype=torch.bfloat16))
                          for _ in range(2)) for _ in range(N_SETS)]
            grads = [torch.randn(n, f, device=device, dtype=torch.bfloat16)]
            liger = None
            try:
                from liger_kernel.ops.swiglu import LigerSiLUMulFunction

                liger = LigerSiLUMulFunction.apply
            except ImportError:
                pass
            return anchors(eager, ours, sets, grads, liger)

        def make(dtype, n=n, f=f):
            g = torch.Generator(device="cuda").manual_seed(0)
            return tuple(torch.randn(n, f, device="cuda", generator=g, dtype=dtype)
                         for _ in range(2))

        out.append(BenchCase(
            family="swiglu", name=f"{n}x{f}", shape={"N": n, "F": f},
            min_bytes=(3 + 3) * n * f * 2, flops=0, setup=setup,
            check=lambda device, make=make: bf16_check(kernel("swiglu", "split")[1], eager,
                                                       make)(device)))
    return out


# The nightly regression suite's share (one shape against eager).
NIGHTLY = NightlySpec(cases={"16384x5632": ("ours", "eager")}, min_threshold=0.08)
