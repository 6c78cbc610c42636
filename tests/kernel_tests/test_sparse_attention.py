"""Top-k sparse attention family: indexer selection vs torch.topk, gathered attention (GQA, sink,
MLA latent) forward and every gradient vs the dense masked reference, opcheck, AOT for sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import DEVICE, OPCHECK_SPLIT

from onboarding.generate import aot
from onboarding.generate import templating
from onboarding.families import family_module
fam = family_module("sparse_attention")
from onboarding.graph.opgraph import Block
from onboarding.testing import (
    KernelFixture,
    check_aot_sm90,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
)
from onboarding.testing.tolerance import rel_rms as rel

# Few, large tiles: the interpreter costs per program and per op. BLOCK_SEL=16 splits a 37-long
# row into 3 chunks, so the chunked counting and the carried compaction offsets are exercised.
CPU_CONFIG = {"BLOCK_K": 16, "BLOCK_H": 16, "BLOCK_K_BWD": 16, "BLOCK_H_BWD": 16, "BLOCK_T": 32,
              "BLOCK_SEL": 16, "SEL_RADIX": 8, "dot_precision": "ieee"}
T = 37  # odd on purpose
_MODULES: dict = {}


@pytest.fixture(scope="module")
def load(kernel_root):
    def _load(variant: str, params: dict | None = None):
        params = params or {}
        key = (variant, tuple(sorted(params.items())))
        if key not in _MODULES:
            source = templating.render(fam.FAMILY, variant, params)
            name = "_".join([variant] + [f"{k}_{v}" for k, v in sorted(params.items())])
            path = templating.write_module(source, kernel_root / fam.NAME / f"{name}.py", overwrite=True)
            module = templating.load_module(path)
            if DEVICE.type == "cpu":
                module.set_config(CPU_CONFIG)
            _MODULES[key] = module
        return _MODULES[key]

    return _load


def indexer_inputs(gen, positive: bool, B: int = 1, T: int = T, H: int = 4, D: int = 16):
    """positive=True: q, k > 0 so no relu clips to 0 and all scores are distinct (no ties)."""
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, T, D, generator=gen)
    if positive:
        q, k = q.abs(), k.abs()
    w = torch.randn(B, T, H, generator=gen)
    return q.to(DEVICE), k.to(DEVICE), w.to(DEVICE)


# ---- indexer ---------------------------------------------------------------------------------

def test_indexer_selection_equals_torch_topk(load):
    """Scores match; the selected set equals torch.topk's on the causally masked scores for K
    below T (rows t < K-1 have fewer positions than K: -1 padded), K == T and K > T."""
    m = load("indexer", {"topk": 8})
    q, k, w = indexer_inputs(torch.Generator().manual_seed(0), positive=True)
    scores = m.index_scores(q, k, w)
    ref_scores = m.reference_scores(q, k, w)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    causal = torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril()
    for topk in (8, T, T + 13):
        idx = m.sparse_topk_indexer_topk_op(scores, topk)
        K = min(topk, T)
        assert idx.shape == (1, T, K) and idx.dtype == torch.int32
        vals, ref = ref_scores.masked_fill(~causal, float("-inf")).topk(K, dim=-1)
        for t in range(T):
            n = min(K, t + 1)
            got = idx[0, t]
            assert (got[n:] == -1).all(), (topk, t, got)
            assert torch.equal(got[:n].long(), ref[0, t, :n].sort().values), (topk, t)
    assert torch.equal(idx, m.reference(q, k, w, T + 13))


def test_indexer_entry_and_ties(load):
    """Signed data: relu gives exact-zero (tied) scores. The selected multiset of scores equals
    torch.topk's values; ties at the threshold go to the lower positions."""
    m = load("indexer", {"topk": 8})
    q, k, w = indexer_inputs(torch.Generator().manual_seed(1), positive=False)
    w = w.abs()  # all-positive weights: rows with many exact zeros (ties at the threshold)
    idx = m.sparse_topk_indexer(q, k, w, 8)
    s = m.reference_scores(q, k, w)
    vals = s.topk(8, dim=-1).values
    for t in range(T):
        n = min(8, t + 1)
        sel = idx[0, t, :n].long()
        assert sel.unique().numel() == n and (sel <= t).all()
        torch.testing.assert_close(s[0, t, sel].sort(descending=True).values, vals[0, t, :n],
                                   rtol=1e-5, atol=1e-6)
        thr = vals[0, t, n - 1]
        tied = (s[0, t, : t + 1] == thr).nonzero().flatten()
        n_above = int((s[0, t, : t + 1] > thr).sum())
        assert torch.equal(sel[s[0, t, sel] == thr], tied[: n - n_above]), t


def test_indexer_no_relu(load):
    m = load("indexer", {"topk": 5, "indexer_relu": False})
    q, k, w = indexer_inputs(torch.Generator().manual_seed(2), positive=False, T=21)
    assert torch.equal(m.sparse_topk_indexer(q, k, w, 5), m.reference(q, k, w, 5))


@pytest.mark.parametrize("B,T_,topk,budget_rows", [
    pytest.param(1, 45, 8, 16, id="T45-k8-3chunks"),        # odd T, last chunk short, K > early rows
    pytest.param(2, 33, 33, 16, id="B2-T33-k=T-3chunks"),   # K == T, two batches share a chunk buffer
    pytest.param(1, 29, 40, 32, id="T29-k>T-1chunk"),       # K > T, the whole row block at once
])
def test_chunked_indexer_equals_torch_topk(load, B, T_, topk, budget_rows):
    """The entry scores and selects one block of query rows at a time (max_score_bytes sized for
    `budget_rows` rows); its selection equals torch.topk's on the full masked scores."""
    m = load("indexer", {"topk": 8})
    q, k, w = indexer_inputs(torch.Generator().manual_seed(6 + T_), positive=True, B=B, T=T_)
    budget = B * budget_rows * T_ * 4
    assert m.query_chunk(B, T_, budget) == min(budget_rows, T_)
    idx = m.sparse_topk_indexer(q, k, w, topk, max_score_bytes=budget)
    K = min(topk, T_)
    assert idx.shape == (B, T_, K)
    causal = torch.ones(T_, T_, dtype=torch.bool, device=DEVICE).tril()
    vals, ref = m.reference_scores(q, k, w).masked_fill(~causal, float("-inf")).topk(K, dim=-1)
    for b in range(B):
        for t in range(T_):
            n = min(K, t + 1)
            assert (idx[b, t, n:] == -1).all(), (b, t)
            assert torch.equal(idx[b, t, :n].long(), ref[b, t, :n].sort().values), (b, t)


# ---- gathered attention ----------------------------------------------------------------------

GATHERED_CASES = [
    # id, params, (H, HK, D_QK, D_V), topk, sink, scale
    pytest.param({}, (4, 2, 16, 16), 8, True, None, id="gqa-sink-k8"),
    pytest.param({}, (4, 1, 32, 16), T, False, 0.2, id="mqa-dqk32-dv16-k=T"),
    pytest.param({"layout": "mla", "d_v": 32}, (4, 1, 40, 32), 8, True, 0.3, id="mla-dqk40-dv32-sink"),
    pytest.param({"layout": "mla", "d_v": 32}, (4, 1, 40, 32), T + 5, False, None, id="mla-k>T"),
]


