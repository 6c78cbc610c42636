"""Sibling MoE blocks of one class of which a forward runs one alone (ERNIE 4.5 VL's
text_moe / vision_moe: a token takes its modality's) are alternatives: a token's active
parameters and the plan's MoE layers count one per layer; the totals and weights count both."""

FIX = "tests/fixtures/modality_moe_models.py"


def _info(ref):
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage

    return load_stage(load_model(f"{FIX}:{ref}", trust_remote_code=True))


def _numel(model, prefix):
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))


def test_active_parameters_count_one_of_alternative_moe_blocks(parse_model):
    """Before: the vision MoE (which ran no op on text tokens) was counted too, as if every
    token took both (ERNIE 4.5 VL: 4.77B active where a text token uses ~4.13B)."""
    from onboarding.graph.parse import parse_stage

    info = _info("modality_moe")
    model = info.loaded.build(device="meta", seed=None)
    total = sum(p.numel() for p in model.parameters())
    assert info.full.total == total
    graph = parse_stage(info)
    # a text token: every dense parameter, the text router, top-2 of 4 text experts; no vision
    text_experts = sum(_numel(model, f"layers.{i}.mlp.text_moe.experts") for i in range(2))
    vision = sum(_numel(model, f"layers.{i}.mlp.vision_moe") for i in range(2))
    want = total - vision - text_experts // 2
    assert info.full.active == want
    assert graph.param_counts["full"]["active"] == want
    assert graph.param_counts["proxy"]["active"] == want  # the proxy is the fixture's size
    # the totals and the routed experts still count both
    assert info.full.total == total
    assert info.full.routed_experts == text_experts + sum(
        _numel(model, f"layers.{i}.mlp.vision_moe.experts") for i in range(2))
    note = info.full.alternatives_note
    assert "layers.*.mlp.text_moe (the largest)" in note and "layers.*.mlp.vision_moe" in note
    assert {m.path: m.alternative_to for m in info.full.moe} == {
        "layers.0.mlp.text_moe": "", "layers.0.mlp.vision_moe": "layers.0.mlp.text_moe",
        "layers.1.mlp.text_moe": "", "layers.1.mlp.vision_moe": "layers.1.mlp.text_moe"}


def test_moe_blocks_of_one_class_that_both_run_count_both(parse_model):
    """The same structure where every token runs both blocks: no block ran no op, so both
    count (the rule keys on what ran, not on siblings alone)."""
    from onboarding.graph.parse import parse_stage

    info = _info("two_moe")
    model = info.loaded.build(device="meta", seed=None)
    total = sum(p.numel() for p in model.parameters())
    parse_stage(info)
    routed = sum(_numel(model, f"layers.{i}.mlp.{b}.experts") for i in range(2)
                 for b in ("first", "second"))
    assert info.full.active == total - routed // 2
    assert info.full.alternatives_note == ""
    assert all(m.alternative_to == "" for m in info.full.moe)


def test_the_plan_counts_one_moe_layer_of_alternatives_in_its_all_to_all():
    """Before: the plan's experts held both patterns (4 MoE layers for 2 layers), so the
    all-to-all and the expert GEMMs were doubled (ERNIE 4.5 VL: 54 MoE layers, 29.7 GB a
    step where a token is sent 27 times). The weights still hold both."""
    import dataclasses

    from onboarding.graph.parse import parse_stage
    from onboarding.plan import ClusterConfig, PlanConfig, build_plan
    from onboarding.plan.estimate import communication, step_flops
    from onboarding.plan.memory import Layout, memory
    from onboarding.plan.shapes import model_shape

    info = _info("modality_moe")
    model = info.loaded.build(device="meta", seed=None)
    shape = model_shape(model, None, parse_stage(info, seq=12))
    assert sorted((e.pattern, e.count, e.alternative_to) for e in shape.experts) == [
        ("layers.*.mlp.text_moe.experts", 2, ""),
        ("layers.*.mlp.vision_moe.experts", 2, "layers.*.mlp.text_moe.experts")]
    assert [e.pattern for e in shape.routed_layers] == ["layers.*.mlp.text_moe.experts"]
    both = dataclasses.replace(shape, experts=[dataclasses.replace(e, alternative_to="")
                                               for e in shape.experts])
    cfg, cluster = PlanConfig(gpus=2, ep=2, seq=8), ClusterConfig()
    lay = Layout(ep=2, fsdp=1, recompute="none", offload="none")
    mem = memory(shape, cfg, lay, cluster)
    comm = communication(shape, cfg, lay, mem, cluster)
    assert comm.a2a_bytes == 2 * comm.a2a_layer_bytes  # one MoE layer per decoder layer
    assert communication(both, cfg, lay, mem, cluster).a2a_bytes == 4 * comm.a2a_layer_bytes
    # a token's expert GEMMs: the text experts' alone
    text = next(e for e in shape.experts if not e.alternative_to)
    assert step_flops(shape, cfg)[1] < step_flops(both, cfg)[1]
    assert step_flops(shape, cfg)[1] == step_flops(
        dataclasses.replace(shape, experts=[text]), cfg)[1]
    # the weights: both experts
    assert mem.weights_experts == memory(both, cfg, lay, cluster).weights_experts > memory(
        dataclasses.replace(shape, experts=[text]), cfg, lay, cluster).weights_experts
    plan = build_plan(shape, cfg, cluster)
    assert any("layers.*.mlp.text_moe.experts in each layer, not "
               "layers.*.mlp.vision_moe.experts" in n for n in plan.notes)
    assert plan.shape["experts"][1]["alternative_to"] == "layers.*.mlp.text_moe.experts"


def test_model_json_gives_the_active_parameters_the_parse_found(parse_model, tmp_path):
    """model.json is written before the parse (`save_model_json`), and the report reads a run's
    active parameters from it: after the parse finds alternatives it holds the parse's count."""
    from onboarding.stages import run_parse, save_model_json
    import json

    info = _info("modality_moe")
    save_model_json(info, tmp_path, {})
    before = json.loads((tmp_path / "model.json").read_text())["params"]["active"]
    run_parse(info, tmp_path)
    after = json.loads((tmp_path / "model.json").read_text())
    assert after["params"]["active"] == info.full.active < before
    assert after["params"]["alternatives_note"] == info.full.alternatives_note != ""


def test_the_report_says_which_alternative_the_active_count_takes(parse_model, tmp_path):
    from onboarding.report import _model_section
    from onboarding.stages import run_parse, save_model_json

    info = _info("modality_moe")
    save_model_json(info, tmp_path, {})
    run_parse(info, tmp_path)
    text = _model_section(tmp_path)
    assert f"{info.full.active:,}" in text
    assert "Active per token: MoE blocks a token takes one of" in text
