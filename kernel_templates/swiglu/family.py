"""SwiGLU activation family: y = (up + up_offset) * g * sigmoid(alpha * g), optionally clamped.

Variants: `split` (gate and up as two tensors) and `fused` (one `[..., 2F]` gate_up tensor,
`layout` "halves" = [gate | up] or "interleaved" = gate at even, up at odd columns, as gpt-oss).
Clamping (`limit`): `clamp_style="pre_act"` is gpt-oss (gate clamped to max=limit before the
activation, up to [-limit, limit]; with alpha=1.702 and up_offset=1.0); `"post_act"` is
Step-3.x (silu(gate) clamped to max=limit, up to [-limit, limit]).

`weighted` (training only, never picked by `match`): the `fused` activation times a per-row
weight, ``swiglu_weighted(gate_up [..., 2F], w [...])``, with dw (a row sum) reduced inside the
backward kernel. Expert parallelism's grouped experts (`onboarding.train.moe_ep`) apply the routing
weight there; `onboarding.train.kernels.attach_swiglu_kernels` renders it (through
`training_variants`, the training-only variants' table) and attaches it.
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

NAME = "swiglu"

def _check(variant: str, params: dict[str, Any]) -> None:
    if params["limit"] is None and params["clamp_style"] != "pre_act":
        raise InputError("swiglu: parameter 'clamp_style' applies only when 'limit' is set")
    if params["limit"] is not None and params["limit"] <= 0:
        raise InputError(f"swiglu: parameter 'limit' must be > 0, got {params['limit']!r}")


def _foreign_params(block: Any) -> list[str]:
    """The block's parameters that are neither a projection's 2-D weight nor the 1-D bias beside
    one (``X.bias`` with an ``X.weight``): per-channel scales, a nested norm's weight, ... that
    the kernel (``down(swiglu(gate(x), up(x)))`` over the block's linears) never reads."""
    weights = {n.rpartition(".")[0] for n, s in block.params.items()
               if len(s) == 2 and n.endswith(".weight")}
    return [n for n, s in block.params.items()
            if len(s) != 2 and not (n.endswith(".bias") and n.rpartition(".")[0] in weights)]


def refusal(block: Any) -> dict[str, str] | None:
    """For a gated-SiLU `mlp.dense` / `moe.shared_expert` block: why the binding would leave it
    unpatched, read off its parameters: one the kernel does not take (Dory's MLP scales gate and
    up by the vectors ``suv_gate``/``suv_up`` before the activation) changes the block's output,
    so no binding could match it and calibration would reject the patch. None otherwise."""
    if block.kind not in ("mlp.dense", "moe.shared_expert"):
        return None
    if block.attrs.get("activation") != "silu" or not block.attrs.get("gated", False):
        return None
    if foreign := _foreign_params(block):
        return {"serves": None, "reason": "parameters the swiglu kernel does not take "
                f"({', '.join(foreign)}): the block computes more than down(swiglu(gate, up))"}
    return None


def match(block: Any) -> dict[str, Any] | None:
    """Render params for a gated-SiLU `mlp.dense` / `moe.shared_expert` block, else None (also
    when the binding would refuse it: `refusal`).

    A fused gate_up projection (two 2-D weights, one twice as wide as the other's input) selects
    `fused`. A clamp (`attrs["clamp"]`) needs its style from attrs (`clamp_style`, `alpha`,
    `up_offset`, `gate_up_layout`); without it the block stays uncovered rather than guessed.
    """
    if block.kind not in ("mlp.dense", "moe.shared_expert"):
        return None
    attrs = block.attrs
    if attrs.get("activation") != "silu" or not attrs.get("gated", False):
        return None
    if refusal(block) is not None:
        return None
    weights = [shape for shape in block.params.values() if len(shape) == 2]
    fused = len(weights) == 2 and any(
        w[0] == 2 * o[1] for w in weights for o in weights if o is not w)
    params: dict[str, Any] = {}
    style: dict[str, Any] = {}
    if attrs.get("clamp") is not None:
        if "clamp_style" not in attrs:
            return None
        style = {"clamp_style": attrs["clamp_style"]}
        params["limit"] = float(attrs["clamp"])
        params["clamp_style"] = style["clamp_style"]
        params["alpha"] = float(attrs.get("alpha", style.get("alpha", 1.0)))
        params["up_offset"] = float(attrs.get("up_offset", style.get("up_offset", 0.0)))
    if fused:
        params["layout"] = attrs.get("gate_up_layout", style.get("layout", "halves"))
    variant = "fused" if fused else "split"
    return FAMILY.served(variant, params)



def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """Fresh random entry arguments: 37 rows at the block's width (scaled so clamps bite)."""
    width = shapes[0][-1] if shapes else 64
    if variant == "fused":
        return [3 * torch.randn(37, 2 * width, generator=gen)]
    if variant == "weighted":
        return [3 * torch.randn(37, 2 * width, generator=gen), torch.rand(37, generator=gen)]
    return [3 * torch.randn(37, width, generator=gen) for _ in range(2)]

FAMILY = FamilySpec(
    plan_saves="gate_and_up",
    name=NAME,
    template="swiglu.py.j2",
    template_version=2,
    folder=Path(__file__).parent,
    variants={
        "split": "swiglu(gate, up): separate [..., F] tensors",
        "fused": "swiglu_fused(gate_up): one [..., 2F] tensor (halves or interleaved)",
        "weighted": "swiglu_weighted(gate_up, w): fused, times a per-row weight w [...] (MoE "
                    "routing weights); dw reduced in the backward kernel",
    },
    params=(
        Param(name="layout", type=str, default="halves", choices=("halves", "interleaved"),
              variants=("fused", "weighted"), doc="where gate and up sit in gate_up"),
        Param(name="limit", type=float, default=None, nullable=True, min=0.0,
              doc="clamp limit (None: no clamp)"),
        Param(name="clamp_style", type=str, default="pre_act", choices=("pre_act", "post_act"),
              doc="pre_act: clamp gate before the activation (gpt-oss); post_act: clamp silu(gate)"),
        Param(name="alpha", type=float, default=1.0, min=0.0, max=100.0,
              doc="sigmoid slope: a = g * sigmoid(alpha * g) (gpt-oss: 1.702)"),
        Param(name="up_offset", type=float, default=0.0, min=-100.0, max=100.0,
              doc="added to (clamped) up before the product (gpt-oss: 1.0)"),
    ),
    tuning_space={
        "BLOCK_N": (1, 2, 4, 8, 16, 32),
        "BLOCK_F": (64, 128, 256, 512, 1024, 2048),
        "num_warps": (1, 2, 4, 8, 16),
    },
    default_config={"BLOCK_N": 4, "BLOCK_F": 1024, "num_warps": 4},
    shape_buckets=(
        ShapeBucket(name="f_le_1k", dim="F", lo=1, hi=1024, config={"BLOCK_N": 8, "BLOCK_F": 512}),
        ShapeBucket(name="f_le_8k", dim="F", lo=1025, hi=8192),
        ShapeBucket(name="f_big", dim="F", lo=8193, hi=2**31 - 1, config={"BLOCK_N": 2, "BLOCK_F": 2048, "num_warps": 8}),
    ),
    check=_check,
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("N", "F"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
    refusal=refusal,
    # "moe.experts.weighted_act": expert parallelism's routing-weighted SwiGLU of frozen experts
    # inside the LoRA training step (no op-graph block: `match` never picks `weighted`), which
    # `onboarding.train.kernels.attach_swiglu_kernels` serves with this variant at its
    # default params ([gate | up] halves, no clamp)
    training_variants={"moe.experts.weighted_act": "weighted"},
)
