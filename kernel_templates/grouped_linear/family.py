"""Grouped linear family: one linear per expert over rows already sorted by expert.

Variant `sorted`: y[rows of e] = x[rows of e] W[e]^T with x [S, K] sorted by expert, per-expert
row counts [E] as a device integer tensor, and one packed weight W [E, N, K]; forward and
backward (dx, dW; dW only when the weight needs a gradient) in Triton, fp32 accumulation, no
host sync (the tile map is built on the device from the counts).

This is the "split by sizes, then one linear per expert" building block of ScatterMoE- and
Megablocks-style models (transformers' JetMoeParallelExperts, used by JetMoE both in its MoE MLP
and in its mixture of attention): the routing, the gather into expert order, the activation and
the combine stay in the surrounding torch code, which calls this block once per projection.

Why a family of its own rather than a variant of `moe_experts`: that family's kernels take the
whole routed MLP (routing indices and weights in, permute, two GEMMs with the activation fused,
combine); this block has neither routing nor an activation, one weight and a different call
signature (x, sizes). Its kernels are three small grouped GEMMs that share with the experts
template the tile-map idea, re-implemented in the rendered module (`tile_map`: rendered modules
are self-contained and cannot import each other), and the banded launch order (`_band`, in the
shared runtime every rendered module includes).

Blocks are picked by structure: `moe.experts` blocks whose classifier attrs say
`layout: "split_linear"` (`onboarding.graph.split`): the module's only parameter is one 3-D
weight [E, N, K], and its ops split its input by sizes and run at most E linears against slices
of that weight. `binding.py` binds the block's forward(x, sizes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, ShapeBucket
from onboarding.families.gemm import GEMM_FWD_BWD_DEFAULT_CONFIG, GEMM_FWD_BWD_TUNING_SPACE, split_tiles

from . import bench
from .binding import bind
from .tuning import problem_dims, timing_inputs

NAME = "grouped_linear"
LAYOUT = "split_linear"  # the classifier's `layout` attr for these blocks


def match(block: Any) -> dict[str, Any] | None:
    """Variant `sorted` for a `moe.experts` block with `layout == "split_linear"` whose parameters
    are exactly the one 3-D weight [E, N, K] the attrs name, with E == `n_experts`."""
    attrs = block.attrs
    if block.kind != "moe.experts" or attrs.get("layout") != LAYOUT:
        return None
    name = attrs.get("weight")
    shape = block.params.get(name) if name else None
    if set(block.params) != {name} or shape is None or len(shape) != 3 or shape[0] != attrs.get("n_experts"):
        return None
    if [shape[1], shape[2]] != [attrs.get("out_features"), attrs.get("in_features")]:
        return None
    return FAMILY.served("sorted", {})


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """37 rows at the block's input width, E=5 with expert 3 empty and 3 padding rows past
    sum(counts), N=40 outputs (the block's input shapes do not carry its output width)."""
    width = shapes[0][-1] if shapes else 24
    counts = torch.tensor([9, 13, 5, 0, 7])
    x = torch.randn(int(counts.sum()) + 3, width, generator=gen)
    weight = torch.randn(5, 40, width, generator=gen) / width ** 0.5
    return [x, counts, weight]


# First GPU tiles (eleventh session, `onboard bench --family grouped_linear`, docs/LOG.md): with
# the shared defaults (64 x 64 x 64, 4 warps) the kernel ran at 0.32-0.44x of torch._grouped_mm
# on the H200; moe_experts' 128 x 128 x 64 GEMM tiles took it to 0.43-0.47x forward and 0.56-0.65x
# fwd+bwd (before the banded order, which is untimed here). `tma` stays off until timed.
_GPU_TILES = split_tiles({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
                         {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3})


FAMILY = FamilySpec(
    name=NAME,
    template="grouped_linear.py.j2",
    template_version=5,
    folder=Path(__file__).parent,
    variants={"sorted": "per-expert linear over rows sorted by expert (counts [E] on the device), "
                        "weight [E, N, K]; fwd + bwd (dx, dW)"},
    params=(),
    # Forward tiles (BLOCK_M/N/K, num_warps, num_stages) and the backward's own (BWD_*): dW
    # reduces over each expert's rows, dx over N. group_m: row tiles per band of the forward and
    # dx GEMMs' launch order (`_band`); tma: those two load their row and weight tiles through
    # tensor descriptors (TMA on Hopper) where the rows are 16-byte aligned. Small widths keep the shared GEMM defaults;
    # from K 1025 the GPU tiles of moe_experts' GEMMs (_GPU_TILES).
    tuning_space={**GEMM_FWD_BWD_TUNING_SPACE, "group_m": (1, 4, 8, 16), "tma": (False, True)},
    default_config={**GEMM_FWD_BWD_DEFAULT_CONFIG, "group_m": 8, "tma": False},
    shape_buckets=(ShapeBucket(name="k_le_1k", dim="K", lo=1, hi=1024),
                   ShapeBucket(name="k_big", dim="K", lo=1025, hi=2**31 - 1, config=_GPU_TILES)),
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("S", "K", "N", "E"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
)
