"""The attention output gate, read by structure: an activation of a projection of the hidden state
that multiplies the attention output before the out projection (`attention.gated`, attrs
`gate_activation` and `gate_per_head`; MLA and top-k sparse blocks keep their kinds and record the
same attrs), whatever the activation; and what the memory planner counts for it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

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
    # the gate's own projection (4 heads, one value each): what tells the heads at full size
    assert all((b.attrs["gate_projection"], b.attrs["gate_width"]) == ("g_proj.weight", 4)
               for b in attn)


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
            assert "gate_projection" not in b.attrs  # a gate per channel needs no head count


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


UNGATED_ATTRS = {
    # the latent (MLA) fixture: its two normed latents; the top-k fixture: its indexer's selection;
    # both: the heads and widths of the SDPA core (MLA's d_qk = 8 nope + 4 rope, d_v = 6)
    "LatentLM": {"layout": "mla", "kv_latent": [10, 12],
                 "core_widths": {"heads": 4, "d_qk": 12, "d_v": 6}},
    "TopkLM": {"topk": 4, "indexer_relu": True, "topk_inputs": [
        {"shape": [1, 12, 12], "dtype": "float32", "dim": -1, "largest": True}],
        "core_widths": {"heads": 4, "d_qk": 8, "d_v": 8},
        # what sparse_attention's probe found: the SDPA call over the top-k positions
        "core_calls": {"sparse-attention": {"attention": [
            {"q": [1, 4, 12, 8], "k": [1, 4, 12, 8], "v": [1, 4, 12, 8], "latent": []}]}}},
}


@pytest.mark.parametrize("plain,gated,kind,gate", [
    ("LatentLM", "GatedLatentLM", "attention.mla", {"gate_activation": "sigmoid",
                                                     "gate_per_head": True,
                                                     "gate_projection": "g_proj.weight",
                                                     "gate_width": 4}),
    ("TopkLM", "GatedTopkLM", "sparse_attention.topk", {"gate_activation": "sigmoid",
                                                         "gate_per_head": False}),
])
def test_an_mla_or_top_k_block_records_its_output_gate(parse_model, plain, gated, kind, gate):
    """MLA (queries through a low-rank pair, the out projection reading heads x d_v, d_v != d_qk)
    and top-k sparse attention keep their kinds and record an output gate as the other kinds do;
    without one their attrs are what they were. Before: both kinds returned before the gate was
    read, so a gated MLA (Ling 3's, one sigmoid per head) recorded no gate."""
    without = _attn(parse_model(f"{GATED}:{plain}", seq=12))
    with_gate = _attn(parse_model(f"{GATED}:{gated}", seq=12))
    assert len(without) == len(with_gate) == 2
    for b in without:
        assert b.kind == kind and b.attrs == UNGATED_ATTRS[plain], (b.kind, b.attrs, b.evidence)
    for b in with_gate:
        assert b.kind == kind, (b.kind, b.evidence)
        assert b.attrs == {**UNGATED_ATTRS[plain], **gate}, b.attrs
        assert any("before the out projection" in e for e in b.evidence)


@pytest.mark.parametrize("ref,config,gate", [
    # MLA's widths from its config fields: d_qk = 8 + 4, d_v = 6; the gate one value per head
    ("GatedLatentLM", dict(qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6), 4 * 6 + 4),
    ("GatedTopkLM", dict(head_dim=8), 2 * 4 * 8),  # one gate value per channel
])
def test_the_memory_plan_counts_an_mla_or_top_k_gate_once(parse_model, ref, config, gate):
    """The planner keeps a gated MLA or top-k block's gated output and gate (heads x d_v, and
    heads or heads x d_v) once: the kind is not `attention.gated`, so only `gate_activation`
    adds it. The block comes from the fixture's parse at full size (`model_shape`); before, the
    parse recorded no gate on these kinds and the plan kept nothing for it."""
    from onboarding.load.model import load_model
    from onboarding.plan.config import PlanConfig
    from onboarding.plan.memory import block_saved
    from onboarding.plan.shapes import model_shape

    cfg = SimpleNamespace(num_attention_heads=4, hidden_size=16, **config)
    model = load_model(f"{GATED}:{ref}").build(None, seed=0)
    shape = model_shape(model, cfg, parse_model(f"{GATED}:{ref}", seq=12))
    (b,) = [x for x in shape.blocks if x.pattern == "attns.*"]
    assert b.attrs.get("gate_activation") == "sigmoid", b.attrs
    plain = replace(b, attrs={k: v for k, v in b.attrs.items() if not k.startswith("gate_")})
    plan = PlanConfig(gpus=1, seq=64)
    assert block_saved(b, shape, plan, 1)[0] - block_saved(plain, shape, plan, 1)[0] == 2 * gate


def test_the_memory_plan_reads_a_per_head_gates_heads_off_its_projection(parse_model):
    """With no head count in the config, a per-head gate's heads are its projection's output
    width at full size: the fixture captured with 4 heads of 8, planned with 8 heads of 4, keeps
    a gate of 8 values per token and 8 fp32 log-sum-exps, and the plan notes where the count came
    from; with no projection to read, one head, and the plan says so. Before: one head, silently
    (1 gate value and 1 log-sum-exp per token)."""
    from onboarding.load.model import load_model
    from onboarding.plan.config import PlanConfig
    from onboarding.plan.memory import block_heads, block_saved
    from onboarding.plan.search import head_notes
    from onboarding.plan.shapes import model_shape

    from fixtures.gated_out_models import HeadGatedAttention

    graph = parse_model(f"{GATED}:SoftplusHeadGateLM", seq=12)
    model = load_model(f"{GATED}:SoftplusHeadGateLM").build(None, seed=0)
    for i in range(len(model.attns)):
        model.attns[i] = HeadGatedAttention(16, heads=8, head_dim=4)
    shape = model_shape(model, None, graph)
    (b,) = [x for x in shape.blocks if x.pattern == "attns.*"]
    assert b.gate_heads == 8 and block_heads(b, shape) == (8, 0, 4, "gate projection")
    plan = PlanConfig(gpus=1, seq=64)

    def kept(x):
        return block_saved(x, shape, plan, 1)[0]

    ungated = replace(b, kind="attention.full",
                      attrs={k: v for k, v in b.attrs.items() if not k.startswith("gate_")})
    assert kept(b) - kept(ungated) == 2 * (8 * 4 + 8)  # the gated output and 8 gate values
    one = replace(b, gate_heads=0)  # no projection read: one head
    assert block_heads(one, shape) == (1, 0, 32, "")
    assert kept(b) - kept(one) == (4 + 2) * (8 - 1)  # fp32 log-sum-exp and gate, per head
    (note,) = head_notes(shape)
    assert "attns.*" in note and "none in the config; 8" in note and "g_proj.weight" in note
    shape.blocks = [one if x is b else x for x in shape.blocks]
    (note,) = head_notes(shape)
    assert "counted as one head" in note and "undercounted" in note
    # a config that names the heads: its count, no note
    shape.config = SimpleNamespace(num_attention_heads=8, head_dim=4, hidden_size=16)
    assert block_heads(one, shape) == (8, 4, 4, "config") and head_notes(shape) == []
