"""Every default LoRA target trains: a module that passes no gradient out to its parameters (a
top-k indexer handing back positions, or a float mask it built from them) keeps them untrained,
so the linears inside it are no default target. Found by structure (the capture's module outputs
and an autograd forward), on our own fixtures: attention over pooled keys whose indexer (its own
pooling, query and head-weight projections) returns top-k indices, or the additive mask made by
scattering constants at them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

FIXTURES = "tests/fixtures/compressed_attention_models.py"


@pytest.mark.parametrize("name", ["CompressedTopkLM", "CompressedTopkMaskLM"])
def test_auto_targets_leave_out_the_linears_of_a_module_that_passes_no_gradient(parse_model,
                                                                              name):
    from onboarding.load.model import load_model
    from onboarding.plan.shapes import model_shape
    from onboarding.train.lora import default_targets, inject_lora, lora_parameters

    fixture = f"{FIXTURES}:{name}"
    # the dispatch recording: the module outputs come from the eager forward either way
    graph = parse_model(fixture, seq=16, try_export=False)
    model = load_model(fixture).build(None, seed=0)
    attn = [x for x in graph.blocks if x.kind == "attention.compressed"]
    assert len(attn) == 2
    assert all(x.attrs.get("no_gradient_modules") == ["indexer"] for x in attn), \
        [x.attrs for x in attn]
    targets = default_targets(model, graph)
    assert not any(".indexer." in t for t in targets), targets
    assert {t.split(".", 3)[-1] for t in targets} == {
        "q_proj", "kv_proj", "o_proj", "compressor.kv_proj", "compressor.gate_proj"}
    # the memory plan counts the same adapters
    planned = [s for s in model_shape(model, None, graph).blocks
               if s.kind == "attention.compressed" and not s.nested]
    assert sum(s.count * len(s.lora_targets) for s in planned) == len(targets)
    # and every one of them gets a gradient (B drawn non-zero: A's gradient needs it)
    inject_lora(model, graph, targets=["auto"], rank=2, alpha=2.0, dropout=0.0)
    for n, p in lora_parameters(model):
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids).float().logsumexp(-1).sum().backward()
    dead = [n for n, p in lora_parameters(model) if p.grad is None or not p.grad.any()]
    assert not dead, dead


class _Way(nn.Module):
    """A projection and one way its result leaves the module (``how``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.proj = how, nn.Linear(4, 4)

    def forward(self, x):
        if self.how == "idle":  # the projection does not run
            return x * 2
        if self.how == "no_grad":
            with torch.no_grad():
                return self.proj(x)
        y = self.proj(x)
        if self.how == "detach":
            return y.detach()
        if self.how == "empty":  # nothing to hand out at this length (no full window yet)
            return y.new_zeros(y.shape[0], 0)
        if self.how == "mask":  # -inf outside the top-2 positions, made of constants
            keep = torch.zeros_like(y, dtype=torch.bool).scatter(-1, y.topk(2).indices, True)
            return torch.zeros_like(y).masked_fill(~keep, float("-inf"))
        return y


def test_the_autograd_probe_names_the_modules_whose_outputs_reach_none_of_their_parameters():
    from onboarding.graph.capture import no_gradient_probe

    ways = ("plain", "mask", "detach", "no_grad", "idle", "empty")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ways = nn.ModuleList(_Way(h) for h in ways)

        def forward(self, x):
            return sum(w(x) for w in self.ways if w.how != "empty") + self.ways[5](x).sum()

    model = Model().requires_grad_(False)  # frozen weights: probed all the same
    found = no_gradient_probe(model, (torch.randn(2, 4),), {})
    # the model itself reaches `plain`'s weight; a module's inner projection (`mask`'s) reaches
    # its own; an idle module is listed here too (no op read its parameters: the classifier
    # takes no such module on this evidence alone); one that handed out only empty tensors
    # showed nothing
    assert found == {"ways.1", "ways.2", "ways.3", "ways.3.proj", "ways.4"}, found
    assert not any(p.requires_grad for p in model.parameters())  # put back as they were


def test_parameters_no_op_read_are_no_evidence_and_a_detached_output_is(parse_model):
    """At 16 tokens `late` reads none of its weights and hands out zeros (it trains from 32 on):
    it stays a default target; `scale` ran and detached its result: it does not."""
    from onboarding.load.model import load_model
    from onboarding.train.lora import default_targets

    fixture = "tests/fixtures/no_gradient_models.py:LateAndDetachedLM"
    graph = parse_model(fixture, seq=16, try_export=False)
    attn = [x for x in graph.blocks if x.kind.startswith("attention.")]
    assert len(attn) == 2 and all(x.attrs.get("no_gradient_modules") == ["scale"] for x in attn), \
        [(x.kind, x.attrs) for x in attn]
    targets = default_targets(load_model(fixture).build(None, seed=0), graph)
    assert {t.split(".", 3)[-1] for t in targets} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "late.proj"}, targets


def test_a_forward_that_refuses_autograd_is_noted_not_silent():
    """A model whose forward cannot run with autograd on still captures; its note says the probe
    did not run and that only integer outputs mark a module passing no gradient."""
    from onboarding.graph.capture import capture

    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            if torch.is_grad_enabled():
                raise RuntimeError("this model runs under no_grad only")
            return self.proj(x)

    cap = capture(NoGrad().eval(), (torch.randn(2, 4),), {}, try_export=False)
    assert cap.no_gradient is None
    assert "RuntimeError: this model runs under no_grad only" in cap.no_gradient_note
    assert "integer outputs only" in cap.no_gradient_note
    assert cap.records  # the capture itself stands
