"""The multimodal projector (the module between a tower's output and the language model's input
embeddings) is counted as ``projector`` in ``by_part`` for every layout, by structure:

- beside the towers with linear layers (LLaVA's and Mllama's ``multi_modal_projector``): as before;
- beside the towers as a bare weight matrix, ``x @ W`` from the tower's width to the language
  model's (Gemma 3's ``mm_input_projection_weight``, with its norm): was ``other``;
- inside the tower after its layer stack (Qwen2-VL's ``merger``): was ``vision``, because the tower
  width was read from the vision config's ``hidden_size``, which there is the language model's
  width (the merger's output), so the merger looked like it kept the tower's width.

Tiny configs built on meta (`multimodal.layout`); the test names the projector's path of each model
to check the count, the code finds it by structure."""

from __future__ import annotations

import pytest

from onboarding.load.multimodal import component_params, layout


def _config(model_type: str, **kw):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in the installed transformers")
    return CONFIG_MAPPING[model_type](**kw)


TEXT = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def gemma3():
    vision = {"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    return _config("gemma3", text_config={**TEXT, "head_dim": 16}, vision_config=vision,
                   mm_tokens_per_image=4), "model.multi_modal_projector"


def llava():
    vision = {"model_type": "clip_vision_model", "hidden_size": 48, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
              "projection_dim": 16}
    return _config("llava", text_config={**TEXT, "model_type": "llama"}, vision_config=vision,
                   vision_feature_layer=-1), "model.multi_modal_projector"


def qwen2_vl():
    # the vision config's hidden_size is the width the merger hands the language model (32), its
    # embed_dim the tower's own (48)
    vision = {"depth": 2, "embed_dim": 48, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
              "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    text = {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}}
    return _config("qwen2_vl", text_config=text, vision_config=vision), "model.visual.merger"


def mllama():
    text = {**TEXT, "num_hidden_layers": 3, "cross_attention_layers": [1], "pad_token_id": 0}
    vision = {"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_global_layers": 1, "attention_heads": 2, "image_size": 28, "patch_size": 14,
              "vision_output_dim": 96, "intermediate_layers_indices": [0]}
    return _config("mllama", text_config=text, vision_config=vision), "model.multi_modal_projector"


@pytest.mark.parametrize("make", [gemma3, llava, qwen2_vl, mllama], ids=lambda f: f.__name__)
def test_the_projector_is_counted_as_projector(make):
    cfg, path = make()
    lay = layout(cfg, False)
    parts = component_params(lay, cfg)
    projector = sum(p.numel() for p in lay.whole.get_submodule(path).parameters())
    assert sum(p.numel() for p in {id(p): p for p in lay.whole.parameters()}.values()) == sum(parts.values())
    assert "other" not in parts, parts
    assert parts.get("projector") == projector, (parts, projector)
    assert parts["vision"] > 0 and parts["language"] > 0, parts
