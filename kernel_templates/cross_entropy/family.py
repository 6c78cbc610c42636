"""Cross-entropy family: the training loss, mean cross-entropy of logits [N, V] against targets
[N], with the logits' gradient written by the forward kernel.

Variant `fused` (training only, never picked by `match`: the loss is no op-graph block): one
Triton kernel per block of rows reads a row's logits twice (online max and log-sum-exp, then the
gradient (softmax - onehot) / N in the logits' dtype) and stores its loss in fp32; torch sums the
losses. It replaces the training step's `_ChunkedCE` (about ten aten passes over each chunk of
logits); `onboarding.train.kernels.attach_loss_kernel` renders it through `training_variants`
and attaches it after a check against `_ChunkedCE`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, ShapeBucket

from . import bench

NAME = "cross_entropy"


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """37 rows of logits at the vocabulary width (default 1000), targets with a few ignored."""
    v = shapes[0][-1] if shapes else 1000
    t = torch.randint(0, v, (37,), generator=gen)
    t[::5] = params.get("ignore_index", -100)
    return [3 * torch.randn(37, v, generator=gen), t]


FAMILY = FamilySpec(
    name=NAME,
    template="cross_entropy.py.j2",
    # v2: the op's own autograd gets None, not autograd's [N, V] zeros, for the stored gradient
    # (set_materialize_grads(False)); the entry's CrossEntropyFunction (one output) unchanged.
    template_version=2,
    folder=Path(__file__).parent,
    variants={
        "fused": "cross_entropy_fused(logits [N, V], targets [N]): the mean loss over N (fp32), "
                 "the gradient written in the forward (one kernel)",
    },
    params=(
        Param(name="ignore_index", type=int, default=-100,
              doc="targets equal to this add no loss and a zero gradient row (still counted in N)"),
    ),
    tuning_space={
        "BLOCK_V": (256, 512, 1024, 2048, 4096, 8192, 16384),
        "ROWS": (1, 2, 4, 8),
        "num_warps": (1, 2, 4, 8, 16, 32),
    },
    default_config={"BLOCK_V": 4096, "ROWS": 1, "num_warps": 8},
    shape_buckets=(
        ShapeBucket(name="v_le_4k", dim="V", lo=1, hi=4096,
                    config={"BLOCK_V": 1024, "ROWS": 4, "num_warps": 4}),
        ShapeBucket(name="v_le_64k", dim="V", lo=4097, hi=65536),
        ShapeBucket(name="v_big", dim="V", lo=65537, hi=2**31 - 1,
                    config={"BLOCK_V": 8192, "num_warps": 16}),
    ),
    sample_inputs=sample_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    # "loss.cross_entropy": the training step's loss over the full-vocabulary logits (no op-graph
    # block; `match` is absent), which `onboarding.train.kernels.attach_loss_kernel` serves with
    # this variant at its default params (ignore_index -100, the worker's IGNORE_INDEX)
    training_variants={"loss.cross_entropy": "fused"},
)
