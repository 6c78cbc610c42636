"""Gate-first gated RMSNorm: y = rmsnorm(x * silu(z)) * w (Mamba-2's mixer norm).

The worked example of docs/families.md, kept outside the built-in folder: use it with
`onboard --families examples/families ...`. The built-in `rmsnorm` family gates after it
normalises and declines blocks that say `norm_before_gate=False`; this family takes exactly those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, ShapeBucket

from .binding import bind

NAME = "rmsnorm_gate_first"


def match(block: Any) -> dict[str, Any] | None:
    """`norm.rms_gated` blocks that gate before normalising, with a weight and a SiLU gate."""
    attrs = block.attrs
    if block.kind != "norm.rms_gated" or attrs.get("norm_before_gate", True) is not False:
        return None
    acts = {a for a in (attrs.get("activation"), attrs.get("gate_activation")) if a is not None}
    if not attrs.get("has_weight", True) or acts - {"silu"}:
        return None
    eps = attrs.get("eps")
    return FAMILY.served("plain", {"eps": 1e-6 if eps is None else float(eps),
                                   "unit_offset": bool(attrs.get("unit_offset", False)),
                                   "group_size": int(attrs.get("group_size") or 0)})


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """Fresh random entry arguments (x, z, weight, eps): 37 rows at the block's width."""
    width = shapes[0][-1] if shapes else 4 * (params.get("group_size") or 16)
    x, z = torch.randn(37, width, generator=gen), torch.randn(37, width, generator=gen)
    w = 0.5 * torch.randn(width, generator=gen) + (0.0 if params.get("unit_offset") else 1.0)
    return [x, z, w, params.get("eps", 1e-6)]


FAMILY = FamilySpec(
    name=NAME,
    template="rmsnorm_gate_first.py.j2",
    template_version=1,
    folder=Path(__file__).parent,
    variants={"plain": "rmsnorm(x * silu(z)) * w; gradients to x, z and w"},
    params=(
        Param(name="eps", type=float, default=1e-6, min=0.0, max=1.0,
              doc="default eps of the user-facing function (eps stays a call argument)"),
        Param(name="unit_offset", type=bool, default=False,
              doc="scale by (1 + w) instead of w"),
        Param(name="group_size", type=int, default=0, min=0, max=16384,
              doc="normalise each group of this many channels of a row (Mamba-2's n_groups); "
                  "0: the whole row"),
    ),
    tuning_space={"num_warps": (1, 2, 4, 8, 16)},
    default_config={"num_warps": 4},
    # one row per program: wider rows want more warps
    shape_buckets=(
        ShapeBucket(name="d_le_1k", dim="D", lo=1, hi=1024, config={"num_warps": 2}),
        ShapeBucket(name="d_le_4k", dim="D", lo=1025, hi=4096, config={"num_warps": 4}),
        ShapeBucket(name="d_le_16k", dim="D", lo=4097, hi=16384, config={"num_warps": 8}),
    ),
    match=match,
    sample_inputs=sample_inputs,
    binding=bind,
)
