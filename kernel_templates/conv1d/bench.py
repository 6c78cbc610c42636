"""Causal depthwise conv1d's benchmark cases (the spec's `bench_cases`): `causal` on [B, T, C]
bf16 with a width-4 filter against transformers' torch fallback (F.conv1d) and its
`torch.compile`."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from onboarding.bench.cases import N_SETS, anchors, bf16_check, config_sweep, kernel, leaf
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec


# The backward's tile sweep at the training proxy's shape (keys from the template's TUNING_SPACE;
# the rest from the bucket's config): `--case B8T2048C4096W4$ --impl ours,eager` and its `ours@` rows.
BWD_SWEEP = ({"BWD_PER_SM": 8}, {"BWD_PER_SM": 16}, {"BWD_BLOCK_T": 32}, {"BWD_BLOCK_T": 32, "BWD_PER_SM": 16},
             {"BWD_BLOCK_T": 64}, {"BWD_BLOCK_T": 64, "BWD_PER_SM": 16}, {"BWD_BLOCK_T": 8, "BWD_PER_SM": 16})


def cases() -> list[BenchCase]:
    def conv(x, w, bias):  # what transformers' torch fallback does, on [B, T, C]
        k = w.shape[-1]
        y = F.conv1d(x.transpose(1, 2), w[:, None, :], bias, padding=k - 1,
                     groups=w.shape[0])[..., : x.shape[1]]
        return y.transpose(1, 2)

    def conv_silu(x, w, bias):
        return F.silu(conv(x, w, bias))

    out = []
    # the 4B Qwen3-Next-style training proxy's conv (8 x 2048 tokens, 4,096 channels; its SiLU
    # runs outside the patched module), whose backward took 1.13 ms a call in the H200 step
    # profile (docs/LOG.md, device call S), and the same with SiLU fused (the backward's da pass)
    for b, t, c, k, act in ((2, 4096, 8192, 4, None), (1, 8192, 12288, 4, None), (8, 2048, 4096, 4, None),
                            (8, 2048, 4096, 4, "silu")):
        params = {"kernel_size": k, **({"activation": act} if act else {})}
        eager = conv_silu if act else conv

        def setup(device, b=b, t=t, c=c, act=act, params=params, eager=eager):
            mod, ours = kernel("conv1d", "causal", params)
            sets = [(leaf(torch.randn(b, t, c, device=device, dtype=torch.bfloat16)),
                     leaf(0.5 * torch.randn(c, k, device=device, dtype=torch.bfloat16)),
                     leaf(torch.randn(c, device=device, dtype=torch.bfloat16)))
                    for _ in range(N_SETS)]
            grads = [torch.randn(b, t, c, device=device, dtype=torch.bfloat16)]
            steps = anchors(eager, ours, sets, grads, None)
            if (b, t, c, act) == (8, 2048, 4096, None):
                steps.update(config_sweep(mod, ours, sets, grads, c, list(BWD_SWEEP)))
            return steps

        def make(dtype, b=b, t=t, c=c, k=k):
            g = torch.Generator(device="cuda").manual_seed(0)
            return (torch.randn(b, t, c, device="cuda", generator=g, dtype=dtype),
                    0.5 * torch.randn(c, k, device="cuda", generator=g, dtype=dtype),
                    torch.randn(c, device="cuda", generator=g, dtype=dtype))

        out.append(BenchCase(
            family="conv1d", name=f"B{b}T{t}C{c}W{k}" + ("silu" if act else ""),
            shape={"B": b, "T": t, "C": c, "W": k},
            min_bytes=5 * b * t * c * 2, flops=2 * 2 * b * t * c * k * 2, setup=setup,
            check=lambda device, make=make, params=params, eager=eager: bf16_check(
                kernel("conv1d", "causal", params)[1], eager, make)(device)))
    return out


# The nightly regression suite's share (one shape against transformers' fallback).
NIGHTLY = NightlySpec(cases={"B2T4096C8192W4": ("ours", "eager")}, min_threshold=0.08)
