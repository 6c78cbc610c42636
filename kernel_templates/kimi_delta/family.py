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
`kda_qk`, `kda_qk_bk`, `kda_qk_warps`, `kda_wy_warps`, `kda_state_bwd_warps`), and GDN's `fwd_o` as a key of its own.
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
# the base template's one-kernel prepare step `kda_prepare_fwd_kernel`):
# kda_prep "fused" (the default of templates v19-v25): the one-kernel prepare step with its tiered
#   Gram pass (a tier per K tile, `_kda_gram_tiers`);
#   "split": the Gram products and Tm = (I + A)^-1 in one kernel, w, u, kd, qg in a second one
#   over K and V tiles (template v18's default). On the H200 (bf16, `onboard bench --family
#   kimi_delta --case B1T8192H32D128 --case B1T32768H32D128 --impl
#   ours,ours_fwd,fla_fwd,ours@kda_prep=fused_fwd --profile` at v18) the forward took, wall / CUDA
#   graph ms: T8192 split 1.383 / 1.092, fused 1.330 / 0.960 (fla 0.6 1.607 / 1.069); T32768
#   split 4.421 / 4.158, fused 4.029 / 3.620 (fla 4.441 / 4.129): fused at both, so the default.
#   "pipelined" (template v25): the one-kernel step with its Gram pass a straight loop (the chunk
#   tier alone, `_kda_gram_chunk`); a chunk whose gc range passes 2 GRAM_SPAN in some channel is
#   redone after it by the tiers. Templates v25-v27 had it as a second kernel
#   (`kda_prep_pipe_fwd_kernel`, the fused kernel's tail copied); v28 made the two one kernel, the
#   Gram pass by the constexpr PIPE_GRAM. sm_90 AOT (bf16 and fp32, K 128, chunk 64, the default
#   tiles; bf16 also at prep_bk 16, the fused pass there at 8 warps): each path's TTGIR equals its
#   v27 kernel's as a dataflow graph (up to names, locations and the order of independent ops),
#   the same shared memory (49152 B), registers (255) and ptxas spills, but for the fused pass's
#   4-warp builds (bf16 992 -> 988 B, fp32 9944 -> 9972 B): their PTX instructions are identical,
#   only the debug line labels moved (ptxas on the PTX without them: the same spills before and
#   after). The tiered pass's loops keep Triton from pipelining it (sm_90 TTGIR: no async copies
#   in it). Twenty-eighth session, prepare step alone on the H200 (`.ci/h200/h32_kda3_prep.py`,
#   graph ms at T8192 / T32768, B1 H32 D128 bf16, the bench's inputs): default 0.696 / 2.645;
#   ablations of the fused kernel (outputs wrong, timing only): the chunk tier alone 0.624 / 2.366,
#   no Gram products 0.470 / 1.748, no solve 0.591 / 2.270, no w/kd/qg pass 0.486 / 1.888, no u
#   0.633 / 2.453; `prep_stages` 3 0.667 / 2.571; `kda_prep_maxnreg` 168 0.723 / 2.763. A "lean"
#   variant (Aqk moved to the w pass, k's product alone in the Gram pass) took 0.765 / 2.949 and
#   gave NaN in w on the H200's triton 3.6 (its w pass held two dots; not in the interpreter):
#   dropped before commit. The whole forward (`onboard bench ... --impl
#   ours_fwd,ours@kda_prep=pipelined_fwd --profile`, same session, wall / CUDA-graph ms): T8192
#   default 1.191 / 0.964, pipelined 1.089 / 0.885; T32768 default 3.847 / 3.614, pipelined
#   3.687 / 3.377. fla 0.6's chunk_kda in the call before (`.ci/h200/h32_kda3.sh`'s bench step, its
#   default row 1.112 / 0.962 and 3.819 / 3.622): 1.692 / 1.085 and 4.643 / 4.159, so pipelined is
#   1.55x / 1.23x (T8192) and 1.26x / 1.23x (T32768) of fla, across the two calls. Its GPU bf16 bars
#   passed (`test_bf16_vs_fp32_on_gpu_fwd_sweep[kda_prep=pipelined]`). The default from template
#   v26 (the lead): it beat the fused default in the same call and passed the bars; fla and
#   pipelined in one call are not measured yet (`.ci/h200/h32_kda3.sh` does that, with "fused" as
#   the sweep row). `prep_stages` 3 (the fused or the pipelined
#   kernel) failed those bars (o 643x the fp32 run's norm, the same for both kernels; the bf16
#   prepare outputs at T8192 equalled the default's, so likely the fp32 build at three stages on
#   triton 3.6; not looked into).
# kda_prep_warps: warps of the one-kernel prepare ("fused", "pipelined"; 0: num_warps). sm_90 AOT (bf16, K 128)
#   of the fused kernel: 4 warps 255 registers / 992 B of spills, 8 warps 255 / 100 B; at prep_bk 16
#   (the base family's key: the fused kernel's K tile, 0: BK): 4 warps 255 / 32 B, 8 warps 255 / 4 B.
#   Both are plain launch / tile parameters of the fused kernel and stay tuning values, but neither
#   beat the default on the H200 (`BUDGET=225 bash .ci/h200/h32_kda2.sh` at template v23, in git at e1f525a, B1 H32
#   D128 bf16, forward only, wall / CUDA-graph ms at T8192, then at T32768): default 1.057 / 0.936,
#   3.915 / 3.611; kda_prep_warps 8 1.578 / 1.412, 5.875 (wall); prep_bk 16 1.426 / 1.145,
#   4.748 / 4.418; both 2.007 / 1.692. Template v23's "fused2" (`kda_prep2_fwd_kernel`: the fused
#   kernel with gl stored from the Gram pass, Tm cast once to its dot dtype, its own w/kd/qg K tile
#   `kda_prep_bk2`) lost too: 1.086 / 0.949, 4.000 / 3.690; with prep_bk 16 and 8 warps
#   1.990 / 1.703. Every row passed the accuracy bars. v24 removed "fused2" (kernel, key, tests),
#   the bench's forward rows of these configs and the script (it timed nothing else; in git at
#   e1f525a).
# kda_prep_maxnreg: a register cap on the one-kernel prepare step ("fused", "pipelined"; 0: none),
#   for three 4-warp programs per SM at 168 (sm_90 AOT of the fused kernel: 388 B of spills): slower
#   (above), a tuning value.
# kda_chunk_ref 1 (split only): the split Gram kernel tries one reference per chunk (v17's
#   chunk-wide tier) before the per-block ones; 0 (default): the tier measured no gain in the split
#   kernel at T8192 (1.122 against 1.080-1.094 ms), so it is a tuning value. The fused kernel
#   always has it.
# kda_gram_warps, kda_wu_warps: the split kernels' warps (0: num_warps). The w/u kernel streams
#   (sm_90 AOT: 198 registers at 4 warps, 80 at 8): 8, untimed.
# kda_qk: the chunk-local backward's second half. "tiles" (default, `_kda_bwd.py.j2`): the wy kernel
#   also writes the l2norm row dots and dA beta, dAqk scale in IDT, and `kda_chunk_bwd_qkt_kernel`
#   runs per (K tile, chunk, key head) in one visit. H200 (twentieth session, B1 H32 D128 bf16):
#   fwd+bwd 3.872 ms against 5.003 for "serial" at T8192, 14.501 against 18.913 at T32768; its GPU
#   bars passed (twenty-first session). "serial": `kda_chunk_bwd_qk_kernel` per (chunk, key head)
#   over the K tiles in turn, the l2norm backward in a second pass over dq and dk stored in fp32
#   (v18: 2.140 ms of a 3.9 ms backward at T8192; sm_90 AOT bf16 255 registers, 5480 B of spills).
#   "fused" (template v29, `_kda_bwd.py.j2`, off by default, untimed): `kda_chunk_bwd_fused_kernel`,
#   one program per (chunk, value head) for the tiled pair's work. The l2norm backward's row dots
#   are known in closed form from the V side (<q_n, dq_n> = <qg S_c, do> plus Aqk's share,
#   <k_n, dk_n> as GDN's wy kernel has it), so each K tile is finished in one visit: no fp32 dq, dk,
#   dg partials between two kernels ([B, T, HV, K] each, written and read back: 192 KB per chunk
#   and value head at K = 128, 0.8 GB at B1 T8192 H32), no second read of q, k, g. With HV > HK dq,
#   dk go to per value head fp32 slots that `kda_group_sum_kernel` sums. Its K tile is
#   `kda_qk_bk`, its warps `kda_qk_warps`. sm_90 AOT (bf16, K 128; registers / spill bytes): BK 16
#   8 warps 255 / 888, BK 32 8 warps 255 / 1524, BK 16 4 warps 255 / 2784, BK 32 4 warps
#   255 / 4432 (the exact elementwise tier's share at BK 16 8 warps: ~700 B; without the Gram
#   tiers 254 registers, no spills). Bench rows and GPU bars: `bench.BWD_SWEEP`,
#   `.ci/h200/h32_kdabwd2.sh`. v29-v32 faulted on the H200 at every shape (triton 3.6, an
#   out-of-bounds shared read by a wgmma in the K tiles, compute-sanitizer); template v33 loads Tm
#   at each of its two dots instead of holding one Tm^T tile through both loops, and takes the K
#   tiles' dx = Tm^T dw as (dw^T Tm)^T (an M = BK mma.sync below BK 64). sm_90 AOT at BK 16 8
#   warps (triton 3.6, the fault's shape): shared 61440 -> 53248 B, spills 760 -> 728 B, HGMMAs
#   with a descriptor reloaded from a stack spill 8 -> 0 (the 4-warp default keeps 16, in the
#   Gram tiers); every wgmma descriptor of both builds starts inside the allocation. GPU check:
#   `.ci/h200/h32_kdafused2.sh`.
#   "ktiles" (v35, untimed): the fused kernel's V side per (chunk, value head) (`kda_chunk_bwd_vside_kernel`)
#   and its K tiles per (K tile, chunk, value head) (`kda_chunk_bwd_ktile_kernel`, dbeta's K share by
#   atomic adds): no fp32 dq/dk/dg partials. Rows and sm_90 AOT facts: `bench.KTILES_SWEEP`.
# kda_qk_bk: the K tile of the "tiles" qk kernel, the "fused" kernel and the "ktiles" K-tile kernel
#   (0: BK). kda_qk_warps, kda_wy_warps: warps of the backward's qk and wy kernels, either form,
#   kda_qk_warps those of the "fused" and the K-tile kernel, kda_wy_warps the V-side kernel's
#   (0: num_warps). kda_state_bwd_warps: warps of the
#   reverse state pass (0: num_warps; sm_90 AOT bf16: 1228 B of spills at 4 warps, 96 at 8).
# fwd_o (template v31; GDN's key of the same name, its own since GDN v17): where the forward's
#   o = qg S_c + Aqk v_new is computed. "split" (default): the output kernel `kda_output_fwd_kernel`
#   (one program per V tile, chunk and head, reading S_c and v_new back). "fused": the state pass
#   `kda_state_fwd_kernel` itself per chunk while S_c is in registers (constexprs FUSE_O and KEEP, the
#   same kernel; qg = scale q exp(gc) and Aqk, which the prepare stores anyway, join its prefetched
#   loads): no output launch, and a forward without training writes neither S_c nor v_new (the training
#   forward still keeps them for the backward). Untimed; bench rows `ours@fwd_o=fused_fwd`,
#   `ours@fwd_o=fused`. sm_90 AOT (bf16, K = V = 128, chunk 64, the k_le_128 bucket, BV 32 (the
#   H200's auto tile at B1 H32), every pointer and integer marked divisible by 16 as the JIT does
#   at T8192; registers / spill bytes / shared bytes / TTGIR async copies): split state pass
#   126 / 0 / 128000 / 12 (v30's build the same, its PTX but for the 5 unused new parameters),
#   output kernel 80 / 0 / 49152; fused, forward without training (KEEP off) 180 / 0 / 197632 / 18,
#   training forward 168 / 0 / 205824 / 18; fused at BV 16 126 / 0 / 185344. Every dot wgmma (28 in
#   the fused pass's PTX, 16 in the split one's). One program per SM either way (shared memory).
# Spill counts above and in bench.py that came from AOT builds marking only the pointers (the specs
#   give no integer values) describe a build the GPU does not run at these shapes. Rebuilt with every
#   integer marked (thirtieth session, helper-66; registers / spill bytes): the reverse state pass
#   194 / 0 at 4 warps, 1 stage (pointer marks: 255 / 888), 198 / 0 at 3 stages (1660), 150 / 0 at
#   3 stages and 8 warps (12); `kda_chunk_bwd_fused_kernel` BK 16 8 warps 255 / 484 (888), BK 32
#   8 warps 255 / 912 (1524); the tiled pair's wyt 255 / 348 (1672) and qkt (BK 32) 255 / 1464
#   (1152): the chunk kernels' spills are real, the state passes' are not.
TUNING_SPACE = {**_base.TUNING_SPACE, "kda_prep": ("split", "fused", "pipelined"), "kda_prep_warps": (0, 4, 8),
                "kda_prep_maxnreg": (0, 128, 168),
                "kda_chunk_ref": (0, 1),
                "kda_gram_warps": (0, 4, 8), "kda_wu_warps": (0, 4, 8), "kda_qk": ("serial", "tiles", "fused", "ktiles"),
                "kda_qk_bk": (0, 16, 32, 64), "kda_qk_warps": (0, 4, 8), "kda_wy_warps": (0, 4, 8),
                "kda_state_bwd_warps": (0, 4, 8), "fwd_o": ("split", "fused")}
