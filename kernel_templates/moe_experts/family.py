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
# group_m: row tiles per band of the row-tiled GEMMs' launch order (`_band` in the kernels): the
# gate/up, down, down-backward and dx GEMMs run a band's row tiles across all column tiles
# before the next band, so gathered rows and expert weight tiles are re-read from L2, not HBM.
# 8 row tiles x 16 column tiles (F or D = 2048 over 128) is about one wave of 132 SMs.
# combine: how each token's K slot rows are summed, by the down GEMM (forward) and the dx GEMM
# (backward): "rows" writes fp32 per-slot rows [S, D] that a combine pass sums per token (a fixed
# order: bitwise reproducible); "atomic" adds them into the token's fp32 row in the GEMM's
# epilogue (no rows round trip; the order varies run to run, so deterministic mode keeps rows).
# swiglu and mlp only: swiglu_lora always keeps rows.
# half_tail: the forward GEMMs run an expert's last tile at half height (BLOCK_M / 2) when it holds
# that few rows (BLOCK_M >= 32). tma: the forward GEMMs load the expert weights through tensor
# descriptors (TMA on Hopper) where their rows are 16-byte aligned; swiglu and mlp only.
# DOWN_BLOCK_N / down_stages: the forward down GEMM's own column tile and pipeline depth (0: the
# forward's BLOCK_N / num_stages; swiglu and mlp only).
# DW_BLOCK_M / DW_BLOCK_N / DW_BLOCK_K / dw_warps / dw_stages: the weight-gradient GEMMs' own
# output tile, row step (their reduction runs over an expert's rows, a few hundred), warps and
# pipeline depth (0: the backward's; swiglu and mlp only). dw_persistent: programs per SM of one
# persistent kernel that computes each weight gradient as a flat loop over (output tile, row step),
# so that a tile's pipeline fills while the last one drains (0: one program per output tile,
# `moe_dwd_kernel` / `moe_dwgu_kernel`; swiglu and mlp only). bwd_tma: the down backward and dx
# GEMMs load the expert weights through tensor descriptors, as `tma` does for the forward's.
# DX_BLOCK_M / DX_BLOCK_N / dx_stages: the dx GEMM's own tile and pipeline depth (0: the
# backward's; its row tile gets its own tile map). swiglu and mlp only. dw_sorted: the grid
# weight-gradient kernels read x[tok] and dy[tok] copied into slot order first ([S, D] each, one
# gather apiece) instead of loading each row step's tokens: with that load in the loop, the
# gathered operand keeps the software pipeline at one step of prefetch whatever the stages (sm_90
# AOT: 66 KB shared at 3 and at 4 stages, `async_wait num = 0` at the loop's top); without it 3
# stages prefetch two steps (98 KB, 112 registers: still two programs per SM), 4 stages three;
# the persistent kernel on such rows likewise (4 stages: 164 KB, 152 registers, three steps).
# dw_sorted: 51.66 ms at DeepSeek-V3 N8192 fwd+bwd, 8.10 / 8.35 at Qwen3-Next uniform / Zipf
# (twentieth session, beside the numbers at _DW_GPU below); swiglu and mlp only. dw_grouped_mm: both weight
# gradients (and with `bias` the bias gradients, per-expert row sums by index_add) by
# torch._grouped_mm on slot-ordered copies of x[tok] and dy[tok], grouped over the reduction dim
# (each expert's rows); ahead of dw_persistent / dw_sorted. On a GPU for bf16 on sm_90+ with rows
# of a multiple of 8 elements only (else the Triton kernels); swiglu and mlp only. The GPU buckets'
# default (timed: see _DW_GPU).
# h_tma: the forward down GEMM loads h [S, F] (slot order) through tensor descriptors, as `rows_tma`
# does the backward's rows (not beside `half_tail`, whose half-height tiles need other blocks);
# swiglu and mlp only. dw_tma: with `dw_persistent` and `dw_sorted`, the persistent weight-gradient
# kernel loads both slot-ordered operands through tensor descriptors (no address registers, no load
# masks; rows past an expert's end zeroed in registers), so that on one warpgroup two programs fit
# an SM (one's epilogue under the other's MMAs: the K-grouped `torch._grouped_mm` is CUTLASS's
# cooperative 128 x 256 x 64 schedule at these M, N, whose epilogue nothing overlaps); swiglu and
# mlp only. dw_pad: with `dw_tma`, each weight gradient's gathered operand (dy[tok], x[tok]) is
# copied with zero rows padding every expert to a row-step multiple, so no row mask is needed and
# both operands go to the MMA from shared memory (with the mask, a passes through registers and a
# layout conversion); a second dy gather beside `dy_sorted`'s copy. dx_warps / down_warps: the
# dx GEMM's and the forward down GEMM's own warps (0: the backward's / the forward's), so that the down backward can take 4 (one warpgroup on 64 x 128:
# m64n128 MMAs, not two warpgroups' m64n64, whose operands take the whole shared-memory bandwidth)
# while dx keeps 8 on its 128 x 256 tile, and the forward down GEMM can run 128 x 128 tiles two per
# SM. All untimed (template v17; sm_90 AOT in bench.py's v17 notes).
_TUNING_SPACE = {**GEMM_FWD_BWD_TUNING_SPACE, "group_m": (1, 4, 8, 16), "combine": ("rows", "atomic"),
                 "half_tail": (False, True), "tma": (False, True), "DOWN_BLOCK_N": (0, 64, 128, 256),
                 "down_stages": (0, 2, 3, 4), "DW_BLOCK_M": (0, 16, 32, 64, 128),
                 "DW_BLOCK_N": (0, 16, 32, 64, 128, 256), "DW_BLOCK_K": (0, 16, 32, 64, 128), "dw_warps": (0, 2, 4, 8),
                 "dw_stages": (0, 1, 2, 3, 4), "dw_persistent": (0, 1, 2, 3, 4), "bwd_tma": (False, True),
                 "DX_BLOCK_M": (0, 16, 32, 64, 128), "DX_BLOCK_N": (0, 16, 32, 64, 128, 256), "dx_stages": (0, 2, 3, 4),
                 "dw_sorted": (False, True), "dw_grouped_mm": (False, True), "dy_sorted": (False, True),
                 "rows_tma": (False, True), "bwd_epi_split": (1, 2, 4), "h_tma": (False, True),
                 "dw_tma": (False, True), "dx_warps": (0, 2, 4, 8),
                 "down_warps": (0, 2, 4, 8), "dw_pad": (False, True)}
