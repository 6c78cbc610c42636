"""The plan of a multimodal model says which part it plans and what it leaves out."""

import pytest

from onboarding.cli.main import main


def test_a_multimodal_plan_names_the_parts_it_leaves_out(tmp_path):
    """onboard run hf:qwen3_vl_moe: the report's totals count the vision tower and projector
    (415.89M + 151.06M), while the plan, titled "the full-size model per GPU", held the
    language model's weights alone and said nothing of it."""
    from transformers import CONFIG_MAPPING

    if "qwen3_vl_moe" not in CONFIG_MAPPING:
        pytest.skip("qwen3_vl_moe is not in the installed transformers")
    small = ["--set", "text_config.num_hidden_layers=2", "--set", "vision_config.depth=1"]
    assert main(["plan", "hf:qwen3_vl_moe", *small, "--out", str(tmp_path)]) == 0
    md = (tmp_path / "plan.md").read_text()
    (note,) = [line for line in md.splitlines() if "the plan is of the model" in line and "the language part" in line]
    assert "vision" in note and "projector" in note and "GiB of weights" in note
    assert "on no GPU" in note  # onboard train builds the language model alone


def test_a_text_model_plan_has_no_parts_note(tmp_path):
    assert main(["plan", "tiny_dense", "--out", str(tmp_path)]) == 0
    assert "the plan is of the" not in (tmp_path / "plan.md").read_text()
