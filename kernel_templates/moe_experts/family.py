"""MoE experts family: permute -> grouped GEMM (SwiGLU fused) -> grouped GEMM (routing weight) -> combine.

Variant `swiglu`: packed expert weights gate_up_proj [E, 2F, D] ([gate | up] halves) and
down_proj [E, D, F] as transformers' 3-D expert layout (a `module_list` block maps to it by
stacking its per-expert weights). Forward and backward (dx, d topk_weights, d gate_up_proj,
d down_proj) in Triton; dropless by default, optional capacity-factor dropping; optional
clamped SwiGLU (gpt-oss style: gate clamped above, up both sides, slope alpha, up offset);
optional per-expert biases (`bias`: gate_up_bias [E, 2F] added before the activation, down_bias
[E, D] added to the expert output before the routing weight, with their gradients).

The kernel has one weight layout; blocks store theirs in others, read off by the classifier:
`weight_layout` "out_in" ([E, out, in], used as x W^T: the kernel's) or "in_out" ([E, in, out],
used as x W: gpt-oss's gate_up [E, D, 2F] and down [E, F, D]); `gate_up_split` "halves" ([gate |
up]) or "interleaved" (gate at even, up at odd columns: gpt-oss), from the recorded split of the
gate/up product (a chunk or step-1 slices vs step-2 slices); `gate_up_bias` / `down_bias`: the
names of the 2-D [E, 2F] / [E, D] parameters added around the two GEMMs. `match` takes these
layouts; `binding.py` converts the block's weights to the kernel's layout (and checks
the result against the block's own output on its first call). A gated packed block whose split
the classifier could not read (`gate_up_split: None`) stays uncovered. Identity ("zero") experts
(attrs `zero_experts`: routing slots >= E return the token times its routing weight; gate_up may
hold E + Z experts, down E) are served by `swiglu` for the E real experts; the patch binding adds
the zero slots' r * x in torch.

Variant `swiglu_lora`: the same experts frozen, with per-expert LoRA adapters on gate_up and on
down applied inside the grouped GEMMs (no delta-W); gradients to x, topk_weights and the
adapters. It also renders `grouped_experts_lora(x_sorted, counts, ...)` for expert-parallel
training, where tokens arrive already sorted by local expert (see the template's docstring).
LoRA is applied by the training stage, so `match` never picks this variant; `training_variants`
offers it to training for `moe.experts` blocks (`families.training_kernel`).

Variant `mlp`: non-gated routed experts, y = sum_k r * down(act(up(x))) with up_proj [E, F, D]
and down_proj [E, D, F] (transformers' NemotronHExperts; a `module_list` block of per-expert
up/down Linear pairs maps to it likewise). `activation` (relu2 = relu(x)^2, relu, silu, gelu
(exact erf), gelu_tanh) is fused in the up GEMM's epilogue; the same permute, grouped GEMMs,
routing weight, combine and backward (dx, d topk_weights, d up_proj, d down_proj) as `swiglu`,
dropless or with `capacity_factor`. Picked by structure: the block's classifier attrs say
`gated: False` (two expert weights whose shapes are each other's transpose, no gate half) and
name the activation read off its ops; other activations, a clamp or biases leave it uncovered.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from onboarding.graph.classify import packed_orientation
from onboarding.errors import InputError
from onboarding.families import FamilySpec, Param, ShapeBucket
from onboarding.families.gemm import GEMM_FWD_BWD_DEFAULT_CONFIG, GEMM_FWD_BWD_TUNING_SPACE, split_tiles

from . import bench
from .binding import bind
from .tuning import problem_dims, timing_inputs

NAME = "moe_experts"


# Activations the `mlp` variant renders; the names are the classifier's (`classify._expert_activation`).
MLP_ACTIVATIONS = ("relu2", "relu", "silu", "gelu", "gelu_tanh")


def _check(variant: str, params: dict[str, Any]) -> None:
    if variant != "mlp" and params["activation"] != "silu":
        raise InputError(f"moe_experts/{variant}: parameter 'activation' must be 'silu' (SwiGLU's gate), "
                         f"got {params['activation']!r}; non-gated experts use variant 'mlp'")
    if params["limit"] is not None and params["limit"] <= 0:
        raise InputError(f"moe_experts: parameter 'limit' must be > 0, got {params['limit']!r}")
    if params["capacity_factor"] is not None and params["capacity_factor"] <= 0:
        raise InputError(f"moe_experts: parameter 'capacity_factor' must be > 0, got {params['capacity_factor']!r}")


# `gate_up_split` of graphs classified before the classifier recorded it: [gate | up] halves, as
# the kernel has always assumed for them (the first-call check at patching still guards it).
_LEGACY_SPLIT = "halves"


def _gate_up_down(shapes: dict[str, list[int]], e: int, weight_layout: str, zero: int = 0
                  ) -> tuple[str, str] | None:
    """(gate_up name, down name) of the packed 3-D weights in `weight_layout`: "out_in" gate_up
    [E, 2F, D] + down [E, D, F], or "in_out" gate_up [E, D, 2F] + down [E, F, D] (the
    classifier's `packed_orientation`); None when no (or more than one) pair fits. With `zero`
    identity experts (the classifier's `zero_experts`) gate_up may hold E + zero experts (the
    patch binding uses the first E); down holds E."""
    three = {n: s for n, s in shapes.items() if len(s) == 3 and s[0] in (e, e + zero)}
    fits = []
    for a, b in itertools.combinations(three, 2):
        orient = packed_orientation([three[a][1:], three[b][1:]])
        if orient is not None and orient[0] == weight_layout:
            pair = (a, b) if orient[1] == 0 else (b, a)
            if three[pair[1]][0] == e:
                fits.append(pair)
    return fits[0] if len(fits) == 1 else None


def _packed_params(block: Any) -> dict[str, Any] | None:
    """The `swiglu` render params a gated packed_3d block needs ({"bias": bool}), or None when its
    weight layout, gate/up split or parameters are not what the kernel (after the patch binding's
    conversion) computes: the two weights, and either both biases [E, 2F] / [E, D] or none."""
    attrs, e = block.attrs, block.attrs.get("n_experts")
    layout = attrs.get("weight_layout", "out_in")
    if attrs.get("gate_up_split", _LEGACY_SPLIT) not in ("halves", "interleaved"):
        return None  # the split could not be read off the ops: no guessing
    pair = _gate_up_down(block.params, e, layout, attrs.get("zero_experts") or 0)
    if pair is None:
        return None
    gu = block.params[pair[0]]
    two_f, d = (gu[1], gu[2]) if layout == "out_in" else (gu[2], gu[1])
    biases = {k: attrs.get(k) for k in ("gate_up_bias", "down_bias")}
    if any(b is not None and b not in block.params for b in biases.values()):
        return None
    if (biases["gate_up_bias"] is None) != (biases["down_bias"] is None):
        return None  # one bias alone: the kernel renders both or none
    if biases["gate_up_bias"] is not None and (block.params[biases["gate_up_bias"]] != [e, two_f]
                                               or block.params[biases["down_bias"]] != [e, d]):
        return None
    known = set(pair) | {b for b in biases.values() if b is not None}
    if set(block.params) - known:
        return None  # a parameter the kernel would ignore
    return {"bias": biases["gate_up_bias"] is not None}


def _layout_ok(block: Any) -> bool:
    """Packed 3-D gate_up + down in a layout `_packed_params` takes, or per-expert 2-D gate/up/down
    weights (module_list)."""
    shapes = list(block.params.values())
    e = block.attrs.get("n_experts")
    if block.attrs.get("gated") is False:  # the classifier found no gate half (variant `mlp`)
        return False
    if block.attrs.get("layout") == "packed_3d":
        return _packed_params(block) is not None
    if block.attrs.get("layout") == "module_list":
        two = [s for s in shapes if len(s) == 2]
        return len(two) == 3 * e or len(two) == 2 * e
    return False


def _transposed_pair(a: list[int], b: list[int]) -> bool:
    """a and b are each other's transpose over their last two dims: up [.., F, D] and down [.., D, F]."""
    return a[:-2] == b[:-2] and a[-2] == b[-1] and a[-1] == b[-2]


def _mlp_layout_ok(block: Any) -> bool:
    """Non-gated experts: exactly two 3-D weights up [E, F, D] and down [E, D, F] (packed_3d), or
    E pairs of 2-D up [F, D] / down [D, F] weights (module_list); no other parameters (biases:
    the kernel has none)."""
    shapes = list(block.params.values())
    e = block.attrs.get("n_experts")
    if not e or block.attrs.get("gated") is not False:
        return False
    if block.attrs.get("layout") == "packed_3d":
        return (len(shapes) == 2 and all(len(s) == 3 and s[0] == e for s in shapes)
                and _transposed_pair(*shapes))
    if block.attrs.get("layout") == "module_list":
        return (len(shapes) == 2 * e and all(len(s) == 2 for s in shapes)
                and all(any(_transposed_pair(s, t) for t in shapes) for s in shapes))
    return False


def _match_mlp(block: Any) -> dict[str, Any] | None:
    """Variant `mlp` for a non-gated experts block with a supported activation and no clamp."""
    attrs = block.attrs
    if attrs.get("activation") not in MLP_ACTIVATIONS or attrs.get("clamp") is not None \
            or not _mlp_layout_ok(block):
        return None
    params: dict[str, Any] = {"activation": attrs["activation"]}
    if attrs.get("capacity_factor") is not None:
        params["capacity_factor"] = float(attrs["capacity_factor"])
    return FAMILY.served("mlp", params)


def match(block: Any) -> dict[str, Any] | None:
    """`moe.experts` blocks with a (gated) SiLU activation and a gate/up + down weight layout
    (variant `swiglu`), or non-gated ones (attrs `gated: False`) with an activation of
    `MLP_ACTIVATIONS` and an up + down layout (variant `mlp`).

    A clamp needs `clamp_style == "pre_act"` (or none given with `alpha`/`up_offset` in attrs is
    taken as gpt-oss's pre-activation clamp only when attrs say so): otherwise uncovered. Packed
    weights in the "in_out" orientation, interleaved gate/up and biases (attrs `weight_layout`,
    `gate_up_split`, `gate_up_bias`/`down_bias`) are served by `swiglu` (with `bias` for the
    biases); a gated packed block with an unread split (`gate_up_split: None`) is not.
    """
    if block.kind != "moe.experts":
        return None
    if block.attrs.get("gated") is False:
        return _match_mlp(block)
    if block.attrs.get("activation") != "silu" or not _layout_ok(block):
        return None
    attrs = block.attrs
    params: dict[str, Any] = {}
    if attrs.get("layout") == "packed_3d":
        params.update(_packed_params(block) or {})
    if attrs.get("clamp") is not None:
        if attrs.get("clamp_style", "pre_act") != "pre_act" or "clamp_style" not in attrs:
            return None
        params["limit"] = float(attrs["clamp"])
        params["alpha"] = float(attrs.get("alpha", 1.0))
        params["up_offset"] = float(attrs.get("up_offset", 0.0))
    if attrs.get("capacity_factor") is not None:
        params["capacity_factor"] = float(attrs["capacity_factor"])
    if attrs.get("alpha") is not None and "alpha" not in params:
        params["alpha"] = float(attrs["alpha"])  # a sigmoid GLU's slope without a clamp
    return FAMILY.served("swiglu", params)


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """37 tokens at the block's width, E=5 top-2 with expert 4 left empty, F=24 (+ rank-8
    adapters with non-zero B for `swiglu_lora`, so every adapter gradient shows; `mlp`: up_proj
    [E, F, D] in place of gate_up; with `bias`, random non-zero gate_up_bias [E, 2F] and down_bias
    [E, D])."""
    width = shapes[0][-1] if shapes else 24
    n, k, e, f, r = 37, 2, 5, 24, 8
    x = torch.randn(n, width, generator=gen)
    idx = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=gen)
    gate_up = torch.randn(e, (f if variant == "mlp" else 2 * f), width, generator=gen) / width ** 0.5
    down = torch.randn(e, width, f, generator=gen) / f ** 0.5
    if params.get("bias"):
        return [x, idx, w, gate_up, down, torch.randn(e, 2 * f, generator=gen) / 2,
                torch.randn(e, width, generator=gen) / 2]
    if variant != "swiglu_lora":
        return [x, idx, w, gate_up, down]
    lora = [torch.randn(e, r, width, generator=gen) / width ** 0.5, torch.randn(e, 2 * f, r, generator=gen) / r,
            torch.randn(e, r, f, generator=gen) / f ** 0.5, torch.randn(e, width, r, generator=gen) / r]
    return [x, idx, w, gate_up, down, *lora, 2.0]


