"""The attention output gate, read by structure: an activation of a projection of the hidden state
that multiplies the attention output before the out projection (`attention.gated`, attrs
`gate_activation` and `gate_per_head`), whatever the activation; and what the memory planner
counts for it."""

from __future__ import annotations

from types import SimpleNamespace

GATED = "tests/fixtures/gated_out_models.py"


def _attn(g):
    return [b for b in g.blocks if b.path.startswith("attns.") and b.path.count(".") == 1]


def test_a_softplus_output_gate_per_head_is_a_gated_attention(parse_model):
    """softplus(g_proj(h)), one value per head, scaling the attention output before the out
    projection (Laguna's gate; our own fixture). Before: `attention.full` (the rule knew only a
    sigmoid)."""
    g = parse_model(f"{GATED}:SoftplusHeadGateLM", seq=12)
    attn = _attn(g)
    assert len(attn) == 2
    for b in attn:
        assert b.kind == "attention.gated", (b.kind, b.evidence)
        assert b.attrs["gate_activation"] == "softplus" and b.attrs["gate_per_head"] is True
        assert any("softplus" in e and "one value per head" in e for e in b.evidence)
    assert g.layer_pattern == "A- A-"


def test_a_sigmoid_output_gate_keeps_its_kind_and_names_its_activation(parse_model):
    """sigmoid(g_proj(h)) per channel (Qwen3-Next's form) and a gate inside the out projection's
    module (`GatedOutLM`) read `attention.gated` as before, now with the activation named."""
    for ref in (f"{GATED}:SigmoidGateLM", f"{GATED}:GatedOutLM"):
        g = parse_model(ref, seq=12)
        attn = [b for b in g.blocks if b.kind.startswith("attention.")]
        assert len(attn) == 2, ref
        for b in attn:
            assert b.kind == "attention.gated", (ref, b.kind, b.evidence)
            assert b.attrs["gate_activation"] == "sigmoid" and b.attrs["gate_per_head"] is False


def test_a_query_gate_and_a_soft_cap_are_no_output_gate(parse_model):
    """A sigmoid of a projection that scales the queries (its product runs before the attention
    core) and a tanh soft-cap of the written-out scores (not a token-major tensor) gate no
    output. Before: `attention.gated` (any sigmoid before the out projection)."""
    g = parse_model(f"{GATED}:QueryGateSoftcapLM", seq=12)
    attn = _attn(g)
    assert len(attn) == 2
    for b in attn:
        assert b.kind == "attention.full", (b.kind, b.evidence)
        assert "gate_activation" not in b.attrs
        assert b.attrs["unfused_core"]["scores"][-2:] == [12, 12]


def test_the_memory_plan_counts_a_per_head_gate_at_its_size():
    """The planner keeps the gated output and the gate: heads x d_v for a per-channel gate (as
    before), heads for a per-head one (before: heads x d_v whatever the gate's width); a sliding
    block with a gate counts it too (before: nothing)."""
    from onboarding.plan.config import PlanConfig
    from onboarding.plan.memory import block_saved
    from onboarding.plan.shapes import BlockShape

    config = SimpleNamespace(num_attention_heads=4, head_dim=8, hidden_size=32)
    shape = SimpleNamespace(hidden=32, config=config)
    cfg = PlanConfig(gpus=1, seq=64)

    def kept(kind, **attrs):
        b = BlockShape(pattern="layers.*.attn", kind=kind, count=1, params=0,
                       linears=[("q", 32, 32), ("o", 32, 32)], attrs=attrs, ops=1, nested=False)
        return block_saved(b, shape, cfg, 1)[0]

    plain = kept("attention.full")
    assert kept("attention.gated") - plain == 2 * (32 + 32)  # a graph without the attrs: as before
    assert kept("attention.gated", gate_activation="sigmoid", gate_per_head=False) - plain == 2 * 64
    assert kept("attention.gated", gate_activation="softplus", gate_per_head=True) - plain == 2 * (32 + 4)
    assert kept("attention.sliding", gate_activation="softplus", gate_per_head=True) \
        - kept("attention.sliding") == 2 * (32 + 4)