DEFAULT_CONFIG = {**_base.DEFAULT_CONFIG, "kda_prep": "pipelined", "kda_prep_warps": 0, "kda_prep_maxnreg": 0,
                  "kda_chunk_ref": 0, "kda_gram_warps": 0,
                  "kda_wu_warps": 8, "kda_qk": "tiles", "kda_qk_bk": 0, "kda_qk_warps": 0, "kda_wy_warps": 0,
                  "kda_state_bwd_warps": 0, "fwd_o": "split"}
SHAPE_BUCKETS, block_params, delta_rule_samples = (_base.SHAPE_BUCKETS, _base.block_params,
                                                   _base.delta_rule_samples)

NAME = "kimi_delta"
# GDN's buckets less what was timed on GDN's kernels only: the prepare kernel's K tile and
# stages (KDA's per-channel Gram differs), the backward WY kernel's V tile, and k_le_128's
# three-stage backward chunk kernels,
# which keep the stages they had. The state passes are one kernel for both (but for KDA's [K]
# gate load): KDA's forward with their three stages went 3.342 -> 3.075 ms (B1 T8192 H32 D128).
_GDN_ONLY = ("prep_bk", "prep_stages", "bwd_bv")
_KDA_STAGES = {"k_le_128": {"num_stages": 2, "state_bwd_stages": 1}}
KDA_BUCKETS = tuple(dataclasses.replace(b, config={**{k: v for k, v in b.config.items() if k not in _GDN_ONLY},
                                                   **_KDA_STAGES.get(b.name, {})})
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
    name=NAME,
    template="kimi_delta.py.j2",
    template_version=35,  # v35: `kda_qk` "ktiles" (off by default; the default path's kernels unchanged)
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