_GATED = ("swiglu", "swiglu_lora")  # the variants with a gate product (SwiGLU clamp, slope, offset)
# Keys on top of the GEMM tiles (see `tuning_space` below). Every default keeps the plain grid
# kernels: options off, 0 = the forward's or the backward's value. The D > 1k buckets take the
# options the H200 timed faster (the notes above `_DW_TILES`). "swiglu and mlp only": swiglu_lora
# ignores the key. History per template version: docs/LOG.md (search "moe_experts" or "MoE").
# group_m (8): row tiles per band of the row-tiled GEMMs' launch order (`_band`). A band runs
#   across all column tiles before the next, so gathered rows and weight tiles come from L2, not
#   HBM. 8 row tiles x 16 column tiles (2048 / 128) is about one wave of 132 SMs.
# combine ("rows"): how a token's K slot rows are summed by the down GEMM and by dx. "rows" writes
#   fp32 per-slot rows that a combine pass sums in a fixed order (bitwise reproducible); "atomic"
#   adds them in the GEMM's epilogue (order varies, so deterministic mode keeps rows). swiglu_lora
#   always keeps rows.
# half_tail (False): the forward GEMMs run an expert's last tile at BLOCK_M / 2 rows when it holds
#   that few (BLOCK_M >= 32).
# half_tail_down, half_tail_bwd (False): the same for the forward down GEMM alone (gate/up keeps
#   full-height tiles), or for the down backward and dx (each on its own row tile). Beside h_tma /
#   rows_tma the half-height tiles load their rows by their own [BLOCK_M / 2, BLOCK_K] tensor
#   descriptors. swiglu and mlp only. Inconclusive on an H100 (fwd+bwd ms against the default, bars
#   passed; docs/LOG.md, thirty-eighth session): DeepSeek-V3 N8192 half_tail_bwd 45.815 against
#   46.109 (+ half_tail_down 45.753), within the spread; Qwen3-Next uniform 7.973 against 7.902,
#   Zipf 8.481 against 8.612.
# tma, bwd_tma (False): the forward GEMMs, or the down backward and dx GEMMs, load the expert
#   weights by tensor descriptors (TMA on Hopper) where rows are 16-byte aligned. swiglu and mlp
#   only.
# DOWN_BLOCK_N, down_stages, down_warps (0): the forward down GEMM's own column tile, stages and
#   warps. swiglu and mlp only.
# DW_BLOCK_M / N / K, dw_warps, dw_stages (0): the weight-gradient GEMMs' output tile, row step
#   (their reduction runs over an expert's rows, a few hundred), warps and stages. swiglu and mlp
#   only.
# dw_persistent (0): programs per SM of one persistent weight-gradient kernel, a flat loop over
#   (output tile, row step) so one tile's pipeline fills while the last drains; 0: one program per
#   output tile (`moe_dwd_kernel`, `moe_dwgu_kernel`). swiglu and mlp only.
# DX_BLOCK_M / N, dx_stages, dx_warps (0): the dx GEMM's own tile, stages and warps. swiglu and
#   mlp only.
#   dx_warps and down_warps let the down backward take 4 warps (m64n128 MMAs on one warpgroup)
#   while dx keeps 8 on 128 x 256, and the forward down GEMM run two 128 x 128 programs per SM.
# DOWN_BWD_BLOCK_M / N, down_bwd_stages (0): the down backward's own tile and stages; its row tiles
#   route the slots, so dx shares them unless DX_BLOCK_M differs. swiglu and mlp only (swiglu_lora's
#   down backward stays on BWD_*).
# dw_sorted (False): the Triton weight-gradient kernels read x[tok] and dy[tok] copied into slot
#   order first. With the gathered load in the loop the pipeline prefetches one step at any stage
#   count (sm_90 AOT: 66 KB shared at 3 and 4 stages); sorted, 3 stages prefetch two steps (98 KB,
#   112 registers: still two programs per SM), 4 stages three. swiglu and mlp only.
# dw_grouped_mm (False): both weight gradients (with `bias` the bias gradients too, by index_add)
#   by torch._grouped_mm on slot-ordered copies of x[tok] and dy[tok], ahead of dw_persistent and
#   dw_sorted. Runs on a GPU for bf16 on sm_90+ with rows a multiple of 8 elements only (else the
#   Triton kernels). swiglu and mlp only.
# dy_sorted (False): dy copied into slot order before the down backward (the weight gradients reuse
#   the copy). rows_tma (False): the backward's slot-ordered row operands by tensor descriptors.
#   bwd_epi_split (1): the down backward's epilogue on that many column slices (8: for its
#   128 x 256 tile, bench.py's v18 notes).
# h_tma (False): the forward down GEMM loads h [S, F] by tensor descriptors (with half_tail or
#   half_tail_down since v20: the half-height tiles by their own). swiglu and mlp only.
# dw_tma (False; with dw_persistent and dw_sorted): the persistent weight-gradient kernel loads both
#   operands by tensor descriptors (no address registers or load masks), so two programs fit an SM
#   on one warpgroup. dw_pad (False; with dw_tma): each gathered operand is copied with zero rows
#   padding every expert to a row-step multiple, so no row mask is needed. swiglu and mlp only.
# The v17 keys (h_tma, dw_tma, dw_pad, dx_warps, down_warps) beat no default on the H200
#   (docs/LOG.md, thirtieth session, device call 3); sm_90 AOT facts in bench.py's v17 notes.
# dx_grouped_mm (False; True in both GPU buckets since v29): dx's GEMM (d(gate|up) [S, 2F] by each
#   expert's packed weight) by torch._grouped_mm into per-slot rows in the dot dtype, which the
#   combine pass sums per token in fp32 (never atomics). On a GPU for bf16 on sm_90+ with rows a
#   multiple of 8 elements only (as dw_grouped_mm; else the Triton dx kernel on the DX_* tiles). Why
#   it was tried: in the same H100 runs the anchor's CUTLASS grouped GEMMs of this shape class (rows
#   by expert, K over D or 2F) ran at about 470 TFLOP/s, ours at 372-417 (docs/LOG.md, thirty-seventh
#   session: the anchor's 39.6 CUTLASS ms less our two weight gradients' 15.0, over its four other
#   GEMMs' 1.16e13 FLOPs). swiglu and mlp only.
# A removed key: v22's ws (dx's K loop under triton's automatic warp specialization, on per-slot
#   bf16 rows for the combine pass) won nothing beyond the spread at DeepSeek-V3 N8192 uniform on an
#   H100 (`source .ci/h200/setup.sh && BUDGET=200 bash .ci/h200/h37_moe6.sh` at 45c8bba; fwd+bwd
#   46.109 ms default, 45.744 ws, 47.140 ws + half_tail_bwd, grouped_mm 53.120; kernel sums 44.28
#   against 45.025: dx 8.675 against 9.129, the combine pass and the rest more) and failed the
#   same-sums bar (dx at 2.69e-3 relative RMS of the default's run, bar 2e-3: its bf16 per-slot
#   rows against the default's fp32 atomics); v24 removed it (docs/LOG.md, thirty-eighth session;
#   what triton's pass took: bench.py's v22 notes).
_TUNING_SPACE = {**GEMM_FWD_BWD_TUNING_SPACE, "group_m": (1, 4, 8, 16), "combine": ("rows", "atomic"),
                 "half_tail": (False, True), "tma": (False, True), "DOWN_BLOCK_N": (0, 64, 128, 256),
                 "down_stages": (0, 2, 3, 4), "DW_BLOCK_M": (0, 16, 32, 64, 128),
                 "DW_BLOCK_N": (0, 16, 32, 64, 128, 256), "DW_BLOCK_K": (0, 16, 32, 64, 128), "dw_warps": (0, 2, 4, 8),
                 "dw_stages": (0, 1, 2, 3, 4), "dw_persistent": (0, 1, 2, 3, 4), "bwd_tma": (False, True),
                 "DX_BLOCK_M": (0, 16, 32, 64, 128), "DX_BLOCK_N": (0, 16, 32, 64, 128, 256), "dx_stages": (0, 2, 3, 4),
                 "dw_sorted": (False, True), "dw_grouped_mm": (False, True), "dy_sorted": (False, True),
                 "rows_tma": (False, True), "bwd_epi_split": (1, 2, 4, 8), "h_tma": (False, True),
                 "dw_tma": (False, True), "dx_warps": (0, 2, 4, 8),
                 "down_warps": (0, 2, 4, 8), "dw_pad": (False, True), "DOWN_BWD_BLOCK_M": (0, 16, 32, 64, 128),
                 "DOWN_BWD_BLOCK_N": (0, 16, 32, 64, 128, 256), "down_bwd_stages": (0, 2, 3, 4),
                 "half_tail_down": (False, True), "half_tail_bwd": (False, True),
                 "dx_grouped_mm": (False, True)}
