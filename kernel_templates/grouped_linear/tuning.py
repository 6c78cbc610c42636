"""Tuning hooks of the grouped linear family: the real problem dims of a split-linear experts
block, and timing inputs at those dims (`FamilySpec.problem_dims`, `timing_inputs`)."""

from __future__ import annotations

from typing import Any

import torch

from onboarding.tune.worker import randn


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """Rows S and K off x [S, K] (sorted rows), N and E off the weight [E, N, K] the classifier
    named (attrs `out_features`, `in_features`, `n_experts`); None when they disagree."""
    x = entry.shapes[0] if entry.shapes else None
    if block is None or not x or len(x) != 2:
        return None
    n, k, e = (block.attrs.get(a) for a in ("out_features", "in_features", "n_experts"))
    return {"S": x[0], "K": k, "N": n, "E": e} if n and k and e and x[1] == k else None


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """x [S, K] sorted by expert, counts [E] of a uniform split of the S rows, weight [E, N, K]."""
    s, k, n, e = (int(dims[x]) for x in ("S", "K", "N", "E"))
    picks = torch.randint(0, e, (s,), generator=gen, device=gen.device)
    counts = torch.bincount(picks, minlength=e)
    return [randn(gen, s, k, dtype=dtype), counts, randn(gen, e, n, k, dtype=dtype, scale=k ** -0.5)]
