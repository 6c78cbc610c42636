"""The MoE experts family's benchmark cases (the spec's `bench_cases`), issue 6's shapes (E
experts, top-K, hidden D, expert FFN F, N tokens, bf16): the anchor E=64 K=8 D=2048 F=512
N=8192; Qwen3-Next's E=512 K=10 D=2048 F=512; DeepSeek-V3's E=256 K=8 D=7168 F=2048 at N=8192
and N=32768. Uniform routing everywhere, Zipf-skewed routing (expert popularity ~ 1/rank) at the
two D=2048 shapes. Non-gated experts (variant ``mlp``, relu(x)^2 as nemotron_h's) at the
anchor's sizes, ``anchor_mlp``. Each shape gives two cases, ``.../fwd`` (forward only, under
no_grad) and ``.../fwdbwd`` (forward + backward to x, routing weights and both expert weights),
so that every row carries TFLOP/s; the anchor and Qwen3-Next (uniform) add ``.../fwdbwd_frozen``
(the expert weights frozen, as LoRA training on attention leaves them: gradients to x and the
routing weights only). Impls:

- ``ours``: the rendered ``swiglu`` experts kernel (permute -> grouped GEMM + SwiGLU -> grouped
  GEMM + routing weight -> combine);
- ``loop``: the per-expert loop transformers runs (one-hot mask, per hit expert: gather, two
  linears, index_add);
- ``grouped_mm``: argsort by expert + ``torch._grouped_mm`` for both GEMMs + index_add.

(``anchor_mlp``: the same three with up [E, F, D] -> relu^2 -> down in place of SwiGLU.)

FLOPs: forward 6 S D F for S = N K routed rows (gate/up 4 S D F, down 2 S D F; non-gated 4 S D
F); forward + backward 3x that (dx and both weight gradients), 2x with frozen experts (dx
only). ``check`` (fwdbwd cases): the bf16 kernel against the fp32 per-expert reference at the
case's E, K, D, F on 4096 tokens (DeepSeek shapes: 32 of the experts, so the fp32 copies fit
beside the bf16 case), output and every gradient.

Some cases add ``ours@...`` rows (``SWEEPS``): the experts kernel under other configs of its
D bucket, for picking them. The anchor sweeps the forward tiles in its ``fwd`` case
(``MOE_FWD_SWEEP``) and the backward kernels' own tiles in its ``fwdbwd`` case
(``MOE_BWD_SWEEP``, forward tiles left at the bucket's); Qwen3-Next (uniform and Zipf) and
DeepSeek-V3 (N8192 and N32768) time the backward's open choices in their ``fwdbwd`` cases
(template v20's ``MOE_V20_SWEEP``, ``MOE_V20_SWEEP_SHORT``, ``MOE_V20_SWEEP_BIG`` and
``MOE_V20_SWEEP_SHORT_BIG``; v19's ``MOE_V19_SWEEP*``, v18's ``MOE_V18_SWEEP*``, v17's ``MOE_V17_SWEEP*``, v15's
``MOE_V15_SWEEP*`` and the twentieth session's ``MOE_DW_SWEEP`` etc. are kept for the record),
and DeepSeek-V3 N8192 its forward down GEMM in its ``fwd`` case (``MOE_V17_FWD_SWEEP_BIG``;
v15's ``MOE_FWD_SWEEP_BIG`` kept likewise).

Shape legend: x [N, D]; topk [N, K]; gate_up [E, 2F, D] (non-gated up [E, F, D]); down [E, D, F].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from onboarding.bench.cases import (
    N_SETS, bf16_check, config_sweep, fwd_bwd, fwd_only, fwd_sweep, kernel, leaf, routing,
    shared_inputs,
)
from onboarding.bench.harness import BenchCase, Step
from onboarding.families import NightlySpec

# (name, E, K, D, F, N, routings)
MOE_SHAPES = (
    ("anchor", 64, 8, 2048, 512, 8192, ("uniform", "zipf")),
    ("qwen3_next", 512, 10, 2048, 512, 8192, ("uniform", "zipf")),
    ("deepseek_v3", 256, 8, 7168, 2048, 8192, ("uniform",)),
    ("deepseek_v3", 256, 8, 7168, 2048, 32768, ("uniform",)),
    ("anchor_mlp", 64, 8, 2048, 512, 8192, ("uniform",)),
)
# shapes whose experts are non-gated (variant "mlp", relu(x)^2)
MLP_LABELS = ("anchor_mlp",)
MLP_ACTIVATION = "relu2"
# shapes that also time a backward with frozen expert weights (LoRA training on attention only:
# gradients to x and the routing weights; `fwdbwd_frozen`), uniform routing
FROZEN_LABELS = ("anchor", "qwen3_next")
CHECK_TOKENS, CHECK_MAX_EXPERTS_WIDE = 4096, 32
# Tile configs timed beside the defaults at the anchor shape (bf16 tensor-core dots): row tile x
# column tile x K step x warps x pipeline stages. Forward (fwd case): the measured best (the
# d_le_4k default since, 1.95 ms on the H200) first, then the old default (64-row tiles) and its
# neighbours.
MOE_FWD_SWEEP = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
]
# Backward kernels' tiles (fwdbwd case): the measured best (64 x 128 x 64, 8 warps, 4 stages: the
# default since), 128-row tiles (6.54 ms fwd+bwd when they drove every kernel), 3 stages (the old
# default) and neighbours.
MOE_BWD_SWEEP = [
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 4},
    {"BWD_BLOCK_M": 128, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 3},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 3},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 32, "bwd_warps": 8, "bwd_stages": 4},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 64, "BWD_BLOCK_K": 64, "bwd_warps": 4, "bwd_stages": 4},
    {"BWD_BLOCK_M": 128, "BWD_BLOCK_N": 64, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 4},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 256, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 3},
]
# The backward's open choices (twentieth session): `dw_grouped_mm` (the weight gradients by
# torch._grouped_mm on slot-ordered rows) against the default grid kernels and `dw_sorted` (grid
# kernels on slot-ordered rows, untimed so far); with it, the down backward on 64 x 64 tiles and
# dx on its own tiles. sm_90 AOT, bf16, `aot.compile_module(..., specialize="all")` (every pointer
# and i32 divisible by 16, as the JIT marks them at these shapes), registers / spilled bytes /
# shared memory: the down backward at the buckets' 64 x 128 255 / 76-80 / 98 KB, at 64 x 64 172 /
# 0 / 65 KB, at 128 x 128 255 / 2920; dx at 64 x 128 77 / 0, 128 x 128 127 / 0 / 98 KB (two
# programs per SM), 128 x 256 254 / 0 / 147 KB. Qwen3-Next: dx 128 x 128 with TMA weights, or dx
# kept at 64 x 128 beside the 64 x 64 down backward. The persistent kernel is left out: it lost by
# 2.1 ms in the seventeenth session.
MOE_DW_SWEEP = [{"dw_grouped_mm": True}, {"dw_sorted": True},
                {"dw_grouped_mm": True, "bwd_tma": True, "DX_BLOCK_M": 128, "DX_BLOCK_N": 128, "dx_stages": 3},
                {"dw_grouped_mm": True, "BWD_BLOCK_N": 64, "DX_BLOCK_N": 128}]
# Zipf routing (a few experts with thousands of rows, many with tens) and DeepSeek-V3 N32768: the
# two weight-gradient alternatives only.
MOE_DW_SWEEP_SHORT = [{"dw_grouped_mm": True}, {"dw_sorted": True}]
# DeepSeek-V3 N8192 (default: dx's own 128 x 256 tile with TMA weights, grid weight gradients):
# the weight gradients by torch._grouped_mm with that dx, with the backward before it (dx on the
# backward's 64 x 128 tile, pointer loads), with the down backward on 64 x 64 tiles and with dx at
# 128 x 128 (AOT above); the grid kernels on slot-ordered rows (`moe_dwgu_kernel` 112 registers,
# 98 KB: two row steps in flight, against 118 / 66 KB and one); the backward before the dx
# default with the grid kernels. Left out to keep the case short: the persistent kernel (lost by
# 7.2 ms here in the seventeenth session) and slot-ordered rows at 4 stages.
_DX_BEFORE = {"bwd_tma": False, "DX_BLOCK_M": 0, "DX_BLOCK_N": 0, "dx_stages": 0}
MOE_BWD_SWEEP_BIG = [{"dw_grouped_mm": True}, {"dw_grouped_mm": True, **_DX_BEFORE},
                     {"dw_grouped_mm": True, "BWD_BLOCK_N": 64}, {"dw_grouped_mm": True, "DX_BLOCK_N": 128},
                     {"dw_sorted": True}, _DX_BEFORE]
# The twentieth session's rows above were decided by call J (`dw_grouped_mm` the default of both GPU
# buckets since). Template v15 (twenty-fourth session) adds the down backward's epilogue on column
# slices (`bwd_epi_split`), dy copied into slot order before the down backward (`dy_sorted`, the
# copy the grouped_mm weight gradients make anyway) and the backward's slot-ordered rows by TMA
# (`rows_tma`: that copy, and dx's d(gate|up)). sm_90 AOT (specialize="all", bf16; registers /
# spilled bytes / shared memory): the down backward at D 7168, 64 x 128, 4 stages, weights by TMA:
# whole-tile epilogue 255 / 16 / 98 KB, 2 slices 127 / 0 (two programs per SM), 2 slices + dy rows
# by TMA 128 / 0; 128 x 128, 3 stages, 4 slices + dy rows by TMA 181 / 0 / 98 KB (at whole-tile
# epilogue 255 / 2920). D 2048: whole 255 / 8, 2 slices 126 / 0; dx 64 x 128 with rows by TMA 66 / 0
# (77 without). Which rows: the slices alone, then with dy sorted, then with both row operands by
# TMA, dx's rows by TMA alone, and at DeepSeek-V3 the 128-row down backward that the slices make
# spill-free.
_ROWS = {"bwd_epi_split": 2, "dy_sorted": True, "rows_tma": True}
MOE_V15_SWEEP_BIG = [{"bwd_epi_split": 2}, {"bwd_epi_split": 2, "dy_sorted": True}, _ROWS, {"rows_tma": True},
                     {**_ROWS, "bwd_epi_split": 4, "BWD_BLOCK_M": 128, "bwd_stages": 3}]
MOE_V15_SWEEP = [{"bwd_epi_split": 2}, _ROWS, {**_ROWS, "bwd_tma": True}]
MOE_V15_SWEEP_SHORT = [{"bwd_epi_split": 2}, _ROWS]
# DeepSeek-V3's forward (1.26x `_grouped_mm` at N8192 in the seventeenth session; goal 1.3x): gate/up
# on 64 columns of each half (sm_90 AOT: 128 registers, no spills, 131 KB at 4 stages, 98 KB at 3:
# two programs per SM; the default 128 columns: 255 / 8 / 197 KB, one) with the down GEMM kept at
# its 4 stages.
MOE_FWD_SWEEP_BIG = [{"BLOCK_N": 64, "num_stages": 3, "down_stages": 4}, {"BLOCK_N": 64, "down_stages": 4}]
# Template v17 (issue 33, helper-57): at DeepSeek-V3 N8192 the CUTLASS weight gradients took 16.78 of
# the fwd+bwd's 45.45 kernel ms (344 TFLOP/s: torch's K-grouped `_grouped_mm` runs CUTLASS's
# cooperative 128 x 256 x 64 schedule whenever M and N pass 128, and with ~256 rows per expert each
# tile's four K steps sit beside an epilogue that nothing overlaps), the down backward 5.36 ms (359
# TFLOP/s on 64 x 128 tiles of 8 warps: two warpgroups of m64n64 MMAs) and the forward down GEMM
# 4.99 ms (385 TFLOP/s: 32 K steps per 128 x 256 tile, then an atomic epilogue, one program per
# SM). The rows put two or three programs on an SM, so that one's epilogue runs under another's
# MMAs (sm_90 AOT, bf16, D 7168, registers / spills / shared memory per program; the LOG has the
# table):
# - `_DW_PAD`: both weight gradients by the persistent kernel on slot-ordered rows loaded by TMA,
#   the gathered operand of each (dy[tok], x[tok]) padded per expert with zero rows to a row-step
#   multiple, so both operands go to the MMA from shared memory: 128 x 128 on one warpgroup (196 /
#   0 / 104 KB: two per SM); on 8 warps with 2 stages (92 / 0 / 96 KB: two). `_DW_TMA`: the same
#   without the padding, a's rows masked in registers (252 / 0 / 88 KB on one warpgroup: two per
#   SM; its operand passes a layout conversion each row step). On 128 x 128 x 8 warps x 3 stages
#   the padded kernel takes 128 KB and the masked one 156 registers: one per SM, not offered.
# - `_DOWN_BWD_4W`: the down backward on one warpgroup (m64n128 MMAs) with its epilogue in four
#   slices (178 / 0 / 96 KB: two per SM), dx kept at 8 warps.
# - `_DOWN_FWD_4W`: the forward down GEMM on 128 x 128 tiles of one warpgroup, 3 stages (254 / 0 /
#   96 KB: two per SM; on 8 warps 138 registers, one); `h_tma`: its h rows by TMA (at the default
#   128 x 256 x 8 warps 254 registers and 8 bytes spilled, against 254 / 0 without).
_DW_TMA = {"dw_grouped_mm": False, "dw_persistent": 2, "dw_sorted": True, "dw_tma": True, "dw_warps": 4}
_DW_PAD = {**_DW_TMA, "dw_pad": True}
_DOWN_BWD_4W = {"bwd_warps": 4, "dx_warps": 8, "bwd_epi_split": 4}
_DOWN_FWD_4W = {"DOWN_BLOCK_N": 128, "down_stages": 3, "down_warps": 4}
MOE_V17_SWEEP_BIG = [_DW_PAD, {**_DW_PAD, "dw_warps": 8, "dw_stages": 2}, _DW_TMA, _DOWN_BWD_4W, _DOWN_FWD_4W,
                     {**_DW_PAD, **_DOWN_BWD_4W, **_DOWN_FWD_4W}]
MOE_V17_FWD_SWEEP_BIG = [_DOWN_FWD_4W, {**_DOWN_FWD_4W, "h_tma": True}, {"h_tma": True}]
# Qwen3-Next (D 2048: half-height tiles on, so no h_tma; its forward is at 1.3x already): the
# backward rows; Zipf and DeepSeek-V3 N32768 the two alone.
MOE_V17_SWEEP_SHORT = [_DW_PAD, _DOWN_BWD_4W]
MOE_V17_SWEEP = [*MOE_V17_SWEEP_SHORT, {**_DW_PAD, **_DOWN_BWD_4W}]
# Template v18 (issue 33, helper-95): the down backward (dh = dy[tok] down_proj[e], then the SwiGLU
# backward, r * h and the routing-weight gradient in its epilogue) on dx's 128 x 256 tile. At
# DeepSeek-V3 N8192 it took 5.36 ms (359 TFLOP/s) on 64 x 128 tiles of 8 warps, where dx, the same
# GEMM shape over 2F, takes 8.31 ms (463) on 128 x 256: per 64-row step a 64 x 128 tile loads
# (64 + 128) x 64 operands for 64 x 128 x 64 MACs (43 FLOP/B), 128 x 256 loads 2x for 4x the MACs
# (85 FLOP/B), and its warpgroups issue m64n256 MMAs, not m64n64. The epilogue runs on eight
# 32-column slices (`bwd_epi_split` 8) with each slice's gate/up pre-activations loaded before the
# previous slice's stores, so their latency overlaps its math (PTX order ld0 ld1 st0 ld2 st1 ...;
# splits 1, 2, 4 keep their order). sm_90 AOT by triton 3.6 (the
# H200's), bf16, D 7168: 128 x 256 x 3 stages 230 registers / 0 spills / 144 KB (4 stages 230 / 0 /
# 192 KB; 4 slices spill); 64 x 256 168 / 0 / 120 KB at 3 stages; the default 64 x 128 x 4 stages
# with two slices 126 / 0 / 96 KB. Expected by arithmetic: dx (64 K steps a tile) and the forward
# down GEMM (32), both 128 x 256 over the same tile count, fit ~0.96 us a K step (~580 TFLOP/s)
# plus ~15 us a tile; the down backward's 112 steps then take ~122 us a tile, 4096 tiles in 32
# waves of 132 (the last of 4): ~3.9 ms; with an epilogue as heavy as gate/up's (whose 112-step
# tiles take ~134 us: 8.29 ms over 62 waves) ~4.3 ms. Against 5.36: -1.1 to -1.4 ms of fwd+bwd's
# 47.3. At Qwen3-Next (160
# rows per expert, F 512) 128-row tiles waste a third of their rows, so its rows are 64 x 256 (D
# 2048: 142 / 0 / 160 KB at 4 stages) and the 128 x 256 one, dx kept on its 64 x 128 tile either
# way. The eight slices also shrink the default 64 x 128 tile's
# epilogue: 70 registers against 126 with two slices, and at 3 stages 72 KB, so three programs fit
# an SM (`_DOWN_BWD_3PS`; two at 96 KB with 4 stages): two run their MMAs while one is in its
# epilogue (triton 3.6 sm_90 AOT as above; the numbers: docs/LOG.md, helper-95).
_DOWN_BWD_WIDE = {"BWD_BLOCK_M": 128, "BWD_BLOCK_N": 256, "bwd_stages": 3, "bwd_epi_split": 8}
_DOWN_BWD_64x256 = {"BWD_BLOCK_N": 256, "bwd_epi_split": 8}
_DOWN_BWD_3PS = {"bwd_epi_split": 8, "bwd_stages": 3}
MOE_V18_SWEEP_BIG = [_DOWN_BWD_WIDE, {**_DOWN_BWD_WIDE, "bwd_stages": 4}, {**_DOWN_BWD_64x256, "bwd_stages": 3},
                     {"bwd_epi_split": 8}, _DOWN_BWD_3PS]
# (D 2048: dx runs on the backward tiles unless pinned; the first three rows keep it on 64 x 128 x 4
# stages, the last lets it follow to 3 stages: 71 / 0 / 72 KB, three per SM too)
MOE_V18_SWEEP = [{**_DOWN_BWD_64x256, "DX_BLOCK_N": 128},
                 {**_DOWN_BWD_WIDE, "DX_BLOCK_M": 64, "DX_BLOCK_N": 128, "dx_stages": 4},
                 {**_DOWN_BWD_3PS, "dx_stages": 4}, _DOWN_BWD_3PS]
MOE_V18_SWEEP_SHORT_BIG = [_DOWN_BWD_WIDE, _DOWN_BWD_3PS]
MOE_V18_SWEEP_SHORT = [MOE_V18_SWEEP[0], MOE_V18_SWEEP[2]]
# Template v19 (thirty-sixth session): the first row, _DOWN_BWD_WIDE, is d_big's default since, by
# the down backward's own keys DOWN_BWD_* (48.579 ms fwd+bwd against 49.779 at DeepSeek-V3 N8192 on
# an H100: family.py's note above _DOWN_BWD_TILES_BIG). On top of it the v18 rows above set BWD_*,
# which no longer reach the down backward there. DeepSeek-V3 times against it the v18 default's
# down backward (`_DOWN_BWD_V18`: the backward's 64 x 128 x 4 stages, two slices; dx keeps its
# 128-row tile on its own tile map, as then) and the two runners-up of that call (4 stages:
# 49.012; 64 x 256 x 3 stages: 49.272).
_DOWN_BWD_V18 = {"DOWN_BWD_BLOCK_M": 0, "DOWN_BWD_BLOCK_N": 0, "down_bwd_stages": 0, "bwd_epi_split": 2}
MOE_V19_SWEEP_BIG = [_DOWN_BWD_V18, {"down_bwd_stages": 4}, {"DOWN_BWD_BLOCK_M": 64}]
MOE_V19_SWEEP_SHORT_BIG = [_DOWN_BWD_V18]
# Template v20 (thirty-seventh session, helper moe37): half-height tails beside TMA rows. At
# DeepSeek-V3 N8192 uniform routing (the bench's experts hold 206-300 rows) the 128-row tile map has
# 635 row tiles where 512 would hold the rows; the 123 third tiles of experts past 256 rows hold
# 1-44 rows (~13). Per-kernel ms against balanced routing (every expert 256 rows, no partial tile;
# H100, h36_moe5.sh, v19): dx 9.147 / 8.270, down backward 4.907 / 4.439, gate/up 8.832 / 8.599,
# down forward 4.939 / 4.739. The v9 forward `half_tail` (gate/up and down forward at half height)
# took gate/up to 10.164 there (8.586 balanced, where no tile is half height: so its half-height
# tiles themselves cost, not the full ones) while the down forward gained (4.694). Not the TMA path:
# at d_big h_tma is off and gate/up's weights stay on TMA either way, and sm_90 AOT (triton 3.6 and
# 3.9, bf16, D 7168) gives gate/up the same 255 registers / 0-8 spilled bytes / 192 KB with both
# loops pipelined (wgmma, TMA weights) as without it. So the rows keep gate/up at full height:
# `half_tail_bwd` (the down backward and dx on half-height tails; their rows by their own
# [64, 64] descriptors beside rows_tma), then with `half_tail_down` (the forward down GEMM alone),
# then with its h rows by TMA (`h_tma`, now allowed beside half-height tiles). sm_90 AOT (specialize
# "all", bf16, D 7168), registers / spilled bytes / shared memory, triton 3.6 (the device's): dx 252 / 0
# / 144 KB (238 without the half tiles), down backward 229 / 0 / 144 KB (230), down forward 239 / 0 /
# 192 KB (237), with h_tma 254 / 0; triton 3.9: dx 254 / 0, down backward 231 / 0, down forward 255
# / 0, with h_tma 254 / 8 (as h_tma alone). Qwen3-Next (d_le_4k: half_tail on, BWD_BLOCK_M 64, ~160
# rows per expert: a third of the backward's tiles hold <= 32 rows) times half_tail_bwd, then with
# h_tma beside its half-height forward tiles.
MOE_V20_SWEEP_BIG = [{"half_tail_bwd": True}, {"half_tail_bwd": True, "half_tail_down": True},
                     {"half_tail_bwd": True, "half_tail_down": True, "h_tma": True}]
MOE_V20_SWEEP_SHORT_BIG = [{"half_tail_bwd": True, "half_tail_down": True}]
MOE_V20_SWEEP = [{"half_tail_bwd": True}, {"half_tail_bwd": True, "h_tma": True}]
MOE_V20_SWEEP_SHORT = [{"half_tail_bwd": True}]
# Template v22 (thirty-seventh session, helper moe38) added config `ws`, dx's K loop under triton's
# automatic warp specialization (`tl.range(..., warp_specialize=True)`); v24 removed it (it lost on
# an H100: family.py's note). What triton's Hopper pass (3.6 and 3.9) took, for a later try: a
# loop only at num_warps 4 (at 8 it silently leaves the kernel alone), only in structured control
# flow (the padding tiles' early return trips an assertion in TaskIdPropagation), no atomics in the
# partitioned code ("Unexpected asyncTaskIds.size()"), and descriptors it may re-block: it splits
# the 128-row loads between two consumer groups, and a host descriptor keeps its [128, 64] block
# (triton 3.6 then built 64-row buffers under 128-row copies, a corrupt kernel; 3.9 refused it:
# "descriptor block and tensor must have the same number of elements"). So under `ws` dx launched
# at 4 warps per group (a TMA producer group + two consumer groups of 64 x 256: 12 warps), made its
# two descriptors in the kernel (tl.make_tensor_descriptor; triton's scratch allocator), wrote
# per-slot rows for the combine pass instead of atomics, and kept full-height tiles (with
# half_tail_bwd's two loops the pass leaves the kernel alone: 4 warps, 255 registers, 2092 bytes
# spilled, triton 3.6). sm_90 AOT (specialize "all", bf16, D 7168, d_big, registers / spilled
# bytes / shared memory): dx with ws, triton 3.6 168 / 0 / 180576 B, triton 3.9 168 / 0 / 180704
# B, setmaxnreg producer 40 / consumers 232; without ws 238 / 0 / 147480 (3.6). The down backward's
# epilogue fails in the pass (triton 3.6: "unsupported op type" with eight slices, "Unexpected
# asyncTaskIds.size()" with one: the dr atomics; 3.9 likewise).
# Which cases sweep: (label, N, routing, mode) -> configs (`fwd` forward tiles, `fwdbwd` the
# backward's). The anchor keeps the full tile sweeps; the larger shapes time only what is being
# decided, so that every case of the family runs in under a minute.
# (The v17 lists above lost to the default on the H200, docs/LOG.md thirtieth session: kept for the
# record, as v18's and v19's, decided in the thirty-sixth session, and v20's, inconclusive on an H100 in
# the thirty-eighth; the backward cases time v28's row, the anchor its tile sweep too.)
# Template v28 (forty-third session): dx's GEMM and the down backward's by torch._grouped_mm (configs
# `dx_grouped_mm`, `down_bwd_grouped_mm`). Why: family.py's note above _TUNING_SPACE. Expected by
# arithmetic at DeepSeek-V3 N8192: dx (3.85e12 FLOPs) ~8.2 ms against 9.1-9.6, plus the combine pass
# over its bf16 rows (~0.9 GB read); the down backward ~4.1 ms + a ~1.6 GB epilogue pass against
# 4.9-5.1. Measured (H100): dx faster at every shape, adopted in v29 (family.py's note above
# _DX_GPU); the down backward's row slower on top of it, removed. The rows now time the default
# against dx by Triton (`_DX_TRITON`: the v28 default's dx, its atomics and tiles as the bucket has them).
_DX_TRITON = {"dx_grouped_mm": False}
MOE_V28_SWEEP = [_DX_TRITON]
SWEEPS = {("anchor", 8192, "uniform", "fwd"): MOE_FWD_SWEEP,
          ("anchor", 8192, "uniform", "fwdbwd"): MOE_V28_SWEEP + MOE_BWD_SWEEP,
          ("qwen3_next", 8192, "uniform", "fwdbwd"): MOE_V28_SWEEP,
          ("qwen3_next", 8192, "zipf", "fwdbwd"): MOE_V28_SWEEP,
          ("deepseek_v3", 8192, "uniform", "fwd"): MOE_V17_FWD_SWEEP_BIG,
          ("deepseek_v3", 8192, "uniform", "fwdbwd"): MOE_V28_SWEEP,
          ("deepseek_v3", 32768, "uniform", "fwdbwd"): MOE_V28_SWEEP}


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _relu2(h: torch.Tensor) -> torch.Tensor:
    return torch.relu(h).square()


def _loop(x, topk_indices, topk_weights, gate_up_proj, down_proj, act: Callable):
    y = torch.zeros_like(x)
    E = gate_up_proj.shape[0]
    with torch.no_grad():
        mask = F.one_hot(topk_indices, num_classes=E).permute(2, 1, 0)
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
    for e in hit:
        e = e[0]
        slot, tok = torch.where(mask[e])
        h = F.linear(act(F.linear(x[tok], gate_up_proj[e])), down_proj[e]) * topk_weights[tok, slot, None]
        y.index_add_(0, tok, h.to(y.dtype))
    return y


def transformers_loop(x, topk_indices, topk_weights, gate_up_proj, down_proj):
    """The per-expert loop of transformers' packed experts (Qwen3MoeExperts.forward et al.)."""
    return _loop(x, topk_indices, topk_weights, gate_up_proj, down_proj, _swiglu)


