"""Top-k sparse attention family (DSA): lightning indexer + causal top-k, and gathered attention.

Two variants of one template, each a self-contained module with its own `entry`/`reference`:
`indexer` (scores[b,t,s] = sum_h w[b,t,h] * relu(scale * q[b,t,h] . k[b,s]), s <= t, then the
top `topk` positions per query as int32 indices, not differentiated) and `gathered` (softmax
attention of each query over only its selected positions, forward and backward, GQA, optional
sink, `layout="mla"` for the absorbed MLA/MQA layout with one shared latent KV whose first `d_v`
columns are the values). They are separate variants because their contracts differ: the indexer
returns integers and has no gradient, the gathered attention is a differentiable op.

A `sparse_attention.topk` block needs both: `match` returns the `gathered` variant (the
differentiable attention core) with the `indexer` variant under "also"; `match_all` returns both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onboarding.errors import InputError
from onboarding.families import FamilySpec, Param, ShapeBucket
from onboarding.patching.sparse import selection_refusal

from . import bench, crossover
from .binding import SPARSE, bind, probe_refusal

NAME = "sparse_attention"


def _check(variant: str, params: dict[str, Any]) -> None:
    if params["layout"] == "mla" and params["d_v"] % 16:
        raise InputError(f"{NAME}/{variant}: parameter 'd_v' must be a multiple of 16 for the MLA "
                         f"layout, got {params['d_v']}")


def match_all(block: Any) -> list[dict[str, Any]]:
    """Both variants a `sparse_attention.topk` block needs (gathered first), or [] for others.

    By structure only: attrs `topk` and `indexer_relu` from the classifier's topk/relu evidence,
    `layout == "mla"` with `kv_latent` (the latent width, which is the absorbed d_v).
    """
    if block.kind != "sparse_attention.topk":
        return []
    attrs = block.attrs
    topk = attrs.get("topk")
    topk = int(topk) if isinstance(topk, int) and topk >= 1 else 2048
    gathered: dict[str, Any] = {}
    if attrs.get("layout") == "mla":
        latent = attrs.get("kv_latent") or []
        latent = latent[0] if isinstance(latent, (list, tuple)) and latent else latent
        if not isinstance(latent, int):
            return []
        gathered = {"layout": "mla", "d_v": latent}
    out = []
    for variant, params in (("gathered", gathered),
                            ("indexer", {"topk": topk, "indexer_relu": bool(attrs.get("indexer_relu", True))})):
        served = FAMILY.served(variant, params)
        if served is None:
            return []
        out.append(served)
    return out


def refusal(block: Any) -> dict[str, Any] | None:
    """For a `sparse_attention.topk` block: why the binding's intercept would find no selection to
    read, by its own test (`patching.sparse.selection_refusal`) on the top-ks over key positions
    the op graph recorded (attrs ``topk_inputs``), or no attention to replace, or (absorbed MLA)
    no rope part beside the latent, read off what the family's probe recorded (attrs
    ``core_calls``, `binding.probe_refusal`), as {"serves": None (the block's core), "reason"};
    None when they fit or nothing was recorded (an older graph: the match stands)."""
    if block.kind != "sparse_attention.topk":
        return None
    why = None
    if block.attrs.get("topk_inputs") is not None:
        why = selection_refusal(block.attrs["topk_inputs"])
    found = (block.attrs.get("core_calls") or {}).get(SPARSE.what)
    if why is None and found is not None:
        latent = block.attrs.get("kv_latent") if block.attrs.get("layout") == "mla" else None
        latent = latent[0] if isinstance(latent, (list, tuple)) and latent else latent
        why = probe_refusal(found, latent if isinstance(latent, int) else None)
    return None if why is None else {"serves": None, "reason": why}


def match(block: Any) -> dict[str, Any] | None:
    """The `gathered` variant for a `sparse_attention.topk` block the binding can take (no
    `refusal`), with the indexer in "also" and, as "note" (coverage's reason), when the patching
    runs the kernel and when the block's own dense attention by the measured crossover
    (`crossover.summary`)."""
    found = match_all(block)
    if not found or refusal(block) is not None:
        return None
    layout = found[0]["params"].get("layout", "mha")
    return {**found[0], "also": found[1:],
            "note": crossover.summary(layout, int(found[1]["params"]["topk"]))}


def causal_topk_indices(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [B, T, min(topk, T)]: each row's top scores among s <= t, ascending, -1 padded."""
    T = scores.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    vals, idx = scores.masked_fill(~causal, float("-inf")).topk(min(topk, T), dim=-1)
    idx = torch.where(torch.isfinite(vals), idx, T).sort(dim=-1).values
    return torch.where(idx >= T, -1, idx).to(torch.int32)


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """Fresh random entry arguments: T=37 (odd), topk 8 (more than the early rows have), 4 query
    heads; gathered MHA uses 2 KV heads (GQA) of width 16 and a sink; MLA one latent head of the
    module's d_v plus a 64-wide rope part (d_v is baked into an MLA module)."""
    B, T, H = 1, 37, 4
    if variant == "indexer":
        D = 16
        q = torch.randn(B, T, H, D, generator=gen)
        k = torch.randn(B, T, D, generator=gen)
        w = torch.randn(B, T, H, generator=gen)
        return [q, k, w, 8, None]
    idx = causal_topk_indices(torch.randn(B, T, T, generator=gen), 8)
    sink = torch.randn(H, generator=gen)
    if params.get("layout") == "mla":
        d_qk = int(params.get("d_v", 512)) + 64
        q = torch.randn(B, T, H, d_qk, generator=gen)
        kv = torch.randn(B, T, 1, d_qk, generator=gen)
        return [q, kv, idx, sink, None]
    D = 16
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, T, 2, D, generator=gen)
    v = torch.randn(B, T, 2, D, generator=gen)
    return [q, k, v, idx, sink, None]


FAMILY = FamilySpec(
    plan_saves="topk_positions",
    name=NAME,
    template="sparse_attention.py.j2",
    template_version=11,  # v11: FWD_EARLY_GATHER 1 in d_le_1024; history: docs/LOG.md
    folder=Path(__file__).parent,
    variants={
        "indexer": "DSA indexer scores (sum_h w * relu(q.k)) + causal top-k indices; no gradient",
        "gathered": "attention over the selected positions: GQA or MLA latent, sink; fwd + bwd",
    },
    params=(
        Param(name="topk", type=int, default=2048, min=1, variants=("indexer",),
              doc="default top-k of the indexer entry (topk stays a call argument)"),
        Param(name="indexer_relu", type=bool, default=True, variants=("indexer",),
              doc="ReLU of each head's q.k score before the weighted head sum (DeepSeek-V3.2)"),
        Param(name="layout", type=str, default="mha", choices=("mha", "mla"), variants=("gathered",),
              doc="mha: k/v [B, S, HK, D]; mla: one shared latent kv [B, S, 1, D_QK], v = kv[..., :d_v]"),
        Param(name="d_v", type=int, default=512, min=16, max=1024, variants=("gathered",),
              doc="value width of the MLA latent (its first d_v columns); mla layout only"),
    ),
    # Keys (default in brackets; the MLA bucket d_le_1024 below sets most of them). History per
    # template version: docs/LOG.md (search "sparse_attention").
    # BLOCK_K, BLOCK_H (32, 16): gathered positions per step and query heads of one KV group per
    #   forward program. BLOCK_K_BWD, BLOCK_H_BWD (32, 16): the same for the fused backward, whose
    #   dq, dk and dv tiles need more registers and shared memory, so it may need smaller blocks.
    # BLOCK_T (64): the indexer's score tile. BLOCK_SEL (1024): chunk of a row per selection pass.
    #   SEL_RADIX (4): bits of the threshold decided per pass (32 / SEL_RADIX passes, 2^SEL_RADIX
    #   compares per element).
    # num_warps (4). dot_precision ("tf32"): operands of fp32 dots, "tf32" or exact "ieee".
    # FWD_STAGES (3): pipeline stages of the forward's gathered loads (3: Triton's default, what the
    #   forward ran with before it was a key).
    # FWD_DV_SPLIT (1; MLA only): 2 splits the value columns over two programs that each recompute
    #   the scores (twice the score work, half the accumulator: BLOCK_H 128 fits, each warp group
    #   owning whole head rows of every dot).
    # FWD_ROW_END (0): 1 stops each row after its last valid index (one [B, T] pass over the indices
    #   first): early rows (t < K) hold t + 1 picks and K - t - 1 padding slots.
    # FWD_TWO_PASS (0; MLA only, over FWD_DV_SPLIT): 1 computes the scores once, stores the
    #   probabilities (B T H K elements in the dot's dtype) and replays them in a value kernel split
    #   as FWD_DV_SPLIT 2.
    # FWD_SPLIT_SCORES (0): 1 splits the score block's key columns over the warp groups. Triton lays
    #   a dot that feeds another dot out with all warps along M, so at BLOCK_H 64 and 8 warps both
    #   warp groups repeat the whole score block. The softmax is then in base 2, the scale folded
    #   into log2(e).
    # FWD_EARLY_GATHER (0; the fused forward): 1 puts the value dot in an always-taken branch, so
    #   Triton's loop scheduler issues the next key block's gather right after this block's score
    #   dots (it overlaps the softmax and the value dot) instead of after the value dot (it
    #   overlaps the value dot only); without FWD_SPLIT_SCORES (whose softmax sits in a branch
    #   too) right after the softmax. The value dot is then waited in its branch, the mask's index
    #   load is a plain load. sm_90 build at the MLA bucket (d_qk 576, d_v 512,
    #   64 x 64, 8 warps, 3 stages): bench.py, MLA forward comment. On since v11 in d_le_1024 (below).
    # BWD_SPLIT (0; MLA only, the GQA layout keeps the fused backward): 1 runs the backward as a dq
    #   kernel (the fused loop without its dkv scatter, stopping at each row's last valid index)
    #   and a dkv kernel (per query and BLOCK_K_DKV of its selected keys, all heads walked
    #   BLOCK_H_DKV at a time, the key block's gradient summed in fp32 registers and added once).
    #   The fused backward adds H / BLOCK_H_BWD times per query and key; those atomics bound it at
    #   T 8192 (163.6 ms, 63 TFLOP/s). Both split kernels recompute scores and dp (~40% more FLOPs).
    # BLOCK_K_DKV, BLOCK_H_DKV (64, 32): the dkv kernel's tiles. BWD_STAGES (1): stages of both
    #   split kernels.
    # BLOCK_H_DQ, BLOCK_K_DQ (0: BLOCK_H_BWD, BLOCK_K_BWD): the dq kernel's own tiles, so a bucket
    #   can give it wgmma tiles (64 x 32) that the fused backward cannot take (311 KB of shared
    #   memory at 64 heads), and BWD_SPLIT 0 stays runnable.
    # sm_90 build facts at the tiles the fwd+bwd bench sweeps: bench.py, MLA_FWDBWD_SWEEP.
    # A removed option: v8's FWD_LAZY_RESCALE 1 (the forward's max, and so its [BLOCK_H, D_V] fp32
    #   output's rescale, moved only when a row's block max grew by more than 2^8, one program-wide
    #   test per key block) lost on an H100 (torch 2.11, triton 3.6; `source .ci/h200/setup.sh &&
    #   bash .ci/h200/h33_mla6.sh` at 047b72b, its bf16 test passed): MLA forward wall 13.485 ->
    #   15.936 ms at T 8192, 57.782 -> 69.293 at T 32768, on the d_le_1024 bucket's forward; its
    #   triton 3.6 build spills 212 B in the loop (the program-wide test). v9 removed it.
    tuning_space={
        "BLOCK_K": (16, 32, 64, 128),
        "BLOCK_H": (16, 32, 64, 128),
        "BLOCK_K_BWD": (16, 32, 64, 128),
        "BLOCK_H_BWD": (16, 32, 64, 128),
        "BLOCK_T": (16, 32, 64, 128),
        "BLOCK_SEL": (16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
        "SEL_RADIX": (2, 4, 8),
        "num_warps": (1, 2, 4, 8),
        "dot_precision": ("tf32", "ieee"),
        "FWD_STAGES": (1, 2, 3, 4),
        "FWD_DV_SPLIT": (1, 2),
        "FWD_ROW_END": (0, 1),
        "FWD_TWO_PASS": (0, 1),
        "FWD_SPLIT_SCORES": (0, 1),
        "FWD_EARLY_GATHER": (0, 1),
        "BWD_SPLIT": (0, 1),
        "BLOCK_K_DKV": (16, 32, 64, 128),
        "BLOCK_H_DKV": (16, 32, 64, 128),
        "BWD_STAGES": (1, 2, 3),
        "BLOCK_H_DQ": (0, 16, 32, 64, 128),
        "BLOCK_K_DQ": (0, 16, 32, 64, 128),
    },
    default_config={"BLOCK_K": 32, "BLOCK_H": 16, "BLOCK_K_BWD": 32, "BLOCK_H_BWD": 16, "BLOCK_T": 64, "BLOCK_SEL": 1024, "SEL_RADIX": 4,
                    "num_warps": 4,
                    "dot_precision": "tf32", "FWD_STAGES": 3, "FWD_DV_SPLIT": 1,
                    "FWD_ROW_END": 0, "FWD_TWO_PASS": 0, "FWD_SPLIT_SCORES": 0,
                    "FWD_EARLY_GATHER": 0,
                    "BWD_SPLIT": 0, "BLOCK_K_DKV": 64, "BLOCK_H_DKV": 32, "BWD_STAGES": 1,
                    "BLOCK_H_DQ": 0, "BLOCK_K_DQ": 0},
    # Over D_QK (the index head dim for the indexer); wide heads get smaller gathered blocks.
    shape_buckets=(
        ShapeBucket(name="d_le_64", dim="D_QK", lo=0, hi=64, config={"BLOCK_K": 64, "BLOCK_K_BWD": 64}),
        ShapeBucket(name="d_le_128", dim="D_QK", lo=65, hi=128, config={"BLOCK_K": 32}),
        ShapeBucket(name="d_le_256", dim="D_QK", lo=129, hi=256, config={"BLOCK_K": 32, "num_warps": 8}),
        # d_le_1024 (MLA 576/512), timed on the H200 at 128 heads, K 2048:
        # - Forward BLOCK_H 64, BLOCK_K 64, 8 warps: 17.69 ms at T 8192 (then with 2 stages) against
        #   28.59 for BLOCK_K 32 with 3 stages, the best of 9 configurations; the value-split and
        #   two-pass forwards took 18.7-25 ms (docs/LOG.md, eighteenth session, call C). 64 heads is
        #   wgmma's m64, so 128 query heads read each gathered block twice, back to back (from L2).
        # - FWD_SPLIT_SCORES 1, FWD_STAGES 3, FWD_ROW_END 1: 17.694 -> 13.706 ms at T 8192, 73.071
        #   -> 58.475 at T 32768, bf16 test passed (docs/LOG.md, thirtieth session, device call 4).
        # - BWD_SPLIT 1 with dq 64 heads x 32 keys, dkv 64 keys x 32 heads, 2 stages (v7): fwd+bwd
        #   182.8 -> 88.1 ms at T 8192, 756.5 -> 412.8 at T 32768, bf16 tests passed (docs/LOG.md,
        #   thirty-first session, device calls 4-5).
        # - FWD_EARLY_GATHER 1 (v11), H100 (torch 2.11, triton 3.6), two runs in one warm session,
        #   bf16 tests passed: T 8192 12.974 -> 12.926 and 12.966 -> 12.851 ms, T 32768 57.786 ->
        #   56.048 and 57.670 -> 55.958 (with 2 stages 14.09-14.25 and 61.1-61.5: slower); docs/LOG.md,
        #   fortieth session.
        # - The fused backward's tiles (32 heads x 16 positions) stay for BWD_SPLIT 0: at 64 heads
        #   it needs 311 KB of shared memory. An sm_90 build without the runtime's integer marks
        #   (so no load pipelined) gave: forward at 64 heads 111 KB shared, 600 B spilled (the
        #   [64, 512] fp32 accumulator is half the register file); backward at 32 x 16 102 KB,
        #   496 B spilled (32 positions: 119 KB, 1 KB spilled). With the marks, as the GPU runs it,
        #   the forward takes 148 KB, 255 registers, 152 B spilled (docs/LOG.md, eighteenth
        #   session, helper h33).
        ShapeBucket(name="d_le_1024", dim="D_QK", lo=257, hi=1024,
                    config={"BLOCK_K": 64, "FWD_STAGES": 3, "BLOCK_H": 64, "BLOCK_K_BWD": 16,
                            "BLOCK_H_BWD": 32, "num_warps": 8, "FWD_SPLIT_SCORES": 1,
                            "FWD_ROW_END": 1, "FWD_EARLY_GATHER": 1, "BWD_SPLIT": 1, "BLOCK_H_DQ": 64, "BLOCK_K_DQ": 32,
                            "BLOCK_K_DKV": 64, "BLOCK_H_DKV": 32, "BWD_STAGES": 2}),
    ),
    check=_check,
    match=match,
    sample_inputs=sample_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
    refusal=refusal,
    probe=SPARSE,
)
