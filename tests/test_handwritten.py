"""Hand-written models that were misclassified (issue 30), classified by structure now:
attention and MLP in one module, an MLP as wide as the vocabulary, a written-out softmax(QK^T)V.
"""

from __future__ import annotations

from onboarding.coverage import build_coverage

FUSED = "tests/fixtures/handwritten.py:FusedBlockLM"
WIDE = "tests/fixtures/handwritten.py:VocabWideLM"


def _entries(graph, path):
    return {e.op: e for e in build_coverage(graph).entries if e.path == path}


def _unserved_reason(graph, path):
    """Why the block's attention core would be uncovered, were no family to serve it."""
    from onboarding.coverage import _unserved_parts

    block = next(b for b in graph.blocks if b.path == path)
    return dict(_unserved_parts(block))["attention core"]


def test_block_with_attention_and_mlp_in_one_module_keeps_its_mlp(parse_model):
    g = parse_model(FUSED)
    assert g.layer_pattern == "AF AF"  # the MLP used to vanish: "A- A-"
    assert all("mlp.dense" in kinds for kinds in g.layer_kinds)
    b = next(b for b in g.blocks if b.path == "blocks.0")
    assert b.kind == "attention.full"
    assert b.attrs["inline_mlp"] == {"activation": "silu", "gated": True, "hidden": 32,
                                     "intermediate": 64, "projections": [
                                         "blocks.0.w_down", "blocks.0.w_gate", "blocks.0.w_up"]}
    assert "unfused_core" not in b.attrs  # its attention is SDPA
    entries = _entries(g, "blocks.0")
    assert entries["attention core"].status == "torch_fast"
    assert entries["inline MLP (silu)"].status == "uncovered"


def test_vocabulary_wide_linears_are_not_lm_heads(parse_model):
    """vocab 128 = the MLP width: gate and up are Linear(32, 128) like the head; only the head,
    whose output nothing else consumes, is the lm_head."""
    g = parse_model(WIDE)
    heads = g.by_kind("lm_head")
    assert [b.path for b in heads] == ["head"], [b.path for b in heads]
    assert "the model's output head" in heads[0].evidence[-1]
    assert [b.path for b in g.by_kind("mlp.dense")] == [f"layers.{i}.mlp" for i in range(3)]
    assert g.layer_pattern == "AF AF AF"


def test_written_out_attention_is_flagged_unfused(parse_model):
    g = parse_model(WIDE)
    b = next(b for b in g.blocks if b.path == "layers.0.attn")
    assert b.kind == "attention.full"
    assert b.attrs["unfused_core"]["scores"] == [1, 4, g.seq, g.seq]
    entries = _entries(g, "layers.0.attn")
    core = entries["attention core"]
    # the core written out is of the kind the sink_attention family serves, but its binding swaps
    # the function a block hands the core to, and this one's runs inline: coverage says so
    # (tests/test_coverage_binding.py)
    assert core.status == "uncovered" and core.family is None, core
    assert "sink_attention" in core.reason and "its core runs inline" in core.reason, core.reason
    assert "O(T^2)" in _unserved_reason(g, "layers.0.attn")
    # the two score matmuls are the core's, not projections: q, k, v, o only
    assert entries["projections (GEMM)"].reason.startswith("4 dense GEMMs")
    # the dispatch capture (export's fallback) records the score matmuls as bmm: still the core's
    d = parse_model(WIDE, try_export=False)
    entries = _entries(d, "layers.0.attn")
    assert d.capture == "dispatch" and entries["attention core"].status == "uncovered"
    assert "its core runs inline" in entries["attention core"].reason
    assert entries["projections (GEMM)"].reason.startswith("4 dense GEMMs")  # not 6
