"""``model.json``'s configs are written the same whatever order a config built its mappings in."""

from __future__ import annotations

import json

from transformers import PretrainedConfig

from onboarding.stages import _config_dict


def test_nested_mapping_order_does_not_change_the_written_config():
    # a field built from a set (Dory's rope_parameters) takes the hash seed's order
    a = PretrainedConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0},
                         layer_types=["full", "sliding"])
    b = PretrainedConfig(rope_parameters={"factor": 2.0, "rope_theta": 1e4, "rope_type": "default"},
                         layer_types=["full", "sliding"])
    da, db = _config_dict(a), _config_dict(b)
    assert json.dumps(da) == json.dumps(db)
    assert list(da["rope_parameters"]) == ["factor", "rope_theta", "rope_type"]
    assert da["layer_types"] == ["full", "sliding"]  # lists keep their order
    assert _config_dict(None) is None


def test_full_config_of_a_multimodal_model_is_the_whole_config(tmp_path):
    """``full_config`` held only the text config of a multimodal model (its towers lost);
    ``proxy_config`` stays the proxy's text config, which readers look up by key."""
    from types import SimpleNamespace

    from transformers import LlavaConfig

    from onboarding.stages import save_model_json

    full = LlavaConfig(text_config={"model_type": "llama", "hidden_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4},
                       vision_config={"model_type": "clip_vision_model", "hidden_size": 32,
                                      "num_attention_heads": 2})
    proxy = LlavaConfig(text_config={"model_type": "llama", "hidden_size": 16,
                                     "num_hidden_layers": 1, "num_attention_heads": 2})
    lm = SimpleNamespace(ref="hf:toy", name="toy", source="test", trust_remote_code=False,
                         weights=[], compat_shims=[], impl_note="", part=None, config=full)
    info = SimpleNamespace(loaded=lm, full=SimpleNamespace(to_dict=lambda: {}), proxy_size="tiny",
                           proxy_note="", proxy_config=proxy)
    save_model_json(info, tmp_path, {})
    m = json.loads((tmp_path / "model.json").read_text())
    assert m["full_config"]["model_type"] == "llava"
    assert m["full_config"]["vision_config"]["hidden_size"] == 32
    assert m["full_config"]["text_config"]["hidden_size"] == 64
    assert m["proxy_config"]["hidden_size"] == 16 and "vision_config" not in m["proxy_config"]
