"""GDN's benchmark cases (the spec's `bench_cases`), issue 5's shapes: B=2 T=4096 H=16 D=128,
and the Qwen3-Next layout (16 key / 32 value heads, D=128) at T=8192 and T=32768. The case
itself (impls, check, bytes, FLOPs) is the shared delta-rule one, scalar decay."""

from __future__ import annotations

from onboarding.bench.cases_linear_attention import delta_rule_case
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec

# (B, T, HK, HV, D, note)
SHAPES = (
    (2, 4096, 16, 16, 128, ""),
    (1, 8192, 16, 32, 128, "Qwen3-Next layout"),
    (1, 32768, 16, 32, 128, "Qwen3-Next layout"),
)


def cases() -> list[BenchCase]:
    return [delta_rule_case("gated_delta", *shape, per_channel=False) for shape in SHAPES]


# The nightly regression suite's share (issue 5's shape; fla's anchors are left out (its autotune takes minutes)).
NIGHTLY = NightlySpec(cases={"B2T4096H16D128": ("ours", "ours_fwd", "eager_fwd")}, min_threshold=0.05)
