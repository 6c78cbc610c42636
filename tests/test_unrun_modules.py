"""Modules inside a layer that ran which ran no op themselves (a modality's branch that text
tokens never reach) are uncovered blocks, not left out of the graph and coverage."""


def test_a_modality_branch_that_never_runs_is_an_uncovered_block(parse_model):
    """ERNIE 4.5 VL's MoE layers hold text_moe and vision_moe, of one class; text tokens run
    text_moe alone. vision_moe (half the routed experts) was in no block: map said uncovered 0
    and align passed without it."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/modality_routed_models.py:modality_routed")
    unknown = g.by_kind("unknown")
    assert [(b.path, b.layer) for b in unknown] == [("layers.0.mlp.vision_mlp", 0),
                                                   ("layers.1.mlp.vision_mlp", 1)]
    assert "ran no op" in unknown[0].attrs["not_run"]
    assert "text_mlp" in unknown[0].attrs["not_run"]
    assert set(unknown[0].params) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    cov = build_coverage(g)
    why = [e.reason for e in cov.entries
           if e.path == "layers.0.mlp.vision_mlp" and e.status == "uncovered"]
    assert len(why) == 1 and "ran no op" in why[0]
    # the branch that ran is classified as before, once per layer
    assert {b.path for b in g.by_kind("mlp.dense")} == {"layers.0.mlp.text_mlp",
                                                       "layers.1.mlp.text_mlp"}


def test_modules_that_all_run_add_no_unknown_block(parse_model):
    g = parse_model("tests/fixtures/multimodal_structure_models.py:padded")
    assert g.by_kind("unknown") == []