def transformers_loop_mlp(x, topk_indices, topk_weights, up_proj, down_proj):
    """The same loop for non-gated relu^2 experts (NemotronHExperts.forward)."""
    return _loop(x, topk_indices, topk_weights, up_proj, down_proj, _relu2)


def _grouped(x, topk_indices, topk_weights, gate_up_proj, down_proj, act: Callable):
    N, K = topk_indices.shape
    E = gate_up_proj.shape[0]
    flat = topk_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    h = act(torch._grouped_mm(x[tok], gate_up_proj.transpose(1, 2), offs=offs))
    o = torch._grouped_mm(h, down_proj.transpose(1, 2), offs=offs)
    o = o * topk_weights.reshape(-1)[order, None].to(o.dtype)
    return torch.zeros_like(x).index_add_(0, tok, o)


def grouped_mm(x, topk_indices, topk_weights, gate_up_proj, down_proj):
    """argsort by expert, torch._grouped_mm for gate/up and down, weight, index_add."""
    return _grouped(x, topk_indices, topk_weights, gate_up_proj, down_proj, _swiglu)


def grouped_mm_mlp(x, topk_indices, topk_weights, up_proj, down_proj):
    """The same for non-gated relu^2 experts."""
    return _grouped(x, topk_indices, topk_weights, up_proj, down_proj, _relu2)


