"""Absorbed-MLA top-k sparse attention with a per-head sink column (HY V4's layers: one shared
latent K/V expanded per head by ``kv_b_proj``, a rope part shared by every head, the eager softmax
over ``cat([scores, sinks], -1)`` whose sink column takes probability mass and adds no value),
checked in CI against a pure-torch *gathered* reference with the sink column, written here (not
the rendered module's own `reference`, which is dense and masked).

- the gathered MLA kernel alone (d_qk 64 + 16, d_v 64): forward and the gradients of q, the latent
  kv and the sink logits, odd T, -1 and past-S indices, a row with no valid index, on the fused
  forward and backward and on the value-split / two-pass forwards and the split backward;
- the family's binding on an HY-V4-shaped block (`sparse_attention/binding.py`'s ``mla_attend``,
  chosen by calibration under the top-k intercept): the block's output and the gradient of its
  input and of every weight (the latent expansion, the latent and rope projections, the query,
  the learnable sinks) equal the same block run with the gathered reference; early rows pick
  future keys the causal mask forbids (-1 after the intercept reads the mask);
- a binding that drops the sink from the normaliser is rejected on calibration.

The kernel returns a sink gradient (``dsink = -sum p_sink * delta``), so learnable sinks are
served, not refused; the test checks that gradient against the reference's autograd.
CPU: TRITON_INTERPRET=1 (tests/conftest.py), fp32.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from onboarding.families import family_module
from onboarding.generate.templating import load_module, render_to
from onboarding.graph.opgraph import Block
from onboarding.patching.core import patch_model

LATENT, ROPE, NOPE, V, HEADS, TOPK = 64, 16, 16, 16, 4, 6
T = 13  # odd, > TOPK: rows TOPK.. are really sparse, rows < TOPK - 1 pick future keys


def gathered_reference(q, kv, indices, sink, scale, d_v):
    """Pure torch, gathered: q [B, T, H, D_QK], kv [B, S, 1, D_QK] (v = kv[..., :d_v]), indices
    [B, T, K] (< 0 or >= S: skipped), sink [H] or None: o [B, T, H, d_v] = sum_j p_j v_j,
    p = softmax over [the selected keys' scores, sink_h] with the sink's column dropped."""
    B, T_, H, _ = q.shape
    S = kv.shape[1]
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    safe = torch.where(valid, idx, 0)
    kg = kv[:, :, 0][torch.arange(B)[:, None, None], safe]  # [B, T, K, D_QK]
    s = torch.einsum("bthd,btkd->bthk", q, kg) * scale
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.view(1, 1, H, 1).expand(B, T_, H, 1)], -1)
    p = torch.softmax(s, -1)
    p = p[..., :-1] if sink is not None else p
    p = torch.nan_to_num(p)  # a row with nothing (no pick, no sink): 0, as the kernel gives
    return torch.einsum("bthk,btkv->bthv", p, kg[..., :d_v])


def _render(tmp_path_factory, attrs):
    fam = family_module("sparse_attention")
    block = Block(path="attn", kind="sparse_attention.topk", layer=0, class_name="Anything", attrs=attrs)
    m = fam.match(block)
    assert m is not None, attrs
    path = render_to(tmp_path_factory.mktemp("k"), fam.NAME, m["variant"], m["params"], overwrite=True)
    return load_module(path), SimpleNamespace(blocks=[block])


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    kmod, graph = _render(tmp_path_factory, {"topk": TOPK, "indexer_relu": True, "layout": "mla",
                                             "kv_latent": [LATENT]})
    assert kmod.VARIANT == "gathered" and kmod.PARAMS["layout"] == "mla" and kmod.PARAMS["d_v"] == LATENT
    return kmod, graph


# the rendered module's configs this test runs: its bucket's at d_qk 80 (fused forward and
# backward), the bucket's that HY V4's d_qk 576 runs ("d_le_1024": split scores, row ends, early
# gather, split backward), and the other forwards (each reads the sink its own way)
PATHS = [pytest.param(None, id="fused"),
         pytest.param("d_le_1024", id="d_le_1024-bucket"),
         pytest.param({"FWD_DV_SPLIT": 2, "FWD_ROW_END": 1}, id="value-split-row-end"),
         pytest.param({"FWD_TWO_PASS": 1}, id="two-pass")]


@pytest.mark.parametrize("extra", PATHS)
def test_mla_kernel_with_learnable_sink_equals_gathered_reference(mla, extra):
    kmod, _ = mla
    gen = torch.Generator().manual_seed(5)
    B, H, D_QK, S = 2, HEADS, LATENT + ROPE, T
    q = torch.randn(B, T, H, D_QK, generator=gen)
    kv = torch.randn(B, S, 1, D_QK, generator=gen)
    scores = torch.randn(B, T, S, generator=gen)
    idx = family_module("sparse_attention").causal_topk_indices(scores, TOPK)  # early rows -1 padded
    assert bool((idx == -1).any())
    idx[:, 9:, 2] = -1  # a hole inside full rows
    idx[1, 11:, 4] = S + 2  # past S: skipped like -1
    idx[0, 7] = -1  # no valid index: the sink takes the whole row (o = 0)
    sink = torch.randn(H, generator=gen)
    scale = 0.2
    leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    if isinstance(extra, str):
        extra = next(b["config"] for b in kmod.SHAPE_BUCKETS if b["name"] == extra)
    try:
        if extra:
            kmod.set_config(extra)
        o = kmod.entry(leaves[0], leaves[1], idx, leaves[2], scale)
        ref = gathered_reference(*ref_leaves[:2], idx, ref_leaves[2], scale, LATENT)
        assert o.shape == (B, T, H, LATENT)
        torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
        assert float(o.detach()[0, 7].abs().max()) == 0.0
        do = torch.randn(o.shape, generator=gen)
        grads = torch.autograd.grad(o, leaves, do)
        ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    finally:
        kmod.set_config(None)
    for name, g, rg in zip(("dq", "dkv", "dsink"), grads, ref_grads):
        assert rg.abs().sum() > 0, name
        torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-5, msg=name)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class HyV4StyleMlaAttention(nn.Module):
    """HY V4's attention written small: q [nope | rope] per head; one latent (``kv_a``'s first
    LATENT columns, normed) expanded per head by ``kv_b`` [H (nope + v), LATENT] into k_nope and v,
    the rope key shared by every head (the rest of ``kv_a``); an indexer's top-k over a causal
    [B, T, S] score as a -inf mask on the causal additive mask; the eager attention with a
    learnable per-head sink column appended, the row max subtracted, softmax, the column dropped,
    ``@ v``. ``gathered=True`` runs the same block through `gathered_reference` instead (the
    test's reference: no dense scores, only the selected keys)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q_proj = nn.Linear(d, HEADS * (NOPE + ROPE), bias=False)
        self.kv_a = nn.Linear(d, LATENT + ROPE, bias=False)
        self.kv_norm = RMSNorm(LATENT)
        self.kv_b = nn.Linear(LATENT, HEADS * (NOPE + V), bias=False)
        self.o_proj = nn.Linear(HEADS * V, d, bias=False)
        self.iq, self.ik = nn.Linear(d, 16, bias=False), nn.Linear(d, 16, bias=False)
        self.sinks = nn.Parameter(torch.randn(HEADS))
        self.scaling = (NOPE + ROPE) ** -0.5
        self.gathered = False

    def select(self, x):
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = torch.matmul(self.iq(x), self.ik(x).transpose(1, 2)).relu()  # [B, T, S]
        scores = scores.masked_fill(~causal, float("-inf"))
        return scores.topk(min(TOPK, t), dim=-1).indices  # early rows: future keys among them

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, NOPE + ROPE).transpose(1, 2)
        c, k_rot = torch.split(self.kv_a(x), [LATENT, ROPE], dim=-1)
        c = self.kv_norm(c).view(b, 1, t, LATENT)
        k_rot = k_rot.view(b, 1, t, ROPE)
        kv = self.kv_b(c).view(b, t, HEADS, NOPE + V).transpose(1, 2)
        k_nope, value = torch.split(kv, [NOPE, V], dim=-1)
        key = kv.new_empty(b, HEADS, t, NOPE + ROPE)
        key[..., :NOPE].copy_(k_nope)
        key[..., NOPE:].copy_(k_rot.expand(-1, HEADS, -1, -1))
        idx = self.select(x)
        if self.gathered:
            y = self._gathered(q, key, value, idx)
        else:
            y = self._eager(q, key, value, idx)
        return self.o_proj(y.reshape(b, t, -1))

    def _eager(self, q, key, value, idx):
        b, _, t, _ = q.shape
        mask = torch.zeros(b, 1, t, t).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                                   torch.finfo(torch.float32).min)
        index_mask = torch.ones(b, t, t, dtype=torch.bool).scatter(-1, idx, False)[:, None]
        mask = mask.masked_fill(index_mask, torch.finfo(torch.float32).min)
        s = torch.matmul(q, key.transpose(2, 3)) * self.scaling + mask
        s = torch.cat([s, self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        p = F.softmax(s, dim=-1, dtype=s.dtype)[..., :-1]
        y = torch.matmul(F.dropout(p, p=0.0, training=self.training).to(value.dtype), value)
        return y.transpose(1, 2)

    def _gathered(self, q, key, value, idx):
        # per head: q . [k_nope | k_rot] over the selected keys, the sink column, @ v; the causal
        # mask's forbidden picks dropped as -1
        t = q.shape[2]
        idx = torch.where(idx <= torch.arange(t).view(1, t, 1), idx, -1)
        # the reference's kv is [v | k] (its first V columns are the values), q [0 | q]
        heads = []
        for h in range(HEADS):
            qh = torch.cat([torch.zeros_like(q[:, h, :, :1]).expand(-1, -1, V), q[:, h]], -1)[:, :, None]
            kvh = torch.cat([value[:, h], key[:, h]], -1)[:, :, None]
            heads.append(gathered_reference(qh, kvh, idx, self.sinks[h:h + 1], self.scaling, V))
        return torch.cat(heads, 2)  # [B, T, H, V]


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Module()
    model.attn = HyV4StyleMlaAttention()
    return model


def test_gathered_reference_is_the_eager_block():
    """The test's own reference agrees with the block's dense eager attention it stands for."""
    model = _model()
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(model)
    ref.attn.gathered = True
    torch.testing.assert_close(model.attn(x), ref.attn(x), rtol=1e-5, atol=1e-6)


def test_absorbed_mla_block_with_sink_column_forward_backward(mla):
    """Bound by calibration to the absorbed MLA binding; then output and every gradient (the
    input's, the sinks', the latent expansion's, the latent and rope projection's, the query's)
    equal the gathered reference block's. The indexer's weights get none (the selection is not
    differentiated)."""
    kmod, graph = mla
    model = _model()
    ref = copy.deepcopy(model)
    ref.attn.gathered = True
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    x.requires_grad_()
    with patch_model(model, graph, {("attn", "sparse_attention"): kmod}) as patches:
        model.attn(x)
        (rec,) = patches.records
        assert rec.status == "active" and "absorbed MLA over the top-k keys" in rec.binding, rec
        out = model.attn(x)  # calibrated: the kernel path, with autograd
        assert rec.calls["kernel"] == 2, rec
        expected = ref.attn(xr)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        out.backward(do)
        expected.backward(do)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5, msg="x")
    assert model.attn.sinks.grad is not None and model.attn.sinks.grad.abs().sum() > 0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        if name.startswith(("attn.iq", "attn.ik")):
            assert p.grad is None and p_ref.grad is None, name
            continue
        assert p_ref.grad is not None and p_ref.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_absorbed_mla_binding_that_drops_the_sink_is_rejected(mla):
    """Planted: the MLA kernel called without the sink logits (the sink missing from the
    normaliser): its output differs, calibration rejects every binding and the block runs its own
    attention."""
    kmod, graph = mla

    class SinkDropped:
        VARIANT, PARAMS = "gathered", dict(kmod.PARAMS)

        @staticmethod
        def entry(q, kv, indices, sink=None, scale=None):
            return kmod.entry(q, kv, indices, None, scale)

    model = _model()
    x = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model.attn(x)
    with patch_model(model, graph, {("attn", "sparse_attention"): SinkDropped}) as patches, torch.no_grad():
        got = model.attn(x)
        (rec,) = patches.records
        assert rec.status == "rejected" and "differs" in rec.detail, rec
    torch.testing.assert_close(got, expected)
