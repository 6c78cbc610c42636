"""Top-k sparse attention family: indexer selection vs torch.topk, gathered attention (GQA, sink,
MLA latent) forward and every gradient vs the dense masked reference, opcheck, AOT for sm_90."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from onboarding import aot, templating
from onboarding.families import sparse_attention as fam
from onboarding.opgraph import Block
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck

# Few, large tiles: the interpreter costs per program and per op. BLOCK_SEL=16 splits a 37-long
# row into 3 chunks, so the chunked counting and the carried compaction offsets are exercised.
CPU_CONFIG = {"BLOCK_K": 16, "BLOCK_H": 16, "BLOCK_T": 32, "BLOCK_SEL": 16, "SEL_RADIX": 8,
              "dot_precision": "ieee"}
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

def test_opcheck_and_contract(load):
    mi = load("indexer", {"topk": 4})
    check_module_contract(mi)
    gen = torch.Generator().manual_seed(4)
    q, k, w = indexer_inputs(gen, positive=False, T=9)
    for op, args in mi.op_samples(q, k, w, 4):
        torch.library.opcheck(op, args)
    for params, dims, sink in (({}, (4, 2, 16, 16), True), ({"layout": "mla", "d_v": 32}, (2, 1, 40, 32), True)):
        mg = load("gathered", params)
        check_module_contract(mg)
        check_opcheck(gathered_fixture(mg, params, dims, 4, sink, None, seq=9), torch.float32, DEVICE)


def test_aot_sm90(load):
    """Compile every kernel for sm_90 at real head dims: indexer D=128, gathered GQA D=128, MLA
    d_qk 576 / d_v 512 (64 query heads per program group)."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    # one child process per head dim (a child costs seconds of imports)
    groups = {128: [load("indexer", {}).__file__, load("gathered", {}).__file__],
              576: [load("gathered", {"layout": "mla", "d_v": 512}).__file__]}
    for size, paths in groups.items():
        for path, results in aot.compile_files(paths, size=size, registers=False).items():
            assert results, path
            for r in results:
                assert r.ok, f"{path}: {r.kernel}: {r.error}"
                assert r.shared_bytes is not None and r.shared_bytes <= aot.H100_SHARED_BYTES, (path, r)


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