# experts drawn per fp32 draw in `_expert_weights`: DeepSeek-V3's gate_up in one fp32 draw was a
# 28 GiB transient beside the 22.5 GB of bf16 weights, and put its N32768 fwd+bwd case out of an
# 80 GB card's memory at setup (thirty-eighth session); 16 experts at a time are 1.9 GB
WEIGHT_DRAW_EXPERTS = 16


def _expert_weights(E: int, rows: int, cols: int, device, gen: torch.Generator) -> torch.Tensor:
    """[E, rows, cols] bf16 expert weights, N(0, 1 / cols) (unit-scale outputs for unit inputs),
    drawn WEIGHT_DRAW_EXPERTS experts at a time so that the fp32 draw stays small."""
    w = torch.empty(E, rows, cols, dtype=torch.bfloat16, device=device)
    for e in range(0, E, WEIGHT_DRAW_EXPERTS):
        n = min(WEIGHT_DRAW_EXPERTS, E - e)
        w[e:e + n] = torch.randn(n, rows, cols, device=device, generator=gen) / cols ** 0.5
    return w


@shared_inputs
def _moe_sets(E, K, D, Fw, N, kind, device, grad: bool, gated: bool = True, frozen: bool = False) -> list[tuple]:
    """N_SETS token sets (x, indices, weights) sharing one set of expert weights: the weights
    (0.2-23 GB in bf16) are far past the L2 on their own, and three copies would not fit. `grad`:
    x, the routing weights and (unless `frozen`) the expert weights require gradients."""
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    gate_up = _expert_weights(E, (2 if gated else 1) * Fw, D, device, gen)
    down = _expert_weights(E, D, Fw, device, gen)
    if grad and not frozen:
        gate_up, down = leaf(gate_up), leaf(down)
    sets = []
    for _ in range(N_SETS):
        x = torch.randn(N, D, device=device, generator=gen).to(bf16)
        idx, w = routing(kind, N, E, K, device, gen)
        w = w.to(bf16)
        sets.append((leaf(x) if grad else x, idx, leaf(w) if grad else w, gate_up, down))
    return sets


