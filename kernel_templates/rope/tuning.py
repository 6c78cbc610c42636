"""Tuning hook of the rotary embedding family: its bucketed dim (`FamilySpec.problem_dims`).
Rope has no real-shape timing inputs: it is timed at its sample shapes."""

from __future__ import annotations

from typing import Any


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """D, the bucketed dim, from the render parameters the module is rendered for (head dim,
    else rotary dim); None (not tuned) when neither is known."""
    d = entry.params.get("head_dim") or entry.params.get("rotary_dim")
    return {"D": int(d)} if d else None
