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
