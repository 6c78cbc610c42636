"""Gated delta rule family (GDN): chunked linear attention with a scalar log-space decay per head.

One variant, `chunk`: the chunked WY/UT algorithm (Triton forward and backward) plus a
token-by-token recurrent kernel for decoding. q, k [B, T, HK, K], v [B, T, HV, V] with HV a
multiple of HK, g and beta [B, T, HV], optional in-kernel l2norm of q and k, a scale, initial /
final state [B, HV, K, V]. Shared with `kimi_delta` (same template, per-channel decay).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, ShapeBucket

from . import bench
from .binding import bind
from .tuning import delta_rule_inputs, problem_dims, timing_inputs  # noqa: F401 (kimi_delta's too)

NAME = "gated_delta"
CHUNK_SIZES = (16, 32, 64)
L2_OPS = ("rsqrt", "sqrt", "norm", "linalg_vector_norm")


def block_params(block: Any) -> dict[str, Any]:
    """Render params read off a linear-attention block by structure: chunk size and q/k l2norm."""
    chunk = block.attrs.get("chunk")
    params: dict[str, Any] = {"chunk_size": chunk if chunk in CHUNK_SIZES else 64}
    hist = block.op_histogram or {}
    params["qk_l2norm"] = any(hist.get(op, 0) > 0 for op in L2_OPS)
    return params


def match(block: Any) -> dict[str, Any] | None:
    """`linear_attention.gated_delta` blocks whose decay cumsum runs over the last dim (scalar per head)."""
    if block.kind != "linear_attention.gated_delta" or block.attrs.get("per_channel_decay", False):
        return None
    return FAMILY.served("chunk", block_params(block))


# BV bounds the [K, BV] fp32 state tile a program keeps in registers (K up to 256).
TUNING_SPACE = {
    "BK": (16, 32, 64, 128),
    "BV": (16, 32, 64, 128),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2, 3),
    "dot_precision": ("tf32", "ieee"),
    # software-pipelining depth of the serial loops over chunks (forward and backward state
    # passes): the next chunks' fp32 [BT, K] tiles are prefetched into shared memory
    "state_stages": (1, 2, 3),
    "state_bwd_stages": (1, 2, 3),
    # K tile of the prepare kernel (the forward's, and the backward's re-run of it); 0: BK, the
    # tile of the backward's chunk kernels. Separate because they disagree: at K=128 on the H200,
    # BK 64 took prepare 12-15% faster and the backward WY kernel 50% slower than BK 32
    "prep_bk": (0, 16, 32, 64, 128),
    # pipeline stages of the prepare kernel; 0: num_stages, the backward chunk kernels' stages
    "prep_stages": (0, 1, 2, 3),
    # V tile of the backward's WY kernel; 0: BV, the forward's (prepare's u and the output kernel)
    "bwd_bv": (0, 16, 32, 64, 128),
    # V tile of the serial state passes; 0 picks the widest tile whose grid still fills the GPU
    # (B * HV heads x V / BV tiles against the SM count, see the module's `_state_bv`)
    "state_bv": (0, 16, 32, 64, 128),
    # operands of the dots with Tm = (I + A)^-1 when the other dots are 16-bit (bf16/fp16 inputs on
    # a GPU): "input" casts Tm to that dtype as fla does, "tf32" keeps fp32 operands for them
    "tm_dot": ("input", "tf32"),
    # operands of the block-merge dots inside Tm = (I + A)^-1 (always fp32: "tf32" or exact "ieee";
    # "ieee" whenever the other dots are)
    "inv_dot": ("tf32", "ieee"),
}
DEFAULT_CONFIG = {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 1, "dot_precision": "tf32",
                  "state_stages": 2, "state_bwd_stages": 1, "state_bv": 0, "tm_dot": "input",
                  "inv_dot": "tf32", "prep_bk": 0, "prep_stages": 0, "bwd_bv": 0}
# GDN's own keys (kimi_delta extends TUNING_SPACE and DEFAULT_CONFIG above, not these):
# fwd_o, where the forward's o = qg S_c + Aqk v_new is computed: "split", the output kernel (one
# program per V tile, chunk and head, reading S_c and v_new back); "fused", the state pass itself
# per chunk while S_c is in registers (qg and Aqk join its prefetched loads): no output launch, and
# a forward without training writes neither S_c nor v_new (the training forward still keeps them)
# prep_pipe, the prepare kernel's order (its constexpr PIPE): "off" (default) as before; "on" sums g
# after the Gram loop (q and k are fetched while g is) and stores kd and qg from a loop of their own
# before the inverse, a `tl.range` without dots whose loads Triton pipelines (in the default's w loop
# q feeds no dot and is loaded synchronously); the w loop after the inverse loads k alone. Same
# arithmetic and outputs; untimed (template v18, see the kernel's docstring).
# prep_warps (0: num_warps) and prep_maxnreg (0: no cap; a compile option, not in the AOT specs):
# the prepare's launch alone. sm_90 AOT with prep_pipe "on" (bf16, K = V = 128, chunk 64, the
# k_le_128 bucket, every integer argument marked divisible by 16 as the JIT does at T8192):
# 4 warps 248 registers, no spills (2 programs per SM by registers); 8 warps 193, none (1);
# 8 warps capped at 128: 76 B of spills, 2 programs of 8 warps per SM (twice the warps); 4 warps
# capped at 168: 288 B, 3 per SM. Untimed.
# fused_kq, with fwd_o "fused" in a forward without training: "stored" (default), the prepare writes
# kd and qg [B, HV, Tp, K]; "rows", it writes their row factors rk exp(gl - gc) and rq exp(gc) scale
# ([B, HV, Tp] fp32) instead, and the fused state pass feeds the raw k and q rows to its dots and
# scales rows of their operand or result instead: qg S_c = diag(fq) (q S_c), kd^T v_new =
# k^T (diag(fk) v_new) (134 MB fewer bytes written at T8192 in the Qwen3-Next layout, and the state
# pass reads k and q [B, T, HK, K], half of kd and qg's bytes at HV = 2 HK; arithmetic). Untimed.
# prep_share (issue 32, template v20), the prepare kernel per (chunk, key head) instead of (chunk,
# value head), `gdn_prepare_share_fwd_kernel`: "off" (default) as before; "on", the raw Gram products
# k k^T, q k^T and the l2norm row scales once per key head (one pass over q and k), then for each of
# the HV / HK value heads its decay, beta, Aqk, M, Tm, w, u (and kd, qg or ROWS' factors), with the raw
# k k^T kept in registers across them and the inverse inlined; "scratch", that product through an fp32
# [B, HK, Tp, 2 BT] scratch and Tm = (I + A)^-1 by a noinline call on its second slot
# (`_unit_lower_inverse_mem`). Same outputs and per-head arithmetic; with prep_pipe, fused_kq rows and
# the kept Tm. At HV = 2 HK (Qwen3-Next) it removes half of the Gram dots (a third of the prepare's
# dot MACs at K = V = 128, BT 64, so a sixth of them; less of its dot time, the inverse's merges being
# tf32 and its diagonal blocks exact fp32) and half of the Gram pass's q and k loads (a fifth of the
# prepare's load bytes with kd and qg stored, a quarter with fused_kq rows); "scratch" adds per value
# head ~88 KB of scratch round trips (L1/L2) and a 2 x 33.5 MB buffer at T8192 HK16. sm_90 AOT (bf16,
# the k_le_128 bucket, 3 stages, the forward without training, integers marked as the JIT marks them
# at T8192 HK16 HV32), registers / spilled bytes, triton 3.6 | 3.9: default prepare 4 warps 255 / 0 |
# 254 / 0, 8 warps 179 / 0 | 200 / 0; "on" 4 warps 255 / 460 | 255 / 296, 8 warps 255 / 376 | 255 / 72;
# "scratch" 4 warps 255 / 396 | 255 / 396, 8 warps 249 / 0 | 234 / 0 (also clean with ROWS, prep_pipe
# and the kept Tm; ptxas notes the call serialises the kernel's wgmma pipeline there); 49152 B shared
# in all. The inlined inverse inside the head loop spills: its index and layout-conversion values are
# hoisted out of the loop and held across it (the loop cut to one head: 151 registers, no spills, at
# 8 warps 1 stage on 3.6, against 412 B of spills with the loop).
# Untimed (bench rows SHARE_SWEEP, `.ci/h200/h32_gdn6.sh`).
GDN_TUNING_SPACE = {**TUNING_SPACE, "fwd_o": ("split", "fused"), "prep_pipe": ("off", "on"),
                    "prep_warps": (0, 4, 8), "prep_maxnreg": (0, 128, 168), "fused_kq": ("stored", "rows"),
                    "prep_share": ("off", "on", "scratch")}
GDN_DEFAULT_CONFIG = {**DEFAULT_CONFIG, "fwd_o": "split", "prep_pipe": "off", "prep_warps": 0, "prep_maxnreg": 0,
                      "fused_kq": "stored", "prep_share": "off"}
SHAPE_BUCKETS = (
    # Timed: the best of a 162-config grid on the H200, fwd+bwd at B2 T4096 HK16 HV32 K=V=64
    # bf16, 2.36 ms against 2.51 ms for the untimed BK32 BV32 8-warp config that was here (re-timed
    # together; docs/LOG.md, fifth session). state_bwd_stages 2 fits the backward state pass up to K=64.
    # num_stages 2, not the grid's 1 (v16, for correctness; speed not re-timed): with one stage the
    # H200's triton 3.6 build of the loops over N tiles of a dot with the register-held Tm gave
    # wrong rows past the first warp's 16 (the forward's w 118% off at K=64, the backward WY kernel
    # an illegal memory access), which the interpreter and the K=128 builds (three stages) do not
    # show; with 2 or 3 stages test_bf16_vs_fp32_on_gpu[k64-slow] passed for both families
    # (docs/LOG.md, twenty-second session, device calls M-R).
    ShapeBucket(name="k_le_64", dim="K", lo=1, hi=64,
                config={"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 2, "state_bwd_stages": 2}),
    # Timed: the best of a 72-config grid on the H200, fwd+bwd at B2 T4096 H16 K=V=128 bf16,
    # 2.26 ms against 3.02 ms for the spill-free BK32 BV32 8-warp config that was here (docs/LOG.md,
    # fourth session: "Grid vs TPE"); every 4-warp config beat every 8-warp one. It spills up to
    # 6.8 KB in the backward WY kernel and is faster all the same. prep_bk 64: the prepare kernel
    # alone 0.189 vs 0.214 ms at B2 T4096 H16 and 1.405 vs 1.647 ms at B1 T32768 HV32 (fifth
    # session; GDN only: kimi_delta drops it, its per-channel Gram at BK 64 is untimed).
    # Three pipeline stages everywhere (sixth session, bf16): each forward kernel timed alone over
    # warps x tile x stages, the state pass 0.570 vs 0.869 ms at B1 T32768 HK16 HV32 (0.076 vs
    # 0.114 at B2 T4096 H16; best of 27 at all three shapes timed), prepare 1.198 vs 1.271 (best
    # of 18); the whole backward over state_bwd_stages x num_stages (3 x 3): 1.080 vs 1.204 ms at
    # B2 T4096 H16, 2.349 vs 2.624 at B1 T8192 HK16 HV32 (best at both). bwd_bv 32 (seventh
    # session, the saving forward + backward over BK x BV x warps as CUDA graphs): BV 32 took the
    # backward to 0.760 from 0.811 ms at B2 T4096 H16 (1.766 from 1.828 at B1 T8192 HK16 HV32) and
    # the forward from 0.310 up to 0.351 (its output kernel): the backward alone takes 32. Re-timed
    # under the tenth session's backward (closed-form dA and l2norm row dots): BK 32, bwd_bv 32,
    # 4 warps stay best (0.886 ms at B2 T4096 H16 against 0.928 for bwd_bv 64, 1.036 for BK 64).
    # fwd_o "fused" (o in the state pass), H200 thirtieth session, CUDA-graph ms in one call each
    # (`bash .ci/h200/h32_gdn5.sh`, `BUDGET=500 bash .ci/h200/h32_kda3.sh`), bf16 bars passed:
    # GDN B2 T4096 H16 0.284 -> 0.235, Qwen3-Next layout T8192 0.521 -> 0.447, T32768 2.029 ->
    # 1.744; KDA (which inherits this bucket) Kimi-Linear layout T8192 0.901 -> 0.807, T32768
    # 3.396 -> 3.090. A training forward keeps S_c and v_new, as the split path does.
    ShapeBucket(name="k_le_128", dim="K", lo=65, hi=128,
                config={"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 3, "prep_bk": 64,
                        "prep_stages": 3, "state_stages": 3, "state_bwd_stages": 3, "bwd_bv": 32,
                        "fwd_o": "fused"}),
    # Untimed, chosen from the AOT build's (sm_90, BT=64) spills and shared memory: fp32
    # [BT, 256] w and kd tiles leave no room for a second pipeline stage
    ShapeBucket(name="k_le_256", dim="K", lo=129, hi=256,
                config={"BK": 32, "BV": 16, "num_warps": 8, "state_stages": 1}),
)
PARAMS = (
    Param(name="chunk_size", type=int, default=64, choices=CHUNK_SIZES,
          doc="tokens per chunk BT (the WY/UT block); changes rounding, not the maths"),
    Param(name="qk_l2norm", type=bool, default=False,
          doc="default of use_qk_l2norm_in_kernel (l2norm of q and k inside the kernels)"),
    Param(name="recompute", type=bool, default=False,
          doc="training: the backward re-runs the forward's prepare and state kernels instead of "
              "keeping their outputs from the forward (less activation memory per layer, a slower "
              "backward; see the module's `saved_shapes`)"),
)


def delta_rule_samples(gen: torch.Generator, *, per_channel: bool) -> list:
    """q, k [1, 37, 1, 16], v [1, 37, 2, 16] (two value heads per key head), a negative log
    decay g (one per head, or per key channel), beta in (0, 1) and an initial state; T=37 is not
    a multiple of the chunk."""
    q = torch.randn(1, 37, 1, 16, generator=gen)
    k = torch.randn(1, 37, 1, 16, generator=gen)
    v = torch.randn(1, 37, 2, 16, generator=gen)
    g = -torch.rand((1, 37, 2, 16) if per_channel else (1, 37, 2), generator=gen) * 0.5
    beta = torch.rand(1, 37, 2, generator=gen)
    h0 = torch.randn(1, 2, 16, 16, generator=gen) * 0.1
    return [q, k, v, g, beta, None, h0, True]


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    return delta_rule_samples(gen, per_channel=False)


FAMILY = FamilySpec(
    name=NAME,
    template="gated_delta.py.j2",
    # v22: `_unit_lower_inverse` is `_unit_lower_inverse_z` with z = 0 (one copy of the inverse;
    # sm_90 PTX of gdn_prepare_fwd_kernel, the scratch share prepare and kda_prepare_fwd_kernel
    # identical before and after under triton 3.6 and 3.9, debug lines and symbol hashes aside).
    # v21: aot_specs lists the prep_share kernel under "off" too (v20: `prep_share`)
    template_version=22,
    folder=Path(__file__).parent,
    variants={"chunk": "chunked gated delta rule, scalar decay per head; fwd, bwd, recurrent decode"},
    params=PARAMS,
    tuning_space=GDN_TUNING_SPACE,
    default_config=GDN_DEFAULT_CONFIG,
    shape_buckets=SHAPE_BUCKETS,
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("B", "T", "HK", "K"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
)
