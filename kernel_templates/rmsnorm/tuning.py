"""Tuning hooks of the RMSNorm family (`layernorm` shares `problem_dims`): the real problem dims
of a norm block, and timing inputs at those dims (`FamilySpec.problem_dims`, `timing_inputs`)."""

from __future__ import annotations

from typing import Any

import torch

from onboarding.tune.worker import randn, rows


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """Rows N and width D off the input x [..., D]."""
    x = entry.shapes[0] if entry.shapes else None
    return {"N": rows(x), "D": x[-1]} if x else None


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """x [N, D] (`gated`: and the gate), a weight near 1 unless the variant has none, eps."""
    n, d = int(dims["N"]), int(dims["D"])
    args = [randn(gen, n, d, dtype=dtype)]
    if variant == "gated":
        args.append(randn(gen, n, d, dtype=dtype))
    if variant != "l2norm" and params.get("has_weight", True):
        args.append(randn(gen, d, dtype=dtype, scale=0.1).add_(1))
    return [*args, params.get("eps", 1e-6)]
