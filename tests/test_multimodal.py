"""Multimodal models (and bare ``*_text`` decoders) with no causal-LM class: the language model is
onboarded, the whole model is accounted by component, and the proxy shrinks every tower."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from onboarding.cli.main import main
from onboarding.errors import InputError
from onboarding.graph.parse import load_stage
from onboarding.load.model import load_model
from onboarding.load.multimodal import layout, text_config_path
from onboarding.report import _model_section

MULTIMODAL = ["kimi_k25", "qwen3_vl_moe", "glm4v_moe", "qwen3_omni_moe"]
TEXT = [f"{t}_text" for t in MULTIMODAL]


def _known(model_type: str) -> str:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"model_type {model_type!r} is not in the installed transformers")
    return f"hf:{model_type}"


# kimi_k25's full size (670B on meta) takes ~35 s to account
SLOW_FULL = {"kimi_k25"}


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.slow) if t in SLOW_FULL
                                        else t for t in MULTIMODAL + TEXT])
def test_parse_and_map_exit_0_with_component_accounting(model_type, tmp_path):
    ref = _known(model_type)
    assert main(["parse", ref, "--out", str(tmp_path / "p")]) == 0
    assert main(["map", ref, "--out", str(tmp_path / "m")]) == 0
    m = json.loads((tmp_path / "m" / "model.json").read_text())
    p = m["params"]
    assert sum(p["by_part"].values()) == p["total"]
    assert "language" in p["by_part"]
    if model_type in MULTIMODAL:
        assert {"language", "vision", "projector"} <= set(p["by_part"])
        assert p["by_part"]["language"] > p["by_part"]["vision"] > 0
        section = _model_section(tmp_path / "m")
        assert "By component" in section and "| vision |" in section
        assert "| projector |" in section
    graph = json.loads((tmp_path / "m" / "opgraph.json").read_text())
    kinds = {b["kind"] for b in graph["blocks"]}
    assert "lm_head" in kinds and "moe.experts" in kinds
    # the language model's blocks keep causal-LM paths; the towers are not in its graph
    assert all(b["path"].startswith(("model.", "lm_head")) or b["path"] in ("", "model")
               for b in graph["blocks"]), {b["path"] for b in graph["blocks"]}


@pytest.mark.parametrize("model_type", MULTIMODAL + TEXT)
def test_proxy_is_small(model_type):
    """Shrinking only the top-level fields leaves text_config (and the towers) full size: the
    whole proxy, towers included, is a few million parameters."""
    info = load_stage(load_model(_known(model_type)), "tiny")
    whole = layout(info.proxy_config, False).whole
    n = sum(p.numel() for p in whole.parameters())
    assert 0.3e6 < n < 12e6, n
    lm = info.loaded.build(info.proxy_config, device="meta", seed=None)
    assert sum(p.numel() for p in lm.parameters()) < 5e6


@pytest.mark.parametrize("model_type", MULTIMODAL)
def test_towers_shrink_and_follow_the_text_width(model_type):
    from transformers import PretrainedConfig

    info = load_stage(load_model(_known(model_type)), "tiny")
    cfg = info.proxy_config
    text = cfg.get_text_config()
    vision = [v for _, v in _walk(cfg) if hasattr(v, "patch_size")]
    assert vision and all(v.hidden_size <= 128 for v in vision)
    for v in vision:
        for name in ("out_hidden_size",):
            if hasattr(v, name):
                assert getattr(v, name) == text.hidden_size
    assert isinstance(text, PretrainedConfig) and text.hidden_size <= 128


def _walk(cfg, path=()):
    from transformers import PretrainedConfig

    for k, v in vars(cfg).items():
        if isinstance(v, PretrainedConfig):
            yield path + (k,), v
            yield from _walk(v, path + (k,))


def test_language_model_runs_and_is_deterministic():
    info = load_stage(load_model(_known("qwen3_vl_moe")), "tiny")
    a = info.loaded.build(info.proxy_config, device="cpu", seed=3).eval()
    b = info.loaded.build(info.proxy_config, device="cpu", seed=3).eval()
    ids = torch.randint(0, info.proxy_config.get_text_config().vocab_size, (1, 8))
    with torch.no_grad():
        la, lb = a(ids, use_cache=False).logits, b(ids, use_cache=False).logits
    assert la.shape == (1, 8, info.proxy_config.get_text_config().vocab_size)
    assert torch.equal(la, lb)
    assert isinstance(a.get_output_embeddings(), nn.Linear)
    # no tower in the language model
    assert not any(isinstance(m, nn.modules.conv._ConvNd) for m in a.modules())


def test_config_without_a_text_part_is_an_input_error(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3_vl_moe")
    cfg.text_config.vocab_size = 0  # no vocabulary: no sub-config holds a text model
    with pytest.raises(InputError, match="text part cannot be found"):
        text_config_path(cfg)
    # through the CLI: exit 2, nothing left behind
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "out"
    assert main(["parse", str(d), "--out", str(out)]) == 2
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "glm4v_moe_text"])
def test_align_tiny_exit_0(model_type, tmp_path):
    ref = _known(model_type)
    assert main(["align", ref, "--proxy", "tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "alignment.json").read_text())
    assert result["logits"]["passed"]


@pytest.mark.slow
def test_train_lora_on_the_language_model(tmp_path):
    """Training takes the language model alone: the towers are never built, so they stay as
    they are; the run's model.json still accounts the whole model by component."""
    ref = _known("qwen3_vl_moe")
    assert main(["train", ref, "--steps", "2", "--seq", "16", "--device", "cpu", "--no-kernels",
                 "--out", str(tmp_path)]) == 0
    m = json.loads((tmp_path / "model.json").read_text())
    assert {"language", "vision"} <= set(m["params"]["by_part"])
    assert "By component" in (tmp_path / "report.md").read_text()
