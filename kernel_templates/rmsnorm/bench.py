"""RMSNorm's benchmark cases (the spec's `bench_cases`): `plain` at 16384x4096, 32768x2048 and
8192x7168 bf16 against transformers' eager RMSNorm, its `torch.compile` and Liger's; the goal
shape (16384x4096) also times the tile configs of `SWEEP`."""

from __future__ import annotations

import torch

from onboarding.bench.cases import N_SETS, anchors, bf16_check, config_sweep, kernel, leaf
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec

# The goal shape's sweep: backward rows per step x warps x programs per SM, and forward rows per
# program, around the d_le_4k defaults.
SWEEP = [
    {"BWD_BLOCK_N": bn, "bwd_warps": w, "programs_per_sm": p}
    for bn in (1, 2, 4) for w in (4, 8) for p in (1, 2, 4, 8)
] + [{"BLOCK_N": bn, "num_warps": w} for bn in (1, 4) for w in (4, 8, 16)]


def cases() -> list[BenchCase]:
    def eager(x, w, eps=1e-6):  # transformers' RMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    out = []
    for n, d in ((16384, 4096), (32768, 2048), (8192, 7168)):
        def setup(device, n=n, d=d):
            mod, ours = kernel("rmsnorm", "plain")
            sets = [(leaf(torch.randn(n, d, device=device, dtype=torch.bfloat16)),
                     leaf(1 + 0.1 * torch.randn(d, device=device, dtype=torch.bfloat16)))
                    for _ in range(N_SETS)]
            grads = [torch.randn(n, d, device=device, dtype=torch.bfloat16)]
            liger = None
            try:
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                lmod = LigerRMSNorm(d, eps=1e-6).to(device, torch.bfloat16)
                liger = lambda x, w: lmod(x)  # noqa: E731  (its own weight, same shape)
            except ImportError:
                pass
            steps = anchors(eager, lambda x, w: ours(x, w, 1e-6), sets, grads, liger)
            if (n, d) == (16384, 4096):  # the goal shape: look at the tile configs too
                steps.update(config_sweep(mod, lambda x, w: ours(x, w, 1e-6), sets, grads, d, SWEEP))
            return steps

        def make(dtype, n=n, d=d):
            g = torch.Generator(device="cuda").manual_seed(0)
            return (torch.randn(n, d, device="cuda", generator=g, dtype=dtype),
                    1 + 0.1 * torch.randn(d, device="cuda", generator=g, dtype=dtype))

        out.append(BenchCase(
            family="rmsnorm", name=f"{n}x{d}", shape={"N": n, "D": d},
            min_bytes=5 * n * d * 2, flops=0, setup=setup,
            check=lambda device, make=make: bf16_check(
                lambda x, w: kernel("rmsnorm", "plain")[1](x, w, 1e-6), eager, make)(device)))
    return out


# The nightly regression suite's share (the goal shape, against eager (torch.compile and Liger stay in the full cases: compiling costs the nightly more than it tells)).
NIGHTLY = NightlySpec(cases={"16384x4096": ("ours", "eager")}, min_threshold=0.08)
