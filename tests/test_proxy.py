"""Proxy configs keep the architecture and shrink the size."""

from __future__ import annotations

import pytest
import torch

from onboarding.accounting import count_parameters
from onboarding.loading import load_model
from onboarding.parse import load_stage
from onboarding.proxy import text_config

DEV = ["hf:qwen3_next", "hf:deepseek_v32", "hf:kimi_linear", "hf:qwen3_moe", "hf:mixtral"]


@pytest.mark.parametrize("ref", DEV)
def test_tiny_proxy_is_a_few_million(ref):
    info = load_stage(load_model(ref), "tiny")
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    n = count_parameters(model).total
    assert 0.5e6 < n < 10e6, n


@pytest.mark.parametrize("ref", ["hf:qwen3_next", "hf:deepseek_v32", "hf:kimi_linear",
                                 "hf:mixtral"])
def test_small_proxy_is_0p3_to_1b(ref):
    info = load_stage(load_model(ref), "small")
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    n = count_parameters(model).total
    assert 0.3e9 <= n <= 1.0e9, n


def test_proxy_keeps_hybrid_period_and_routing():
    lm = load_model("hf:qwen3_next")
    info = load_stage(lm, "tiny")
    full, tiny = text_config(lm.config), text_config(info.proxy_config)
    assert tiny.layer_types == full.layer_types[:4]  # one full period: 3 linear, 1 full
    assert {"linear_attention", "full_attention"} == set(tiny.layer_types)
    assert tiny.norm_topk_prob == full.norm_topk_prob
    assert tiny.num_experts_per_tok <= tiny.num_experts
    assert tiny.linear_num_value_heads // tiny.linear_num_key_heads == \
        full.linear_num_value_heads // full.linear_num_key_heads


def test_proxy_keeps_group_limited_routing_valid():
    info = load_stage(load_model("hf:deepseek_v3"), "tiny")
    c = text_config(info.proxy_config)
    assert c.n_group > 1 and c.topk_group < c.n_group
    assert c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts // c.n_group)


def test_same_seed_same_model():
    info = load_stage(load_model("hf:qwen3_moe"), "tiny")
    a = info.loaded.build(info.proxy_config, seed=3).state_dict()
    b = info.loaded.build(info.proxy_config, seed=3).state_dict()
    c = info.loaded.build(info.proxy_config, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_small_full_model_is_used_as_is_with_weights():
    info = load_stage(load_model("tiny_dense"), "tiny")
    assert info.proxy_note.startswith("full size")
    assert info.loaded.weights, "tiny_dense ships model.safetensors"


def test_shipped_weights_are_loaded_into_the_parsed_model(monkeypatch):
    from safetensors.torch import load_file

    import onboarding.parse as parse

    seen = {}
    real = parse.load_weights

    def spy(model, files):
        n = real(model, files)
        seen["state"] = {k: v.clone() for k, v in model.state_dict().items()}
        return n

    monkeypatch.setattr(parse, "load_weights", spy)
    info = load_stage(load_model("tiny_dense"), "tiny")
    parse.parse_stage(info, seq=16)
    shipped = load_file(str(info.loaded.weights[0]))
    assert shipped and all(torch.equal(seen["state"][k], v) for k, v in shipped.items())


@pytest.mark.parametrize("ref, heads, dim", [
    ("hf:mamba2", "num_heads", "head_dim"),
    ("hf:bamba", "mamba_n_heads", "mamba_d_head"),
    ("hf:falcon_h1", "mamba_n_heads", "mamba_d_head"),  # inner width from mamba_d_ssm
    ("hf:granitemoehybrid", "mamba_n_heads", "mamba_d_head"),
])
def test_ssm_proxy_keeps_heads_times_head_dim_equal_to_the_inner_width(ref, heads, dim):
    """Mamba-2 style mixers reshape their inner width into heads: a proxy that shrank the
    hidden size and the heads apart failed in its first forward (a reshape error)."""
    from onboarding.proxy import _ssm_inner

    info = load_stage(load_model(ref), "tiny")
    c = text_config(info.proxy_config)
    assert getattr(c, heads) * getattr(c, dim) == _ssm_inner(c)
    groups = next(getattr(c, g) for g in ("mamba_n_groups", "n_groups") if hasattr(c, g))
    assert getattr(c, heads) % groups == 0
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, c.vocab_size, (1, 16)), use_cache=False)
    assert torch.isfinite(out.logits).all()


def _model_type_or_skip(ref: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if ref.removeprefix("hf:") not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {ref}")


@pytest.mark.parametrize("ref", [
    "hf:gemma4_text",  # heterogeneous config: per-layer head_dim overrides (full layers 2x)
    "hf:dots3_note_text",  # per-layer heads and MLA ranks; rotary table 256 x 0.25 = qk_rope 64
    "hf:xlstm",  # v_head_dim a read-only property; embedding_dim and num_blocks name the width, depth again
    "hf:zamba2",  # attention_head_dim, mamba_headdim derived in __post_init__
])
def test_proxy_of_configs_with_derived_and_per_layer_fields_runs(ref):
    """Each of these failed before the proxy rules knew the config pattern in its comment
    (an internal error, or a shape error in the proxy's first forward)."""
    _model_type_or_skip(ref)
    info = load_stage(load_model(ref), "tiny")
    c = text_config(info.proxy_config)
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0)
    # Gemma 4's per-layer input embeddings (a second table over the vocabulary) made it 400M
    assert count_parameters(model).total <= 20_000_000
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, c.vocab_size, (1, 16)), use_cache=False)
    assert torch.isfinite(out.logits).all()


def test_per_layer_overrides_follow_their_global_field():
    """A per-layer override is scaled as its global field was and renumbered with the kept
    layers: Gemma 4's full-attention layers keep twice the sliding layers' head dim."""
    _model_type_or_skip("hf:gemma4_text")
    from transformers import AutoConfig

    from onboarding.proxy import shrink_config

    full = AutoConfig.for_model("gemma4_text")
    c = shrink_config(full, "tiny")
    layers = c.per_layer_config
    kinds = c.layer_types
    assert "full_attention" in kinds
    dims = {kind: {layers[i].head_dim for i, k in enumerate(kinds) if k == kind} for kind in set(kinds)}
    assert dims["full_attention"] == {2 * d for d in dims["sliding_attention"]}, dims
    assert max(dims["full_attention"]) <= 2 * 32