def gathered_fixture(module, params, dims, topk, sink, scale, B=1, seq=T):
    H, HK, D_QK, D_V = dims
    mla = params.get("layout") == "mla"

    def make_inputs(dtype, device, gen):
        q = torch.randn(B, seq, H, D_QK, generator=gen)
        idx = fam.causal_topk_indices(torch.randn(B, seq, seq, generator=gen), topk)
        s = torch.randn(H, generator=gen) if sink else None
        if mla:
            kvs = [torch.randn(B, seq, 1, D_QK, generator=gen)]
        else:
            kvs = [torch.randn(B, seq, HK, D_QK, generator=gen), torch.randn(B, seq, HK, D_V, generator=gen)]
        tensors = [t.to(device, dtype) for t in (q, *kvs)]
        return [*tensors, idx.to(device), None if s is None else s.to(device, dtype), scale]

    sink_pos = 3 if mla else 4
    return KernelFixture(name=f"sparse_attention/{'mla' if mla else 'mha'}", module=module,
                         make_inputs=make_inputs, weights=(sink_pos,) if sink else ())


@pytest.mark.parametrize("params,dims,topk,sink,scale", GATHERED_CASES)
def test_gathered_forward_backward(load, params, dims, topk, sink, scale):
    """Output and gradients of q, k, v (the latent kv in MLA mode) and the sink vs dense masked."""
    module = load("gathered", params)
    check_forward_backward(gathered_fixture(module, params, dims, topk, sink, scale, B=2),
                           torch.float32, DEVICE)


@pytest.mark.parametrize("H,D_QK,D_V,topk,sink,extras", [
    # halves 24 / 24 (padded to 32), rope 8, K % BLOCK_K != 0; each choice alone and together
    pytest.param(3, 56, 48, 21, True, ({"FWD_DV_SPLIT": 2}, {"FWD_ROW_END": 1}, {"FWD_DV_SPLIT": 2, "FWD_ROW_END": 1},
                                       {"FWD_TWO_PASS": 1}, {"FWD_TWO_PASS": 1, "FWD_ROW_END": 1},
                                       {"BLOCK_K": 64, "FWD_STAGES": 2}),  # the MLA bucket's H200 pick
                 id="h3-dv48-rope8-k21-sink"),
    # nightly (22 s on 2 cores): the same choices as above with two head blocks and K > T
    pytest.param(20, 40, 32, 29 + 5, False, ({"FWD_TWO_PASS": 1}, {"FWD_DV_SPLIT": 2, "FWD_ROW_END": 1}),
                 id="h20-two-head-blocks-k>T", marks=pytest.mark.slow),
])
def test_mla_value_split_forward(load, H, D_QK, D_V, topk, sink, extras):
    """FWD_DV_SPLIT = 2 (the value columns over two programs, each recomputing the scores),
    FWD_TWO_PASS = 1 (scores and stored probabilities, then the value dots) and FWD_ROW_END = 1
    (stop at a row's last valid index): the output and the log-sum-exp (which the unchanged
    backward reads) equal the fused forward's, and under the last config the output and every
    gradient equal the dense reference's; rows with fewer valid picks than K (early rows, -1
    padding), invalid indices (-1 inside a row, positions >= S) and a row with none are handled
    as there."""
    m = load("gathered", {"layout": "mla", "d_v": D_V})
    gen = torch.Generator().manual_seed(21)
    B, S = 1, 29
    q = torch.randn(B, S, H, D_QK, generator=gen).to(DEVICE)
    kv = torch.randn(B, S, 1, D_QK, generator=gen).to(DEVICE)
    idx = fam.causal_topk_indices(torch.randn(B, S, S, generator=gen), topk)
    idx[:, 24:, 1] = -1  # a hole inside full rows
    idx[:, 26:, 2] = S + 3  # past S: skipped like -1
    if sink:  # a row with no valid index (the reference is finite there only with a sink)
        idx[0, 6] = -1
    idx = idx.to(DEVICE)
    s = torch.randn(H, generator=gen).to(DEVICE) if sink else None
    scale = 0.3
    # fp32 dots on both paths (the GPU's default tf32 would round the two score sums differently)
    base = {**CPU_CONFIG} if DEVICE.type == "cpu" else {"dot_precision": "ieee"}
    try:
        m.set_config({**base, "FWD_DV_SPLIT": 1})
        o1, lse1 = m._forward(q, kv, idx, s, scale)
        for extra in extras:
            m.set_config({**base, **extra})
            o2, lse2 = m._forward(q, kv, idx, s, scale)
            torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5, msg=str(extra))
            torch.testing.assert_close(lse2, lse1, rtol=1e-5, atol=1e-5, msg=str(extra))
        if sink:
            assert int(m._row_ends(idx, S)[0, 6]) == 0 and int(m._row_ends(idx, S)[0, 3]) == 4
        leaves = [q.clone().requires_grad_(), kv.clone().requires_grad_()] + \
            ([s.clone().requires_grad_()] if sink else [])
        ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        o = m.entry(leaves[0], leaves[1], idx, leaves[2] if sink else None, scale)  # the last extra's config
        ref = m.reference(ref_leaves[0], ref_leaves[1], idx, ref_leaves[2] if sink else None, scale)
        torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
        do = torch.randn(o.shape, generator=gen).to(DEVICE)
        for name, g, rg in zip(("dq", "dkv", "dsink"), torch.autograd.grad(o, leaves, do),
                               torch.autograd.grad(ref, ref_leaves, do)):
            torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-4, msg=name)
    finally:
        m.set_config(CPU_CONFIG if DEVICE.type == "cpu" else None)


@pytest.mark.parametrize("params,dims,topk,extra,scale", [
    # MLA: d_v 48 (padded to 64), rope 8, K 21 (not a multiple of BLOCK_K), a sink; row ends, 3 stages
    pytest.param({"layout": "mla", "d_v": 48}, (3, 1, 56, 48), 21,
                 {"FWD_SPLIT_SCORES": 1, "FWD_ROW_END": 1, "FWD_STAGES": 3}, 0.3, id="mla-dv48-rope8-k21-row-end"),
    pytest.param({}, (4, 2, 16, 16), 8, {"FWD_SPLIT_SCORES": 1}, 0.3, id="gqa-h4-hk2-d16-k8"),
    # FWD_EARLY_GATHER (the value dot behind its own always-taken branch; with split scores the mask
    # applied before the softmax's branch): the rows above, then 20 heads (two head blocks, the last
    # ragged) with K > T (every early row's tail is -1 padding) at scale 3, then the fused path
    # (no split) on GQA. These rows also check the gradients through the entry against the reference.
    pytest.param({"layout": "mla", "d_v": 48}, (3, 1, 56, 48), 21,
                 {"FWD_SPLIT_SCORES": 1, "FWD_ROW_END": 1, "FWD_STAGES": 3, "FWD_EARLY_GATHER": 1}, 0.3,
                 id="mla-dv48-rope8-k21-row-end-early-gather"),
    pytest.param({"layout": "mla", "d_v": 32}, (20, 1, 40, 32), 29 + 5,
                 {"FWD_SPLIT_SCORES": 1, "FWD_EARLY_GATHER": 1}, 3.0, id="mla-h20-dv32-k>T-early-gather"),
    pytest.param({}, (4, 2, 16, 16), 8, {"FWD_EARLY_GATHER": 1}, 0.3, id="gqa-h4-hk2-d16-k8-early-gather"),
])
def test_split_scores_forward(load, params, dims, topk, extra, scale):
    """FWD_SPLIT_SCORES = 1 (the score dots split over the warp groups behind an always-taken
    branch, the softmax in base 2): the output and the log-sum-exp equal the fused forward's
    (so the unchanged backward, which reads o and lse, gives its gradients: the other tests
    check those against the reference) and the output the dense reference's, on rows with fewer
    valid picks than K, -1 holes, indices >= S and a row with none (a sink keeps it finite).
    FWD_EARLY_GATHER rows (its own branch around the value dot) also take the gradients of q,
    k / v (the latent) and the sink through the entry against the reference's: the backward
    reads the option's o and lse."""
    H, HK, D_QK, D_V = dims
    mla = params.get("layout") == "mla"
    m = load("gathered", params)
    gen = torch.Generator().manual_seed(33)
    S = 29
    q = torch.randn(1, S, H, D_QK, generator=gen).to(DEVICE)
    kvs = ([torch.randn(1, S, 1, D_QK, generator=gen)] if mla else
           [torch.randn(1, S, HK, D_QK, generator=gen), torch.randn(1, S, HK, D_V, generator=gen)])
    kvs = [t.to(DEVICE) for t in kvs]
    idx = fam.causal_topk_indices(torch.randn(1, S, S, generator=gen), topk)
    idx[:, 24:, 1] = -1
    idx[:, 26:, 2] = S + 3
    idx[0, 6] = -1
    idx = idx.to(DEVICE)
    sink = torch.randn(H, generator=gen).to(DEVICE)
    base = {**CPU_CONFIG} if DEVICE.type == "cpu" else {"dot_precision": "ieee"}
    try:
        m.set_config(base)
        o1, lse1 = m._forward(q, *kvs, idx, sink, scale)
        m.set_config({**base, **extra})
        o2, lse2 = m._forward(q, *kvs, idx, sink, scale)
        torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse2, lse1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o2, m.reference(q, *kvs, idx, sink, scale), rtol=1e-4, atol=1e-5)
        if extra.get("FWD_EARLY_GATHER"):
            leaves = [t.clone().requires_grad_() for t in (q, *kvs, sink)]
            ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
            o = m.entry(*leaves[:-1], idx, leaves[-1], scale)
            ref = m.reference(*ref_leaves[:-1], idx, ref_leaves[-1], scale)
            torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
            do = torch.randn(o.shape, generator=gen).to(DEVICE)
            for i, (g, rg) in enumerate(zip(torch.autograd.grad(o, leaves, do), torch.autograd.grad(ref, ref_leaves, do))):
                torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-4, msg=f"grad {i}")
    finally:
        m.set_config(CPU_CONFIG if DEVICE.type == "cpu" else None)


