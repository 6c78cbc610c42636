"""The split-by-size per-expert linear's benchmark cases (the spec's `bench_cases`).

ScatterMoE / Megablocks-style experts (transformers' JetMoeParallelExperts) hold one weight
[E, N, K] and run one linear per expert over rows already sorted by expert: y = x_e W_e^T for the
pieces of x.split(counts). Shapes (bf16, S sorted rows = tokens x top-k):

- ``jetmoe_in``: JetMoE-8B's MoE input linear, E=8 top-2 of 8192 tokens (S=16384), K=2048 ->
  N=11264 (gate and up of the 5632-wide expert FFN);
- ``jetmoe_out``: its output linear, K=5632 -> N=2048;
- ``fine``: fine-grained experts, E=64 top-8 of 8192 tokens (S=65536), K=2048 -> N=1024.

Counts come from uniform top-k routing (`onboarding.bench.cases.routing`). Each shape gives ``.../fwd``
(forward only, under no_grad) and ``.../fwdbwd`` (forward + backward to x and the weight). Impls:

- ``ours``: the rendered `grouped_linear/sorted` kernel (counts on the device, no host sync);
- ``loop``: what the module runs, x.split(sizes) and F.linear per expert (the sizes a Python
  list: the host sync of reading counts is charged to it, as the module's `.tolist()` is);
- ``grouped_mm``: ``torch._grouped_mm`` over the sorted rows with int32 offsets.

FLOPs: forward 2 S K N; forward + backward 3x that (dx and d weight). ``check`` (fwdbwd
cases): the bf16 kernel against the fp32 reference on 4096 tokens, output, dx and d weight.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from onboarding.bench.cases import (
    N_SETS, bf16_check, fwd_bwd, fwd_only, kernel, leaf, routing, shared_inputs,
)
from onboarding.bench.harness import BenchCase, Step
from onboarding.families import NightlySpec

# (name, E, top-k, tokens, K, N)
SHAPES = (
    ("jetmoe_in", 8, 2, 8192, 2048, 11264),
    ("jetmoe_out", 8, 2, 8192, 5632, 2048),
    ("fine", 64, 8, 8192, 2048, 1024),
)
CHECK_TOKENS = 4096


def loop(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """JetMoeParallelExperts.forward: split by the sizes, one F.linear per expert, concatenate."""
    pieces = x.split(counts.tolist(), dim=0)
    return torch.cat([F.linear(p, weight[e]) for e, p in enumerate(pieces)], dim=0)


def grouped_mm(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over the sorted rows (offsets = cumsum of counts, int32)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)


@shared_inputs
def _sets(E: int, topk: int, tokens: int, K: int, N: int, device: torch.device, grad: bool) -> list[tuple]:
    """N_SETS (x, counts) sets sharing one weight; counts of a uniform top-k routing."""
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(E, N, K, device=device, generator=gen) / K ** 0.5).to(torch.bfloat16)
    if grad:
        weight = leaf(weight)
    sets = []
    for _ in range(N_SETS):
        idx, _ = routing("uniform", tokens, E, topk, device, gen)
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        x = torch.randn(tokens * topk, K, device=device, generator=gen).to(torch.bfloat16)
        sets.append((leaf(x) if grad else x, counts, weight))
    return sets


def _steps(E, topk, tokens, K, N, backward: bool, device) -> dict[str, Step]:
    _, ours = kernel("grouped_linear", "sorted")
    impls = {"ours": ours, "loop": loop, "grouped_mm": grouped_mm}
    sets = _sets(E, topk, tokens, K, N, device, backward)
    if not backward:
        return {name: fwd_only(fn, sets) for name, fn in impls.items()}
    grads = [torch.randn(tokens * topk, N, device=device, dtype=torch.bfloat16)]
    return {name: fwd_bwd(fn, sets, grads) for name, fn in impls.items()}


def _check_case(E, topk, K, N):
    """bf16 kernel against the fp32 reference at the case's widths on 4096 tokens."""
    def make(dtype):
        gen = torch.Generator(device="cuda").manual_seed(0)
        idx, _ = routing("uniform", CHECK_TOKENS, E, topk, torch.device("cuda"), gen)
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        return (torch.randn(CHECK_TOKENS * topk, K, device="cuda", generator=gen).to(dtype), counts,
                (torch.randn(E, N, K, device="cuda", generator=gen) / K ** 0.5).to(dtype))

    def check(device):
        mod, ours = kernel("grouped_linear", "sorted")
        return bf16_check(ours, mod.reference, make)(device)
    return check


def cases() -> list[BenchCase]:
    out = []
    for label, E, topk, tokens, K, N in SHAPES:
        S = tokens * topk
        for backward in (False, True):
            out.append(BenchCase(
                family="grouped_linear", name=f"{label}/E{E}S{S}K{K}N{N}/{'fwdbwd' if backward else 'fwd'}",
                shape={"E": E, "S": S, "K": K, "N": N},
                # x, y and the weight once (backward: dy, x, the weight; dx and d weight written)
                min_bytes=2 * (S * K + S * N + E * N * K) + (2 * (2 * S * N + S * K + 2 * E * N * K) * backward),
                flops=(3 if backward else 1) * 2 * S * K * N,
                setup=lambda device, a=(E, topk, tokens, K, N, backward): _steps(*a, device),
                check=_check_case(E, topk, K, N) if backward else None,
                note="uniform routing; " + ("forward + backward" if backward else "forward only")))
    return out


# The nightly regression suite's share (fine-grained experts against torch._grouped_mm).
NIGHTLY = NightlySpec(cases={"fine/E64S65536K2048N1024/fwdbwd": ("ours", "grouped_mm")}, min_threshold=0.05)
