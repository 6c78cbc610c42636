"""Mamba-1 selective-scan family: the per-channel selective state-space scan of Mamba-1 mixers.

One variant, `scan`: u, delta, z [B, D, T], A [D, N], B and C [B, N, T] (or grouped
[B, G, N, T]), D skip and delta bias [D], initial / final state [B, D, N]; Triton forward and
backward (gradients to every tensor input) against a pure-PyTorch reference (the token-by-token
recurrence of transformers' torch path), and a one-token decode step. The binding serves the scan
core of a classified Mamba-1 mixer; its projections and conv stay the model's modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, ShapeBucket

from . import bench
from .binding import bind

NAME = "selective_scan"


def match(block: Any) -> dict[str, Any] | None:
    """A `linear_attention.mamba` block whose classification read a Mamba-1 mixer off its
    structure (`scan: selective`: a [inner, state] decay exponentiated per channel and state,
    softplus time step, x_proj to dt_rank + 2 state, dt_proj, depthwise causal conv), else None.
    Normed B/C/dt (Falcon-Mamba, Jamba) change the mixer around the scan, not the scan."""
    if block.kind != "linear_attention.mamba" or block.attrs.get("scan") != "selective":
        return None
    if not block.attrs.get("inner") or not block.attrs.get("state"):
        return None
    return FAMILY.served("scan", {})


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """u, delta [1, 8, 11], A < 0 [8, 16], B, C [1, 16, 11], D, z, delta_bias, softplus: the
    block's input [B, T, hidden] does not give the inner width (and the check only needs the
    interface), so small fixed sizes."""
    d, n, t = 8, 16, 11
    return [torch.randn(1, d, t, generator=gen), torch.randn(1, d, t, generator=gen),
            -torch.exp(torch.rand(d, n, generator=gen)), torch.randn(1, n, t, generator=gen),
            torch.randn(1, n, t, generator=gen), torch.randn(d, generator=gen),
            torch.randn(1, d, t, generator=gen), torch.randn(d, generator=gen) - 1.0, True]


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """Batch and tokens off x [B, T, hidden]; inner width D and state N off the block's attrs."""
    x = entry.shapes[0] if entry.shapes else None
    if block is None or not x or len(x) != 3 or not block.attrs.get("inner"):
        return None
    return {"B": x[0], "T": x[1], "D": block.attrs["inner"], "N": block.attrs["state"]}


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """Entry arguments at the block's dims, as a mixer calls the scan (fp32 A, D, delta bias)."""
    from onboarding.tune.worker import randn

    b, t, d, n = (int(dims[k]) for k in ("B", "T", "D", "N"))
    return [randn(gen, b, d, t, dtype=dtype), randn(gen, b, d, t, dtype=dtype) - 2.0,
            -torch.exp(randn(gen, d, n, dtype=torch.float32)), randn(gen, b, n, t, dtype=dtype),
            randn(gen, b, n, t, dtype=dtype), randn(gen, d, dtype=torch.float32),
            randn(gen, b, d, t, dtype=dtype), randn(gen, d, dtype=torch.float32), True]


FAMILY = FamilySpec(
    name=NAME,
    template="selective_scan.py.j2",
    template_version=2,
    folder=Path(__file__).parent,
    variants={"scan": "Mamba-1 selective scan: per-channel decay exp(dt A), (grouped) B/C, D skip, "
                      "silu(z) gate, delta bias + softplus, initial/final state; decode step"},
    params=(),
    # BLOCK_D: channels per program (the [BLOCK_D, N] fp32 state in registers); BLOCK_T: steps
    # per scanned tile (and between the states the forward stores for the backward); BWD_BLOCK_D:
    # the backward's channels per program (it holds several [BLOCK_D, N, BLOCK_T] fp32 tiles).
    tuning_space={
        "BLOCK_D": (2, 4, 8, 16, 32),
        "BLOCK_T": (8, 16, 32, 64),
        "num_warps": (1, 2, 4, 8),
        "BWD_BLOCK_D": (2, 4, 8, 16),
        "bwd_warps": (1, 2, 4, 8),
    },
    # Untimed, chosen from the sm_90 AOT build (bf16, N 16; ptxas registers / spill bytes):
    # forward 8 x 32 at 4 warps 212 / 0 (16 x 16 spills 8, 16 x 32 at 4 warps spills 4);
    # backward 4 x 32 at 4 warps 229 / 0 (8 x 32 at 4 warps spills 24, 16 x 16 spills 112).
    default_config={"BLOCK_D": 8, "BLOCK_T": 32, "num_warps": 4, "BWD_BLOCK_D": 4, "bwd_warps": 4},
    shape_buckets=(
        ShapeBucket(name="n_le_16", dim="N", lo=1, hi=16),
        # Untimed: the same tiles' registers at twice to four times the state
        ShapeBucket(name="n_big", dim="N", lo=17, hi=2**31 - 1,
                    config={"BLOCK_D": 4, "BLOCK_T": 16, "BWD_BLOCK_D": 2}),
    ),
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("B", "T", "D", "N"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
)
