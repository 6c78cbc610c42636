"""LoRA family: a frozen linear plus a low-rank adapter, y = x W^T + s (x A^T) B^T, fused.

Variant `linear`, gradients to x, A and B only (W frozen). Param `base` picks who runs the base
GEMMs (x W^T, dy W):
- "torch" (default): one Triton kernel per pass writes the rank-r term (reads x, writes y once;
  stores x A^T for the backward), then the vendor GEMM (cuBLAS) adds x W^T onto it through its
  beta = 1 epilogue, which reads y under the GEMM's math. Our Triton
  GEMM runs at about half of cuBLAS on an H200, so this is the path that can keep the LoRA
  overhead within ~15% of the base GEMM.
- "triton": everything in our Triton GEMM, the rank-r product joining its accumulator.
LoRA is applied by the training stage to chosen linears, not found in the op graph: no `match`;
training asks for this variant through `training_variants` ("lora.linear": its `LoRALinear` layers).
The grouped expert LoRA (per-expert A_e / B_e inside the grouped GEMM) is the `swiglu_lora`
variant of the `moe_experts` family: it shares the experts' permutation and grouped GEMMs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, ShapeBucket
from onboarding.families.gemm import GEMM_DEFAULT_CONFIG, GEMM_TUNING_SPACE

from . import bench

NAME = "lora"


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """x [37, I] at the block's width, W [40, I], rank-8 A and B (B non-zero, so dA shows)."""
    width = shapes[0][-1] if shapes else 24
    x = torch.randn(37, width, generator=gen)
    w = torch.randn(40, width, generator=gen) / width ** 0.5
    a = torch.randn(8, width, generator=gen) / width ** 0.5
    b = torch.randn(40, 8, generator=gen) / 8 ** 0.5
    return [x, w, a, b, params.get("scaling", 1.0)]


FAMILY = FamilySpec(
    name=NAME,
    template="lora.py.j2",
    # v6: the backward gets None, not autograd's [N, r] zeros, for the saved xa (set_materialize_grads(False)).
    template_version=6,
    folder=Path(__file__).parent,
    variants={"linear": "x W^T + scaling * (x A^T) B^T, frozen W; grads to x, A, B"},
    params=(
        Param(name="base", type=str, default="torch", choices=("torch", "triton"),
              doc="base GEMMs in torch (a low-rank kernel, then the vendor GEMM adding onto it) or in our Triton GEMM"),
        Param(name="scaling", type=float, default=1.0, min=-1e6, max=1e6,
              doc="default scaling (PEFT: lora_alpha / r); stays a call argument"),
    ),
    tuning_space=GEMM_TUNING_SPACE,
    default_config=GEMM_DEFAULT_CONFIG,
    shape_buckets=(
        ShapeBucket(name="i_le_1k", dim="I", lo=1, hi=1024),
        ShapeBucket(name="i_big", dim="I", lo=1025, hi=2**31 - 1,
                    config={"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8}),
    ),
    sample_inputs=sample_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    # "lora.linear": training's `LoRALinear` (a frozen nn.Linear plus its adapters; no op-graph
    # block kind), which `onboarding.train.kernels.attach_lora_kernels` serves with this variant
    # at its default params (base="torch")
    training_variants={"lora.linear": "linear"},
)
