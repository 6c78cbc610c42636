"""GDN's benchmark cases (the spec's `bench_cases`), issue 5's shapes: B=2 T=4096 H=16 D=128,
and the Qwen3-Next layout (16 key / 32 value heads, D=128) at T=8192 and T=32768. The case
itself (impls, check, bytes, FLOPs) is the shared delta-rule one, scalar decay, plus rows of the
Tm dots' alternative operands (`SWEEP`: ``ours@tm_dot=tf32_fwd`` forward, ``ours@tm_dot=tf32``
forward + backward), on request, on the same inputs, so that one call times them against the
default and fla."""

from __future__ import annotations

import dataclasses

import torch

from onboarding.bench.cases import N_SETS, config_sweep, fwd_sweep, kernel
from onboarding.bench.cases_linear_attention import CHUNK, delta_rule_case, make_inputs
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec

# (B, T, HK, HV, D, note)
SHAPES = (
    (2, 4096, 16, 16, 128, ""),
    (1, 8192, 16, 32, 128, "Qwen3-Next layout"),
    (1, 32768, 16, 32, 128, "Qwen3-Next layout"),
)


# fp32 operands (tf32) for the dots with Tm = (I + A)^-1 under bf16 inputs: the 4B Qwen3-Next
# proxy's forward has a layer where the default 16-bit Tm dots land at 1.1e-2 relative RMS of the
# fp32 path (fla 4.2e-3, tf32 Tm dots 3.3e-3; docs/LOG.md, twentieth session); these rows time it.
SWEEP = ({"tm_dot": "tf32"},)
SWEEP_ROWS = tuple(f"ours@{k}={v}{end}" for cfg in SWEEP for k, v in cfg.items() for end in ("_fwd", ""))


def _with_sweep(case: BenchCase, B: int, T: int, HK: int, HV: int, D: int) -> BenchCase:
    def setup(device):
        steps = case.setup(device)
        mod, entry = kernel("gated_delta", "chunk", {"chunk_size": CHUNK, "qk_l2norm": True})
        sets = [make_inputs(False, B, T, HK, HV, D, device, seed=s) for s in range(N_SETS)]
        fn = lambda q, k, v, g, beta: entry(q, k, v, g, beta, None, None, True, True)  # noqa: E731
        gen = torch.Generator(device=device).manual_seed(N_SETS)
        grads = [torch.randn(B, T, HV, D, device=device, generator=gen).to(torch.bfloat16)]
        steps.update({k + "_fwd": v for k, v in fwd_sweep(mod, fn, sets, D, list(SWEEP)).items()})
        steps.update(config_sweep(mod, lambda *a: fn(*a)[0], sets, grads, D, list(SWEEP)))
        return steps

    return dataclasses.replace(case, setup=setup, on_request=(*case.on_request, *SWEEP_ROWS))


def cases() -> list[BenchCase]:
    return [_with_sweep(delta_rule_case("gated_delta", *shape, per_channel=False), *shape[:5]) for shape in SHAPES]


# The nightly regression suite's share (issue 5's shape; fla's anchors are left out (its autotune takes minutes)).
NIGHTLY = NightlySpec(cases={"B2T4096H16D128": ("ours", "ours_fwd", "eager_fwd")}, min_threshold=0.05)
