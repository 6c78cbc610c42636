"""Full-size parameter accounting on the meta device."""

from __future__ import annotations

import time

import pytest

from onboarding.accounting import count_parameters
from onboarding.loading import load_model


def _full(ref: str, **overrides):
    lm = load_model(ref, overrides=overrides)
    model = lm.build(device="meta", seed=None)
    return model, count_parameters(model, lm.config)


def test_qwen3_next_default_counts():
    _, c = _full("hf:qwen3_next")
    assert round(c.total / 1e9, 2) == 79.67
    assert 3.8e9 < c.active < 3.95e9  # ~3.9B active with embeddings and lm_head
    assert 3.15e9 < c.active_without_embeddings < 3.3e9  # ~3.2B without them
    assert c.moe[0].n_experts == 512 and c.moe[0].top_k == 10
    assert c.moe[0].shared_paths, "the shared expert must be found (counted fully)"


def test_deepseek_v3_total():
    _, c = _full("hf:deepseek_v3")
    assert round(c.total / 1e9, 2) == 671.03
    assert c.by_category["moe.shared_expert"] > 0


@pytest.mark.parametrize("ref", ["hf:qwen3_next", "hf:deepseek_v32", "hf:kimi_linear",
                                 "hf:qwen3_moe", "hf:mixtral", "onboard_hybrid", "tiny_dense"])
def test_meta_total_equals_numel_sum(ref):
    model, c = _full(ref)
    assert c.total == sum(p.numel() for p in model.parameters())
    assert sum(c.by_category.values()) == c.total
    assert all(p.device.type == "meta" for p in model.parameters()) or ref == "tiny_dense"


def test_trillion_parameter_config_is_cheap():
    # A Kimi-K2-like configuration: 384 experts, 61 layers.
    t0 = time.perf_counter()
    model, c = _full("hf:deepseek_v3", n_routed_experts=384, num_attention_heads=64,
                     vocab_size=163840, first_k_dense_replace=1)
    assert c.total > 1.0e12
    assert c.active < 0.05 * c.total
    assert time.perf_counter() - t0 < 60  # "seconds", with a wide margin for slow CI
    assert not any(p.device.type != "meta" for p in model.parameters())


def test_routed_weighting_is_top_k_over_experts():
    _, c = _full("hf:mixtral")
    dense = c.total - c.routed_experts
    assert c.active == dense + round(c.routed_experts * 2 / 8)


def test_tied_embeddings_counted_once():
    model, c = _full("hf:llama", tie_word_embeddings=True, num_hidden_layers=2)
    assert c.tied_embeddings
    assert c.total == sum(p.numel() for p in model.parameters())
