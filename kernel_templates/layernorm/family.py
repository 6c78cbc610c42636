"""LayerNorm family: a LayerNorm written out in torch ops (mean subtracted, biased mean of squares,
rsqrt, scale by a weight, optional bias), forward and backward.

One variant, `plain`: y = (x - mean(x)) * rsqrt(mean((x - mean(x))^2) + eps) * w (+ b), all in
fp32 and cast once to x's dtype (Cohere 2's Cohere2MoeLayerNorm, no bias). Blocks that call the
fused op (`F.layer_norm` / `native_layer_norm`) are left to torch: registry marks them
`torch_fast`, and `match` refuses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, family_module

from .binding import bind
from .tuning import problem_dims, timing_inputs

# LayerNorm's kernels tile like RMSNorm's (a row reduction, then the column sums of the weight
# gradients): it borrows that family's tuning space, default and buckets.
_rms = family_module("rmsnorm").FAMILY

NAME = "layernorm"
_FUSED_OPS = ("layer_norm", "native_layer_norm")
# The eps of torch.nn.LayerNorm and of Cohere's LayerNorm, for a block whose eps was not read.
_DEFAULT_EPS = 1e-5


def match(block: Any) -> dict[str, Any] | None:
    """Render params for an `opgraph.Block`, or None when this family cannot serve it.

    `norm.layer` written in torch ops (no fused layer_norm op in its histogram) with a weight
    (attrs `has_weight`, which the classifier records only for the written-out form) -> `plain`
    with the block's `eps` and `has_bias`. A fused layer_norm, a block without a weight or that
    does not say, one that scales by (1 + w) (`unit_offset`), or one whose parameters are not
    all [D] (a per-head weight [H, D], as Cohere's QK norm) -> None.
    """
    if block.kind != "norm.layer" or block.attrs.get("group_size"):
        return None  # (a norm per group of the row: the kernels normalise whole rows)
    if any(block.op_histogram.get(op) for op in _FUSED_OPS):
        return None
    if any(len(shape) != 1 for shape in block.params.values()):
        return None
    attrs = block.attrs
    if not attrs.get("has_weight", False) or attrs.get("unit_offset", False):
        return None
    eps = attrs.get("eps")
    return FAMILY.served("plain", {"eps": _DEFAULT_EPS if eps is None else float(eps),
                                   "has_bias": bool(attrs.get("has_bias", False))})


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """Fresh random entry arguments: 37 rows (odd on purpose) at the block's width, an offset
    x (so subtracting the mean matters), a weight near 1 and a bias near 0."""
    width = shapes[0][-1] if shapes else 64
    args = [torch.randn(37, width, generator=gen) + 0.5, 0.5 * torch.randn(width, generator=gen) + 1.0]
    if params.get("has_bias"):
        args.append(0.5 * torch.randn(width, generator=gen))
    return [*args, params.get("eps", _DEFAULT_EPS)]


FAMILY = FamilySpec(
    plan_saves="norm_input",
    name=NAME,
    template="layernorm.py.j2",
    template_version=1,
    folder=Path(__file__).parent,
    variants={
        "plain": "(x - mean) * rsqrt(var + eps) * w (+ b); gradients to x, w (and b)",
    },
    params=(
        Param(name="eps", type=float, default=_DEFAULT_EPS, min=0.0, max=1.0,
              doc="default eps of the user-facing function (eps stays a call argument)"),
        Param(name="has_bias", type=bool, default=False,
              doc="add a bias [D] after the weight (and return its gradient)"),
    ),
    # The row tiles are rmsnorm's (one [BLOCK_N, BLOCK_D] fp32 tile per step, one more live
    # in the backward): its tuning space and buckets are the starting point, not yet measured
    # for this kernel.
    tuning_space=_rms.tuning_space,
    default_config=_rms.default_config,
    shape_buckets=_rms.shape_buckets,
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("N", "D"),
    timing_inputs=timing_inputs,
    binding=bind,
)
