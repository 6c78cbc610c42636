"""Cross-entropy's benchmark cases (the spec's `bench_cases`): the training loss forward +
backward at B*T x V = 16384 x 32000 and 8192 x 151936, bf16 logits, against `F.cross_entropy`
on fp32 logits (as transformers computes the loss; eager and `torch.compile`), on the bf16
logits themselves (`eager_bf16`), and the training worker's `_ChunkedCE` (`chunked`: what the
kernel replaces). Liger's fused linear cross-entropy also runs the LM head: not the same op."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from onboarding.bench.cases import N_SETS, bf16_check, fwd_bwd, kernel, leaf
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec


def _eager(x, t):
    return F.cross_entropy(x.float(), t)


def _eager_bf16(x, t):
    return F.cross_entropy(x, t).float()


def cases() -> list[BenchCase]:
    out = []
    for n, v in ((16384, 32000), (8192, 151936)):
        def make_sets(device, n=n, v=v):
            gen = torch.Generator(device=device).manual_seed(0)
            sets = []
            for _ in range(N_SETS):
                t = torch.randint(0, v, (n,), device=device, generator=gen)
                t[::97] = -100  # a few ignored rows, as padding would give
                sets.append((leaf(torch.randn(n, v, device=device, generator=gen,
                                              dtype=torch.bfloat16)), t))
            return sets

        def setup(device, n=n, v=v, make_sets=make_sets):
            from onboarding.train.worker import chunked_cross_entropy

            _, ours = kernel("cross_entropy", "fused")
            sets = make_sets(device)
            grads = [torch.ones((), device=device)]
            return {"ours": fwd_bwd(ours, sets, grads), "eager": fwd_bwd(_eager, sets, grads),
                    "compile": fwd_bwd(torch.compile(_eager), sets, grads),
                    "eager_bf16": fwd_bwd(_eager_bf16, sets, grads),
                    "chunked": fwd_bwd(chunked_cross_entropy, sets, grads)}

        def make(dtype, n=n, v=v):
            g = torch.Generator(device="cuda").manual_seed(0)
            t = torch.randint(0, v, (n,), device="cuda", generator=g)
            t[::97] = -100
            return torch.randn(n, v, device="cuda", generator=g, dtype=dtype), t

        out.append(BenchCase(
            family="cross_entropy", name=f"{n}x{v}", shape={"N": n, "V": v},
            # the logits read once and their gradient written once (bf16), the targets read
            min_bytes=2 * 2 * n * v + 8 * n, flops=0, setup=setup,
            note="ours reads the logits twice (the second pass often from L2)",
            check=lambda device, make=make: bf16_check(kernel("cross_entropy", "fused")[1], _eager,
                                                       make)(device)))
    return out


# The nightly regression suite's share (one shape against eager).
NIGHTLY = NightlySpec(cases={"16384x32000": ("ours", "eager")}, min_threshold=0.08)
