"""MoE router family: scores, (group-limited) top-k, score-correction bias, renorm, scaling.

Variants by scoring: `softmax` (Qwen3-MoE, Mixtral: softmax over all experts, then top-k),
`sigmoid` (DeepSeek-V3: sigmoid scores, a bias added for selection only, group-limited top-k,
renormalised, times a routed scaling factor) and `sqrtsoftplus` (DeepSeek-V4: sqrt(softplus)
scores, otherwise as `sigmoid`). The kernel takes router logits [N, E]; the linear
producing them stays in PyTorch so autograd gives the router weight's gradient. It also emits the
per-expert token counts that dispatch and balancing statistics need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.errors import InputError
from onboarding.families import FamilySpec, Param, ShapeBucket

from .binding import bind

NAME = "moe_router"


def _check(variant: str, params: dict[str, Any]) -> None:
    if params["topk_group"] > params["n_group"]:
        raise InputError(f"moe_router: parameter 'topk_group' ({params['topk_group']}) must be "
                         f"<= n_group ({params['n_group']})")


def match(block: Any) -> dict[str, Any] | None:
    """`moe.router` blocks with softmax, sigmoid or sqrt(softplus) scoring, else None.

    Group-limited routing needs `n_group` and `topk_group` in attrs, and a DeepSeek-style router
    (group-limited or with a score bias) needs `routed_scaling_factor`: these are numbers of the
    config, not of the graph's structure, so without them the block stays uncovered, never guessed.
    """
    if block.kind != "moe.router":
        return None
    attrs = block.attrs
    variant = attrs.get("scoring")
    if variant not in FAMILY.variants or not attrs.get("top_k"):
        return None
    if attrs.get("scorer") == "mlp":  # logits from an MLP, not one [E, D] linear (ZAYA)
        return None
    if attrs.get("shared_logits"):  # one linear scores E routed + S shared experts (Inkling):
        return None  # the kernel's [E, D] weight and its normalisation over the top k do not fit
    params: dict[str, Any] = {"top_k": int(attrs["top_k"]), "score_bias": bool(attrs.get("score_bias")),
                              "renormalize": bool(attrs.get("renormalize"))}
    if attrs.get("group_limited"):
        if attrs.get("n_group") is None or attrs.get("topk_group") is None:
            return None
        params["n_group"], params["topk_group"] = int(attrs["n_group"]), int(attrs["topk_group"])
    if "routed_scaling_factor" in attrs:
        params["routed_scaling_factor"] = float(attrs["routed_scaling_factor"])
    elif attrs.get("group_limited") or attrs.get("score_bias"):
        return None
    return FAMILY.served(variant, params)


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """x [37, D] at the block's width, a router weight [E, D] and (if rendered with one) a bias."""
    width = shapes[0][-1] if shapes else 32
    n_experts = max(8, params.get("top_k", 2) + 1, 2 * params.get("n_group", 1))
    n_experts += (-n_experts) % params.get("n_group", 1)
    x = torch.randn(37, width, generator=gen)
    w = torch.randn(n_experts, width, generator=gen) / width ** 0.5
    bias = 0.1 * torch.randn(n_experts, generator=gen) if params.get("score_bias") else None
    return [x, w, bias]


FAMILY = FamilySpec(
    name=NAME,
    template="moe_router.py.j2",
    template_version=2,
    folder=Path(__file__).parent,
    variants={
        "softmax": "softmax over all experts, then top-k (Qwen3-MoE, Mixtral)",
        "sigmoid": "sigmoid scores, top-k (DeepSeek-V3 with bias, groups, renorm, scaling)",
        "sqrtsoftplus": "sqrt(softplus) scores, top-k (DeepSeek-V4 with bias, renorm, scaling)",
    },
    params=(
        Param(name="top_k", type=int, default=2, min=1, max=64, doc="experts per token"),
        Param(name="n_group", type=int, default=1, min=1, max=64,
              doc="expert groups for group-limited routing (1: none)"),
        Param(name="topk_group", type=int, default=1, min=1, max=64,
              doc="groups kept per token (by the sum of each group's top-2 scores)"),
        Param(name="score_bias", type=bool, default=False,
              doc="add a score-correction bias [E] for selection only (aux-loss-free balancing)"),
        Param(name="renormalize", type=bool, default=False,
              doc="divide the top-k weights by their sum (+1e-20)"),
        Param(name="routed_scaling_factor", type=float, default=1.0, min=0.0, max=1000.0,
              doc="multiplies the final weights (DeepSeek-V3: 2.5)"),
    ),
    tuning_space={"BLOCK_N": (1, 2, 4, 8, 16, 32, 64), "num_warps": (1, 2, 4, 8)},
    default_config={"BLOCK_N": 16, "num_warps": 4},
    shape_buckets=(
        ShapeBucket(name="e_le_64", dim="E", lo=1, hi=64, config={"BLOCK_N": 32}),
        ShapeBucket(name="e_le_256", dim="E", lo=65, hi=256, config={"BLOCK_N": 8}),
        ShapeBucket(name="e_big", dim="E", lo=257, hi=4096, config={"BLOCK_N": 2, "num_warps": 8}),
    ),
    check=_check,
    match=match,
    sample_inputs=sample_inputs,
    binding=bind,
)
