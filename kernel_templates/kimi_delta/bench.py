"""KDA's benchmark cases (the spec's `bench_cases`), issue 32's shapes: the Kimi-Linear layout
(H=32, D=128) at T=8192 and T=32768. The case itself (impls, check, bytes, FLOPs) is the shared
delta-rule one, per-channel decay, plus forward rows of the prepare step's alternatives
(`PREP_SWEEP`, rows ``ours@<cfg>_fwd``), forward + backward rows of the backward's (`QK_SWEEP`,
rows ``ours@<cfg>``) and both rows of the fused output (`FWD_O_SWEEP`: ``ours@fwd_o=fused_fwd``,
``ours@fwd_o=fused``), on request, on the same inputs, so that one call times them against the
default and fla."""

from __future__ import annotations

from onboarding.bench.cases_linear_attention import delta_rule_case, sweep_rows
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec

# (B, T, HK, HV, D, note)
SHAPES = (
    (1, 8192, 32, 32, 128, "Kimi-Linear layout"),
    (1, 32768, 32, 32, 128, ("Kimi-Linear layout; no check (the fallback's 34 GB decays): the "
                             "same kernels are checked at T8192")),
)

# The forward's alternatives to the default "pipelined" prepare step (template v26's default: the
# one-kernel step `kda_prepare_fwd_kernel` with its Gram pass a straight loop Triton pipelines,
# PIPE_GRAM): the split step (template v18's default; `kda_chunk_ref` acts on it only) and "fused",
# the same kernel with its tiered Gram pass (the default of v19-v25; the pipelined pass was a
# second kernel in v25-v27). Rows on request only (--impl names them: ours@kda_prep=split_fwd,
# ours@kda_prep=fused_fwd): the default bench and the nightly suite leave them (and their
# compiles) out. `.ci/h200/h32_kda3.sh` times the default against "fused" and fla. Three prepare
# stages (`prep_stages` 3, the base family's key; the bucket has two), for the fused and the pipelined
# kernel, were rows too for one H200 call (twenty-eighth session): both failed the bf16 bars with
# the same error (o 643x, every gradient 225-23045x the fp32 run's norm), so they are not rows;
# the prepare step alone took 0.667 ms at T8192 against 0.696 at two stages (family.py).
# Template v23's other forward rows (the fused prepare at 8 warps, `kda_prep_warps`; its K tile 16,
# `prep_bk`; both; `kda_prep` "fused2", since removed) all lost to the default on the H200
# (family.py has the numbers; the script is in git at e1f525a): v24 dropped them.
PREP_SWEEP = ({"kda_prep": "split"}, {"kda_prep": "fused"})
# Template v31 (issue 32): o from the state pass (`fwd_o` "fused", GDN's option since its v17: no
# output kernel, and a forward without training writes neither S_c nor v_new), forward
# (``ours@fwd_o=fused_fwd``) and forward + backward (``ours@fwd_o=fused``: the training forward keeps
# S_c and v_new, so it saves only the output launch there). Untimed; on request only.
FWD_O_SWEEP = ({"fwd_o": "fused"},)
FWD_SWEEP = (*PREP_SWEEP, *FWD_O_SWEEP)
# Forward + backward rows of the backward's alternatives, on the same inputs as `ours`; on request
# only. Their names join the keys with "+" (``ours@kda_qk=fused+kda_qk_bk=16+kda_qk_warps=8``), so
# that --impl can name them. Template v29 (issue 32, fwd+bwd <= 3x the forward; none GPU-timed yet):
# the fused chunk-local backward (`kda_qk` "fused", `kda_chunk_bwd_fused_kernel`: the tiled pair's
# work in one kernel per (chunk, value head), no fp32 dq/dk/dg partials between two kernels) at
# 8 warps, K tile 16 and 32; the reverse state pass with three prefetch stages (GDN's bucket value;
# KDA's bucket keeps 1, untimed for KDA) at 8 warps; both. sm_90 AOT (bf16, K = 128; registers /
# spill bytes): fused BK 16 8 warps 255 / 888, BK 32 8 warps 255 / 1524 (4 warps: 2784 / 4432);
# state pass at state_bv 32 (the H200's pick at B1 H32): 1 stage 255 / 888 at 4 warps, 3 stages
# 255 / 1660 at 4 warps, 255 / 12 at 8 (66.5 KB of shared memory); the tiled pair's wyt 255 / 1672
# and qkt (BK 32) 255 / 1152 at 4 warps. The rows of template v20-v27 (`kda_qk` "serial"; "tiles"
# at K tile 16; 8 warps for the wy kernel and the state pass, with and without it) all lost to the
# tiled default on the H200 (docs/LOG.md, twentieth session, call J) and left.
# Since v62 the reverse state pass at three stages and 8 warps is the k_le_128 bucket's, so its rows (alone and with
# `_FUSED`) left: the fused rows now run it.
_FUSED = {"kda_qk": "fused", "kda_qk_bk": 16, "kda_qk_warps": 8}
QK_SWEEP = (_FUSED, {"kda_qk": "fused", "kda_qk_warps": 8})
# Template v35 (issue 32): `kda_qk` "ktiles" (the fused kernel's V side per (chunk, value head), its K
# tiles per (K tile, chunk, value head); untimed) at `bwd_bv` 32: the K-tile kernel at BK 16 / 8 warps,
# BK 32 / 8 warps, BK 16 / 4 warps (two programs per SM), and the first with the reverse state pass at
# three stages (198 registers, no spills at 4 warps). sm_90 AOT (bf16, every integer marked; registers /
# spill bytes, triton 3.9 | 3.6): V-side kernel 4 warps 251 / 0 | 244 / 0 (BV 64: 255 / 472 | 476);
# K-tile kernel in the row order 246 / 0 | 255 / 24, 255 / 52 | 255 / 336, 255 / 716 | 255 / 296 (the
# tiled pair: wyt 255 / 348 | 324, qkt 255 / 1464 | 1780). `.ci/h200/h32_kdabwd3.sh` times them.
_KT = {"kda_qk": "ktiles", "bwd_bv": 32}
KTILES_SWEEP = ({**_KT, "kda_qk_bk": 16, "kda_qk_warps": 8}, {**_KT, "kda_qk_warps": 8}, {**_KT, "kda_qk_bk": 16},
                {**_KT, "kda_qk_bk": 16, "kda_qk_warps": 8, "state_bwd_stages": 3})
