"""Every default LoRA target trains: a module whose every output is an integer tensor (a top-k
indexer's positions) passes no gradient out, so the linears inside it are no default target.
Found by structure (the capture's module outputs), on our own fixture: attention over pooled
keys whose indexer (its own pooling, query and head-weight projections) returns top-k indices."""

from __future__ import annotations

import torch

FIXTURE = "tests/fixtures/compressed_attention_models.py:CompressedTopkLM"


def test_auto_targets_leave_out_the_linears_of_an_integer_output_module(parse_model):
    from onboarding.load.model import load_model
    from onboarding.plan.shapes import model_shape
    from onboarding.train.lora import default_targets, inject_lora, lora_parameters

    # the dispatch recording: the module outputs come from the eager forward either way
    graph = parse_model(FIXTURE, seq=16, try_export=False)
    model = load_model(FIXTURE).build(None, seed=0)
    attn = [x for x in graph.blocks if x.kind == "attention.compressed"]
    assert len(attn) == 2
    assert all(x.attrs.get("integer_output_modules") == ["indexer"] for x in attn), \
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