@pytest.mark.slow  # 51.7 s under -n 2 on a 2-core host (forty-ninth session, --durations)
@pytest.mark.skipif(DEVICE.type != "cpu", reason="fp32 tiles at d 576 exceed shared memory; the GPU has its bf16 row")
def test_early_gather_forward_at_the_mla_bucket_tiles(load):
    """FWD_EARLY_GATHER at the d_le_1024 bucket's own forward (64 heads x 64 keys, d_qk 576 / d_v 512,
    split scores, row ends; 128 heads = two head blocks, K 128 = two key blocks, early rows padded,
    -1 holes, a sink): o and lse equal the default's, o the reference's (interpreter)."""
    m = load("gathered", {"layout": "mla", "d_v": 512})
    gen = torch.Generator().manual_seed(3)
    T_, H, K, scale = 150, 128, 128, 0.1
    q = torch.randn(1, T_, H, 576, generator=gen).to(DEVICE)
    kv = torch.randn(1, T_, 1, 576, generator=gen).to(DEVICE)
    idx = fam.causal_topk_indices(torch.randn(1, T_, T_, generator=gen), K)
    idx[:, 100:, 5] = -1
    idx = idx.to(DEVICE)
    sink = torch.randn(H, generator=gen).to(DEVICE)
    try:
        m.set_config(None)  # the bucket's tiles (the CPU tests otherwise pin small ones)
        assert m.config_for(576)["BLOCK_K"] == 64 and m.config_for(576)["FWD_SPLIT_SCORES"] == 1
        out = []
        for early in (0, 1):
            m.set_config({"dot_precision": "ieee", "FWD_EARLY_GATHER": early}, bucket="d_le_1024")
            out.append(m._forward(q, kv, idx, sink, scale))
        (o1, lse1), (o2, lse2) = out
        torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse2, lse1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o2, m.reference(q, kv, idx, sink, scale), rtol=1e-4, atol=1e-5)
    finally:
        m.set_config(None, bucket="d_le_1024")
        m.set_config(CPU_CONFIG if DEVICE.type == "cpu" else None)


@pytest.mark.parametrize("H,D_QK,D_V,topk,sink,extras", [
    # 20 heads: a ragged last head block at BLOCK_H_DKV 16 and a masked half at 32; d_v 48 (padded
    # to 64), rope 8 (padded to 16), K 21 (not a multiple of BLOCK_K), a sink, a row with no pick
    pytest.param(20, 56, 48, 21, True, ({"BLOCK_K_DKV": 16, "BLOCK_H_DKV": 16},
                                        {"BLOCK_K_DKV": 32, "BLOCK_H_DKV": 32, "BWD_STAGES": 2,
                                         "BLOCK_H_DQ": 32, "BLOCK_K_DQ": 32}),
                 id="h20-dv48-rope8-k21-sink"),
    # K > T: every early row's tail is padding, whole dkv key blocks of it (their programs return)
    pytest.param(4, 40, 32, 29 + 5, False, ({"BLOCK_K_DKV": 16, "BLOCK_H_DKV": 16},
                                            {"BLOCK_K_DKV": 64, "BLOCK_K_BWD": 32}), id="h4-dv32-k>T"),
])
def test_mla_split_backward(load, H, D_QK, D_V, topk, sink, extras):
    """BWD_SPLIT = 1 (the dq kernel, then the dkv kernel that walks all heads of a query per key
    block and adds its sum once): dq, dkv and dsink equal the fused backward's on the same o and
    lse, and under the last config the dense reference's gradients (autograd through the entry);
    rows with fewer valid picks than K (early rows, -1 padding), -1 holes, indices >= S and a row
    with none (kept finite by the sink) are handled as there."""
    m = load("gathered", {"layout": "mla", "d_v": D_V})
    gen = torch.Generator().manual_seed(44)
    B, S = 1, 29
    q = torch.randn(B, S, H, D_QK, generator=gen).to(DEVICE)
    kv = torch.randn(B, S, 1, D_QK, generator=gen).to(DEVICE)
    idx = fam.causal_topk_indices(torch.randn(B, S, S, generator=gen), topk)
    idx[:, 24:, 1] = -1  # a hole inside full rows
    idx[:, 26:, 2] = S + 3  # past S: skipped like -1
    if sink:
        idx[0, 6] = -1
    idx = idx.to(DEVICE)
    s = torch.randn(H, generator=gen).to(DEVICE) if sink else None
    scale = 0.3
    base = {**CPU_CONFIG} if DEVICE.type == "cpu" else {"dot_precision": "ieee"}
    try:
        m.set_config(base)
        o, lse = m._forward(q, kv, idx, s, scale)
        do = torch.randn(o.shape, generator=gen).to(DEVICE)
        fused = m._backward(do, q, kv, idx, s, o, lse, scale)
        for extra in extras:
            m.set_config({**base, "BWD_SPLIT": 1, **extra})
            split = m._backward(do, q, kv, idx, s, o, lse, scale)
            for name, a, b in zip(("dq", "dkv", "dsink"), split, fused):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name} {extra}")
        leaves = [q.clone().requires_grad_(), kv.clone().requires_grad_()] + \
            ([s.clone().requires_grad_()] if sink else [])
        ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        o = m.entry(leaves[0], leaves[1], idx, leaves[2] if sink else None, scale)  # the last extra's config
        ref = m.reference(ref_leaves[0], ref_leaves[1], idx, ref_leaves[2] if sink else None, scale)
        torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
        for name, g, rg in zip(("dq", "dkv", "dsink"), torch.autograd.grad(o, leaves, do),
                               torch.autograd.grad(ref, ref_leaves, do)):
            torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-4, msg=name)
    finally:
        m.set_config(CPU_CONFIG if DEVICE.type == "cpu" else None)


