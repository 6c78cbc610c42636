"""sparse_attention's intercept follows a softmax that reads the scores with a per-head sink column
appended (HY V4's layers 0-1: ``cat([scores, sinks], -1)``, the row max subtracted, softmax, the
column dropped, ``@ v``) and hands the sink logits to the gathered kernel, whose sink is the same
thing: a per-head logit in the softmax's denominator only. Before, the chain broke at the cat and
the block was rejected ("no attention ... over the top-k positions"). The sinks get their gradient
through the kernel. A binding that drops the sink is caught on calibration; a sink column that is
not one logit per head (computed per token) is refused, and says so."""

from __future__ import annotations

import copy

import pytest
import torch
from types import SimpleNamespace

from onboarding.families import family_module
from onboarding.generate.templating import load_module, render_to
from onboarding.graph.opgraph import Block
from onboarding.patching.core import patch_model
from fixtures.coverage_binding_models import RowSinkTopkSparseAttention, ShiftedSinkTopkSparseAttention


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    fam = family_module("sparse_attention")
    block = Block(path="attn", kind="sparse_attention.topk", layer=0, class_name="Anything",
                  attrs={"topk": 6, "indexer_relu": True})
    m = fam.match(block)
    return load_module(render_to(tmp_path_factory.mktemp("k"), fam.NAME, m["variant"], m["params"],
                                 overwrite=True)), SimpleNamespace(blocks=[block])


def _model(cls, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.attn = cls(32, 4, 6)
    return model


def test_sink_column_softmax_is_bound_forward_backward(gathered):
    """T=13 > topk 6: rows 6.. are really sparse; same output and the same gradients for every
    weight, the sinks' own included (the indexer's weights get none: the selection is not
    differentiated)."""
    kmod, graph = gathered
    model = _model(ShiftedSinkTopkSparseAttention)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(0))
    with patch_model(model, graph, {("attn", "sparse_attention"): kmod}) as patches:
        model.attn(x)
        (rec,) = patches.records
        assert rec.status == "active" and "top-k keys" in rec.binding, rec
        out = model.attn(x)  # calibrated: the kernel path with autograd
        expected = ref.attn(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        do = torch.randn_like(out)
        out.backward(do)
        expected.backward(do)
    assert model.attn.sinks.grad is not None and model.attn.sinks.grad.abs().sum() > 0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        if p_ref.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_binding_that_drops_the_sink_is_rejected(gathered):
    """Planted: the kernel called without the sink logits (attention over the keys only): its
    output differs from the model's, so calibration rejects it and the block runs its own."""
    kmod, graph = gathered

    class SinkDropped:
        VARIANT, PARAMS = "gathered", {"layout": "mha"}

        @staticmethod
        def entry(q, k, v, indices, sink=None, scale=None):
            return kmod.entry(q, k, v, indices, None, scale)

    model = _model(ShiftedSinkTopkSparseAttention)
    x = torch.randn(1, 13, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.attn(x)
    with patch_model(model, graph, {("attn", "sparse_attention"): SinkDropped}) as patches, torch.no_grad():
        got = model.attn(x)
        (rec,) = patches.records
        assert rec.status == "rejected" and "differs" in rec.detail, rec
    torch.testing.assert_close(got, expected)


def test_a_per_token_sink_column_is_refused_with_its_reason(gathered):
    """A sink column computed per token is not the kernel's per-head sink: not followed, the
    block given back, the record saying why."""
    kmod, graph = gathered
    model = _model(RowSinkTopkSparseAttention)
    x = torch.randn(1, 13, 32, generator=torch.Generator().manual_seed(2))
    with patch_model(model, graph, {("attn", "sparse_attention"): kmod}) as patches, torch.no_grad():
        model.attn(x)
        (rec,) = patches.records
        assert rec.status == "rejected", rec
        assert "not one logit per head" in rec.detail, rec.detail
