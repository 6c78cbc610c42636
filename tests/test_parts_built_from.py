"""The accounting's components (`multimodal.param_components`) are the modules built from each
sub-config. A module that keeps no ``.config`` (a head built as ``Head(config.flow_head_config)``)
was matched to nothing: the class that holds it looked as if it built no module from that
sub-config, so the whole model fell back to a class without it, and its parameters were in no
breakdown. Now the config a module's constructor was given counts too (`built_from`). And a whole
model that still builds no module from some sub-config says so in its notes (they were empty).
By structure: the tests use transformers' classes as fixtures, the code names none."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from onboarding.load import multimodal
from onboarding.load.multimodal import (built_from, component_params, layout,
                                        recording_configs)


def _config(model_type: str, **kw):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in the installed transformers")
    return CONFIG_MAPPING[model_type](**kw)


class _Head(nn.Module):
    def __init__(self, config, scale: float = 1.0):
        super().__init__()  # keeps no .config
        self.proj = nn.Linear(config.hidden_size, 2)


class _Kept(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


def test_a_module_is_built_from_the_config_its_constructor_was_given():
    from transformers import PretrainedConfig

    sub, other = PretrainedConfig(hidden_size=4), PretrainedConfig(hidden_size=4)
    with recording_configs():
        head, kept = _Head(sub), _Kept(other)
    assert built_from(head) is sub and built_from(kept) is other
    assert built_from(head.proj) is None  # a Linear is given ints, no config
    assert built_from(_Head(sub)) is None  # built outside the recorder: as before
    assert nn.Module.__init__ is torch.nn.modules.module.Module.__init__


def test_a_head_that_keeps_no_config_is_its_sub_configs_component():
    """A text model at the root with a flow head built from its ``flow_head_config`` (a module
    that keeps no ``config``): the class holding the head is the whole model, and the head's
    parameters are its own component. Before: the whole was the class without the head, and
    the breakdown was the language model alone."""
    cfg = _config("pocket_tts", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=64,
                  audio_prompt_token_id=60, audio_latent_token_id=61,
                  audio_prompt_bos_token_id=62, audio_bos_token_id=63,
                  flow_head_config={"hidden_size": 16, "num_hidden_layers": 1,
                                    "condition_dim": 32, "frequency_embedding_size": 8,
                                    "loss_weighting_hidden_size": 8})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lay = layout(cfg, False)
    heads = [m for n, m in lay.whole.named_children() if built_from(m) is cfg.flow_head_config]
    assert heads  # the head (and its loss weighting), each built from the flow-head config
    parts = component_params(lay, cfg)
    total = sum(p.numel() for p in lay.whole.parameters())
    assert sum(parts.values()) == total
    # the heads' own parameters, but what leaves their width (an out-projection: `_tower_heads`)
    n_heads = sum(p.numel() for m in heads for p in m.parameters())
    assert 0 < parts.get("flow_head", 0) <= n_heads
    assert parts["language"] == sum(p.numel() for p in lay.decoder.parameters())
    assert lay.notes == []


def _tiny_gemma3():
    text = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    return _config("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4)


@pytest.mark.parametrize("raising_first", [False, True])
def test_a_whole_that_builds_no_module_from_a_sub_config_says_so(monkeypatch, raising_first):
    """Every class of the config either raises or builds the text part alone: the whole model is
    the text part (the first such class, or the last class tried), and its notes name the
    sub-config it builds nothing from and why (the error of a class that might have). They were
    empty: by_part showed the language model alone with nothing said."""
    from transformers import Gemma3ForCausalLM

    cfg = _tiny_gemma3()

    def raises(c):
        raise ValueError("embed_dim must be divisible by num_heads")

    builders = [("TextOnly", lambda c: Gemma3ForCausalLM(c.text_config)), ("Whole", raises)]
    if raising_first:
        builders.reverse()
    monkeypatch.setattr(multimodal, "_builders", lambda c, trust: builders if c is cfg else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lay = layout(cfg, False)
    assert lay.node_path == () and isinstance(lay.whole, Gemma3ForCausalLM)
    [note] = lay.notes
    assert "not built: vision_config" in note and "Whole: ValueError" in note, note
    assert set(component_params(lay, cfg)) == {"language"}