def test_indexer_feeds_gathered(load):
    """End to end: kernel indices (with -1 padding) into the gathered kernel; MQA as in DSA."""
    mi, mg = load("indexer", {"topk": 8}), load("gathered", {})
    gen = torch.Generator().manual_seed(3)
    qi, ki, w = indexer_inputs(gen, positive=False)
    idx = mi.sparse_topk_indexer(qi, ki, w, 8)
    q = torch.randn(1, T, 4, 16, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(1, T, 1, 16, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(1, T, 1, 16, generator=gen).to(DEVICE).requires_grad_()
    o, ref = mg.sparse_attention(q, k, v, idx), mg.reference(q, k, v, idx)
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
    do = torch.randn_like(o)
    for g, rg in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-5)


def test_shape_errors_name_shapes(load):
    m = load("gathered", {})
    q = torch.randn(1, 5, 4, 16)
    k = torch.randn(1, 5, 3, 16)
    with pytest.raises(ValueError, match=r"\(1, 5, 3, 16\)"):
        m.sparse_attention(q, k, k, torch.zeros(1, 5, 2, dtype=torch.int32))


# ---- opcheck, contract, AOT ------------------------------------------------------------------

@pytest.mark.parametrize("opcheck_utils", OPCHECK_SPLIT)
def test_opcheck_and_contract(load, opcheck_utils):
    mi = load("indexer", {"topk": 4})
    check_module_contract(mi)
    gen = torch.Generator().manual_seed(4)
    q, k, w = indexer_inputs(gen, positive=False, T=9)
    for op, args in mi.op_samples(q, k, w, 4):
        torch.library.opcheck(op, args)
    for params, dims, sink in (({}, (4, 2, 16, 16), True), ({"layout": "mla", "d_v": 32}, (2, 1, 40, 32), True)):
        mg = load("gathered", params)
        check_module_contract(mg)
        check_opcheck(gathered_fixture(mg, params, dims, 4, sink, None, seq=9), torch.float32, DEVICE,
                      utils=opcheck_utils)


# Child process (no interpreter): compile each module's bf16 AOT specs for sm_90 and report the
# tensor-core instructions and the global atomics its PTX uses (Triton's cache makes the second
# compile of a spec that test_aot_sm90 just built cheap).
_PTX_SCRIPT = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from onboarding.generate import aot
from onboarding.generate.templating import load_module
out = {}
for path, size in json.loads(sys.argv[1]):
    m = load_module(path)
    kernels = aot.jit_kernels(m)
    for spec in m.aot_specs("bf16", size):
        src = ASTSource(fn=kernels[spec["kernel"]], signature=spec["signature"], constexprs=spec["constexprs"])
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={
            "num_warps": spec["num_warps"], "num_stages": spec.get("num_stages", 3)}).asm["ptx"]
        out[spec["kernel"]] = {
            "mma": sorted(set(re.findall(r"(?:wgmma\\.mma_async|mma\\.sync)[\\w.]*", ptx))),
            "atomics": sorted(set(re.findall(r"(?:red|atom)\\.global[\\w.]*", ptx)))}
print(json.dumps(out))
"""


def _aot_groups(load) -> dict:
    # one child process per head dim (a child costs seconds of imports)
    return {128: [load("indexer", {}).__file__, load("gathered", {}).__file__],
            576: [load("gathered", {"layout": "mla", "d_v": 512}).__file__]}


@pytest.mark.slow  # 34 s in CI on a cold Triton cache
def test_aot_sm90(load):
    """Compile every kernel for sm_90 at real head dims: indexer D=128, gathered GQA D=128, MLA
    d_qk 576 / d_v 512 (128 query heads over one latent)."""
    for size, paths in _aot_groups(load).items():
        check_aot_sm90(paths, size=size)


@pytest.mark.slow  # sm_90 build, nightly: 32.5 s on CI's cold Triton cache (28th session)
def test_aot_sm90_bf16_tensor_cores_and_relaxed_atomics(load):
    """bf16 specs compile the fast path: every dot is a bf16 tensor-core MMA (mma.sync or wgmma
    with bf16 operands, no tf32), and the backward's dk/dv scatter-adds are relaxed reductions
    (red.global...add.f32), not acq_rel atom instructions that return a value."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    jobs = [(path, size) for size, paths in _aot_groups(load).items() for path in paths]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, json.dumps(jobs)], capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = json.loads(run.stdout.splitlines()[-1])
    dot_kernels = {"sparse_topk_indexer_scores_kernel", "sparse_attention_fwd_kernel",
                   "sparse_attention_bwd_kernel", "sparse_mla_attention_fwd_kernel",
                   "sparse_mla_attention_bwd_kernel", "sparse_mla_attention_fwd_split_kernel",
                   "sparse_mla_attention_fwd_scores_kernel", "sparse_mla_attention_fwd_values_kernel",
                   "sparse_mla_attention_bwd_dq_kernel", "sparse_mla_attention_bwd_dkv_kernel"}
    assert dot_kernels <= set(ptx), sorted(ptx)
    for name in dot_kernels:
        mma = ptx[name]["mma"]
        assert mma and all("bf16" in ins for ins in mma), (name, mma)
    assert not [a for a in ptx["sparse_mla_attention_bwd_dq_kernel"]["atomics"] if "add" in a]  # dq: stores only
    for name in ("sparse_attention_bwd_kernel", "sparse_mla_attention_bwd_kernel", "sparse_mla_attention_bwd_dkv_kernel"):
        adds = [a for a in ptx[name]["atomics"] if "add" in a]
        assert adds and all(a.startswith("red.") and "relaxed" in a for a in adds), (name, ptx[name]["atomics"])


