"""A config transformers' model code cannot build or run with is reported with the line that
failed, not only the exception's text."""

from __future__ import annotations

import pytest
import torch

from onboarding.errors import InputError
from onboarding.load.model import load_model

TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64)


def test_a_build_failure_names_the_model_code_line():
    """hf:lfm2_moe's default config (transformers 5.25) has ``layer_types`` None, and building it
    said only "TypeError: 'NoneType' object is not subscriptable". The error now names the
    modeling file's line that read the field (here hf:lfm2 with that field set to None)."""
    lm = load_model("hf:lfm2", overrides={"layer_types": None, **TINY})
    with pytest.raises(InputError) as err:
        lm.build(device="meta", seed=None)
    msg = str(err.value)
    assert "'NoneType' object is not subscriptable at modeling_lfm2.py:" in msg
    assert "config.layer_types[layer_idx]" in msg and "--set" in msg


def test_a_forward_failure_names_the_model_code_line():
    """The capture's forward error names the innermost line of transformers' model code too
    (hf:step3p5's default config: "Could not find a `sliding_window` argument in the config" at
    modeling_step3p7.py's mask creation); here token ids past the vocabulary."""
    from onboarding.graph.capture import ModelRunError, _call

    lm = load_model("hf:llama", overrides=TINY)
    model = lm.build(device="cpu", seed=0)
    with pytest.raises(ModelRunError) as err:
        _call(model, (torch.full((1, 4), 1000),), {})
    assert " at modeling_llama.py:" in str(err.value)
