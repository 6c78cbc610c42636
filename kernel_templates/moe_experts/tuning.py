"""Tuning hooks of the MoE experts family: the real problem dims of a block, and timing inputs
at those dims (`FamilySpec.problem_dims`, `timing_inputs`)."""

from __future__ import annotations

from typing import Any

import torch

from onboarding.tune.worker import randn, rows


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """Tokens N, width D, experts E, top-k and expert width F off x [..., D], the top-k indices
    [..., TOPK] and the expert weights; only D (the bucketed dim) when the weights do not say.

    down by shape: [E, D, F], the expert weight whose output side is x's width D (gate_up
    [E, 2F, D] and up [E, F, D] take D in); [E, F, D] for weights stored [E, in, out]
    (`weight_layout` "in_out", gpt-oss). When F == D or 2F == D: the one that is not D x D."""
    shapes = entry.shapes
    if not shapes or not shapes[0]:
        return None
    x = shapes[0]
    if block is not None and len(shapes) >= 2:
        e, d = block.attrs.get("n_experts"), x[-1]
        out_dim, f_dim = (2, 1) if block.attrs.get("weight_layout") == "in_out" else (1, 2)
        downs = [s for s in block.params.values() if len(s) == 3 and s[0] == e and s[out_dim] == d]
        if e and downs:
            f = next((s[f_dim] for s in downs if s[f_dim] != d), d)
            return {"N": rows(x), "D": d, "E": e, "TOPK": shapes[1][-1], "F": f}
    return {"D": x[-1]}


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """x [N, D], top-k indices of E experts with weights, gate_up [E, 2F, D] (`mlp`: up
    [E, F, D]), down [E, D, F]."""
    n, d, e, k, f = (int(dims[x]) for x in ("N", "D", "E", "TOPK", "F"))
    x = randn(gen, n, d, dtype=dtype)
    # balanced on average
    idx = torch.rand(n, e, generator=gen, device=gen.device).topk(k, dim=-1).indices
    w = torch.rand(n, k, generator=gen, device=gen.device).to(dtype)
    gate_up = randn(gen, e, f if variant == "mlp" else 2 * f, d, dtype=dtype, scale=d ** -0.5)
    down = randn(gen, e, d, f, dtype=dtype, scale=f ** -0.5)
    return [x, idx, w, gate_up, down]