# Child process: the MLA kernels each config runs (the forward, or the split backward's dq and
# dkv kernels), compiled for sm_90 as the runtime JIT specialises them (16-byte aligned pointers
# and i32 arguments divisible by 16, as at T 8192, K 2048, 128 heads): only then does Triton
# pipeline the gathered loads, so only then is the shared memory the GPU will ask for known.
_SWEEP_SCRIPT = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from onboarding.generate import aot
from onboarding.generate.templating import load_module
m = load_module(sys.argv[1])
kernels = aot.jit_kernels(m)
out = []
for cfg in json.loads(sys.argv[2]):
    m.set_config(cfg)
    names = (("_bwd_dq_kernel", "_bwd_dkv_kernel") if cfg.get("BWD_SPLIT") else
             ("_fwd_scores_kernel", "_fwd_values_kernel") if cfg.get("FWD_TWO_PASS") else
             ("_fwd_split_kernel",) if cfg.get("FWD_DV_SPLIT", 1) == 2 else ("_fwd_kernel",))
    for spec in [s for s in m.aot_specs("bf16", 576) if s["kernel"].endswith(names)]:
        sig = spec["signature"]
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n].startswith("*") or sig[n] == "i32"}
        with aot._triton_ptxas_log() as log:  # the build's own registers and spills
            c = triton.compile(ASTSource(fn=kernels[spec["kernel"]], signature=sig, constexprs=spec["constexprs"], attrs=attrs),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
        g = c.asm["ttgir"]
        regs, spills = aot._usage_in_log(log.getvalue())
        body = g[g.find("scf.for"):]  # the (first) loop: is a gathered load issued before the first exp2?
        copy, exp2 = body.find("async_copy_global_to_local"), body.find("math.exp2")
        out.append({"cfg": cfg, "kernel": spec["kernel"], "shared": int(c.metadata.shared), "regs": regs, "spills": spills,
                    "async": g.count("async_copy_global_to_local"), "gather_first": 0 <= copy < exp2,
                    "mma_warps": sorted(set(re.findall(r"nvidia_mma<{[^}]*warpsPerCTA = (\\[[0-9, ]+\\])", g)))})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_aot_sm90_mla_forward_fits_as_the_runtime_compiles_it(load):
    """The MLA forward at the d_le_1024 bucket's config (what the bench's forward cases time)
    compiles for sm_90 with the runtime's specialisation within an H100/H200 SM's shared memory,
    with its 3 stages its gathered rows load asynchronously (pipelined), and with
    FWD_SPLIT_SCORES the score dots' warps split the key columns ([4, 2]) instead of both warp
    groups computing the whole block (a [8, 1] layout over 64 rows). The same for the rows
    bench.MLA_FWD_SWEEP times. With FWD_EARLY_GATHER 1 (the bucket's since v11) the loop issues the
    next block's gathered loads before the softmax's exp2; the sweep's FWD_EARLY_GATHER 0 row
    issues them after."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    m = load("gathered", {"layout": "mla", "d_v": 512})
    bucket = m.config_for(576)
    assert bucket["FWD_STAGES"] == 3 and bucket["FWD_SPLIT_SCORES"] == 1 and bucket["FWD_EARLY_GATHER"] == 1, bucket
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    configs = [{"dot_precision": "tf32"}] + [{"dot_precision": "tf32", **c} for c in fam.bench.MLA_FWD_SWEEP]
    run = subprocess.run([sys.executable, "-c", _SWEEP_SCRIPT, m.__file__, json.dumps(configs)],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.splitlines()[-1])
    assert len(rows) == len(configs), rows
    for r in rows:
        assert r["shared"] <= aot.H100_SHARED_BYTES, r
        assert r["async"] > 0, r
        assert r["mma_warps"] == ["[4, 2]"], r
        assert r["gather_first"] == bool({**bucket, **r["cfg"]}["FWD_EARLY_GATHER"]), r


@pytest.mark.slow  # sm_90 builds, 6 configs x 2 kernels: 11 s on a cold Triton cache (2 cores)
def test_aot_sm90_mla_split_backward_sweep_fits_as_the_runtime_compiles_it(load):
    """Every config of the split backward the MLA fwd+bwd sweep times (bench.MLA_FWDBWD_SWEEP)
    compiles its dq and dkv kernels for sm_90 with the runtime's specialisation within an
    H100/H200 SM's shared memory; at 64-row tiles (dq: 64 heads, dkv: 64 keys) every dot is a
    wgmma with the two warp groups split over its columns ([4, 2]), none with both computing the
    same rows ([8, 1]: the scores, which feed further dots, without the always-taken branches)."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    path = load("gathered", {"layout": "mla", "d_v": 512}).__file__
    configs = [{"dot_precision": "tf32", **c} for c in fam.bench.MLA_FWDBWD_SWEEP if c.get("BWD_SPLIT")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SWEEP_SCRIPT, path, json.dumps(configs)],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.splitlines()[-1])
    assert len(rows) == 2 * len(configs)
    for r in rows:
        assert r["shared"] <= aot.H100_SHARED_BYTES, r
        dq = r["kernel"].endswith("_dq_kernel")
        if (dq and r["cfg"].get("BLOCK_H_DQ", 64) == 64) or not dq:  # the bucket's dq: 64 heads
            assert r["mma_warps"] == ["[4, 2]"], r


def test_dot_mode_keeps_fp32_operands_on_cpu(load):
    """_dot_mode picks fp32 operands ("ieee"/"tf32") for bf16 inputs on the CPU and in the
    interpreter (whose bf16 dots are wrong), the 16-bit dot only for 16-bit inputs on a GPU
    outside it; a mixed-dtype call never rounds its fp32 tensors to bf16. bf16 inputs on the
    CPU then match the fp32 reference of the same values to bf16 output rounding."""
    m = load("gathered", {})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert m._dot_mode("tf32", torch.bfloat16, cpu) == "tf32"
    assert m._dot_mode("ieee", torch.bfloat16, cpu) == "ieee"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # the interpreter, even for a cuda device
        assert m._dot_mode("tf32", torch.bfloat16, cuda) == "tf32"
    else:
        assert m._dot_mode("tf32", torch.bfloat16, cuda) == "bf16"
        assert m._dot_mode("tf32", torch.float16, cuda) == "fp16"
    bf = torch.zeros(2, dtype=torch.bfloat16)
    assert m._mode({"dot_precision": "ieee"}, bf, bf) == "ieee"
    assert m._mode({"dot_precision": "ieee"}, bf, bf.float()) == "ieee"
    if DEVICE.type == "cpu":
        gen = torch.Generator().manual_seed(9)
        q = torch.randn(1, 21, 4, 16, generator=gen).bfloat16()
        k, v = (torch.randn(1, 21, 2, 16, generator=gen).bfloat16() for _ in range(2))
        idx = fam.causal_topk_indices(torch.randn(1, 21, 21, generator=gen), 6)
        o = m.sparse_attention(q, k, v, idx)
        ref = m.reference(q.float(), k.float(), v.float(), idx)
        assert o.dtype == torch.bfloat16
        err = ((o.float() - ref).norm() / ref.norm()).item()
        assert err < 4e-3, err  # bf16 output rounding is ~2e-3 relative RMS; garbage is O(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core dots need a GPU")
@pytest.mark.parametrize("params,dims,config", [
    pytest.param({}, (16, 2, 128, 128), None, id="gqa-h16-hk2-d128"),
    pytest.param({"layout": "mla", "d_v": 512}, (128, 1, 576, 512), None, id="mla-h128-576-512"),
    # the value-split and two-pass forwards at tiles the bench sweeps (the backward is the same kernel)
    pytest.param({"layout": "mla", "d_v": 512}, (128, 1, 576, 512),
                 {"FWD_DV_SPLIT": 2, "BLOCK_H": 128, "BLOCK_K": 32, "FWD_STAGES": 2}, id="mla-split-h128-k32"),
    pytest.param({"layout": "mla", "d_v": 512}, (128, 1, 576, 512),
                 {"FWD_DV_SPLIT": 2, "BLOCK_H": 128, "BLOCK_K": 64, "FWD_STAGES": 1}, id="mla-split-h128-k64"),
    pytest.param({"layout": "mla", "d_v": 512}, (128, 1, 576, 512),
                 {"FWD_TWO_PASS": 1, "BLOCK_H": 128, "BLOCK_K": 32, "FWD_STAGES": 2, "FWD_ROW_END": 1},
                 id="mla-two-pass-h128-k32-row-end"),
    # the backward rows of bench.MLA_FWDBWD_SWEEP beside the bucket's (the split backward at dq
    # 64 heads x 32 keys, dkv 64 keys x 32 heads, 2 stages: the row above): the fused backward it
    # replaced, and the split one at 1 stage
    pytest.param({"layout": "mla", "d_v": 512}, (128, 1, 576, 512), {"BWD_SPLIT": 0}, id="mla-bwd-fused"),
    pytest.param({"layout": "mla", "d_v": 512}, (128, 1, 576, 512), {"BWD_SPLIT": 1, "BWD_STAGES": 1},
                 id="mla-bwd-split-1stage"),
    # the forward FWD_EARLY_GATHER 1 replaced in the bucket (v11): the gather after the value dot
    pytest.param({"layout": "mla", "d_v": 512}, (128, 1, 576, 512), {"FWD_EARLY_GATHER": 0},
                 id="mla-gather-after-value-dot"),
])
def test_gpu_bf16_accuracy(load, params, dims, config):
    """bf16 kernel (16-bit dots) vs the fp32 reference on the same bf16 values, T=1024, K=256:
    relative RMS <= 5e-3 on the output and <= 1e-2 on every gradient."""
    H, HK, D_QK, D_V = dims
    m = load("gathered", params)
    if config is not None:
        m.set_config(config)
        try:
            _gpu_bf16_accuracy(m, params, dims)
        finally:
            m.set_config(None)
    else:
        _gpu_bf16_accuracy(m, params, dims)