def _variant(label: str) -> tuple[str, dict, bool]:
    """(variant, params, gated) of a MOE_SHAPES label."""
    if label in MLP_LABELS:
        return "mlp", {"activation": MLP_ACTIVATION}, False
    return "swiglu", {}, True


def _moe_steps(label, E, K, D, Fw, N, kind, backward: bool, sweep: list[dict], device,
               frozen: bool = False) -> dict[str, Step]:
    """The case's steps: every impl, plus ``ours@...`` rows for the `sweep` configs."""
    variant, params, gated = _variant(label)
    mod, ours = kernel("moe_experts", variant, params)
    impls = {"ours": ours, "loop": transformers_loop if gated else transformers_loop_mlp,
             "grouped_mm": grouped_mm if gated else grouped_mm_mlp}
    sets = _moe_sets(E, K, D, Fw, N, kind, device, backward, gated, frozen)
    if not backward:
        steps = {name: fwd_only(fn, sets) for name, fn in impls.items()}
        return {**steps, **(fwd_sweep(mod, ours, sets, D, sweep) if sweep else {})}
    grads = [torch.randn(N, D, device=device, dtype=torch.bfloat16)]
    steps = {name: fwd_bwd(fn, sets, grads) for name, fn in impls.items()}
    return {**steps, **(config_sweep(mod, ours, sets, grads, D, sweep) if sweep else {})}


