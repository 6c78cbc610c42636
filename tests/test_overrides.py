"""`--set` on a config: per-layer lists follow a new layer count, as the config class derives
them, and transformers' own validation still runs (`onboarding.load.overrides`)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from onboarding.errors import InputError
from onboarding.load.overrides import apply_overrides


def test_layer_count_carries_layer_types_along():
    c = AutoConfig.for_model("qwen3_next")
    full = list(c.layer_types)
    apply_overrides(c, {"num_hidden_layers": 6})
    assert c.num_hidden_layers == 6 and list(c.layer_types) == full[:6]
    apply_overrides(c, {"num_hidden_layers": 9})  # grows: its repeating pattern goes on
    assert list(c.layer_types)[:6] == full[:6] and len(c.layer_types) == 9
    # as a config built with that count derives it
    assert list(c.layer_types) == list(AutoConfig.for_model("qwen3_next",
                                                            num_hidden_layers=9).layer_types)


def test_layer_types_given_with_the_count_are_kept_and_validated():
    c = AutoConfig.for_model("qwen3_next")
    mine = ["full_attention", "linear_attention"]
    apply_overrides(c, {"num_hidden_layers": 2, "layer_types": mine})
    assert list(c.layer_types) == mine
    with pytest.raises(InputError, match="transformers rejects the config"):
        apply_overrides(AutoConfig.for_model("qwen3_next"),
                        {"num_hidden_layers": 3, "layer_types": mine})
