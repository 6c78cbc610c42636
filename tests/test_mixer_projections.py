"""A sequence mixer whose recurrence runs in a weightless child module of its own (xLSTM's mLSTM
layer: q, k, v and soft-capped gate projections, the mLSTM cell, a sigmoid output gate and the
out projection): its projections are the mixer's, as gated delta's or Kimi delta's are their
block's. The mixer module is the `linear_attention` block, the cell's block taken into it
(`Classifier._recurrent_wrapper`, the path Griffin's recurrent block takes), so the map lists
the projections under it and training's default LoRA targets (the linears inside attention-kind
blocks) hold them. Our own fixture (`tests/fixtures/recurrent_cell_models.py`) and, slow,
transformers' xLSTM."""

from __future__ import annotations

import pytest

RECURRENT_CELL = "tests/fixtures/recurrent_cell_models.py"
MIXER_LINEARS = ("q", "k", "v", "o_gate", "i_gate", "f_gate", "out")


@pytest.mark.parametrize("cls,mlp,evidence", [
    ("RecurrentCellLM", "layers.{i}.ffn", "3 projections with silu gating (act(gate) * up)"),
    ("LayerMLPLM", "layers.{i}", "2 projections with gelu")])
def test_projections_around_a_child_recurrence_are_the_mixers_block(parse_model, cls, mlp,
                                                                    evidence):
    """The mixer module is one `linear_attention.other` block holding its projections and the
    cell's ops (before: the cell alone, `layers.i.mixer.cell`, its projections in no block and
    no default LoRA target; before that a gated tanh `mlp.dense`, `LFF LFF`). The control
    (`LayerMLPLM`): a layer that runs that mixer, then an MLP's projections in its own forward
    is still an MLP, the mixer's projections not in it."""
    from onboarding.load.model import load_model
    from onboarding.train.lora import default_targets

    ref = f"{RECURRENT_CELL}:{cls}"
    g = parse_model(ref, seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "LF LF"
    for i in (0, 1):
        mixer = by[f"layers.{i}.mixer"]
        assert mixer.kind == "linear_attention.other", (mixer.kind, mixer.evidence)
        assert f"layers.{i}.mixer.cell" not in by  # taken into the mixer
        assert {f"{n}.weight" for n in MIXER_LINEARS} <= set(mixer.params)
        assert mixer.op_histogram.get("cumsum") == 1 and mixer.op_histogram.get("linear") == 7
        assert "the recurrence has no weights" in mixer.evidence[-1]
        assert [p for p, b in by.items() if b.layer == i and b.kind == "mlp.dense"] == \
            [mlp.format(i=i)]
        assert by[mlp.format(i=i)].evidence == [evidence]  # the mixer's 7 projections not in it
    targets = default_targets(load_model(ref).build(None, seed=0), g)
    assert set(targets) == {f"layers.{i}.mixer.{n}" for i in (0, 1) for n in MIXER_LINEARS}


# xLSTM (transformers' own): a ~3 s parse of the proxy: nightly
@pytest.mark.slow
def test_xlstm_mlstm_layer_is_one_mixer_with_its_projections(parse_model):
    """hf:xlstm's mLSTM layer is the `linear_attention.other` block: its q, k, v and gate
    projections and out projection inside it (default LoRA targets), the mLSTM cell
    (`mlstm_backend`) taken into it, no `mlp.dense` but each block's `ffn` (`LF LF`)."""
    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.train.lora import default_targets

    g = parse_model("hf:xlstm")
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "LF LF"
    layer = "backbone.blocks.0.mlstm_layer"
    assert by[layer].kind == "linear_attention.other"
    assert f"{layer}.mlstm_backend" not in by
    assert by[layer].attrs["core_module"] == "mlstm_backend"  # the generate stage's kernel target
    assert by["backbone.blocks.0.ffn"].kind == "mlp.dense"
    linears = ["q", "k", "v", "ogate_preact", "igate_preact", "fgate_preact", "out_proj"]
    loaded = load_model("hf:xlstm")
    targets = default_targets(loaded.build(load_stage(loaded).proxy_config, seed=0), g)
    assert {t for t in targets if t.startswith(layer + ".")} == {f"{layer}.{n}" for n in linears}
