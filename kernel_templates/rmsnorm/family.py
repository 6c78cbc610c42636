"""RMSNorm family: plain, gated (`* silu(gate)` or `* sigmoid(gate)`) and weightless L2 norm,
forward and backward.

Variants: `plain` (y = x * rsqrt(mean(x^2) + eps) * w, or `* (1 + w)` with `unit_offset`, or no
weight at all with `has_weight=False`: Gemma 4's v_norm), `gated` (plain times act(gate), norm
before gate: silu as Qwen3-Next / fla's FusedRMSNormGated, sigmoid as Bailing-hybrid's
BailingHybridRMSNormGated), `l2norm` (y = x * rsqrt(sum(x^2) + eps), no weight: q/k before
delta-rule attention).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.errors import InputError
from onboarding.families import FamilySpec, Param, ShapeBucket

from . import bench
from .binding import bind
from .tuning import problem_dims, timing_inputs

NAME = "rmsnorm"


def _check(variant: str, params: dict[str, Any]) -> None:
    if variant == "l2norm" and params["unit_offset"]:
        raise InputError("rmsnorm/l2norm: parameter 'unit_offset' needs a weight; l2norm has none")
    if params["unit_offset"] and not params["has_weight"]:
        raise InputError(f"rmsnorm/{variant}: parameter 'unit_offset' needs a weight; "
                         "has_weight is False")


def match(block: Any) -> dict[str, Any] | None:
    """Render params for an `opgraph.Block`, or None when this family cannot serve it.

    `norm.rms` with a weight -> `plain` (a mean of squares: attrs `reduction` absent or "mean");
    without one -> `l2norm` when the block says it sums (`reduction == "sum"`), else `plain` with
    `has_weight=False` (a mean-RMSNorm with no scale; a weightless block cannot be unit-offset).
    A block normalised per group of its row (attrs `group_size`) -> None.
    `norm.rms_gated` -> `gated` with the gate's `activation` (attrs `activation` /
    `gate_activation`: silu or sigmoid; both must agree where both are given); the template
    computes norm, weight, then gate, so a block that says it gates first
    (`norm_before_gate=False`), has no weight, or another activation -> None, and so does one
    whose gate is an MLP of its own normalised output (`gate == "mlp"`: z needs the norm first).
    """
    attrs = block.attrs
    if attrs.get("group_size"):
        return None  # normalised per group of the row: the kernels normalise whole rows
    eps = attrs.get("eps")
    params: dict[str, Any] = {"eps": 1e-6 if eps is None else float(eps)}
    if block.kind == "norm.rms":
        reduction = attrs.get("reduction") or "mean"
        if attrs.get("has_weight", True) and reduction == "mean":
            variant = "plain"
            params["unit_offset"] = bool(attrs.get("unit_offset", False))
        elif attrs.get("has_weight", True):
            return None
        elif reduction == "sum":
            variant = "l2norm"
        elif reduction == "mean" and not attrs.get("unit_offset", False):
            variant = "plain"
            params["has_weight"] = False
        else:
            return None
    elif block.kind == "norm.rms_gated":
        if not attrs.get("has_weight", True) or attrs.get("norm_before_gate", True) is False:
            return None
        if attrs.get("gate") == "mlp":  # z = mlp(norm(x)): there is no z before the norm runs
            return None
        acts = {a for a in (attrs.get("activation"), attrs.get("gate_activation")) if a is not None}
        if len(acts) > 1:
            return None
        variant = "gated"
        params["activation"] = acts.pop() if acts else "silu"
        params["unit_offset"] = bool(attrs.get("unit_offset", False))
    else:
        return None
    return FAMILY.served(variant, params)


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """Fresh random entry arguments: 37 rows (odd on purpose) at the block's width."""
    width = shapes[0][-1] if shapes else 64
    x = torch.randn(37, width, generator=gen)
    args = [x]
    if variant == "gated":
        args.append(torch.randn(37, width, generator=gen))
    if variant != "l2norm" and params.get("has_weight", True):
        args.append(0.5 * torch.randn(width, generator=gen) + (0.0 if params.get("unit_offset")
                                                               else 1.0))
    return [*args, params.get("eps", 1e-6)]

FAMILY = FamilySpec(
    plan_saves="norm_input",
    name=NAME,
    template="rmsnorm.py.j2",
    template_version=3,
    folder=Path(__file__).parent,
    variants={
        "plain": "x * rsqrt(mean(x^2) + eps) * w (or * (1 + w) with unit_offset, or no w)",
        "gated": "plain * silu(gate) or * sigmoid(gate); gradients to x, gate and w",
        "l2norm": "x * rsqrt(sum(x^2) + eps), no weight",
    },
    params=(
        Param(name="eps", type=float, default=1e-6, min=0.0, max=1.0,
              doc="default eps of the user-facing function (eps stays a call argument)"),
        Param(name="unit_offset", type=bool, default=False, variants=("plain", "gated"),
              doc="scale by (1 + w) instead of w (Gemma / Qwen3-Next style zero-centred weight)"),
        Param(name="has_weight", type=bool, default=True, variants=("plain",),
              doc="False: no weight argument, no weight read, no weight gradient (Gemma 4 v_norm)"),
        Param(name="activation", type=str, default="silu", choices=("silu", "sigmoid"),
              variants=("gated",),
              doc="the gate's activation: y = norm(x) * w * act(gate)"),
    ),
    # Forward (BLOCK_N rows per program, num_warps) and backward (BWD_BLOCK_N rows per loop
    # step, bwd_warps, programs_per_sm for the grid-stride loop) tile separately.
    tuning_space={"BLOCK_N": (1, 2, 4, 8, 16, 32), "num_warps": (1, 2, 4, 8, 16, 32),
                  "BWD_BLOCK_N": (1, 2, 4, 8, 16, 32), "bwd_warps": (1, 2, 4, 8, 16, 32),
                  "programs_per_sm": (1, 2, 4, 8)},
    default_config={"BLOCK_N": 4, "num_warps": 4, "BWD_BLOCK_N": 4, "bwd_warps": 4,
                    "programs_per_sm": 4},
    # Untuned defaults keep ~32 fp32 elements of a row tile per thread (sm_90 AOT: no spills),
    # except d_le_4k, set from the H200 sweep at 16384x4096 bf16 (docs/LOG.md, 2026-11-30 #2).
    shape_buckets=(
        ShapeBucket(name="d_le_512", dim="D", lo=1, hi=512,
                    config={"BLOCK_N": 8, "num_warps": 4, "BWD_BLOCK_N": 8, "bwd_warps": 4}),
        ShapeBucket(name="d_le_2k", dim="D", lo=513, hi=2048,
                    config={"BLOCK_N": 2, "num_warps": 4, "BWD_BLOCK_N": 2, "bwd_warps": 4}),
        ShapeBucket(name="d_le_4k", dim="D", lo=2049, hi=4096,
                    config={"BLOCK_N": 2, "num_warps": 8, "BWD_BLOCK_N": 2, "bwd_warps": 8,
                            "programs_per_sm": 2}),
        ShapeBucket(name="d_le_8k", dim="D", lo=4097, hi=8192,
                    config={"BLOCK_N": 1, "num_warps": 16, "BWD_BLOCK_N": 1, "bwd_warps": 16}),
        ShapeBucket(name="d_le_64k", dim="D", lo=8193, hi=65536,
                    config={"BLOCK_N": 1, "num_warps": 32, "BWD_BLOCK_N": 1, "bwd_warps": 32}),
    ),
    check=_check,
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("N", "D"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
)
