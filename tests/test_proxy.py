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
