"""One benchmark harness for every kernel family (docs/design.md)."""

from onboarding.bench.harness import BenchCase, Timing, measure_ceilings, run_cases, time_fn

__all__ = ["BenchCase", "Timing", "measure_ceilings", "run_cases", "time_fn"]
