"""Kimi delta attention family (KDA): the gated delta rule with a per-channel log-space decay.

One variant, `chunk`: g is [B, T, HV, K] (one decay per key channel). The intra-chunk products
sum a_ik b_jk exp(gc_ik - gc_jk) over channels: by dots on 16-row blocks, each with a reference
at the midpoint of its gc range, where a chunk's decays stay within that range's bound (a gc
range of 80 inside a block: per-step log decays to ~-5, as fla's safe gate); otherwise by dots
below the diagonal blocks (a reference row between i and j, both factors <= 1) and elementwise
with the exponent clamped at 0 inside them. So any gate is safe, including ones without a lower
bound. The kernels, API and tuning space of `gated_delta` (its one-kernel prepare step,
`kda_prepare_fwd_kernel`, is `kda_prep` "pipelined", the default from template v26, and "fused":
two Gram passes by its switch PIPE_GRAM, one kernel from v28), plus KDA's own split prepare step
(`_kda_prepare.py.j2`, "split"), its tiled chunk-local backward (`_kda_bwd.py.j2`, a tuning value) and its tuning keys
(`kda_prep`, `kda_prep_warps`, `kda_prep_maxnreg`, `kda_chunk_ref`, `kda_gram_warps`, `kda_wu_warps`,
`kda_qk`, `kda_qk_bk`, `kda_qk_warps`, `kda_wy_warps`, `kda_wyk_warps`, `kda_wyk_maxnreg`,
`kda_wyk_stages`, `kda_wyk_bv`, `kda_qkt_cold`, `kda_qkt_maxnreg`, `kda_wykq`, `kda_state_bwd_warps`), and GDN's `fwd_o`
as a key of its own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, family_module

from . import bench
from .tuning import problem_dims, timing_inputs

# KDA shares the scalar-gated delta rule's kernels (its template includes that family's, with
# the per-channel path on), parameters and tuning space (plus its own keys): it extends that family.
BASE = "gated_delta"
_base = family_module(BASE)
PARAMS = _base.PARAMS
# KDA's own keys (its split prepare step, kimi_delta.py.j2's `_kda_prepare.py.j2`, and the Gram pass of
# the base template's one-kernel prepare step `kda_prepare_fwd_kernel`). One entry per key, default
# first; the measurements behind each are in docs/LOG.md under the session named.
# kda_prep ("pipelined"): the forward's prepare step. "pipelined" the one-kernel step with its Gram
#   pass a straight loop (the chunk tier); a chunk whose gc range passes 2 GRAM_SPAN in a channel is
#   redone by the tiers. "fused" the same kernel with the tiered Gram pass (PIPE_GRAM off; its loops
#   keep Triton from pipelining it). "split" the Gram products and Tm in one kernel, w, u, kd, qg in
#   a second. Default since v26: on the H200 (B1 H32 D128 bf16) the forward took 0.885 ms (CUDA
#   graph) against fused's 0.964 at T8192, 3.377 against 3.614 at T32768, and its bf16 bars passed
#   (docs/LOG.md, twenty-eighth session, helper-55). "fused" beat "split" at v18 (nineteenth
#   session, calls E and F).
# kda_prep_warps (0: num_warps): warps of the one-kernel prepare. 8 warps, and the base key
#   prep_bk 16, were slower on the H200 (docs/LOG.md, twenty-seventh session, calls 1-5).
# kda_prep_maxnreg (0: none): register cap of the one-kernel prepare. 168 (three 4-warp programs
#   per SM) was slower: 0.723 against 0.696 ms at T8192 (twenty-eighth session, helper-55).
# kda_chunk_ref (0): 1 makes the split Gram kernel try one reference per chunk before the
#   per-block ones. No gain at T8192 (docs/LOG.md, eighteenth session, calls B and C). The
#   one-kernel prepare always has it.
# kda_gram_warps (0: num_warps), kda_wu_warps (8): warps of the split prepare's two kernels. 8 for
#   the w/u kernel from the build (198 registers at 4 warps, 80 at 8); untimed.
# kda_qk ("tiles"): the chunk-local backward's second half. "tiles" the wy kernel also writes the
#   l2norm row dots, then `kda_chunk_bwd_qkt_kernel` per (K tile, chunk, key head). "serial" one
#   qk kernel per (chunk, key head) over the K tiles in turn, then a second l2norm pass. "fused"
#   (v29) one program per (chunk, value head), no fp32 dq/dk/dg partials; v33 fixed its fault on
#   the H200 (triton 3.6). "ktiles" (v35) the fused kernel's V side and its K tiles as two
#   kernels. Default "tiles" (k_le_128: "ksplit", below): fwd+bwd 3.872 ms against 5.003 for "serial" at T8192 (docs/LOG.md,
#   twentieth session, call J); "fused" and "ktiles" untimed (`bench.BWD_SWEEP`,
#   `bench.KTILES_SWEEP`). "ksplit" (v38) the tiled pair with the wy kernel's K tiles in programs of
#   their own (the wyt kernel's body `_kda_wy_head` in two kernels: since v47 the V side per (chunk, value
#   head) by `kda_chunk_bwd_wyvp_kernel`, then the K tiles per (K tile, chunk, value head) by
#   `kda_chunk_bwd_wykp_kernel`; a row-sum kernel, then the same qkt kernel): on an H100 (v38-v42, the two
#   parts as launches of one kernel by the head's PART, `kda_chunk_bwd_wyp_kernel`) fwd+bwd 4.163 ms against
#   the default's 4.266 at B1 T8192 H32 D128 (`.ci/h200/h32_kdabwd4.sh`, in git at 047b72b, thirty-sixth
#   session; bars passed).
# A removed key: v38's kda_qk_tiers "split" (the qkt kernel as its chunk tier, `kda_chunk_bwd_qkc_kernel`,
#   then the redo of the tiles it flagged) faulted on an H100 (triton 3.6, "an illegal memory access" in
#   qkc) at one value head per key head (HV = HK: the bench's layout and HK = HV = 2 at T 1000) and ran
#   clean at HV = 2 HK; the interpreter's bounds check at the faulting shape found every access in
#   bounds, so the fault is in the build; v40 removed it (docs/LOG.md, thirty-sixth session).
# kda_qk_bk (0: BK): the K tile of the "tiles" qk kernel, the "fused" kernel and the "ktiles" K-tile
#   kernel.
# kda_qk_warps, kda_wy_warps (0: num_warps): warps of the backward's qk and wy kernels;
#   kda_qk_warps also sizes the "fused" and K-tile kernels, kda_wy_warps the V-side kernel and
#   "ksplit"'s V side (`kda_chunk_bwd_wyvp_kernel`).
# kda_wyk_warps (0: kda_wy_warps, else num_warps), kda_wyk_maxnreg (0: no cap): warps and register cap of
#   "ksplit"'s K tiles (`kda_chunk_bwd_wykp_kernel`; v38-v39 wyk, v40-v46 the wyp kernel's PART 2). sm_90
#   AOT at the bench shape (bf16, JIT marks; registers, triton 3.9 | 3.6, v39's wyk): 4 warps 204 | 229, 8
#   warps 124 | 139, no spills: on 3.6 two 4-warp or one 8-warp program per SM, as the wyt kernel's 255; 128 at 8 warps (two
#   per SM, no spills) and 168 at 4 (three; 36 | 56 B of spills) are the caps that add programs. v40's
#   PART 2 (triton 3.6, same marks): 242 registers at 4 warps, no spills; 128 with 16 B of spills at 8
#   warps capped at 128; its PART 1 244, no spills (v39's wyv 247).
# kda_wyk_stages (0: num_stages), kda_wyk_bv (0: bwd_BV): the stages and V tile of the V loop of "ksplit"'s
#   K tiles, `kda_chunk_bwd_wykp_kernel` (v43): the head's K tile (PART 2 of v40-v46's wyp kernel) with the
#   epilogue's q, k, g, Tm (and beta, the row scales) loaded before the V loop, a `tl.range`. Why: on an
#   H100 PART 2 took 871 us at 242 registers, 45% of its warp samples long-scoreboard stalls: the loop's
#   loads are cp.async, the epilogue's were plain loads each waited on (global -> registers -> shared, a
#   barrier) after the loop (Nsight Compute, `.ci/h200/h37_ncu.sh`, thirty-eighth session). sm_90 AOT (bf16,
#   every integer marked; triton 3.6): 226 registers, no spills at BV 64; BV 32 capped at 168 (three
#   programs per SM) no spills (36 KB of shared memory; 3 stages 52 KB); PART 2 capped at 168 spilled 96 B.
#   "ksplit"'s V side, `kda_chunk_bwd_wyvp_kernel` (v43), is the head's V side (PART 1) with the l2norm's
#   row norms first, its q, k loads over the K tiles unrolled (issued together, beside the V loop's first
#   cp.async copies), where PART 1 walked them tile by tile after its V loop (329 us on the H100, 61%
#   long-scoreboard stalls; its hottest SASS rows bf16 unpacks waiting on those loads). sm_90 AOT (triton
#   3.6): 243 registers, no spills, 64 KB (PART 1 244, 0, 64 KB). v43-v46 had them as options (keys
#   `kda_wyk_pre`, `kda_wyv_pre`); v46 made both the k_le_128 bucket's, with BV 32 and the cap 168 (numbers
#   at `_KDA_BUCKET`); v47 removed the wyp kernel and the two keys (the bucket's kernels' sm_90 PTX the
#   same; docs/LOG.md, thirty-ninth session).
# kda_qkt_cold ("inline"), kda_qkt_maxnreg (0: no cap): "ksplit"'s qkt kernel (only that launch: the
#   "tiles" one is the base template's). "split" (v51) launches it twice, with no host read between: the hot
#   launch (SPLIT 1) runs the chunk tier alone for a tile whose decays fit it (every tile of the bench's gates
#   and of fla's safe gate; `_kda_qkt_fits`) and writes its flag (an int32 per (K tile, chunk, key head)) 0;
#   any other tile writes its flag 1 and nothing else; the cold launch (SPLIT 2) runs the three tiers for the
#   flagged tiles (the others read their flag and end). Every tile is written once, its dg partials read
#   intact. So the tiers the hot path never takes no longer set its registers, and no build has a call.
#   `kda_qkt_maxnreg` caps the hot launch only. sm_90 AOT at the bench shape (bf16, every integer marked;
#   registers, spill bytes stored / loaded, shared memory; triton 3.6, the GPU image's | 3.9): hot BK 32 237,
#   0 / 0, 20 KB | 255, 8 / 8; hot BK 16 136, 0 / 0, 18 KB | 140, 0 / 0 (three programs per SM, uncapped);
#   capped at 168 151 | 148, 0 / 0; the cold builds are the default's under their flag (BK 32 255, 1064 /
#   1796, 36 KB | 1308 / 1684; BK 16 255, 0 / 0); the one-launch default BK 32 255, 1052 / 1780 | 1280 / 1652.
#   **v51 faulted on an H100** (torch 2.11, triton 3.6; fortieth session, call 5): both bench rows
#   (`ours@kda_qk=ksplit+kda_qkt_cold=split`, and with `kda_qk_bk` 16 + `kda_qkt_maxnreg` 168) raised "an illegal
#   memory access" at B1 T8192 H32 D128, HV = HK, where "call" had run (the CPU bounds check passes both
#   launches). compute-sanitizer (forty-first session): "Out-of-range shared or local address" at
#   kda_chunk_bwd_qkt_kernel+0x64b0, `_dot`'s bf16 line. The cause (helper kda41, sm_90 builds with triton 3.6
#   on the CPU): the hot launch's build, a ptxas 12.8 miscompile. Its PTX is right (20480 B of shared: dM at 0,
#   dQ at 8192, a B operand at 16384), but the chunk tier's fourth dot (dQ^T (q e)) takes its B operand at
#   offset 0, where the dead dM's A operand was, and ptxas builds that wgmma's K steps 2-4 (SASS 0x64b0, 0x6500,
#   0x6730) with B descriptors from the shared base register (low word base + 0x40, high word base +
#   0x80000020: stride 16896 B for 512), so they read past the CTA's shared memory: 0x64b0 is the
#   sanitizer's address. Also at BK 16 (stride 16640 for 256) and at G 2; the default's and the cold launch's
#   builds are right (their allocation differs); ptxas 12.9 (triton 3.9) builds the same PTX right.
#   v52-v53 (`_kda_qkt_chunk_dots`, the hot launch's own chunk tier, the same values: the column side's dots
#   first, so no B operand takes dM's or dQ's memory): every wgmma descriptor of the qkt builds read back from
#   the SASS is right (tests/kernel_tests/sass_hgmma.py; test_aot_sm90_qkt_wgmma_descriptors fails on v51 with
#   triton 3.6); triton 3.6 | 3.9: hot BK 32 247 | 239 registers, 0 spills, 20 KB; capped BK 16 147 | 139; the
#   default's and cold builds' SASS unchanged. On an H100 (forty-first session) memcheck clean, 6.9% faster
#   by graph; its cold launch's 4-warp build wrong at G 2 (forty-second session), at 8 warps since v56, the
#   k_le_128 bucket's default (below).
# A removed value: v49-v50's "call" (the chunk tier inline, any other tile's three tiers in `_kda_qkt_cold`, a
#   Triton `noinline` function the kernel called): on an H100 (torch 2.11, triton 3.6; fortieth session) fwd+bwd
#   3.828 ms wall / 3.235 by CUDA graph against the default's 4.008 / 3.507 at B1 T8192 H32 D128 (HV = HK; the
#   bench's gates fit: the call never ran), but its GPU bars row faulted ("an illegal memory access") at the qkt
#   launch, grid (4, 16, 4): HV = 2 HK, and there too every tile fits (the interpreter flags none of the 256 at
#   that case; its widest chunk's gc span 44 against the limit 80), so the fault came from that build at G 2
#   with no tile calling, not from the called tiers; v51 replaced it by "split" (no call in any build).
#   v38-v39's `kda_qk_tiers` "split" was a two-kernel form of the same partition and faulted on an H100 at HV =
#   HK (above), ran clean at HV = 2 HK; its chunk-tier kernel masked its stores by a count of unfit heads, where
#   "split"'s hot launch has the whole tile under one `if fits` (as "call"'s hot path). sm_90 AOT at G 2 (triton
#   3.6; spill bytes loaded): the hot launch BK 32 255 registers, 244 B; BK 16 capped 168, 172 B (the default 255,
#   4716 B). `test_qkt_split_cold_tiles_on_gpu` runs both launches on the GPU at G 1 and 2 with tiles flagged.
# Removed keys: v57's `kda_qkt_chunks` (1, 2, 4) and `kda_qkt_stages` (0, 2, 3), "split"'s hot launch over C
#   chunks a program in a pipelined `tl.range` (HV = HK only; every load a cp.async copy, at 3 stages the next
#   chunk's in flight under this one's dots; sm_90 AOT, triton 3.6: BK 16 C 4 / 3 stages 186 registers, no spills,
#   97 KB, two programs per SM). On an H100 (forty-third session, call 1; bars, flagged-tile test and memcheck
#   clean) wall / graph ms: the default 3.612 / 3.246, BK 16 C 4 / 3 stages 3.725 / 3.403, C 2 / 3 stages
#   3.915 / 3.469: slower by both clocks; removed in v58.
# kda_wykq (0): 1 (v60, under "ksplit") runs "ksplit"'s K tiles and the qkt kernel's hot launch as one kernel
#   per (K tile, chunk, key head), `kda_chunk_bwd_wykq_kernel` (`_kda_bwd_wykq.py.j2`): the V side
#   (`kda_chunk_bwd_wyvp_kernel`, FULL) writes the l2norm's row dots whole in the fused kernel's closed form, so
#   each K tile finishes its dq, dk, dg in one visit, with no fp32 dq, dk, dg partials written and read back
#   and one read of q, k, g; a tile whose decays do not fit the chunk tier writes its partials and its flag,
#   and the qkt kernel's cold launch (SPLIT 2) runs it (the K tiles' BK; `kda_qk_bk` has no effect). Its warps
#   and V loop are the K tiles' (`kda_wyk_warps`, `kda_wyk_bv`, `kda_wyk_stages`), uncapped. The k_le_128
#   bucket's since v62 (below).
# kda_state_bwd_warps (0: num_warps): warps of the reverse state pass. Its spills at 4 warps came
#   from builds that marked only the pointers; with every integer marked it has none (194
#   registers; docs/LOG.md, thirtieth session, helper-66).
# fwd_o ("split"; GDN's key, KDA's own since GDN v17): "split" computes o = qg S_c + Aqk v_new in
#   `kda_output_fwd_kernel`; "fused" in the state pass while S_c is in registers (no output
#   launch, and an inference forward stores neither S_c nor v_new). "fused" is the k_le_128
#   bucket's value, inherited from GDN's buckets: on the H200 KDA's forward took 0.807 ms (CUDA
#   graph) against 0.901 at T8192 and passed the bars (docs/LOG.md, thirtieth session, device
#   calls 1-4).
# AOT spill counts from builds that mark only the pointers describe a build the GPU does not run;
#   the chunk kernels' spills are real, the state passes' are not (docs/LOG.md, helper-66).
TUNING_SPACE = {**_base.TUNING_SPACE, "kda_prep": ("split", "fused", "pipelined"), "kda_prep_warps": (0, 4, 8),
                "kda_prep_maxnreg": (0, 128, 168),
                "kda_chunk_ref": (0, 1),
                "kda_gram_warps": (0, 4, 8), "kda_wu_warps": (0, 4, 8),
                "kda_qk": ("serial", "tiles", "fused", "ktiles", "ksplit"),
                "kda_qk_bk": (0, 16, 32, 64), "kda_qk_warps": (0, 4, 8), "kda_wy_warps": (0, 4, 8),
                "kda_wyk_warps": (0, 4, 8), "kda_wyk_maxnreg": (0, 128, 168),
                "kda_wyk_stages": (0, 2, 3), "kda_wyk_bv": (0, 16, 32, 64, 128),
                "kda_qkt_cold": ("inline", "split"), "kda_qkt_maxnreg": (0, 128, 168), "kda_wykq": (0, 1),
                "kda_state_bwd_warps": (0, 4, 8), "fwd_o": ("split", "fused")}
DEFAULT_CONFIG = {**_base.DEFAULT_CONFIG, "kda_prep": "pipelined", "kda_prep_warps": 0, "kda_prep_maxnreg": 0,
                  "kda_chunk_ref": 0, "kda_gram_warps": 0,
                  "kda_wu_warps": 8, "kda_qk": "tiles", "kda_qk_bk": 0, "kda_qk_warps": 0, "kda_wy_warps": 0,
                  "kda_wyk_warps": 0, "kda_wyk_maxnreg": 0, "kda_wyk_stages": 0, "kda_wyk_bv": 0,
                  "kda_qkt_cold": "inline", "kda_qkt_maxnreg": 0, "kda_wykq": 0, "kda_state_bwd_warps": 0,
                  "fwd_o": "split"}
SHAPE_BUCKETS, block_params, delta_rule_samples = (_base.SHAPE_BUCKETS, _base.block_params,
                                                   _base.delta_rule_samples)

NAME = "kimi_delta"
# GDN's buckets less what was timed on GDN's kernels only: the prepare kernel's K tile and stages
# (KDA's per-channel Gram differs), the backward WY kernel's V tile, GDN's row-factor forward
# (`fused_kq`, `rows_maxnreg`: keys KDA's own prepare does not have), and k_le_128's three-stage
# chunk kernels (KDA's keep the stages they had: _KDA_BUCKET). The state passes are one kernel for
# both (but for KDA's [K] gate load), so KDA takes their stages: its forward went 3.342 -> 3.075 ms
# (B1 T8192 H32 D128; docs/LOG.md, sixth session). k_le_128 also takes `kda_qk` "ksplit" (v42): on
# an H100 fwd+bwd 3.887 ms wall / 3.643 by CUDA graph against "tiles"' 3.965 / 3.760 at B1 T8192 H32
# D128, its bf16 bars passed (`.ci/h200/h36_kda5.sh`; docs/LOG.md, thirty-seventh session). And (v46)
# `kda_wyk_pre` 1 at `kda_wyk_bv` 32 capped at 168 registers with `kda_wyv_pre` 1 (the wykp and wyvp kernels,
# since v47 "ksplit"'s only ones: the bucket keeps the V tile and the cap): on an H100 (torch 2.11,
# triton 3.6; `BUDGET=200 bash .ci/h200/h38_kda6.sh` at 7b365a2, thirty-ninth session) fwd+bwd 3.774 ms wall /
# 3.475 by CUDA graph against "ksplit"'s 3.917 / 3.646 (graph -4.7%, wall -3.7%; the K tiles' row alone
# 3.820 / 3.508) at B1 T8192 H32 D128, ours_fwd 0.907 / 0.810, both rows' bf16 bars passed; fwd+bwd over fwd
# by graph 4.29x (was 4.50x; goal 3x). And (v56) `kda_qkt_cold` "split" (its cold launch at 8 warps, v56): on
# an H100 (v53, forty-first session, `.ci/h200/kda_split_check.sh` and its calls 4-5) fwd+bwd 3.481 / 3.212 and
# 3.619 / 3.218 ms (wall / CUDA graph) against "inline"'s 3.728 / 3.450 and 3.813 / 3.450 at B1 T8192 H32 D128
# (graph -6.9%; fwd+bwd over fwd 3.97x from 4.26x), memcheck clean; the forty-second session's GPU checks of
# the cold launch at both head layouts (docs/LOG.md). And (v62) `kda_wykq` 1 with the reverse state pass at 3
# stages and 8 warps (`state_bwd_stages` 3, `kda_state_bwd_warps` 8): on an H100 (fifty-fifth session,
# `LIMIT=575 STEPS="kda wykq" bash .ci/h200/h55.sh`, one run) fwd+bwd 3.093 / 2.693 ms (wall / CUDA graph)
# against v61's 3.638 / 3.265 (graph -17.5%) and `kda_wykq` alone 3.292 / 2.950 at B1 T8192 H32 D128, the
# forward 0.928 / 0.804 (fla's 1.951 / 1.248): fwd+bwd over fwd 3.35x by graph (v61 4.06x); the three rows'
# bf16 bars and the cold-tile check at HV = HK passed on that H100.
_GDN_ONLY = ("prep_bk", "prep_stages", "bwd_bv", "fused_kq", "rows_maxnreg")
_KDA_BUCKET = {"k_le_128": {"num_stages": 2, "state_bwd_stages": 3, "kda_qk": "ksplit", "kda_wyk_bv": 32,
                            "kda_wyk_maxnreg": 168, "kda_qkt_cold": "split", "kda_wykq": 1,
                            "kda_state_bwd_warps": 8}}
KDA_BUCKETS = tuple(dataclasses.replace(b, config={**{k: v for k, v in b.config.items() if k not in _GDN_ONLY},
                                                   **_KDA_BUCKET.get(b.name, {})})
                    for b in SHAPE_BUCKETS)


def match(block: Any) -> dict[str, Any] | None:
    """`linear_attention.kimi_delta` blocks (decay cumsum over a non-last dim: per-channel gate)."""
    if block.kind != "linear_attention.kimi_delta":
        return None
    return FAMILY.served("chunk", block_params(block))


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    return delta_rule_samples(gen, per_channel=True)


FAMILY = FamilySpec(
    plan_saves="delta_rule",
    name=NAME,
    template="kimi_delta.py.j2",
    # v62: the k_le_128 bucket takes `kda_wykq` 1, `state_bwd_stages` 3 and `kda_state_bwd_warps` 8 (above); the
    # template is unchanged. bench.PREV_SWEEP keeps v61's default beside it; the "ksplit" rows that describe the
    # K tiles and the qkt kernel apart (KSPLIT_SWEEP, QKT_COLD_SWEEP, HOT_SWEEP) pin `kda_wykq` 0. The reverse state
    # pass's AOT spec takes `kda_state_bwd_warps` as its launch does (the base template, KDA regions only: GDN's
    # render unchanged); before, it said num_warps, so the AOT check built a state pass the GPU did not run.
    # v61: `_kda_bwd_wykq.py.j2`'s byte counts corrected (a comment; the kernels unchanged).
    # v60: `kda_wykq` 1 (off; above): `kda_chunk_bwd_wykq_kernel` (`_kda_bwd_wykq.py.j2`), the V side's FULL
    # (p_qg, p_h: the row dots whole) and `_backward_wykq`; the default's launches and kernels' code paths unchanged.
    # v59: the qkt kernel's flag index ((key head * NT + chunk) * NK + K tile, the hot launch's store and the cold
    # one's load) is one `@triton.jit` helper, `_kda_qkt_flag`; its sm_90 builds unchanged (PTX equal but for
    # debug lines, triton 3.9: the inline and both `QKT_COLD_SWEEP` rows, G 1 and 2).
    # v58: v57's hot-launch chunk loop removed (`kda_qkt_chunks`, `kda_qkt_stages`, the kernel's CHUNKS / STAGES,
    # `_kda_qkt_tile`'s LOOP / m_run, the host's `_qkt_loop`, bench.LOOP_SWEEP): slower than the default on an H100
    # by both clocks (above). The template's qkt kernel is v56's text again; the default's qkt builds unchanged
    # (sm_90, triton 3.6: PTX and TTGIR equal to v57's but for debug lines; the hot launch 247 registers, 0
    # spills, 20 KB).
    # v57: `kda_qkt_chunks`, `kda_qkt_stages` (off; above): "split"'s hot launch over C chunks a program in a
    # pipelined `tl.range` (`kda_chunk_bwd_qkt_kernel`'s CHUNKS, STAGES; `_kda_qkt_tile`'s LOOP: dM's and dQ's loads
    # masked past the last chunk, every store by the tile's fit), at HV = HK only; the qkt specs name CHUNKS 1 and
    # STAGES 2 (the kernel's defaults). The default's launches and kernels' code paths unchanged (the hot launch's
    # sm_90 build, triton 3.6: 247 registers, 0 spills, 20 KB, as v56). Untimed on a GPU (bench.LOOP_SWEEP).
    # v56: `kda_qkt_cold` "split" is the k_le_128 bucket's (bench KSPLIT_SWEEP keeps "inline" beside it), its
    # cold launch (SPLIT 2) at 8 warps (`QKT_COLD_WARPS`): on an H100 (forty-second session) the 4-warp cold
    # build at two value heads per key head gave wrong bf16 dq / dg on the tiles it ran (triton 3.6 / ptxas 12.8; a build
    # the SASS checker finds nothing in: fp32 right, the one-launch build's TTGIR the same but the flag branch);
    # the 8-warp build passed the cold-tier test at both head layouts. Every other build unchanged.
    # v55 GPU check (H100, forty-second session): memcheck of both 8-warp "ktiles" bench rows 0 errors; the
    # bars passed at BK 16 (4 and 8 warps) but not at BK 32, 8 warps (NaN dk, dg, dbeta); untimed still.
    # v55: the ktiles K-tile kernel (`kda_chunk_bwd_ktile_kernel`) builds right with ptxas 12.8 (triton 3.6, the
    # GPU image's): v54's 8-warp builds (bench KTILES_SWEEP rows at 8 warps, BK 16 and 32) took the K steps of
    # the dot dx = Tm^T dw with B descriptors from an unrelated uniform register (the shared base: stride
    # 16640 B for 256, or starts outside the window), v51's miscompile, and the 4-warp BK 16 build at bwd_bv 64
    # its 16-row Gram tier's (`_kda_gram_bwd_dots`) likewise. v55: dx after dq, and below BK 32 as the fused
    # kernel's (dw^T Tm)^T (an mma.sync; the same products, fp32 sums in another order); the Gram tiers by
    # `_kda_ktile_gram_dots` (the base's dots to the same accumulators, in another order: the same values).
    # The fused kernel's render and every other kernel unchanged. `OMP_NUM_THREADS=1 PYTHONPATH=/work/main
    # /tmp/t36/bin/python .ci/h200/sass_audit.py --only kimi_delta --kernel ktile --sweep` (triton 3.6.0, ptxas
    # 12.8): v54 5 of 7 builds flagged (20 descriptors), v55 0 of 7. Untimed; not yet run on a GPU.
    # v54 (with the base's v34): a `_tiles` hit also takes equal pins set again (bench sweep rows). On an H100
    # (forty-first session, `host_step.py`) v52's step: host 1.108 ms, GPU 3.466, wall 3.639 (v51: 1.490 /
    # 3.511 / 3.860); v53's "split" ran memcheck-clean and 6.9% faster by graph in two runs (docs/LOG.md);
    # its cold-tier GPU test has not finished inside a call yet, so it stays off.
    # v53 (its notes and tests; the render is v52's, whose commit took this change from the shared working
    # tree): the hot launch of `kda_qkt_cold` "split" (SPLIT 1) runs its chunk tier by `_kda_qkt_chunk_dots`
    # (`_kda_gram_bwd_dots` at BC = BT, its dots reordered: v51's build by ptxas 12.8 read shared memory out
    # of range, above); the default's and the cold launch's builds unchanged (sm_90 SASS equal, triton 3.6).
    # v52 (with the base's v33; host cost of the training step, the kernels' maths unchanged): no torch.zeros
    # d(final state) when the final state has no gradient (the reverse state pass's HAS_DHT), `_cdiv` / `_npow2`
    # on the host, `_tiles` cached (a pin still applies: test_training_step_host_cost); "ksplit"'s row-sum
    # kernel stores dbeta in beta's dtype (no cast launch after; "tiles", "serial", "fused" and "ktiles" keep
    # it fp32 and cast: "ktiles" adds K tiles' shares by atomics). At the bench's B1 T8192 H32 D128 step: 7 Triton
    # launches, aten launches 2 -> 0, 32 allocations; host time per fwd+bwd on a CPU (CPU tensors, Triton's
    # JITFunction.run stubbed, medians of 7 interleaved rounds of 200 steps, v51 against v52): 0.743 -> 0.514 ms
    # (v51's includes the CPU's own 4 MB zeros fill, a launch on a GPU). Untimed on a GPU. sm_90 builds (bf16,
    # K = V = 128, every integer marked; triton 3.6 | 3.9): the reverse state pass at HAS_DHT False 250 | 250
    # registers, True (v51's build) 248 | 250, no spills; the row sums with a bf16 dbeta 62 registers (v51 56), 4 KB
    # of shared memory (v51 0).
    # v51: `kda_qkt_cold` "split" (off; above) replaces "call": the qkt kernel's chunk-tier launch flags the
    # tiles that do not fit it, a second launch runs those with every tier (SPLIT, p_flag: the base template's
    # "tiles" launch and the default's build unchanged, sm_90 PTX equal but for debug sections); it faults on
    # an H100 (above).
    # v50: aot_specs carry the launches' register caps (`kda_wyk_maxnreg`, `kda_qkt_maxnreg` under "ksplit"),
    # which `aot.compile_module` now builds with: the k_le_128 bucket's wykp is checked at 168, as it runs.
    # v49: `kda_qkt_cold` "call" and `kda_qkt_maxnreg` (off; above): the qkt kernel's body is `_kda_qkt_tile`
    # (its sm_90 PTX unchanged but for debug labels), its cold tiers callable; untimed.
    # v48: the base's `_kda_wy_head` (KDA regions only; GDN's render unchanged) loses what only the wyp kernel
    # reached: the PART constexpr's V-side-only and K-tile-only branches and the i_kp, R arguments; its callers
    # (the "serial" wy kernel, ROW_DOTS off; the wyt kernel, ROW_DOTS on) updated; the kernels' sm_90 PTX
    # unchanged (docs/LOG.md, thirty-ninth session).
    # v47: "ksplit" runs its V side by `kda_chunk_bwd_wyvp_kernel` and its K tiles by `kda_chunk_bwd_wykp_kernel`
    # always: the wyp kernel (the head's PART 1 and 2) and the keys `kda_wyk_pre`, `kda_wyv_pre` are gone; the
    # k_le_128 bucket's kernels' sm_90 PTX unchanged (docs/LOG.md, thirty-ninth session).
    # v46: the k_le_128 bucket takes `kda_wyk_pre` 1 (`kda_wyk_bv` 32, `kda_wyk_maxnreg` 168) and `kda_wyv_pre`
    # 1 (above); the template is unchanged.
    # v45: with the base's v30, `aot_specs` builds its variant specs with one helper (the same specs);
    # kernels unchanged.
    # v44: with the base's v28, `aot_specs` also holds the forward without training as it launches (the
    # prepare without Tm and M, the fused state pass keeping nothing) and the state spec is the training
    # launch; the default's kernels unchanged.
    # v43: `kda_wyk_pre`, `kda_wyv_pre` (off): "ksplit"'s K tiles by `kda_chunk_bwd_wykp_kernel` (their
    # epilogue's loads before the V loop), its V side by `kda_chunk_bwd_wyvp_kernel` (the row norms' loads
    # first, together); the default's kernels unchanged.
    # v42: the k_le_128 bucket takes `kda_qk` "ksplit" (above); the template is unchanged.
    # v41: with the base's v26 (the AOT specs type u as the runtime allocates it; the base's `_prepare`
    # no longer rendered beside KDA's own), the split prepare's wu spec u in IDT; the default's kernels
    # unchanged. History: docs/LOG.md
    template_version=62,
    folder=Path(__file__).parent,
    extends=BASE,
    variants={"chunk": "chunked delta rule, per-channel decay; fwd, bwd, recurrent decode"},
    params=PARAMS,
    tuning_space=TUNING_SPACE,
    default_config=DEFAULT_CONFIG,
    shape_buckets=KDA_BUCKETS,
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("B", "T", "HK", "K"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=_base.FAMILY.binding,
)
