"""Rotary position embedding family: q and k rotated by cos/sin, forward and backward.

Variants: `half` (rotate_half: pairs (i, i + R/2), the transformers default) and `interleaved`
(pairs (2i, 2i + 1)). The rotary dim R is cos.shape[-1]; R < head_dim is partial rotary (the
rest of each head passes through). `head_dim`/`rotary_dim` (optional) pin the shapes the module
accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.errors import InputError
from onboarding.families import FamilySpec, Param, ShapeBucket

from . import bench, binding
from .tuning import problem_dims

NAME = "rope"


def _check(variant: str, params: dict[str, Any]) -> None:
    r, d = params["rotary_dim"], params["head_dim"]
    if r is not None and r % 2:
        raise InputError(f"rope: parameter 'rotary_dim' must be even, got {r}")
    if r is not None and d is not None and r > d:
        raise InputError(f"rope: parameter 'rotary_dim' ({r}) must be <= 'head_dim' ({d})")


def refusal(block: Any) -> dict[str, str] | None:
    """For a `rope` block: why the binding would leave it unpatched, by its own acceptance test
    (`binding.refusal`) on what the parse stage's probe recorded (attrs ``core_calls``,
    `FAMILY.probe`: the rotation call its tables are handed to and the layouts it computes), as
    {"serves": None, "reason"}; None when it would take the block or nothing was recorded (a
    graph not probed: the classifier's attrs stand)."""
    if block.kind != "rope":
        return None
    found = (block.attrs.get("core_calls") or {}).get(binding.ROTARY.what)
    if found is None or binding.unread(found):  # unread: no rotation to refuse
        return None
    why = binding.refusal(found)
    return None if why is None else {"serves": None, "reason": why}


def match(block: Any) -> dict[str, Any] | None:
    """Render params for a `rope` block, else None. Probed (attrs ``core_calls``): the layout
    the binding found its rotation function computes, its rotation the variant and its rotary
    dim pinned (left open for a block whose tables have several widths, one per layer type);
    None when the binding would refuse the block (`refusal`). Unprobed: the classifier's attrs
    (layout, default half; rotary_dim, head_dim)."""
    if block.kind != "rope" or refusal(block) is not None:
        return None
    attrs = block.attrs
    if binding.unread((attrs.get("core_calls") or {}).get(binding.ROTARY.what) or {}):
        return None  # tables no op reads: nothing for the kernel to rotate
    layout = attrs.get("layout", "half")
    params = {"head_dim": attrs.get("head_dim"), "rotary_dim": attrs.get("rotary_dim")}
    probed = binding.probed_layout((attrs.get("core_calls") or {}).get(binding.ROTARY.what) or {})
    if probed is not None:
        layout = probed[0].variant
        if not attrs.get("rotary_dims"):
            params["rotary_dim"] = probed[1]
    if layout not in ("half", "interleaved"):
        return None
    served = FAMILY.served(layout, params)
    if served is not None:
        served["note"] = NOTE
    return served


# coverage's reason: where the kernel runs (the block itself only makes the tables)
NOTE = ("the kernel rotates q/k in the blocks that use this block's cos/sin tables (the binding "
        "swaps the function they hand them to; alignment judges it there)")



def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """q, k of shape [2, 19, H, D] and cos/sin tables over the rotary dim."""
    r = params.get("rotary_dim") or 32
    d = params.get("head_dim") or r
    theta = 10 * torch.rand(19, r, generator=gen)
    q = torch.randn(2, 19, 3, d, generator=gen)
    k = torch.randn(2, 19, 1, d, generator=gen)
    return [q, k, theta.cos(), theta.sin()]

FAMILY = FamilySpec(
    name=NAME,
    template="rope.py.j2",
    template_version=1,
    folder=Path(__file__).parent,
    variants={
        "half": "rotate_half layout: x * cos + cat(-x2, x1) * sin",
        "interleaved": "interleaved pairs (2i, 2i+1)",
    },
    params=(
        Param(name="head_dim", type=int, default=None, nullable=True, min=2, max=1024,
              doc="accepted head dim D (None: any)"),
        Param(name="rotary_dim", type=int, default=None, nullable=True, min=2, max=1024,
              doc="accepted rotary dim R = cos.shape[-1] (None: any even R <= D)"),
    ),
    tuning_space={
        "BLOCK_T": (1, 2, 4, 8, 16, 32),
        "BLOCK_H": (1, 2, 4, 8, 16, 32, 64),
        "num_warps": (1, 2, 4, 8),
    },
    default_config={"BLOCK_T": 4, "BLOCK_H": 8, "num_warps": 4},
    shape_buckets=(
        ShapeBucket(name="d_le_64", dim="D", lo=1, hi=64, config={"BLOCK_T": 8}),
        ShapeBucket(name="d_le_128", dim="D", lo=65, hi=128),
        ShapeBucket(name="d_le_256", dim="D", lo=129, hi=256, config={"BLOCK_T": 2}),
        ShapeBucket(name="d_big", dim="D", lo=257, hi=1024, config={"BLOCK_T": 1, "BLOCK_H": 4}),
    ),
    check=_check,
    match=match,
    binding=binding.bind,
    probe=binding.ROTARY,
    refusal=refusal,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
)