def _gpu_bf16_accuracy(m, params, dims):
    H, HK, D_QK, D_V = dims
    gen = torch.Generator(device="cuda").manual_seed(12)
    T_, K = 1024, 256

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16().requires_grad_()

    q = leaf(1, T_, H, D_QK)
    kvs = [leaf(1, T_, 1, D_QK)] if params else [leaf(1, T_, HK, D_QK), leaf(1, T_, HK, D_V)]
    scores = torch.randn(1, T_, T_, device="cuda", generator=gen)
    idx = fam.causal_topk_indices(scores, K)
    do = torch.randn(1, T_, H, D_V, device="cuda", generator=gen)
    o = m.entry(q, *kvs, idx)
    grads = torch.autograd.grad(o, (q, *kvs), do.bfloat16())
    hi = [t.detach().float().requires_grad_() for t in (q, *kvs)]
    o32 = m.reference(*hi, idx)
    grads32 = torch.autograd.grad(o32, hi, do)

    assert rel(o, o32) <= 5e-3, rel(o, o32)
    for name, g, g32 in zip(("dq", "dk", "dv"), grads, grads32):
        assert rel(g, g32) <= 1e-2, (name, rel(g, g32))


# ---- block matching and sample inputs ------------------------------------------------------

def _block(kind, **attrs):
    return Block(path="model.layers.0.self_attn", kind=kind, layer=0, class_name="Anything", attrs=attrs)


def test_match_by_structure():
    m = fam.match(_block("sparse_attention.topk", topk=2048, indexer_relu=True))
    assert m["variant"] == "gathered" and m["params"]["layout"] == "mha"
    assert m["also"] == [{"variant": "indexer", "params": fam.FAMILY.resolve("indexer", {"topk": 2048})}]
    m = fam.match(_block("sparse_attention.topk", topk=64, indexer_relu=False, layout="mla", kv_latent=[512]))
    assert m["params"]["layout"] == "mla" and m["params"]["d_v"] == 512
    assert m["also"][0]["params"]["topk"] == 64 and m["also"][0]["params"]["indexer_relu"] is False
    assert fam.match(_block("attention.full")) is None
    assert fam.match(_block("sparse_attention.topk", layout="mla")) is None  # latent width unknown


@pytest.mark.parametrize("variant,params", [("indexer", {}), ("gathered", {"layout": "mla", "d_v": 64})])
def test_sample_inputs_run(load, variant, params):
    resolved = fam.FAMILY.resolve(variant, params)
    args = fam.sample_inputs(variant, resolved, [], torch.Generator().manual_seed(5))
    m = load(variant, {k: v for k, v in resolved.items() if v != fam.FAMILY.param(k).default})
    out, ref = m.entry(*args), m.reference(*args)
    if variant == "indexer":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# ---- benchmark cases (GPU-only to run; built and sanity-checked here) --------------------------

def test_bench_cases_build_without_running():
    from onboarding.bench.cases import cases_for

    assert family_module("sparse_attention").FAMILY.bench_cases is not None
    cases = cases_for(["sparse_attention"])
    names = {c.name for c in cases}
    for T in (8192, 16384, 32768, 65536):
        assert {f"mha-T{T}-fwd", f"mha-T{T}-fwdbwd", f"mla-T{T}-fwd", f"indexer-T{T}"} <= names
        # MLA fwd+bwd stops at 32k so that the family fits one 10-minute device command
        assert (f"mla-T{T}-fwdbwd" in names) == (T <= 32768)
    by = {c.name: c for c in cases}
    c = by["mha-T8192-fwd"]
    assert c.shape["K"] == 2048 and c.shape["H"] == 16 and c.shape["D_QK"] == 128
    # useful FLOPs: rows t < K have t + 1 keys, later rows K
    pairs = 2048 * 2049 // 2 + (8192 - 2048) * 2048
    assert c.flops == 16 * pairs * 2 * (128 + 128)
    assert by["mha-T8192-fwdbwd"].flops == 16 * pairs * (8 * 128 + 6 * 128)
    assert by["mla-T65536-fwd"].shape["D_QK"] == 576 and by["mla-T65536-fwd"].shape["HK"] == 1
    assert "causal_sdpa left out" in by["mla-T32768-fwd"].note and "left out" not in by["mha-T65536-fwd"].note
    assert "eager left out" in by["indexer-T65536"].note and by["mha-T8192-fwdbwd"].check is not None


