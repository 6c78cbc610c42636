"""The report's model section says which part of a multimodal model the run onboarded."""

import json

from onboarding.report import _model_section


def _run(tmp_path, part):
    params = {"total": 1000, "active": 1000, "active_without_embeddings": 800,
              "routed_experts": 0, "moe": [],
              "by_part": {"language": 700, "vision": 250, "projector": 50}}
    m = {"ref": "hf:x_vl", "source": "hf", "proxy": "tiny", "proxy_note": "shrunk", "part": part,
         "params": params, "environment": {"torch": "t", "transformers": "tf", "triton": "tr",
                                           "commit": "c", "date": "d"}}
    (tmp_path / "model.json").write_text(json.dumps(m))
    return _model_section(tmp_path)


def test_a_vision_run_does_not_say_the_language_model_was_onboarded(tmp_path):
    """onboard run MODEL --part vision: the section said "the language model is what is
    onboarded" whatever the part."""
    text = _run(tmp_path, "vision")
    assert "language model is what is onboarded" not in text
    assert "the vision part is what this run onboarded" in text


def test_a_language_run_names_the_parts_left_and_how_to_run_the_tower(tmp_path):
    text = _run(tmp_path, "language")
    assert "the language part is what this run onboarded" in text
    assert "vision, projector" in text and "--part vision" in text
