"""The report's operator-graph section tells blocks that never ran in the proxy's forward (a layer
or branch taken only for inputs the run did not give: `parse.unrun_layers`) from unknown blocks
whose ops no rule explains."""

from onboarding.graph.opgraph import Block, OpGraph
from onboarding.report import _opgraph_section


def _graph(blocks: list[Block]) -> OpGraph:
    return OpGraph(model="toy", capture="dispatch", capture_note="", batch=1, seq=8, dtype="float32",
                   blocks=blocks, layer_pattern="A?", layer_kinds=[], param_counts={}, total_flops=0)


def test_a_block_that_never_ran_is_not_called_unexplained(tmp_path):
    why = "ran no op in the proxy's forward while 3 of the 4 layers of model.layers did"
    blocks = [Block(path="model.layers.0.self_attn", kind="attention.full", layer=0, class_name="Attn"),
              Block(path="model.layers.1", kind="unknown", layer=1, class_name="CrossLayer",
                    attrs={"not_run": why}),
              Block(path="model.layers.2.mixer", kind="unknown", layer=2, class_name="Odd")]
    _graph(blocks).save(tmp_path / "opgraph.json")
    text = _opgraph_section(tmp_path)
    assert "**1 unknown blocks** (no rule explains them): `model.layers.2.mixer`" in text
    assert "**1 blocks never ran** in the proxy's forward" in text
    never = text.split("never ran", 1)[1]
    assert "`model.layers.1`" in never and "model.layers.2.mixer" not in never


def test_only_unrun_blocks_say_no_rule_nothing(tmp_path):
    blocks = [Block(path="model.layers.1", kind="unknown", layer=1, class_name="CrossLayer",
                    attrs={"not_run": "ran no op"})]
    _graph(blocks).save(tmp_path / "opgraph.json")
    text = _opgraph_section(tmp_path)
    assert "no rule explains" not in text and "**1 blocks never ran**" in text