_DEFAULT_CONFIG = {**GEMM_FWD_BWD_DEFAULT_CONFIG, "group_m": 8, "combine": "rows", "half_tail": False,
                   "tma": False, "DOWN_BLOCK_N": 0, "down_stages": 0, "DW_BLOCK_M": 0, "DW_BLOCK_N": 0,
                   "DW_BLOCK_K": 0, "dw_warps": 0, "dw_stages": 0, "dw_persistent": 0, "bwd_tma": False,
                   "DX_BLOCK_M": 0, "DX_BLOCK_N": 0, "dx_stages": 0, "dw_sorted": False,
                   "dw_grouped_mm": False, "dy_sorted": False, "rows_tma": False, "bwd_epi_split": 1,
                   "h_tma": False, "dw_tma": False, "dx_warps": 0, "down_warps": 0, "dw_pad": False,
                   "DOWN_BWD_BLOCK_M": 0, "DOWN_BWD_BLOCK_N": 0, "down_bwd_stages": 0, "half_tail_down": False,
                   "half_tail_bwd": False, "dx_grouped_mm": False}
_BWD_TILES = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
# Why the GPU buckets' values (H200, bf16, uniform routing unless named; docs/LOG.md, the session
# named; "the anchor" is E64 top-8 D2048 F512 N8192, Qwen3-Next E512 top-10 D2048 F512 N8192,
# DeepSeek-V3 E256 top-8 D7168 F2048):
# - Forward tiles 128 x 64 x 64, 8 warps, 3 stages for D <= 4k: in the bench's interleaved sweep
#   1.961 ms at the anchor and 2.823 at Qwen3-Next, both faster than 64 x 128 / 4 stages (eighth
#   session). D > 4k: 128 x 128 with 4 stages (15.49 ms against 16.54 with 3) and bands of 16 row
#   tiles (15.81 against 16.54 with 8) at DeepSeek-V3 N8192 (seventh session).
# - combine "atomic": a faster forward at every shape but Qwen3-Next Zipf; fwd+bwd within 3%
#   (ninth session).
# - half_tail, D <= 4k only: it helps where half the tiles are partial (Qwen3-Next 2.465 ms against
#   2.638) and not at DeepSeek-V3, whose tails cost weight traffic (ninth session, call 3).
# - tma: faster at every shape (DeepSeek-V3 N8192 14.725 ms against 15.485; ninth session, call 6).
# - DOWN_BLOCK_N 256, D > 4k only: DeepSeek-V3 N8192 13.835 ms against 14.732 (call 7). At
#   Qwen3-Next 128 columns took 2.381-2.463 ms and 256 took 2.286, against 2.254 with 64.
# - _DW_TILES: 128 x 128 x 64, 8 warps, 3 stages cut DeepSeek-V3 N8192's weight gradients from
#   20.84 / 9.53 ms to 16.61 / 8.34 (eleventh session). They serve where `_grouped_mm` cannot.
# - dw_persistent stays 0: fwd+bwd 64.17 ms against 56.95 for the grid kernels at DeepSeek-V3 N8192
#   (one program per SM at 146 registers, against two at 118; seventeenth session, helper h33).
_DW_TILES = {"DW_BLOCK_M": 128, "DW_BLOCK_N": 128, "DW_BLOCK_K": 64, "dw_warps": 8, "dw_stages": 3}
# dw_grouped_mm on both GPU buckets: fwd+bwd at DeepSeek-V3 N8192 46.76 ms against 53.28 with the
# grid kernels, Qwen3-Next 7.85 against 8.21, Zipf even; bf16 tests passed (docs/LOG.md, twentieth
# session, device call J).
_DW_GPU = {"dw_grouped_mm": True}
# dx_grouped_mm on both GPU buckets since v29: fwd+bwd wall ms against the default in the same run,
# H100 80GB HBM3 (torch 2.11, triton 3.6; docs/LOG.md, forty-third session, calls 2-3): DeepSeek-V3
# N8192 45.479 / 46.387 and 45.986 / 46.663, Qwen3-Next uniform 7.694 / 7.949 and 7.576 / 7.958, Zipf
# 8.078 / 8.194, DeepSeek-V3 N32768 134.780 / 134.878; bf16 bars passed at d_big and d_le_4k. The v28
# key down_bwd_grouped_mm (the down backward's GEMM by torch._grouped_mm, its epilogue a pass of its
# own) was slower on top of it in three of four comparisons (DeepSeek-V3 46.892 and 46.204, Qwen3-Next
# Zipf 8.225, uniform 7.662 against dx alone's 7.576) and was removed in v29.
_DX_GPU = {"dx_grouped_mm": True}
# bwd_epi_split 2, dy_sorted and rows_tma on both GPU buckets since v16: fwd+bwd at DeepSeek-V3
# N8192 46.727-47.144 ms against 47.442, N32768 142.02 against 146.50; bf16 bars passed
# (docs/LOG.md, twenty-fifth session, call moe2).
_BWD_ROWS = {"bwd_epi_split": 2, "dy_sorted": True, "rows_tma": True}
_GPU_TILES = {**split_tiles({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
                            _BWD_TILES), "combine": "atomic", "half_tail": True, "tma": True, **_DW_TILES, **_DW_GPU,
              **_DX_GPU, **_BWD_ROWS}
# dx's own 128 x 256 tile with bwd_tma, D > 4k only: fwd+bwd 61.88 ms against 64.28 with bwd_tma
# alone at DeepSeek-V3 N8192 (docs/LOG.md, seventeenth session, helper h33). Timed beside the
# persistent weight-gradient kernel, not beside the grid ones.
_DX_TILES_BIG = {"bwd_tma": True, "DX_BLOCK_M": 128, "DX_BLOCK_N": 256, "dx_stages": 3}
# The down backward on 128 x 256 x 64 tiles, 3 stages, its epilogue on eight column slices, D > 4k
# only (v18's row `BWD_BLOCK_M=128,BWD_BLOCK_N=256,bwd_stages=3,bwd_epi_split=8`, by its own keys
# since v19; dx keeps its own tile, the same 128 x 256, and now shares the down backward's row
# tiles): fwd+bwd at DeepSeek-V3 N8192 48.579 ms against 49.779 with _BWD_TILES and two slices
# (grouped_mm 54.121; 4 stages 49.012, 64 x 256 x 3 stages 49.272, 64 x 128 with eight slices
# 49.937 / 49.722 at 3 stages), moe_down_bwd_kernel 5.045 ms against 6.289 (H100 80GB HBM3, torch
# 2.11, triton 3.6, commit 047b72b: `BUDGET=230 bash .ci/h200/h33_moe4.sh`, one median per row;
# docs/LOG.md, thirty-sixth session). Qwen3-Next (D 2048): no row beat the default (9.269-9.436 ms
# against 9.316), so d_le_4k keeps the down backward on _BWD_TILES. By DOWN_BWD_* and not BWD_*:
# swiglu_lora's backward kernels run on BWD_* (and keep their whole-tile epilogue), and at
# 128 x 256 x 3 stages its down backward and dx spill (sm_90 AOT by triton 3.9, bf16, D 7168: 255
# registers, 4036 / 1820 bytes spilled, against 170 / 0 and 124 / 0 on _BWD_TILES).
_DOWN_BWD_TILES_BIG = {"DOWN_BWD_BLOCK_M": 128, "DOWN_BWD_BLOCK_N": 256, "down_bwd_stages": 3, "bwd_epi_split": 8}
_GPU_TILES_BIG = {**split_tiles({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
                                _BWD_TILES), "group_m": 16, "combine": "atomic", "tma": True, "DOWN_BLOCK_N": 256,
                  **_DW_TILES, **_DX_TILES_BIG, **_DW_GPU, **_DX_GPU, **_BWD_ROWS,
                  **_DOWN_BWD_TILES_BIG}

FAMILY = FamilySpec(
    name=NAME,
    template="moe_experts.py.j2",
    # v31: v30's config `x_sorted` removed (the template is v29's again): the gate/up GEMM's x rows by TMA from a
    # slot-ordered copy x[tok] lost on an H100 80GB HBM3 (torch 2.11, triton 3.6; docs/LOG.md, forty-fourth session,
    # call 2): DeepSeek-V3 E256 K8 D7168 F2048 N8192 forward 15.835 ms against the default's 14.413, fwd+bwd 46.646
    # against 45.942; the gate/up kernel itself 10.575 against 10.599 ms (forward) and 9.870 against 9.294 (fwd+bwd),
    # so the pointer-gathered x rows were not what held the GEMM back, and the copy (0.63 ms) came on top.
    # v29: dx_grouped_mm on in both GPU buckets (the note above _DX_GPU); down_bwd_grouped_mm and its
    # moe_act_bwd_kernel removed (slower on top of it on an H100).
    # v28: configs `dx_grouped_mm` and `down_bwd_grouped_mm` (off in every bucket): dx's GEMM and the down
    # backward's by torch._grouped_mm, the latter's epilogue in a new moe_act_bwd_kernel.
    # v27: the pre-sorted LoRA entry's saved gu / xa / ha (and the routed one's with capacity dropping) are zero
    # in the rows past offsets[E], written by the padding tiles of the kernels that write them (moe_gate_up_fwd_kernel,
    # moe_lora_proj_kernel: a row bound S each) instead of left unwritten (or, routed with capacity, zero-filled
    # whole); swiglu_lora only (the other variants' renders differ by the version line alone).
    # v26: no host sync: route counts by a scatter-add (expert_counts; CUDA's bincount read the largest id back)
    # and, with capacity dropping, keeps S = n_rows rows (a bound; dropped slots after the kept) instead of a
    # boolean-mask index (the saved rows after the kept ones zero-filled); kernels unchanged, outputs and gradients
    # the same.
    # v25: no behaviour change: moe_dx_kernel's one-caller helper _dx_rows inlined; aot_specs' gate_up
    # signature without its repeated "p_wgu" key (same specs; default sm_90 PTX identical to v24).
    # v24: config `ws` removed (it lost on an H100: the note above _TUNING_SPACE); the default's kernels unchanged.
    # v23: no behaviour change (de-duplication): one call per half-height tail, one dx call with or without WS.
    # v22: config `ws` (off in every bucket): dx's all-TMA K loop warp-specialized by triton (tl.range
    # warp_specialize), on in-kernel descriptors and per-slot rows; the default's kernels unchanged (sm_90 PTX).
    # v21: the backward gets None, not autograd's zeros, for the saved pre-activations (swiglu, mlp, LoRA).
    # v20: half-height tails beside TMA rows (half_tail_down, half_tail_bwd; h_tma with half_tail); all off, defaults
    # unchanged. v19: the down backward's own tile (DOWN_BWD_*; d_big: 128 x 256). History: docs/LOG.md
    template_version=31,
    folder=Path(__file__).parent,
    variants={"swiglu": "routed SwiGLU experts, packed [E, 2F, D] / [E, D, F] weights (+ optional per-expert "
                        "biases), fwd + bwd",
              "swiglu_lora": "frozen routed SwiGLU experts + per-expert LoRA on gate_up and down "
                             "(routed and pre-sorted entries); grads to x, routing weights, adapters",
              "mlp": "routed non-gated experts down(act(up x)), packed [E, F, D] / [E, D, F] weights, "
                     "fwd + bwd"},
    params=(
        Param(name="activation", type=str, default="silu", choices=MLP_ACTIVATIONS,
              doc="the expert activation: SwiGLU's gate activation (silu only) for swiglu/swiglu_lora; "
                  "act(up) for mlp: relu2 = relu(x)^2, relu, silu, gelu (exact erf), gelu_tanh"),
        Param(name="limit", type=float, default=None, nullable=True, min=0.0, variants=_GATED,
              doc="SwiGLU clamp (pre-activation, gpt-oss style); None: no clamp"),
        Param(name="alpha", type=float, default=1.0, min=0.0, max=100.0, variants=_GATED,
              doc="sigmoid slope: g * sigmoid(alpha * g)"),
        Param(name="up_offset", type=float, default=0.0, min=-100.0, max=100.0, variants=_GATED,
              doc="added to (clamped) up before the product"),
        Param(name="bias", type=bool, default=False, variants=("swiglu",),
              doc="per-expert biases: gate_up_bias [E, 2F] before the activation, down_bias [E, D] "
                  "before the routing weight (gpt-oss); swiglu only (swiglu_lora and mlp have none)"),
        Param(name="capacity_factor", type=float, default=None, nullable=True, min=0.0, max=1000.0,
              doc="keep ceil(cf * N * K / E) slots per expert (token order); None: dropless"),
    ),
    # Forward tiles (BLOCK_M/N/K, num_warps, num_stages: gate/up and down GEMMs, forward combine)
    # and backward tiles (BWD_BLOCK_M/N/K, bwd_warps, bwd_stages: down backward, dx, both weight
    # gradients, backward combine, and in `swiglu_lora` the adapter kernels of the backward) tile
    # separately: the backward's weight-gradient GEMMs reduce over each expert's rows.
    tuning_space=_TUNING_SPACE,
    default_config=_DEFAULT_CONFIG,
    shape_buckets=(
        # D <= 1k keeps the defaults. d_le_4k's backward tiles (_BWD_TILES: 64 x 128 x 64, 8
        # warps, 4 stages) were the best fwd+bwd at the anchor (6.30 ms against 6.54 for 128 x
        # 128; docs/LOG.md, third session) and waste less on many small experts (~160 rows each
        # at Qwen3-Next); d_big's down backward tile (_DOWN_BWD_TILES_BIG) and both buckets'
        # forward tiles and options: the notes above `_DW_TILES`.
        ShapeBucket(name="d_le_1k", dim="D", lo=1, hi=1024),
        ShapeBucket(name="d_le_4k", dim="D", lo=1025, hi=4096, config=_GPU_TILES),
        ShapeBucket(name="d_big", dim="D", lo=4097, hi=2**31 - 1, config=_GPU_TILES_BIG),
    ),
    check=_check,
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("N", "D", "E", "TOPK", "F"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    training_variants={"moe.experts": "swiglu_lora"},
    binding=bind,
)
