"""Structures met in the sweep of multimodal types (docs/LOG.md), each on a tiny config built here:
the language-model rules of `onboarding.load.multimodal` go by structure."""

from __future__ import annotations

import json

import pytest

from onboarding.cli.main import main
from onboarding.errors import InputError
from onboarding.load.multimodal import layout


def _tiny_t5():
    from transformers import T5Config

    return T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                    num_heads=2)


def test_encoder_decoder_language_model_is_an_input_error():
    """Florence-2's language model (BART) and T5 hold an encoder and a decoder stack over one
    vocabulary; the shallowest match was the bidirectional encoder, mapped as a causal LM."""
    with pytest.raises(InputError, match="encoder-decoder"):
        layout(_tiny_t5(), False)


def test_encoder_decoder_through_the_cli_exits_2(tmp_path, capsys):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_tiny_t5().to_dict()))
    out = tmp_path / "out"
    assert main(["map", str(d), "--out", str(out)]) == 2
    assert "encoder-decoder" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_a_head_narrower_than_the_embedding_is_the_lm_head(parse_model):
    """Mllama's embedding holds 8 image-token rows past the vocabulary its head predicts: the
    head was matched against the embedding's rows only, and left out of the graph."""
    g = parse_model("tests/fixtures/multimodal_structure_models.py:padded")
    assert [b.path for b in g.by_kind("lm_head")] == ["lm_head"]


def test_proxy_keeps_the_head_dim_of_a_rotary_layout_fixed_in_code():
    """Qwen2-VL's attention takes its head dim as hidden / heads (no head_dim field) and its
    M-RoPE sections ([16, 24, 24], a rotary half of 64) are a default of its code: setting a
    head_dim on the proxy's config did not reach the attention, and the tiny proxy's forward
    raised (split_with_sizes). The head count is now cut so that hidden / heads is the head dim."""
    from transformers import CONFIG_MAPPING

    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model

    if "qwen2_vl" not in CONFIG_MAPPING:
        pytest.skip("qwen2_vl is not in the installed transformers")
    small = {"text_config.num_hidden_layers": 2, "text_config.hidden_size": 512,
             "text_config.intermediate_size": 512, "text_config.num_attention_heads": 4,
             "text_config.num_key_value_heads": 2, "vision_config.depth": 1}
    info = load_stage(load_model("hf:qwen2_vl", overrides=small), "tiny")
    text = info.proxy_config.text_config
    assert text.hidden_size // text.num_attention_heads == 128, info.proxy_note
    assert text.num_attention_heads % text.num_key_value_heads == 0
    assert "head dim 128" in info.proxy_note


def test_a_layer_that_never_runs_is_an_uncovered_block(parse_model):
    """Mllama's cross-attention layers are skipped without image states: the proxy's layer 3
    ran no op and was missing from the graph, the layer pattern and coverage (uncovered 0)."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/multimodal_structure_models.py:skipped")
    unknown = g.by_kind("unknown")
    assert [(b.path, b.layer) for b in unknown] == [("layers.1", 1)]
    assert "ran no op" in unknown[0].attrs["not_run"]
    assert g.layer_pattern.split()[1].startswith("?")
    why = [e.reason for e in build_coverage(g).entries
           if e.path == "layers.1" and e.status == "uncovered"]
    assert len(why) == 1 and "ran no op" in why[0]
    # the layers that ran are classified as before
    assert {b.path for b in g.by_kind("attention.full")} == {"layers.0.attn", "layers.2.attn"}


def _tiny_mllama():
    from transformers import CONFIG_MAPPING

    if "mllama" not in CONFIG_MAPPING:
        pytest.skip("mllama is not in the installed transformers")
    text = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_key_value_heads": 1, "cross_attention_layers": [1],
            "pad_token_id": 0}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_global_layers": 1, "attention_heads": 2, "image_size": 28, "patch_size": 14,
              "vision_output_dim": 64, "intermediate_layers_indices": [0]}
    return CONFIG_MAPPING["mllama"](text_config=text, vision_config=vision)


def test_the_whole_model_is_the_class_that_builds_the_towers():
    """Mllama's config maps a causal LM that builds the text model alone, and its embedding
    holds 8 rows past the vocabulary: the whole model was that causal LM, the decoder was not
    found in it ("no module holds an embedding of the text vocabulary"), and --part vision
    found no tower. The class that builds every sub-config's module is the whole model."""
    cfg = _tiny_mllama()
    lay = layout(cfg, False)
    assert any(getattr(m, "config", None) is cfg.vision_config for m in lay.whole.modules())
    assert lay.decoder.embed_tokens.num_embeddings == 96 + 8
    assert len(lay.decoder.layers) == 3


def test_a_tower_that_did_not_build_names_why(monkeypatch):
    """FastVLM's and PerceptionLM's towers are timm models: without timm the root does not
    build and the text config's model is the whole. --part vision said 'the model has no vision
    part'; it now says the tower was not built and why (the missing package)."""
    from onboarding.load import multimodal
    from onboarding.load.vision import build_vision_part

    cfg = _tiny_mllama()
    real = multimodal._builders

    def builders(node, trust_remote_code):
        if node is not cfg:
            return real(node, trust_remote_code)

        def fail(c):
            raise ImportError("TowerModel requires the timm library but it was not found")
        return [("AutoModelForImageTextToText", fail)]

    monkeypatch.setattr(multimodal, "_builders", builders)
    with pytest.raises(InputError, match="vision tower was not built.*requires the timm library"):
        build_vision_part(cfg, False, "meta", "hf:tiny")


