"""Pair-sum family: each token's k gathered rows summed, out[t] = sum_j src[index[t*k + j]].

Variant `gather` (training only, never picked by `match`: no op-graph block is this op): one
Triton program per block of tokens x block of columns gathers the k rows of each token, adds
them in fp32 in slot order (deterministic, no atomics) and stores the sums once in src's dtype.
Expert parallelism (`onboarding.train.moe_ep`) sums pairs twice per MoE layer: the combine (each
token's k expert output rows, `_CombinePairs`) and the backward of the token-row gather feeding
the experts (`_GatherPairs`); its torch path gathers the rows into a temporary and sums it.
`onboarding.train.kernels.attach_pair_sum_kernels` renders this variant through
`training_variants` and attaches it after a check against that torch path.

Its own folder rather than a variant of `moe_experts`: the op shares no code with the experts'
GEMMs, and a new family leaves that family's template (and its reviewed kernels) untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, ShapeBucket

NAME = "pair_sum"


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """37 tokens x top-3 rows of the block's width (default 130), gathered by a permutation of
    the 111 pair rows (the combine's and the gather backward's case)."""
    d = shapes[0][-1] if shapes else 130
    n, k = 37, 3
    return [torch.randn(n * k, d, generator=gen), torch.randperm(n * k, generator=gen), k]


FAMILY = FamilySpec(
    name=NAME,
    template="pair_sum.py.j2",
    template_version=1,
    folder=Path(__file__).parent,
    variants={
        "gather": "pair_sum_gather(src [S, D], index [N * k], k): out [N, D], each token's k "
                  "rows of src summed in fp32 (slot order), rounded once to src's dtype",
    },
    params=(),
    # Untuned: none of these has been timed on a GPU. BLOCK_T tokens x BLOCK_D columns per
    # program; the k gathers of a block are unrolled (k is a compile-time constant).
    tuning_space={
        "BLOCK_T": (1, 2, 4, 8, 16, 32),
        "BLOCK_D": (64, 128, 256, 512, 1024, 2048, 4096),
        "num_warps": (1, 2, 4, 8, 16),
    },
    default_config={"BLOCK_T": 4, "BLOCK_D": 512, "num_warps": 4},
    shape_buckets=(
        ShapeBucket(name="d_le_512", dim="D", lo=1, hi=512, config={"BLOCK_T": 8, "BLOCK_D": 256}),
        ShapeBucket(name="d_le_4k", dim="D", lo=513, hi=4096),
        ShapeBucket(name="d_big", dim="D", lo=4097, hi=2**31 - 1,
                    config={"BLOCK_D": 1024, "num_warps": 8}),
    ),
    sample_inputs=sample_inputs,
    # "moe.experts.pair_sum": expert parallelism's pair sums (the combine and the token-row
    # gather's backward; no op-graph block: `match` is absent), which
    # `onboarding.train.kernels.attach_pair_sum_kernels` serves with this variant
    training_variants={"moe.experts.pair_sum": "gather"},
)
