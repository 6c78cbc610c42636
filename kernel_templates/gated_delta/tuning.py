"""Tuning hooks of the delta-rule families (`gated_delta`, and `kimi_delta`, which extends it):
the real problem dims of a linear-attention block, and timing inputs at those dims
(`FamilySpec.problem_dims`, `timing_inputs`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from onboarding.tune.worker import randn


def head_dims(block: Any) -> dict[str, int] | None:
    """Heads and head dims of a delta-rule block from its weights: value heads from the per-head
    decay parameter, V from the value projection; K is taken equal to V when the query
    projection divides by it (true of Qwen3-Next and Kimi-Linear), else from the norm weight."""
    p = block.params
    hv = next((s[0] for n, s in p.items() if len(s) == 1 and n.split(".")[-1].startswith("A")),
              None)
    v_out = next((s[0] for n, s in p.items() if n.endswith("v_proj.weight") and len(s) == 2),
                 None)
    q_out = next((s[0] for n, s in p.items() if n.endswith("q_proj.weight") and len(s) == 2),
                 None)
    if not (hv and v_out and q_out) or v_out % hv:
        return None
    vd = v_out // hv
    kd = vd if q_out % vd == 0 else next((s[0] for n, s in p.items()
                                          if n.endswith("norm.weight") and len(s) == 1), None)
    if not kd or q_out % kd:
        return None
    return {"HV": hv, "V": vd, "K": kd, "HK": q_out // kd}


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """Batch B and tokens T off x [B, T, hidden], heads and head dims off the weights."""
    x = entry.shapes[0] if entry.shapes else None
    if block is None or not x or len(x) != 3:
        return None
    d = head_dims(block)
    return {"B": x[0], "T": x[1], **d} if d else None


def delta_rule_inputs(dims: dict[str, int], dtype, gen: torch.Generator, *, per_channel: bool
                      ) -> list:
    """q, k [B, T, HK, K], v [B, T, HV, V], fp32 log decay g [B, T, HV(, K)], beta [B, T, HV]."""
    b, t, hk = int(dims["B"]), int(dims["T"]), int(dims["HK"])
    hv, kd = int(dims.get("HV", hk)), int(dims["K"])
    vd = int(dims.get("V", kd))
    q, k = (randn(gen, b, t, hk, kd, dtype=dtype) for _ in range(2))
    v = randn(gen, b, t, hv, vd, dtype=dtype)
    # the models compute the log decay in fp32
    g = F.logsigmoid(randn(gen, *((b, t, hv, kd) if per_channel else (b, t, hv)), dtype=torch.float32) + 3)
    beta = torch.sigmoid(randn(gen, b, t, hv, dtype=torch.float32)).to(dtype)
    return [q, k, v, g, beta, None, None, False]  # training needs o only


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    return delta_rule_inputs(dims, dtype, gen, per_channel=False)
