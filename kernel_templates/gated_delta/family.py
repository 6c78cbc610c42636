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
# GDN's own keys (kimi_delta extends TUNING_SPACE and DEFAULT_CONFIG above, not these; it has its
# own fwd_o). Each default keeps the forward it had before the key; history: docs/LOG.md.
# fwd_o ("split"): where the forward's o = qg S_c + Aqk v_new is computed. "split" an output kernel
#   (one program per V tile, chunk and head, reading S_c and v_new back); "fused" the state pass
#   itself while S_c is in registers (qg and Aqk join its prefetched loads): no output launch, and
#   a forward without training writes neither S_c nor v_new. The k_le_128 bucket takes "fused"
#   (below).
# prep_pipe ("off"): "on" orders the prepare kernel (constexpr PIPE) so that Triton pipelines more
#   of its loads: g summed after the Gram loop, kd and qg stored from a loop of their own before the
#   inverse, the w loop loading k alone. Same arithmetic and outputs. Stays off: on the H200 it was
#   within 4% of fwd_o "fused" alone, faster at two shapes and slower at one (docs/LOG.md, thirtieth
#   session, device call 2).
# prep_warps (0: num_warps), prep_maxnreg (0: no cap; a compile option the AOT specs do not carry):
#   the prepare's launch alone. 8 warps capped at 128 fit two 8-warp programs per SM at 76 B of
#   spills (sm_90 AOT, docs/LOG.md, helper-65); on the H200 that row was slower (same call).
# fused_kq ("stored"; with fwd_o "fused" in a forward without training): "rows" writes the row
#   factors of kd and qg ([B, HV, Tp] fp32) in their place, and the fused state pass scales the rows
#   of the raw k and q dots instead (by arithmetic 134 MB fewer bytes written at T8192 in the
#   Qwen3-Next layout, and half of kd and qg's bytes read at HV = 2 HK). Alone it was a little
#   slower on the H200 (same call) and level on an H100; with `rows_maxnreg` 168 the k_le_128
#   bucket takes it (v27, below).
# rows_maxnreg (0: prep_maxnreg's): the prepare's register cap when it writes row factors (`fused_kq`
#   "rows", a forward without training), where it keeps neither kd and qg tiles nor Tm and M. 168 fits
#   three 4-warp programs per SM. `prep_maxnreg` 168, the same cap on every prepare, lost on an H100
#   (0.465 against 0.456 ms at B1 T8192 HK16 HV32; docs/LOG.md, thirty-seventh session): the training
#   prepare keeps its uncapped build.
# A removed key: v20's prep_share (the prepare per (chunk, key head): "on", "scratch") was slower
#   than the default forward in every row at both shapes timed on an H100 (`.ci/h200/h32_gdn6.sh`,
#   CUDA graph, B2 T4096 H16 D128: 0.310-0.408 ms against 0.243; B1 T8192 HK16 HV32 D128:
#   0.576-0.733 against 0.455); v23 removed it (docs/LOG.md, "prep_share").
# Removed keys: v24's bwd_split "vk" (the chunk-local backward as a V-side launch, one program per
#   K tile and a row sum of their shares; bwd_split_warps the K tiles' warps) lost to the one-kernel
#   default at both shapes timed on an H100 (`.ci/h200/h32_gdn7.sh`, in git at 047b72b; CUDA graph, fwd+bwd ms: B2
#   T4096 H16 D128 0.808 default, 0.940 vk, 1.005 vk at 8 warps; B1 T8192 HK16 HV32 D128 1.590,
#   1.925, 2.035; bars passed); v25 removed it (docs/LOG.md, thirty-sixth session).
GDN_TUNING_SPACE = {**TUNING_SPACE, "fwd_o": ("split", "fused"), "prep_pipe": ("off", "on"),
                    "prep_warps": (0, 4, 8), "prep_maxnreg": (0, 128, 168), "fused_kq": ("stored", "rows"),
                    "rows_maxnreg": (0, 168)}
GDN_DEFAULT_CONFIG = {**DEFAULT_CONFIG, "fwd_o": "split", "prep_pipe": "off", "prep_warps": 0, "prep_maxnreg": 0,
                      "fused_kq": "stored", "rows_maxnreg": 0}
