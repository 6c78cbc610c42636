"""Sink-attention family: softmax attention with optional per-head sinks (an extra logit per head
that joins each row's softmax denominator and gives no value), causal with an optional sliding
window, grouped-query heads, an optional additive mask and an optional logit soft-cap (c tanh(s /
c), Gemma 2's); FlashAttention-2-style Triton forward and backward (gradients to q, k, v and the
sinks) against the eager path written out in torch.

One variant, `attention`: q [B, H, Tq, D], k, v [B, Hk, Tk, D], sinks [H] or None; the soft-cap is
a runtime argument (the call's, read by the binding), not a render parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, ShapeBucket

from . import bench
from .binding import ATTENTION_CORE, bind, capped
from .binding import refusal as binding_refusal
from .tuning import problem_dims, timing_inputs

NAME = "sink_attention"
# the softmax-attention kinds whose core the module hands to one function (MLA's latent layout,
# top-k and compressed attention have cores of their own)
KINDS = ("attention.full", "attention.sliding", "attention.gated")


def _claims(block: Any) -> dict[str, Any] | None:
    """What `match` serves of an attention block by its kind and core alone (`match`)."""
    if block.kind not in KINDS or block.attrs.get("layout") == "mla":
        return None
    core = block.attrs.get("unfused_core")
    if core is None:
        return None
    m = FAMILY.served("attention", {})
    if m is None:
        return None
    scores = core.get("scores") or []
    sink = len(scores) >= 2 and scores[-1] == scores[-2] + 1
    return {**m, "serves": "attention core",
            "note": "softmax(QK^T)V fused" + (", the sink column in the softmax" if sink else "")
            + (", the logits soft-capped (the call's softcap)" if core.get("softcap") else "")}


def refusal(block: Any) -> dict[str, str] | None:
    """For a block of the kinds `match` serves: why the binding would leave it unpatched, by its
    own acceptance test (`binding.refusal`) on the core calls the parse stage recorded
    (attrs ``core_calls``, `FAMILY.probe`), as {"serves", "reason"}; None when it would take the
    block or nothing was recorded (a graph not probed: the match stands)."""
    if _claims(block) is None:
        return None
    found = (block.attrs.get("core_calls") or {}).get(ATTENTION_CORE.what)
    if found is None:
        return None
    vectors = {n: shape[0] for n, shape in block.params.items() if "." not in n and len(shape) == 1}
    why = binding_refusal(found, vectors, capped(block))
    return None if why is None else {"serves": "attention core", "reason": why}


def match(block: Any) -> dict[str, Any] | None:
    """An attention block whose core is written out (`unfused_core`: softmax over scores
    [..., T, T], or [..., T, T + 1] with a sink column, materialised; no SDPA op), not MLA, and
    that the binding can take (no `refusal`), else None. Serves the block's "attention core"; the
    projections stay cuBLAS GEMMs."""
    m = _claims(block)
    return None if m is None or refusal(block) is not None else m


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """q [1, 4, 19, 16], k, v [1, 2, 19, 16], sinks [4], no mask, default scale, causal, window 8:
    the block's input [B, T, hidden] does not give the head layout, and the check needs only the
    interface, so small fixed sizes (GQA, a partial block, a window shorter than T)."""
    b, h, hk, t, d = 1, 4, 2, 19, 16
    return [torch.randn(b, h, t, d, generator=gen), torch.randn(b, hk, t, d, generator=gen),
            torch.randn(b, hk, t, d, generator=gen), torch.randn(h, generator=gen), None, None, True, 8]


FAMILY = FamilySpec(
    name=NAME,
    template="sink_attention.py.j2",
    template_version=5,  # v3: aot_specs builds the masked backward (dK/dV, dQ) too; v4: the logit soft-cap; v5: a D > 128 bucket
    folder=Path(__file__).parent,
    variants={"attention": "softmax attention with optional per-head sinks; causal, optional sliding "
                           "window, GQA, optional additive mask; forward + backward (dq, dk, dv, dsinks)"},
    params=(),
    # BLOCK_M / BLOCK_N: query rows / key columns per tile of the forward; BWD_BLOCK_M /
    # BWD_BLOCK_N: the backward's (the dK/dV kernel holds a BWD_BLOCK_N key block, the dQ kernel
    # a BWD_BLOCK_M query block); precision: fp32 inputs' dots ("tf32" only where torch allows
    # tf32 matmuls; 16-bit inputs dot in their own dtype on a GPU).
    tuning_space={
        "BLOCK_M": (16, 32, 64, 128),
        "BLOCK_N": (16, 32, 64, 128),
        "num_warps": (2, 4, 8),
        "num_stages": (1, 2, 3, 4),
        "BWD_BLOCK_M": (16, 32, 64, 128),
        "BWD_BLOCK_N": (16, 32, 64, 128),
        "bwd_warps": (2, 4, 8),
        "precision": ("tf32", "ieee"),
    },
    # Untimed (no GPU yet): FlashAttention-2's usual tiles, warps from the sm_90 build (bf16,
    # D 64; ptxas registers / spill bytes): forward 128 x 64 at 4 warps 255 / 0, at 8 warps
    # 166 / 0; backward 64 x 64 at 4 warps dK/dV 255 / 160, dQ 255 / 52, at 8 warps 198 / 0 and
    # 169 / 0. The masked forward (an additive mask tile per block) spills at every tried
    # config: 128 x 64 at 4 warps 3400 bytes, at 8 warps 460, 64 x 64 at 4 warps 564. The masked
    # backward (in aot_specs since v3; triton 3.9 with the runtime's marks, bf16, these defaults):
    # dK/dV 232 / 0 and dQ 232 / 0 at D 64, 252 / 0 and 239 / 0 at D 128. The soft-capped kernels
    # (in aot_specs since v4; no mask; the uncapped builds unchanged by v4): forward, dK/dV, dQ
    # 172 / 0, 236 / 0, 225 / 0 at D 64, 198 / 0, 250 / 0, 214 / 0 at D 128.
    default_config={"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                    "BWD_BLOCK_M": 64, "BWD_BLOCK_N": 64, "bwd_warps": 8, "precision": "tf32"},
    shape_buckets=(
        ShapeBucket(name="d_le_64", dim="D", lo=1, hi=64),
        # D 128 at BLOCK_M 64, 4 warps, backward 32 x 64 at 8 warps: forward 198 / 0, dK/dV
        # 246 / 0, dQ 225 / 0 (the masked forward 255 / 1084)
        ShapeBucket(name="d_le_128", dim="D", lo=65, hi=128,
                    config={"BLOCK_M": 64, "num_warps": 4, "BWD_BLOCK_M": 32}),
        # D 256 (Gemma 2's heads; the head-dim tile is 256 from D 129 on): d_le_128's tiles spill
        # there (forward 255 / 956, dK/dV 255 / 116, dQ 255 / 144). Of six tile sets built for
        # sm_90 (bf16), this one spills nowhere unmasked and uncapped: forward 64 x 32 at 8
        # warps 255 / 0, backward 32 x 32 at 8 warps dK/dV 187 / 0, dQ 240 / 0; capped 255 / 16,
        # 206 / 0, 240 / 0; masked 255 / 212, 255 / 8, 255 / 0. Untimed.
        ShapeBucket(name="d_big", dim="D", lo=129, hi=2**31 - 1,
                    config={"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "BWD_BLOCK_M": 32,
                            "BWD_BLOCK_N": 32}),
    ),
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("B", "T", "H", "Hk", "D"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    binding=bind,
    probe=ATTENTION_CORE,
    refusal=refusal,
)
