"""The projection an attention block's per-head output gate is read from (attrs
``gate_projection``, ``gate_width``; the plan reads the full-size head count off it where the
config gives none: `onboarding.plan.shapes.gate_heads`). A low-rank gate, sigmoid(g_b(g_a(x)))
of one value per head (D -> r -> H, our own fixture), comes out of its second linear, g_b,
which reads g_a's output, not the hidden state."""

from __future__ import annotations

LOW_RANK_GATES = "tests/fixtures/low_rank_gate_models.py"


def test_a_low_rank_per_head_gate_names_its_up_projection(parse_model):
    """Before, only projections of the hidden state were candidates: the gate named g_a (D -> r,
    r a multiple of H), and the plan would have scaled the heads by r's full size."""
    from onboarding.load.model import load_model
    from onboarding.plan.shapes import gate_heads

    ref = f"{LOW_RANK_GATES}:LowRankHeadGateLM"
    g = parse_model(ref, seq=12)
    assert g.layer_pattern == "AF AF"
    attn = {b.path: b for b in g.blocks}["layers.0.attn"]
    assert attn.kind == "attention.gated"
    assert (attn.attrs["gate_per_head"], attn.attrs["gate_projection"], attn.attrs["gate_width"]) \
        == (True, "gate.g_b.weight", 4)
    # a full-size model with 8 heads and the same gate rank: 8 heads read off g_b [8, r]
    model = load_model(ref).build(None, seed=0)
    model.layers[0].attn = type(model.layers[0].attn)(32, heads=8, gate_rank=8, per_head=True)
    assert gate_heads(attn, model.layers[0].attn) == 8
