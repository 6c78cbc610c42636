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
