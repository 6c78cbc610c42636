"""Tuning hooks of the SwiGLU family: the real problem dims of an activation block, and timing
inputs at those dims (`FamilySpec.problem_dims`, `timing_inputs`)."""

from __future__ import annotations

from typing import Any

import torch

from onboarding.tune.worker import randn, rows


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """Rows N and width F off the input: [..., 2F] for `fused` ([gate | up] in one tensor),
    [..., F] otherwise (`weighted`: as `fused`)."""
    x = entry.shapes[0] if entry.shapes else None
    if not x:
        return None
    return {"N": rows(x), "F": x[-1] // 2 if entry.variant in ("fused", "weighted") else x[-1]}


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """`fused`: x [N, 2F]; `weighted`: x [N, 2F] and w [N]; otherwise gate and up [N, F]."""
    n, f = int(dims["N"]), int(dims["F"])
    if variant == "weighted":
        return [randn(gen, n, 2 * f, dtype=dtype), randn(gen, n, dtype=dtype)]
    if variant == "fused":
        return [randn(gen, n, 2 * f, dtype=dtype)]
    return [randn(gen, n, f, dtype=dtype) for _ in range(2)]
