"""Tuning hooks of the LayerNorm family: RMSNorm's problem dims (rows N, width D), and timing
inputs at those dims (`FamilySpec.problem_dims`, `timing_inputs`)."""

from __future__ import annotations

from typing import Any

import torch

from onboarding.tune.worker import randn
from onboarding.families import family_module

problem_dims = family_module("rmsnorm").problem_dims


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """x [N, D], a weight near 1, a bias near 0 with `has_bias`, eps."""
    n, d = int(dims["N"]), int(dims["D"])
    args = [randn(gen, n, d, dtype=dtype), randn(gen, d, dtype=dtype, scale=0.1).add_(1)]
    if params.get("has_bias"):
        args.append(randn(gen, d, dtype=dtype, scale=0.1))
    return [*args, params.get("eps", 1e-5)]