def test_bench_stratified_indices_and_dense_baselines():
    """The benchmark's selections are distinct, causal and -1 padded; its masked SDPA baseline
    computes what the kernel's reference computes (both layouts, small T on the CPU)."""
    cs = family_module("sparse_attention").bench

    gen = torch.Generator().manual_seed(0)
    idx = cs.stratified_indices(2, 50, 8, torch.device("cpu"), gen).long()
    assert idx.shape == (2, 50, 8)
    for t in range(50):
        row = idx[0, t]
        n = min(8, t + 1)
        assert (row[n:] == -1).all() and row[:n].unique().numel() == n and (row[:n] <= t).all()
    assert cs.useful_pairs(50, 8) == int((idx[0] >= 0).sum())
    for layout in ("mha", "mla"):
        H, HK, D_QK, D_V = cs.LAYOUTS[layout]
        H = 2 if layout == "mla" else H // 8
        T_ = 24
        q = torch.randn(1, T_, H, D_QK, generator=gen)
        kvs = [torch.randn(1, T_, 1, D_QK, generator=gen)] if layout == "mla" else \
            [torch.randn(1, T_, H, D_QK, generator=gen), torch.randn(1, T_, H, D_V, generator=gen)]
        sel = cs.stratified_indices(1, T_, 5, torch.device("cpu"), gen)
        dense = cs._dense(layout, masked=True)(q, *kvs, sel).transpose(1, 2)
        # attention over the same selection, by hand: softmax over the selected keys only
        k, v = (kvs[0], kvs[0][..., :D_V]) if layout == "mla" else kvs
        kf, vf = k.repeat_interleave(H // k.shape[2], 2), v.repeat_interleave(H // v.shape[2], 2)
        logits = torch.einsum("bthd,bshd->bhts", q, kf) * D_QK ** -0.5
        keep = torch.zeros(1, T_, T_ + 1, dtype=torch.bool).scatter(2, torch.where(sel >= 0, sel.long(), T_), True)[..., :T_]
        probs = logits.masked_fill(~keep[:, None], float("-inf")).softmax(-1)
        torch.testing.assert_close(dense, torch.einsum("bhts,bshd->bthd", probs, vf), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_bench_steps_and_check_run_small(layout, monkeypatch):
    """The GPU cases' own code (steps of every impl, fwd and fwd+bwd, and the bf16 check) run at a
    tiny T, K and head count, so a bug in them shows here rather than on the GPU machine."""
    cs = family_module("sparse_attention").bench

    monkeypatch.setattr(cs, "TOPK", 5)
    monkeypatch.setattr(cs, "CHECK_T", 20)
    monkeypatch.setattr(cs, "CHECK_H", 2)
    monkeypatch.setitem(cs.LAYOUTS, layout, (2, min(cs.LAYOUTS[layout][1], 2), *cs.LAYOUTS[layout][2:]))
    res = cs._attn_check(layout)(DEVICE)
    assert res["ok"] == 1.0, res
    for backward in (False, True):
        steps = cs._attn_steps(layout, 12, backward, DEVICE)
        sweep = [] if layout != "mla" else \
            ["ours@" + ",".join(f"{k}={v}" for k, v in c.items())
             for c in (cs.MLA_FWDBWD_SWEEP if backward else cs.MLA_FWD_SWEEP)]
        assert sorted(steps) == sorted(["causal_sdpa", "masked_sdpa", "ours", *sweep])
        for step in steps.values():
            step(0)


# ---- the measured crossover against dense attention, and the patching's choice by it ------------

xo = fam.crossover


def _table(groups=(1, 8), t_star=(500_000, 60_000)) -> dict:
    """A table in crossover.json's form: ours = a T, masked dense = b T^2 with the crossover of
    each group at `t_star` (forward; forward + backward at twice it); causal dense 4x cheaper."""
    rows = []
    ts = [16384, 32768, 65536, 131072]
    for g, t0 in zip(groups, t_star):
        a = 1e-3
        times = {}
        for mode, tc in (("fwd", t0), ("fwdbwd", 2 * t0)):
            b = a / tc
            times[mode] = {"ours": [a * t for t in ts], "masked_sdpa": [b * t * t for t in ts],
                           "causal_sdpa": [b * t * t / 4 for t in ts]}
        rows.append({"layout": "mha", "H": 16 * g, "HK": 16, "group": g, "d": 128, "K": 2048, "ts": ts,
                     "times": times})
    return {"device": "test", "rows": rows}


def test_crossover_fit_interpolates_extrapolates_and_bounds():
    """`fit`: the crossing T of ours = a T and dense = b T^2 (T* = a / b) between measured T
    (log-linear: exact for these power laws), past them (a T + c against b T^2), or ours winning
    from the first measured T; no pair timed: never."""
    ts = [16384, 32768, 65536, 131072]
    ours = [1e-3 * t for t in ts]
    inside = xo.fit(ts, ours, [1e-3 / 100_000 * t * t for t in ts])
    assert inside["how"] == "interpolated" and abs(inside["t"] - 100_000) <= 100
    past = xo.fit(ts, ours, [1e-3 / 514_000 * t * t for t in ts])
    assert past["how"] == "extrapolated" and abs(past["t"] - 514_000) <= 500
    assert xo.fit(ts, ours, [1e-3 / 8000 * t * t for t in ts]) == {"t": 16384, "how": "below"}
    # a baseline left out at the largest T (its masks would not fit): fitted from the others
    assert xo.fit(ts, ours, [1e-3 / 514_000 * t * t for t in ts[:3]] + [None])["how"] == "extrapolated"
    assert xo.fit(ts, ours, [None] * 4) == {"t": None, "how": "untimed"}


def test_crossover_threshold_by_group_topk_and_backward():
    """`threshold` takes the row of the call's group (no other group's: the crossover moves with
    it), the mode's crossover against the block's own (masked) dense attention, and scales it with
    K; no row for the layout or group, or a row never timed: None (the kernel at every T)."""
    table = _table()
    t, why = xo.threshold(table, "mha", 1, 2048, backward=False)
    assert abs(t - 500_000) <= 500 and "extrapolated" in why
    assert abs(xo.threshold(table, "mha", 1, 2048, backward=True)[0] - 1_000_000) <= 1000
    assert abs(xo.threshold(table, "mha", 8, 1024, backward=False)[0] - 30_000) <= 50  # interpolated, K/2
    assert xo.threshold(table, "mha", 4, 2048, False)[0] is None
    assert xo.threshold(table, "mla", 1, 2048, False)[0] is None
    untimed = {"rows": [{**table["rows"][0], "times": {m: {i: [None] * 4 for i in ("ours", "masked_sdpa")}
                                                      for m in ("fwd", "fwdbwd")}}]}
    t, why = xo.threshold(untimed, "mha", 1, 2048, False)
    assert t is None and "not measured" in why and "g1: not measured / not measured" in xo.summary("mha", 2048, untimed)
    causal = xo.threshold(table, "mha", 1, 2048, False, baseline="causal_sdpa")[0]
    assert abs(causal - 2_000_000) <= 2000  # 4x cheaper dense: 4x later
    assert "g1: 500000 / 1000000" in xo.summary("mha", 2048, table)


def test_crossover_policy_decides_per_call_on_gpu_only():
    """`policy(layout)(q, k, topk, backward)`: dense below T*, the kernel from T*; never dense off a
    GPU (the table's times are a GPU's) or without a table row for the layout."""
    class Shape:  # q / k stand-ins: the policy reads shapes and the device only
        def __init__(self, shape, cuda=True):
            self.shape, self.device = shape, torch.device("cuda" if cuda else "cpu")

    prefer = xo.policy("mha", _table())
    q, k = Shape((1, 16, 400_000, 128)), Shape((1, 16, 400_000, 128))
    assert prefer(q, k, 2048, False) and not prefer(Shape((1, 16, 600_000, 128)), k, 2048, False)
    assert prefer(Shape((1, 16, 600_000, 128)), k, 2048, True)  # fwd+bwd: crossover 1M
    assert not prefer(Shape((1, 32, 60_000, 128)), Shape((1, 4, 60_000, 128)), 2048, False)  # g8: 60k
    assert not prefer(Shape((1, 16, 400_000, 128), cuda=False), k, 2048, False)
    assert not xo.policy("mha", {"rows": []})(q, k, 2048, False)  # no row for the layout: the kernel
    why = prefer(q, k, 2048, False)
    assert why.startswith("T 400000 below the crossover T 50") and "fwd, K 2048" in why
    # injected for a CPU test: the same table acts on CPU tensors, without faking a GPU
    assert xo.policy("mha", _table(), devices=("cpu",))(Shape((1, 16, 400_000, 128), cuda=False), k, 2048, False)


class _TopkAttention(torch.nn.Module):
    """Scores -> top-k over key positions -> boolean mask -> SDPA, as DSA blocks do."""

    def __init__(self, topk: int):
        super().__init__()
        self.topk = topk

    def forward(self, q, k, v):
        T = q.shape[-2]
        scores = (q.mean(1) @ k.mean(1).transpose(-1, -2)).float()  # [B, T, T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        idx = scores.masked_fill(~causal, float("-inf")).topk(min(self.topk, T), dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True) & causal
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def test_patched_block_leaves_calls_below_the_crossover_to_its_own_attention():
    """The intercept with a shape policy: the first call calibrates the binding (it runs once,
    against the original); then calls the policy sends to dense run the block's own attention
    (the binding untouched, same output), the others the binding, told whether a backward
    follows."""
    from onboarding.patching.core import PatchRecord
    from onboarding.patching.sparse import patch_sparse_block

    calls, seen = [], []

    def attend(q, k, v, idx, scale, _linears):  # the gathered attention, in torch
        calls.append(q.shape[-2])
        T = q.shape[-2]
        i = idx.long()
        keep = torch.zeros(*i.shape[:2], T + 1, dtype=torch.bool).scatter_(-1, torch.where(i >= 0, i, T), True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, :, :T], scale=scale)

    def prefer_dense(q, k, topk, backward):
        seen.append((q.shape[-2], topk, backward))
        return q.shape[-2] < 20

    block = _TopkAttention(topk=8)
    record = PatchRecord(path="attn", kind="sparse_attention.topk", family="sparse_attention")
    undo = patch_sparse_block(block, {"torch gathered": (attend, None, "topk")}, record, prefer_dense=prefer_dense)
    gen = torch.Generator().manual_seed(0)
    short = [torch.randn(1, 2, 12, 8, generator=gen) for _ in range(3)]
    long = [torch.randn(1, 2, 24, 8, generator=gen).requires_grad_() for _ in range(3)]
    try:
        out = block(*short)
        assert calls == [12]  # calibration only: then the block's own
        # calibrated, but the kernel served no call: not counted as kernel-patched
        assert record.status == "dense_by_shape" and record.calls == {"kernel": 0, "dense": 1}
        assert "the shape policy chose dense" in record.detail
        out_long = block(*long)
        out_long.sum().backward()
        assert calls == [12, 24] and seen == [(12, 8, False), (24, 8, True)]
        assert block.forward.dense_calls == 1 and block.forward.kernel_calls == 1
        assert record.status == "active" and record.calls == {"kernel": 1, "dense": 1}
    finally:
        undo()
    torch.testing.assert_close(out, block(*short))
    torch.testing.assert_close(out_long, block(*long), rtol=1e-5, atol=1e-6)


def _torch_gathered(calls: list):
    def attend(q, k, v, idx, scale, _linears):  # the gathered attention, in torch
        calls.append(q.shape[-2])
        T = q.shape[-2]
        i = idx.long()
        keep = torch.zeros(*i.shape[:2], T + 1, dtype=torch.bool).scatter_(-1, torch.where(i >= 0, i, T), True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, :, :T], scale=scale)
    return attend


