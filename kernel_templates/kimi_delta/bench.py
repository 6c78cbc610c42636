"""KDA's benchmark cases (the spec's `bench_cases`), issue 32's shapes: the Kimi-Linear layout
(H=32, D=128) at T=8192 and T=32768. The case itself (impls, check, bytes, FLOPs) is the shared
delta-rule one, per-channel decay."""

from __future__ import annotations

from onboarding.bench.cases_linear_attention import delta_rule_case
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec

# (B, T, HK, HV, D, note)
SHAPES = (
    (1, 8192, 32, 32, 128, "Kimi-Linear layout"),
    (1, 32768, 32, 32, 128, ("Kimi-Linear layout; no check (the fallback's 34 GB decays): the "
                             "same kernels are checked at T8192")),
)


def cases() -> list[BenchCase]:
    return [delta_rule_case("kimi_delta", *shape, per_channel=True) for shape in SHAPES]


# The nightly regression suite's share (the smaller shape, our kernel alone (the fallback takes 82 ms a forward there)).
NIGHTLY = NightlySpec(cases={"B1T8192H32D128": ("ours", "ours_fwd")}, min_threshold=0.05)
