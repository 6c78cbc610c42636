"""Tuning hooks of the sink-attention family: the real problem dims of an attention block whose
core is written out, and timing inputs at those dims (`FamilySpec.problem_dims`,
`timing_inputs`)."""

from __future__ import annotations

from typing import Any

import torch


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """B and T off the block's input x [B, T, hidden]; H off the materialised scores
    [B, H, T, T (+ 1)]; the head dim D off a 2-D weight [hidden, H D] (the output projection's
    shape; with H D = hidden the query projection's too); Hk off the narrowest projection from
    the hidden width [Hk D, hidden]. A sink parameter is one 1-D weight of H entries; C is 1
    where the core soft-caps its scores (``unfused_core.softcap``: the capped kernels are timed)."""
    x = entry.shapes[0] if entry.shapes else None
    scores = ((block.attrs.get("unfused_core") or {}).get("scores") or []) if block is not None else []
    if not x or len(x) != 3 or len(scores) != 4:
        return None
    hidden, h = x[2], scores[1]
    weights = [s for s in block.params.values() if len(s) == 2]
    d = next((s[1] // h for s in weights if s[0] == hidden and s[1] % h == 0), None)
    if not d:
        return None
    kv = [s[0] for s in weights if s[1] == hidden and s[0] % d == 0 and h % (s[0] // d) == 0]
    if not kv:
        return None
    sink = any(len(s) == 1 and s[0] == h for s in block.params.values())
    capped = bool((block.attrs.get("unfused_core") or {}).get("softcap"))
    return {"B": x[0], "T": x[1], "H": h, "Hk": min(kv) // d, "D": d, "S": int(sink), "C": int(capped)}


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """q [B, H, T, D], k, v [B, Hk, T, D], sinks [H] (with S), no mask, causal; a window W when
    the dims give one; a soft-cap with C (its value changes no timing: 50, Gemma 2's)."""
    from onboarding.tune.worker import randn

    b, t, h, hk, d = (int(dims[k]) for k in ("B", "T", "H", "Hk", "D"))
    sinks = randn(gen, h, dtype=dtype) if dims.get("S", 1) else None
    return [randn(gen, b, h, t, d, dtype=dtype), randn(gen, b, hk, t, d, dtype=dtype),
            randn(gen, b, hk, t, d, dtype=dtype), sinks, None, None, True, int(dims.get("W", 0)),
            50.0 if dims.get("C") else None]