_DEFAULT_CONFIG = {**GEMM_FWD_BWD_DEFAULT_CONFIG, "group_m": 8, "combine": "rows", "half_tail": False,
                   "tma": False, "DOWN_BLOCK_N": 0, "down_stages": 0, "DW_BLOCK_M": 0, "DW_BLOCK_N": 0,
                   "DW_BLOCK_K": 0, "dw_warps": 0, "dw_stages": 0, "dw_persistent": 0, "bwd_tma": False,
                   "DX_BLOCK_M": 0, "DX_BLOCK_N": 0, "dx_stages": 0, "dw_sorted": False,
                   "dw_grouped_mm": False, "dy_sorted": False, "rows_tma": False, "bwd_epi_split": 1,
                   "h_tma": False, "dw_tma": False, "dx_warps": 0, "down_warps": 0, "dw_pad": False}
_BWD_TILES = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
# Forward tiles measured on the H200 with the banded launch order (seventh session, bf16, uniform
# routing, forward alone against argsort + torch._grouped_mm in the same process; docs/LOG.md):
# at Qwen3-Next (E512 top-10 D2048 F512 N8192, ~160 rows per expert) 64-row tiles with 4 stages
# took 2.756 ms against 3.059 for 128 x 128 / 3 stages (1.38x vs 1.24x); the anchor (E64, 1024
# rows per expert) preferred 128 rows (1.839 ms against 1.972 for these tiles in the bench's sweep).
# Eighth session, the bench's own sweep (one run, interleaved rounds): 128 x 64 x 64, 8 warps, 3
# stages took 1.961 ms at the anchor (64 x 128 / 4 stages: 2.179) and 2.823 at Qwen3-Next (3.053):
# one D bucket serves both. At DeepSeek-V3 (E256 top-8 D7168 F2048 N8192) 128-row tiles with 4
# stages 15.49 ms against 16.54 (3 stages), and bands of 16 row tiles 15.81 against 16.54 (8).
# Ninth session (same-process A/B, forward, uniform routing, median of three interleaved rounds):
# combine "atomic" took the anchor to 1.671 ms from 1.891 with rows, Qwen3-Next 2.560 from 2.635,
# DeepSeek-V3 N8192 15.53 from 15.79 and N32768 50.45 from 53.64 (Qwen3-Next Zipf: 2.619 against
# 2.491); fwd+bwd within 3% either way; bf16 vs fp32 the same (output 4.73e-3). half_tail (same
# A/B, call 3): Qwen3-Next (~160 rows per expert: every other tile a partial one) 2.465 ms against
# 2.638, Zipf 2.446 against 2.547, the anchor 1.737 against 1.747; DeepSeek-V3 15.87 against 15.72
# at N8192 and 52.44 against 52.89 at N32768 (its tails cost weight traffic, not MMA work): on
# for D <= 4k only.
# tma (call 6, same A/B): DeepSeek-V3 N8192 14.725 ms against 15.485 (N32768 48.47 against
# 53.61), Qwen3-Next 2.580 against 2.670, the anchor 1.856 against 1.920. The down GEMM's own
# 256-column tile (call 7, with tma): DeepSeek-V3 N8192 13.835 ms at 4 stages and 14.036 at 3
# against 14.732 with gate/up's 128 (N32768 46.35 against 47.80); at Qwen3-Next 128 or 256
# columns lost to gate/up's 64 (2.381-2.463 and 2.286 against 2.254 ms).
# Weight-gradient GEMMs (eleventh session, `.gpu/dw.py`: fwd+bwd per DW config in one process,
# kernel times by torch.profiler; the grid already expert-slowest): 128 x 128 x 64, 8 warps, 3
# stages took d gate_up / d down from 0.917 / 0.423 ms to 0.685 / 0.349 at the anchor, 1.995 /
# 0.962 to 1.624 / 0.821 at Qwen3-Next and 20.84 / 9.53 to 16.61 / 8.34 at DeepSeek-V3 N8192
# (its step 62.1 -> 56.5 ms); 4 stages the same, 128 x 256 16.85 / 7.40, 128-row steps worse.
# Seventeenth session (`onboard bench --family moe_experts --case deepseek_v3/...N8192/uniform/fwd
# --profile`, one run): the persistent weight-gradient kernel (`dw_persistent` 1: one program per
# SM, 146 registers, so no second program beside it) lost to these grid kernels (two programs per
# SM at 118 registers): fwd+bwd 64.17 ms against 56.95 at DeepSeek-V3 N8192 (its two launches
# 32.98 ms), 10.50 against 8.40 at Qwen3-Next. It stays an option, off.
_DW_TILES = {"DW_BLOCK_M": 128, "DW_BLOCK_N": 128, "DW_BLOCK_K": 64, "dw_warps": 8, "dw_stages": 3}
# Weight gradients by torch._grouped_mm on slot-ordered rows (`dw_grouped_mm`; twentieth session,
# `bash .ci/h200/call_j.sh`, H200, fwd+bwd, one timing per sweep row beside the interleaved
# `ours` / `_grouped_mm` medians): DeepSeek-V3 N8192 46.76 ms against 53.28 with the grid dW
# kernels (the anchor 51.09), Qwen3-Next uniform 7.85 against 8.21 (anchor 8.88), Zipf 8.25
# against 8.22 (anchor 9.73); its GPU bf16 tests passed in the same call.
_DW_GPU = {"dw_grouped_mm": True}
# The down backward's epilogue on two column slices, dy read in slot order and the rows by TMA
# (template v15's options; twenty-fifth session, `bash .ci/h200/h33_moe2.sh`, H200, fwd+bwd bf16,
# each row's median beside the v15 default's in one run): DeepSeek-V3 N8192 46.727-47.144 ms against
# 47.442, N32768 142.02 against 146.50, Qwen3-Next uniform 7.793 against 7.915, Zipf 8.013 against
# 8.383 (`_grouped_mm` 51.96 / 162.53 / 8.884 / 9.713); their GPU bf16 bars passed in the same call
# (`test_backward_v15_configs_bf16_cuda`). The GPU buckets' default since template v16.
_BWD_ROWS = {"bwd_epi_split": 2, "dy_sorted": True, "rows_tma": True}
_GPU_TILES = {**split_tiles({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
                            _BWD_TILES), "combine": "atomic", "half_tail": True, "tma": True, **_DW_TILES, **_DW_GPU,
              **_BWD_ROWS}
# dx's own 128 x 256 tile with the backward's weights by TMA (same run, sweep rows): 61.88 ms
# fwd+bwd at DeepSeek-V3 N8192 against 64.28 with TMA alone (TMA alone: 64.28 against 64.17, no
# gain; dx 128 x 128: 62.09); dx took 10.12 ms of the step at 64 x 128. Measured beside the
# persistent weight-gradient kernel; with the grid ones (the default) the sum is not yet timed.
_DX_TILES_BIG = {"bwd_tma": True, "DX_BLOCK_M": 128, "DX_BLOCK_N": 256, "dx_stages": 3}
_GPU_TILES_BIG = {**split_tiles({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
                                _BWD_TILES), "group_m": 16, "combine": "atomic", "tma": True, "DOWN_BLOCK_N": 256,
                  **_DW_TILES, **_DX_TILES_BIG, **_DW_GPU, **_BWD_ROWS}

FAMILY = FamilySpec(
    name=NAME,
    template="moe_experts.py.j2",
    template_version=17,
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
        ShapeBucket(name="d_le_1k", dim="D", lo=1, hi=1024),
        # Backward measured on the H200 at E64 top-8 D2048 F512 N8192 bf16 (docs/LOG.md, third
        # session): forward + backward (one config for all kernels then) best 64 x 128 x 64, 8 warps,
        # 4 stages (6.30 ms; 128 x 128 tiles 6.54 ms). 64-row tiles also waste less on many small
        # experts (E=512 top-10 of 8192 tokens: ~160 rows each). Forward: see _GPU_TILES.
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