def _small_table(t_star: int = 20, K: int = 8) -> dict:
    """crossover.json's form at toy sizes: ours = a T, masked dense = a T^2 / t_star (forward;
    forward + backward at 2 t_star), so the fitted crossover is t_star (log-linear: exact)."""
    ts = [8, 16, 32, 64]
    times = {m: {"ours": [1e-3 * t for t in ts], "masked_sdpa": [1e-3 / tc * t * t for t in ts],
                 "causal_sdpa": [None] * 4} for m, tc in (("fwd", t_star), ("fwdbwd", 2 * t_star))}
    return {"device": "test table", "rows": [{"layout": "mha", "H": 2, "HK": 2, "group": 1, "d": 8,
                                              "K": K, "ts": ts, "times": times}]}


@pytest.mark.parametrize("lengths, status, kernel, dense", [
    ((12, 16), "dense_by_shape", 0, 2),  # every call below the crossover T 20
    ((12, 24), "active", 1, 1),  # mixed
    ((24, 32), "active", 2, 0),  # every call at or past it
])
def test_sparse_block_record_counts_kernel_and_dense_calls(lengths, status, kernel, dense):
    """The family's measured-crossover policy, injected on the CPU (devices=("cpu",) with a toy
    table: nothing else thinks a GPU is there): the record counts the calls the kernel served and
    those left to the block's own attention, with the crossover's T; a block whose every call
    went dense is ``dense_by_shape``, not kernel-patched, and the alignment verdict says why."""
    from onboarding.align.core import AlignmentResult
    from onboarding.align.verdicts import unchecked_blocks
    from onboarding.coverage import Coverage, CoverageEntry
    from onboarding.patching.core import PatchRecord
    from onboarding.patching.sparse import patch_sparse_block

    calls: list[int] = []
    block = _TopkAttention(topk=8)
    record = PatchRecord(path="attn", kind="sparse_attention.topk", family="sparse_attention")
    prefer = xo.policy("mha", _small_table(), devices=("cpu",))
    undo = patch_sparse_block(block, {"torch gathered": (_torch_gathered(calls), None, "topk")}, record,
                              prefer_dense=prefer)
    gen = torch.Generator().manual_seed(1)
    outs = []
    try:
        for T in lengths:
            x = [torch.randn(1, 2, T, 8, generator=gen) for _ in range(3)]
            outs.append((x, block(*x)))
    finally:
        undo()
    assert record.status == status and record.calls == {"kernel": kernel, "dense": dense}
    # the first call calibrates (the kernel once, under no_grad), then serves only from T 20
    assert calls == [lengths[0]] + [T for T in lengths if T >= 20]
    for x, out in outs:  # same function whichever served the call
        torch.testing.assert_close(out, block(*x), rtol=1e-5, atol=1e-6)
    if dense:
        assert f"below the crossover T 20 (fwd, K 8, mha g1, measured on test table" in record.detail
        assert f"T {lengths[0]} below" in record.detail or f"T {lengths[1]} below" in record.detail
    else:
        assert record.detail == ""

    cov = Coverage(model="m", entries=[CoverageEntry(path="attn", kind="sparse_attention.topk", op="x",
                                                     status="template", family="sparse_attention")])
    n, out = unchecked_blocks(cov, [record], available={("attn", "sparse_attention")},
                              bindable=["sparse_attention"])
    patches = [{"path": "attn", "kind": record.kind, "family": record.family, "status": record.status,
                "binding": record.binding, "detail": record.detail, "calls": dict(record.calls)}]
    logits = {"stats": {"rel_rms": 1e-7}, "kl": 0.0, "kl_max": 0.0, "top1_agreement": 1.0, "tokens": 16,
              "passed": True}
    res = AlignmentResult(model="m", mode="percentile", reference_dtype="float64", candidate_dtype="float32",
                          seed=0, input_shapes=[[1, 16]], blocks=[], forward_order=[], backward_order=[],
                          logits=logits, patches=patches, coverable=n, not_checked=out)
    line, md = res.summary(), res.to_markdown()
    if status == "dense_by_shape":  # not checked: the kernel served nothing
        assert [x["reason"] for x in out] == ["dense by shape: " + record.detail]
        assert "0 of 1 coverable blocks patched; not checked: attn (dense by shape: all 2 attention calls" in line
        assert "- patched blocks: 0 active of 1; 1 dense by shape" in md
    elif dense:  # checked, and the verdict says the kernel served 1 of the 2 calls
        assert out == [] and "1 of 1 coverable blocks patched; partly dense by shape: attn (the kernel " \
            "served 1 of 2 attention calls, 1 ran the block's own dense attention: T 12 below" in line
        assert "- partly dense by shape: `attn`" in md and "- patched blocks: 1 active of 1" in md
    else:
        assert out == [] and "partly dense" not in line and "dense by shape" not in md


def test_coverage_reason_names_the_choice_by_shape():
    """A `sparse_attention.topk` block's coverage entry says when the patching runs the kernel
    and when the block's own attention (the family's match note, from the measured table)."""
    from onboarding.coverage import build_coverage
    from onboarding.graph.opgraph import OpGraph

    block = _block("sparse_attention.topk", topk=2048, indexer_relu=True)
    graph = OpGraph(model="m", capture="export", capture_note="", batch=1, seq=32, dtype="float32",
                    blocks=[block], layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)
    entry = next(e for e in build_coverage(graph).entries if e.variant == "gathered")
    assert entry.reason.split("; ", 1)[1] == fam.crossover.summary("mha", 2048)  # after "reviewed kernel" or "template ..."


def test_measured_crossover_table_is_consistent():
    """crossover.json (measured on the H200; docs/LOG.md): every row holds a time or None per T for
    each impl and mode, its stored crossovers are what `fit` derives from those times, and the
    MHA row's forward crossover against the block's own attention lies between two measured T."""
    table = xo.load_table()
    assert table is not None and table["rows"]
    for row in table["rows"]:
        for mode in xo.MODES:
            for impl in ("ours", *xo.BASELINES):
                assert len(row["times"][mode][impl]) == len(row["ts"]), (row["group"], mode, impl)
        assert row["crossover"] == xo.crossovers(row)
    mha = next(r for r in table["rows"] if r["layout"] == "mha" and r["group"] == 1)
    fwd = mha["crossover"]["fwd"]["masked_sdpa"]
    assert fwd["how"] == "interpolated" and mha["ts"][0] < fwd["t"] < mha["ts"][-1]
