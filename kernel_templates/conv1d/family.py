"""Causal depthwise conv1d family over [B, T, C], kernel size W, optional bias, optional SiLU.

One variant, `causal`: y = act(bias + sum_w x[t - (W - 1) + w] * weight[:, w]), the short
token-mixing convolution of Mamba and gated delta-net blocks; gradients to x, weight and bias.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, ShapeBucket

from . import bench
from .binding import bind

NAME = "conv1d"


def match(block: Any) -> dict[str, Any] | None:
    """Render params for a `conv.causal1d` block (attrs kernel_size, activation), else None."""
    if block.kind != "conv.causal1d":
        return None
    attrs = block.attrs
    # `left_pad` (the caller pads the sequence, the conv runs unpadded): the binding serves the
    # unpadded call too, as the causal conv less its first K-1 steps (T + left_pad - K + 1 long)
    activation = attrs.get("activation")
    if activation not in (None, "silu"):
        return None
    params = {"kernel_size": attrs.get("kernel_size"), "activation": activation}
    return FAMILY.served("causal", params)



def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """x [2, 37, C], weight [C, W], bias [C]; C from the block's conv input ``[B, C, T]``."""
    width = shapes[0][1] if shapes and len(shapes[0]) == 3 else 64
    w = params.get("kernel_size", 4)
    return [torch.randn(2, 37, width, generator=gen), 0.5 * torch.randn(width, w, generator=gen),
            torch.randn(width, generator=gen)]

FAMILY = FamilySpec(
    name=NAME,
    template="conv1d.py.j2",
    template_version=3,
    folder=Path(__file__).parent,
    variants={"causal": "causal depthwise conv over [B, T, C], optional bias, optional SiLU"},
    params=(
        Param(name="kernel_size", type=int, default=4, min=1, max=8, doc="taps W (weight [C, W])"),
        Param(name="activation", type=str, default=None, nullable=True, choices=("silu",),
              doc="fused activation: None or 'silu'"),
    ),
    tuning_space={
        "BLOCK_T": (8, 16, 32, 64, 128),
        "BLOCK_C": (32, 64, 128, 256),
        "num_warps": (1, 2, 4, 8),
        # the backward's time tile and programs per SM (its programs stride over time blocks)
        "BWD_BLOCK_T": (8, 16, 32, 64, 128),
        "BWD_PER_SM": (2, 4, 8, 16),
    },
    default_config={"BLOCK_T": 16, "BLOCK_C": 128, "num_warps": 4, "BWD_BLOCK_T": 16, "BWD_PER_SM": 4},
    shape_buckets=(
        ShapeBucket(name="c_le_1k", dim="C", lo=1, hi=1024, config={"BLOCK_C": 64}),
        # BWD_BLOCK_T 64: the backward 1.694 -> 0.895 ms fwd+bwd (graph 1.245 -> 0.518) at the
        # Qwen3-Next proxy's B8 T2048 C4096 W4 on the H200 (docs/LOG.md, device call V)
        ShapeBucket(name="c_big", dim="C", lo=1025, hi=2**31 - 1, config={"BWD_BLOCK_T": 64}),
    ),
    match=match,
    sample_inputs=sample_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
)