def _moe_check(label, E, K, D, Fw, kind) -> Callable[[torch.device], dict[str, float]]:
    e = E if D < 4096 else min(E, CHECK_MAX_EXPERTS_WIDE)
    variant, params, gated = _variant(label)

    def make(dtype):
        gen = torch.Generator(device="cuda").manual_seed(0)
        idx, w = routing(kind, CHECK_TOKENS, e, K, torch.device("cuda"), gen)
        return (torch.randn(CHECK_TOKENS, D, device="cuda", generator=gen).to(dtype), idx, w.to(dtype),
                (torch.randn(e, (2 if gated else 1) * Fw, D, device="cuda", generator=gen) / D ** 0.5).to(dtype),
                (torch.randn(e, D, Fw, device="cuda", generator=gen) / Fw ** 0.5).to(dtype))

    def check(device):
        mod, ours = kernel("moe_experts", variant, params)
        return bf16_check(ours, mod.reference, make)(device)
    return check


def cases() -> list[BenchCase]:
    out = []
    for label, E, K, D, Fw, N, kinds in MOE_SHAPES:
        S = N * K
        mats = 3 if _variant(label)[2] else 2  # weight matrices of F x D per expert
        # bytes: x, y (bf16) and the expert weights once; the backward reads dy, x, the weights
        # and writes dx and both weight gradients
        fwd_bytes = 2 * (2 * N * D + mats * E * Fw * D)
        for kind in kinds:
            frozen_too = label in FROZEN_LABELS and kind == "uniform"
            for backward, frozen in ((False, False), (True, False)) + (((True, True),) if frozen_too else ()):
                mode = "fwdbwd_frozen" if frozen else "fwdbwd" if backward else "fwd"
                sweep = SWEEPS.get((label, N, kind, mode), [])
                # the backward reads dy, x and the weights and writes dx (+ both weight gradients)
                bwd_bytes = 2 * (3 * N * D + (1 if frozen else 2) * mats * E * Fw * D)
                out.append(BenchCase(
                    family="moe_experts", name=f"{label}/E{E}K{K}D{D}F{Fw}N{N}/{kind}/{mode}",
                    shape={"E": E, "K": K, "D": D, "F": Fw, "N": N},
                    min_bytes=fwd_bytes + (bwd_bytes if backward else 0),
                    flops=(1 + (1 if frozen else 2) * backward) * 2 * mats * S * D * Fw,
                    setup=lambda device, a=(label, E, K, D, Fw, N, kind, backward, sweep), f=frozen:
                        _moe_steps(*a, device, frozen=f),
                    check=_moe_check(label, E, K, D, Fw, kind) if backward and not frozen else None,
                    note=f"{kind} routing; " + ("forward + backward to x and the routing weights (frozen experts)"
                                                if frozen else "forward + backward" if backward else "forward only")))
    return out


# The nightly regression suite's share (the anchor shape against torch._grouped_mm).
NIGHTLY = NightlySpec(cases={"anchor/E64K8D2048F512N8192/uniform/fwdbwd": ("ours", "grouped_mm")}, min_threshold=0.05)
