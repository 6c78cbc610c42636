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

from . import bench, crossover
from .binding import bind

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


def match(block: Any) -> dict[str, Any] | None:
    """The `gathered` variant for a `sparse_attention.topk` block, with the indexer in "also" and,
    as "note" (coverage's reason), when the patching runs the kernel and when the block's own
    dense attention by the measured crossover (`crossover.summary`)."""
    found = match_all(block)
    if not found:
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
    name=NAME,
    template="sparse_attention.py.j2",
    template_version=7,
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
    # BLOCK_K: gathered positions per step; BLOCK_H: query heads of one KV group per program
    # (BLOCK_K_BWD / BLOCK_H_BWD: the same for the backward, whose dq, dk and dv tiles need more
    # registers and shared memory, so it may need smaller blocks than the forward);
    # BLOCK_T: indexer score tile; BLOCK_SEL: chunk of a row per selection pass; SEL_RADIX: bits
    # of the threshold decided per pass (32 / SEL_RADIX passes, 2^SEL_RADIX compares per element).
    # FWD_STAGES: software-pipeline stages of the forward kernels' gathered loads (3: Triton's
    # default, what the forward ran with before it was a key). FWD_DV_SPLIT (MLA layout only):
    # 1 = one program holds a head block's whole [BLOCK_H, d_v] output; 2 = the value columns
    # split over two programs that each recompute the scores (twice the score work, half the
    # accumulator: BLOCK_H = 128 fits, each warp group owning whole head rows of every dot).
    # FWD_ROW_END 1: the forward stops each row after its last valid index (one [B, T] pass
    # over the indices first): early rows (t < K) hold t + 1 picks and K - t - 1 padding slots.
    # FWD_TWO_PASS 1 (MLA only, over FWD_DV_SPLIT): the scores once, the probabilities stored
    # (B T H K elements in the dot's dtype) and replayed by a value kernel split as FWD_DV_SPLIT 2.
    # FWD_SPLIT_SCORES 1 (the fused forward): the score block's key columns split over the warp
    # groups instead of every warp group computing all of them (Triton lays a dot that feeds
    # another dot out with all warps along M: at BLOCK_H 64 and 8 warps both warp groups repeat
    # the whole score block), and the softmax in base 2 with the scale folded into log2(e).
    # BWD_SPLIT 1 (MLA only; the GQA layout keeps the fused backward): the backward as two
    # kernels. A dq kernel (per query and BLOCK_H_BWD heads, BLOCK_K_BWD keys per step, the fused
    # backward's loop without its dkv scatter, stopping at each row's last valid index) and a dkv
    # kernel: per query and BLOCK_K_DKV of its selected keys, all H heads walked BLOCK_H_DKV at a
    # time, the key block's [BLOCK_K_DKV, D_QK] gradient summed in fp32 registers and added once
    # (one fp32 reduction per query and selected key, against H / BLOCK_H_BWD in the fused
    # backward, whose atomics bound it at T 8192: 163.6 ms, 63 TFLOP/s). Scores and dp are
    # computed by both kernels (~40% more FLOPs). BWD_STAGES: software-pipeline stages of both.
    # BLOCK_H_DQ / BLOCK_K_DQ: the dq kernel's tiles (0: BLOCK_H_BWD / BLOCK_K_BWD), its own keys
    # so that a bucket can give it wgmma tiles (64 x 32) that the fused backward could not take
    # (311 KB of shared memory at 64 heads), which then stays runnable with BWD_SPLIT 0.
    # Its sm_90 build facts at the tiles the fwd+bwd bench sweeps: bench.py, MLA_FWDBWD_SWEEP.
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
                    "BWD_SPLIT": 0, "BLOCK_K_DKV": 64, "BLOCK_H_DKV": 32, "BWD_STAGES": 1,
                    "BLOCK_H_DQ": 0, "BLOCK_K_DQ": 0},
    # Over D_QK (the index head dim for the indexer); wide heads get smaller gathered blocks.
    shape_buckets=(
        ShapeBucket(name="d_le_64", dim="D_QK", lo=0, hi=64, config={"BLOCK_K": 64, "BLOCK_K_BWD": 64}),
        ShapeBucket(name="d_le_128", dim="D_QK", lo=65, hi=128, config={"BLOCK_K": 32}),
        ShapeBucket(name="d_le_256", dim="D_QK", lo=129, hi=256, config={"BLOCK_K": 32, "num_warps": 8}),
        # MLA 576/512 on sm_90 with bf16 dots (AOT, ptxas): the forward takes 64 heads per
        # program (wgmma m64, 111 KB shared, 600 B spilled: the [64, 512] fp32 accumulator is half
        # the register file), so 128 query heads read each gathered block twice, back to back (L2).
        # The backward at 64 heads needs 311 KB of shared memory; at 32 heads x 16 positions it
        # takes 102 KB (496 B spilled; 32 positions: 119 KB, 1 KB spilled).
        # Those AOT numbers compile without the runtime's specialisation (16-byte aligned
        # pointers, ints divisible by 16), under which no load is pipelined. With it (what the
        # GPU runs at T 8192, K 2048, 128 heads; triton 3.9, sm_90, issue 33): the forward's
        # gathered rows load by cp.async, 148 KB, 255 registers, 152 B spilled, its score dot
        # m64n16 per warp group (the 32 key columns split over the two warp groups); the
        # value-split forward (FWD_DV_SPLIT 2, 128 heads, BLOCK_K 32, 2 stages) 221 KB,
        # 244 registers, no spill, m64n32 score and m64n256 value dots per warp group.
        # Timed on the H200 (docs/LOG.md, eighteenth session, call C: `onboard bench --family
        # sparse_attention --case 'mla-T8192-fwd$' --case 'mla-T32768-fwd$' --impl ours`, 128
        # heads, K 2048): BLOCK_K 64 with 2 stages 17.69 ms at T 8192 and 73.32 at T 32768,
        # against 28.59 / 113.38 at BLOCK_K 32 with 3 stages, the best of 9 configurations
        # (the value-split and two-pass forwards 18.7-25 ms at T 8192).
        # The score block split over the two warp groups, three stages, rows stopped at their end
        # (thirtieth session, H200, `source .ci/h200/setup.sh && BUDGET_S=250 bash
        # .ci/h200/h33_mla.sh`, wall ms, one call): 17.694 -> 13.706 at T 8192 (the kernel alone
        # 240.7 -> 316.9 TFLOP/s), 73.071 -> 58.475 at T 32768; its GPU bf16 test (output and
        # every gradient) passed.
        # The split backward (thirty-first session, H200, `source .ci/h200/setup.sh && BUDGET_S=230
        # bash .ci/h200/h33_mla_bwd.sh`, one call): dq 64 heads x 32 keys, dkv 64 keys x 32 heads,
        # 2 stages: fwd+bwd 182.8 -> 88.1 ms at T 8192 (79 -> 164 TFLOP/s; the backward's kernels
        # 164.9 -> 69.0 ms: dkv 38.4 + dq 30.6) and 756.5 -> 412.8 ms at T 32768 (155 TFLOP/s);
        # its GPU bf16 tests (o and every gradient, at 1 stage: stages only pipeline the loads)
        # passed. The fused backward's tiles stay for BWD_SPLIT 0.
        ShapeBucket(name="d_le_1024", dim="D_QK", lo=257, hi=1024,
                    config={"BLOCK_K": 64, "FWD_STAGES": 3, "BLOCK_H": 64, "BLOCK_K_BWD": 16,
                            "BLOCK_H_BWD": 32, "num_warps": 8, "FWD_SPLIT_SCORES": 1,
                            "FWD_ROW_END": 1, "BWD_SPLIT": 1, "BLOCK_H_DQ": 64, "BLOCK_K_DQ": 32,
                            "BLOCK_K_DKV": 64, "BLOCK_H_DKV": 32, "BWD_STAGES": 2}),
    ),
    check=_check,
    match=match,
    sample_inputs=sample_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
)