def test_parts_left_out_of_the_totals_are_warned_about(monkeypatch):
    """The language map of such a model exits 0 with the tower left out of the totals: the
    reason was only in model.json's parts_note; it is now a warning on the terminal too."""
    from onboarding.load import multimodal

    cfg = _tiny_mllama()
    real = multimodal._builders

    def builders(node, trust_remote_code):
        if node is not cfg:
            return real(node, trust_remote_code)

        def fail(c):
            raise ImportError("TowerModel requires the timm library but it was not found")
        return [("AutoModelForImageTextToText", fail)]

    monkeypatch.setattr(multimodal, "_builders", builders)
    lm = multimodal.build_language_model(cfg, False, "meta")
    with pytest.warns(UserWarning, match="not built: vision_config"):
        counts = multimodal.account(lm, cfg)
    assert "vision" not in counts.by_part


def test_a_bare_decoder_built_alone_keeps_the_note(monkeypatch):
    """Granite4Vision's root does not build in the installed transformers and its text config
    builds a bare decoder (no lm_head): the accounting returned early there and dropped the
    note (parts_note empty, no warning), so nothing said the tower was left out."""
    from transformers.models.mllama.modeling_mllama import MllamaTextModel

    from onboarding.load import multimodal

    cfg = _tiny_mllama()

    def builders(node, trust_remote_code):
        def fail(c):
            raise TypeError("object of type 'NoneType' has no len()")
        if node is cfg:
            return [("AutoModelForImageTextToText", fail)]
        return [("MllamaTextModel", MllamaTextModel)]

    monkeypatch.setattr(multimodal, "_builders", builders)
    lm = multimodal.build_language_model(cfg, False, "meta")
    with pytest.warns(UserWarning, match="not built: vision_config"):
        counts = multimodal.account(lm, cfg)
    assert counts.by_part == {"language": counts.total}
    assert "not built: vision_config" in counts.parts_note


def _meta_lm(cfg):
    from onboarding.load.model import LoadedModel

    return LoadedModel(ref="tiny", name="tiny", source="hf", config=cfg).build(device="meta",
                                                                               seed=None)


def _unique_params(m):
    return sum({id(p): p.numel() for p in m.parameters()}.values())


def test_towers_beside_a_text_only_causal_lm_are_in_the_totals():
    """Mllama's config maps a causal LM over its text config alone: the multimodal accounting was
    never used, and the totals (onboard map hf:mllama: 9.78B) left out the vision tower and the
    projector (0.87B) without a word. The language model is still the causal LM; the totals and
    by_part count the whole model built beside it."""
    from onboarding.load.accounting import count_parameters
    from onboarding.load.multimodal import account

    cfg = _tiny_mllama()
    lm = _meta_lm(cfg)
    assert not any(getattr(m, "config", None) is cfg.vision_config for m in lm.modules())
    counts = account(lm, cfg)
    whole = layout(cfg, False).whole
    assert counts.total == _unique_params(whole) > count_parameters(lm, cfg).total
    assert counts.by_part["language"] == _unique_params(lm)
    assert {"vision", "projector"} <= set(counts.by_part)
    assert sum(counts.by_part.values()) == counts.total


def _tiny_gemma3():
    from transformers import CONFIG_MAPPING

    if "gemma3" not in CONFIG_MAPPING:
        pytest.skip("gemma3 is not in the installed transformers")
    text = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    return CONFIG_MAPPING["gemma3"](text_config=text, vision_config=vision, mm_tokens_per_image=4)


def test_a_causal_lm_that_holds_the_towers_is_split_by_part():
    """Gemma 3's config maps a causal LM that builds the whole model (its tower too): the totals
    counted it all, but by_part was empty. Now by_part splits it, the totals unchanged."""
    from onboarding.load.accounting import count_parameters
    from onboarding.load.multimodal import account

    cfg = _tiny_gemma3()
    lm = _meta_lm(cfg)
    counts = account(lm, cfg)
    assert counts.total == count_parameters(lm, cfg).total == _unique_params(lm)
    assert "vision" in counts.by_part and "language" in counts.by_part
    assert sum(counts.by_part.values()) == counts.total


def test_towers_no_class_builds_are_warned_about(monkeypatch):
    """Emu3's causal LM is text-only and no class of its config builds from the hub config: the
    totals leave the tower out, and now say so (ComponentsWarning)."""
    from onboarding.load import multimodal

    cfg = _tiny_mllama()
    lm = _meta_lm(cfg)

    def fail(c):
        raise ValueError("a vocabulary map is needed")
    monkeypatch.setattr(multimodal, "_builders", lambda node, trc: [("AutoModel", fail)])
    with pytest.warns(multimodal.ComponentsWarning, match="vision_config"):
        counts = multimodal.account(lm, cfg)
    assert counts.total == _unique_params(lm)


def test_a_bare_decoders_mlp_as_wide_as_the_vocabulary_is_no_lm_head():
    """find_lm_head skipped its "inside the decoder" guard where the decoder is the whole model
    (path ""): a tiny proxy's MLP whose width equals the vocabulary was taken as the lm_head."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from fixtures.multimodal_structure_models import Layer
    from onboarding.load.multimodal import find_decoder, find_lm_head

    class BareDecoder(nn.Module):
        def __init__(self, vocab=64, d=32):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Layer(d, 2) for _ in range(2))  # MLP width 2 * d = vocab

    cfg = SimpleNamespace(vocab_size=64, num_hidden_layers=2, hidden_size=32)
    with torch.device("meta"):
        model = BareDecoder()
    path, _ = find_decoder(model, cfg)
    assert path == ""
    assert find_lm_head(model, path, cfg) is None