SHAPE_BUCKETS = (
    # k_le_64: the best of a 162-config grid on the H200, fwd+bwd at B2 T4096 HK16 HV32 K=V=64 bf16:
    # 2.36 ms against 2.51 for the config before, re-timed together (docs/LOG.md, fifth session).
    # state_bwd_stages 2 fits the backward state pass up to K=64. num_stages 2, not the grid's 1,
    # for correctness (v16; speed not re-timed): with one stage the H200's triton 3.6 build gave
    # wrong rows at K=64 (docs/LOG.md, twenty-second session, device calls M-R).
    ShapeBucket(name="k_le_64", dim="K", lo=1, hi=64,
                config={"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 2, "state_bwd_stages": 2}),
    # k_le_128: the best of a 72-config grid on the H200, fwd+bwd at B2 T4096 H16 K=V=128 bf16:
    # 2.26 ms against 3.02 (docs/LOG.md, fourth session, "Grid vs TPE"); it spills up to 6.8 KB in
    # the backward WY kernel and is faster all the same. prep_bk 64: the prepare alone 0.189 against
    # 0.214 ms at B2 T4096 H16 (fifth session; GDN only: kimi_delta drops it). Three stages
    # everywhere: the best of each kernel's grid at every shape timed (sixth session; the state pass
    # 0.570 against 0.869 ms at B1 T32768 HK16 HV32). bwd_bv 32: the backward 0.760 ms from 0.811 at
    # B2 T4096 H16 (1.766 from 1.828 at B1 T8192 HK16 HV32) while the forward wants BV 64 (seventh
    # session); re-timed best in the tenth session. fwd_o "fused": the forward 0.521 -> 0.447 ms
    # (CUDA graph) at T8192 HK16 HV32, faster at all five shapes timed for GDN and KDA (which
    # inherits this bucket), bf16 bars passed (thirtieth session, device calls 1-2). `fused_kq` "rows"
    # with `rows_maxnreg` 168 (v27; the forward without training only): on an H100, by CUDA graph,
    # 0.439 / 0.229 / 1.733 ms against 0.456 / 0.240 / 1.757 at B1 T8192 HK16 HV32 / B2 T4096 H16 /
    # B1 T32768 HK16 HV32 (`.ci/h200/h36_gdn8.sh`), again 0.438 / 0.231 / 1.736 against 0.453 /
    # 0.241 / 1.748 in a second call (`.ci/h200/h37_gdn9.sh`, where "rows" uncapped was 0.455 /
    # 0.240 / 1.777); bf16 bars passed (docs/LOG.md, thirty-seventh and thirty-eighth sessions).
    ShapeBucket(name="k_le_128", dim="K", lo=65, hi=128,
                config={"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 3, "prep_bk": 64,
                        "prep_stages": 3, "state_stages": 3, "state_bwd_stages": 3, "bwd_bv": 32,
                        "fwd_o": "fused", "fused_kq": "rows", "rows_maxnreg": 168}),
    # k_le_256: untimed, chosen from the sm_90 build's spills and shared memory: fp32 [BT, 256] w
    # and kd tiles leave no room for a second pipeline stage.
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
    plan_saves="delta_rule",
    name=NAME,
    template="gated_delta.py.j2",
    # v27: config `rows_maxnreg` (the prepare's register cap when it writes row factors); k_le_128
    # takes `fused_kq` "rows" with it (the forward without training). v28: `aot_specs` also holds the
    # forward without training as it launches (the prepare without Tm and M, with row factors; the
    # fused state pass keeping nothing), and the state spec the training launch; kernels unchanged.
    # v29: the fused state pass's raw q and k rows (`fused_kq` "rows") are fp32 dot operands under a
    # 32-bit dot mode (16-bit inputs in the interpreter failed "Both operands must be same dtype"); the
    # 16-bit path unchanged. v30: `aot_specs` builds its variant specs (the no-grad forward's, the
    # recomputing backward's wide u) with one helper, the same specs; a comment reworded; kernels
    # unchanged. v31: `aot_specs` declares the prepare's register caps as `_prepare` launches it
    # (`prep_maxnreg`; `rows_maxnreg` for the no-grad row-factor prepare, k_le_128's 168), which the AOT
    # build now takes; GDN only, kernels unchanged. v32: that cap rule is one helper, `_prep_maxnreg`,
    # for the launch and the specs (the same caps). v33 (host cost of the training step; the kernels' maths
    # unchanged): the reverse state pass takes HAS_DHT, so an unused final state needs no torch.zeros
    # d(final state) (the bwd op's dht is Optional; AOT specs both builds, the training step's False);
    # the wy kernel stores dbeta in beta's dtype (each once: no cast launch after); host grids and
    # powers of two by plain helpers (`_cdiv`, `_npow2`: triton's are constexpr functions, ~1.5-2 us a
    # host call); `_tiles` cached per (shape, dtype, device, mode) and the pins it was computed under,
    # with the config in it (`cfg`, read there in place of `config_for`) (test_training_step_host_cost;
    # KDA shares all but the dbeta store, which its "ksplit" row sums take too). At the bench's
    # B1 T8192 HK16 HV32 D128 step: 5 Triton launches, aten launches 2 -> 0, 24 allocations. Host time
    # per fwd+bwd on a CPU (CPU tensors, Triton's JITFunction.run stubbed, medians of 7 interleaved rounds
    # of 200 steps, v32 against v33 in one process): 0.650 -> 0.452 ms, again 0.915 -> 0.443 (a loaded
    # CPU); ~80 us of v32's is the CPU's own 4 MB zeros fill, a launch on a GPU. Untimed on a GPU; the
    # H100 measured the step host-bound at v32 (host 1.772 ms, GPU 1.795; `.ci/h200/host_step.py`).
    # sm_90 builds (bf16, K = V = 128, every integer marked; registers / spill bytes, triton 3.6 | 3.9):
    # the reverse state pass at HAS_DHT False 255 / 0 | 255 / 20 (True, v32's build: 255 / 24 | 255 / 124),
    # the same 216 KB of shared memory; the wy kernel with a bf16 dbeta 255 / 76 | 255 / 128 (v32 76 | 112).
    # On an H100 (`host_step.py --family gated_delta --case '^B1T8192' --impl ours --steps 20 --rounds 5`,
    # forty-first session) v33's step: host 0.768 ms, GPU 1.590, synced wall 1.779 (v32, an earlier
    # machine of the same kind: 1.772 / 1.795 / 2.349, host-bound): GPU-bound now; GPU bars passed.
    # v34: a `_tiles` hit also takes equal pins set again (a bench sweep row pins a new dict of the same
    # values before each step: v33 recomputed its tiles every step, so option rows paid host time the
    # default row did not). History: docs/LOG.md.
    template_version=34,
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