# Template v38 (issue 32): `kda_qk` "ksplit" (the tiled pair with the wy kernel's K tiles in programs of
# their own: v40-v46 `kda_chunk_bwd_wyp_kernel` launched per (chunk, value head) for the V side, then per
# (K tile, chunk, value head) for the K tiles; the row sums, then the same qkt kernel), the k_le_128 bucket's
# since v42. On an H100 (`.ci/h200/h32_kdabwd4.sh`, in git at 047b72b) it took 4.163 ms fwd+bwd against the
# then default's 4.266 at B1 T8192 H32 D128; with the K tiles' launch at 8 warps capped at 128 registers (two
# 8-warp programs per SM) 3.942 / 3.691 ms (wall / CUDA graph) against 3.887 / 3.643 at 4 warps
# (`.ci/h200/h36_kda5.sh`, thirty-seventh session); both passed the bars.
# Template v43 (issue 32), from the thirty-eighth session's Nsight Compute profile of "ksplit" on an H100:
# `kda_wyk_pre` (the K tiles by `kda_chunk_bwd_wykp_kernel`, their epilogue's loads before the V loop) and
# `kda_wyv_pre` (the V side by `kda_chunk_bwd_wyvp_kernel`, the row norms' loads first). On an H100
# (`BUDGET=200 bash .ci/h200/h38_kda6.sh` at 7b365a2, in git there, thirty-ninth session) both at the K
# tiles' BV 32 capped at 168 registers took 3.774 / 3.475 ms against "ksplit"'s 3.917 / 3.646 (the K tiles'
# alone 3.820 / 3.508), bars passed: v46 made them the k_le_128 bucket's, v47 "ksplit"'s only kernels (the
# keys and their rows left). The one row left: the K tiles (now wykp, BV 32) at 8 warps capped at 128
# registers (two 8-warp programs per SM, against the default's three 4-warp ones); untimed in this form.
_KS8 = {"kda_qk": "ksplit", "kda_wyk_warps": 8, "kda_wyk_maxnreg": 128, "kda_wykq": 0}
# v56: "ksplit"'s qkt kernel in one launch, the k_le_128 bucket's before "split" became its default
# Since v62 (the bucket's `kda_wykq` 1) these rows and the qkt rows below pin `kda_wykq` 0: the K tiles and the qkt
# kernel's hot launch as two kernels, as they were timed.
KSPLIT_SWEEP = (_KS8, {"kda_qk": "ksplit", "kda_qkt_cold": "inline", "kda_wykq": 0})
# Template v51 (issue 32): `kda_qkt_cold` "split" ("ksplit"'s qkt kernel in two launches: the chunk tier alone,
# which flags the tiles whose decays do not fit it, then every tier for the flagged tiles; the bench's gates flag
# none), at the default K tile (BK 32) and at BK 16 capped at 168 registers (`kda_qkt_maxnreg`, the hot launch
# only: three programs per SM). sm_90 AOT, triton 3.6: the hot launch 237 registers, no spills (the default's
# 255, 1052 / 1780 B stored / loaded) and 151, no spills (family.py; docs/LOG.md, fortieth session, helper
# kda43). Untimed. v49's rows were "call" (its cold tiers in a noinline function): 3.828 / 3.235 ms against the
# default's 4.008 / 3.507 on an H100, but its GPU bars row faulted (at HV = 2 HK, no tile calling); v51 replaced it.
_COLD = {"kda_qk": "ksplit", "kda_qkt_cold": "split", "kda_wykq": 0}
QKT_COLD_SWEEP = (_COLD, {**_COLD, "kda_qk_bk": 16, "kda_qkt_maxnreg": 168})
# v56 (issue 32): more programs per SM for "split"'s hot launch, which waits on its loads (Nsight Compute,
# thirty-ninth session: long scoreboard 50% of the one-launch build's stalls at two programs per SM). At BK 16
# it needs 131 registers uncapped (three programs per SM) and 128 capped at 128 (four), no spills either way
# (BK 32: 247, two; capped at 168 it spills 384 B); sm_90 AOT, triton 3.6, forty-second session. BK 16 doubles
# the K tiles that read a chunk's dM and dQ, neighbours in the grid (K tile fastest), so mostly from L2. On an
# H100 (forty-second session, call 5; bars passed) wall / graph ms: the default 3.530 / 3.321, BK 16 capped at
# 128 3.551 / 3.263 (-1.7% by graph, +0.6% by wall: not adopted), BK 16 uncapped 3.645 / 3.396 (dropped since).
HOT_SWEEP = ({**_COLD, "kda_qk_bk": 16, "kda_qkt_maxnreg": 128},)
# v57's LOOP_SWEEP (issue 32: "split"'s hot launch over C chunks a program in a pipelined `tl.range`, BK 16, C 4 and
# C 2 at 3 stages; sm_90 AOT, triton 3.6: 186 / 190 registers, no spills, 97 KB) lost on an H100 (forty-third
# session, call 1; bars and memcheck clean) wall / graph ms: the default 3.612 / 3.246, C 4 3.725 / 3.403, C 2
# 3.915 / 3.469 (slower by both clocks); dropped with its keys in template v58.
# Template v60 (issue 32): `kda_wykq` 1, "ksplit"'s K tiles and the qkt kernel's hot launch as one kernel per (K tile,
# chunk, key head) (`kda_chunk_bwd_wykq_kernel`; the V side writes the l2norm's row dots whole, so no fp32 dq, dk, dg
# partials go between two kernels and q, k, g are read once). Untimed. sm_90 AOT (bf16, every integer marked; registers
# / spill bytes, triton 3.6 (the GPU image's) | 3.9): at 4 warps the V side with FULL 250 / 0 | 255 / 24 (the default's
# V side 243 / 0 | 255 / 12) and the fused kernel 255 / 0 | 255 / 12 (the default's K tiles capped at 168: 168 / 0, its
# qkt hot launch 247 / 0 | 239 / 0); with `kda_wy_warps` 8 (both kernels at 8 warps) 206 / 0 | 230 / 0 and 183 / 0 |
# 178 / 0. Capped, the fused kernel spills (triton 3.6: 4 warps at 168 684 B, 8 warps at 128 124 B): no row.
# `.ci/h200/sass_audit.py --only kimi_delta --kernel wy` with these configs (triton 3.6): 0 of 11 builds flagged.
# On an H100 (fifty-fourth session, `.ci/h200/h54b.sh` call 5; B1 T8192 H32 D128, wall / graph ms): the default
# 3.669 / 3.257, `kda_wykq` 3.351 / 2.936 (-9.9% by graph; its two sweep bars rows passed), at 8 warps 4.456 /
# 4.037, and the state pass's row alone (`state_bwd_stages` 3, `kda_state_bwd_warps` 8) 3.374 / 2.981 (-8.5%). The two together (fifty-fifth session, `.ci/h200/h55.sh`)
# 3.093 / 2.693 against the default's 3.638 / 3.265: v62 made them the k_le_128 bucket's. The rows are `kda_wykq`
# with v61's reverse state pass and at 8 warps (the bucket's state pass).
_STATE1 = {"state_bwd_stages": 1, "kda_state_bwd_warps": 0}
WYKQ_SWEEP = ({"kda_qk": "ksplit", "kda_wykq": 1, **_STATE1}, {"kda_qk": "ksplit", "kda_wykq": 1, "kda_wy_warps": 8})
# v61's default (the k_le_128 bucket's before v62): the K tiles and the qkt kernel's hot launch apart, the reverse
# state pass at 1 stage and num_warps.
PREV_SWEEP = ({"kda_wykq": 0, **_STATE1},)
BWD_SWEEP = (*QK_SWEEP, *FWD_O_SWEEP, *KTILES_SWEEP, *KSPLIT_SWEEP, *QKT_COLD_SWEEP, *HOT_SWEEP, *WYKQ_SWEEP,
             *PREV_SWEEP)


SWEEP_ROWS = sweep_rows(FWD_SWEEP, BWD_SWEEP)


def cases() -> list[BenchCase]:
    return [delta_rule_case("kimi_delta", *shape, per_channel=True, fwd_sweep=FWD_SWEEP, bwd_sweep=BWD_SWEEP)
            for shape in SHAPES]


# The nightly regression suite's share (the smaller shape, our kernel alone (the fallback takes 82 ms a forward there)).
NIGHTLY = NightlySpec(cases={"B1T8192H32D128": ("ours", "ours_fwd")}, min_threshold=0.05)
