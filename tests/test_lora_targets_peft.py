"""LoRA targets the PEFT baseline accepts (issue 34): a Mamba mixer's auto targets leave out its
output projection (PEFT refuses it), found by structure; explicit targets PEFT refuses fail
before any run directory exists; a transformer MoE's auto targets are unchanged."""

from __future__ import annotations

import json

import pytest

from onboarding.cli.main import main
from onboarding.errors import InputError
from onboarding.train.config import TrainConfig


def _linears(model):
    from torch import nn

    return {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    from onboarding.train.setup import build

    return build(TrainConfig(model="hf:mamba", out=str(tmp_path_factory.mktemp("mamba"))))


@pytest.fixture
def small_data(tmp_path):
    f = tmp_path / "data.jsonl"
    rows = [{"prompt": f"Return item {i} squared.", "response": f"def f(x):\n    return x * x + {i}\n"}
            for i in range(100)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_mamba_auto_targets_leave_out_the_mixer_output_and_peft_takes_them(mamba):
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from onboarding.train.lora import check_peft_accepts, default_targets, scan_mixer_outputs

    model, graph = mamba.model, mamba.graph
    mixers = [b.path for b in graph.blocks if b.kind == "linear_attention.mamba"]
    assert mixers
    targets = default_targets(model, graph)
    assert {t.rsplit(".", 1)[-1] for t in targets} == {"in_proj", "x_proj", "dt_proj"}
    assert len(targets) == 3 * len(mixers)
    assert scan_mixer_outputs(graph, _linears(model)) == \
        {f"{m}.out_proj" for m in mixers}
    # the memory plan counts the same adapters (one rule: mixer_output_names)
    from onboarding.plan.shapes import model_shape

    shape = model_shape(model, mamba.info.proxy_config, graph)
    planned = [b for b in shape.blocks if b.kind == "linear_attention.mamba" and not b.nested]
    assert planned and sum(b.count * len(b.lora_targets) for b in planned) == len(targets)
    build = lambda: mamba.info.loaded.build(mamba.info.proxy_config, device="meta", seed=None)
    check_peft_accepts(build, targets, rank=4, alpha=8.0)  # no refusal
    with pytest.raises(InputError, match=r"refuses LoRA on out_proj \(2 modules, e\.g\. "
                                         r"backbone\.layers\.0\.mixer\.out_proj\)"):
        check_peft_accepts(build, targets + [f"{m}.out_proj" for m in mixers], rank=4, alpha=8.0)
    # PEFT itself on the real model: the adapters go in and the model still runs
    import copy

    peft_model = copy.deepcopy(model)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets), peft_model)
    assert sum("lora_A" in n for n, _ in peft_model.named_parameters()) == len(targets)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(peft_model(input_ids=ids).logits).all()


def test_transformer_moe_auto_targets_unchanged(tmp_path):
    from onboarding.train.lora import default_targets, scan_mixer_outputs
    from onboarding.train.setup import build

    b = build(TrainConfig(model="hf:qwen3_moe", out=str(tmp_path)))
    targets = default_targets(b.model, b.graph)
    assert {".".join(t.split(".")[-2:]) for t in targets} == \
        {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert not scan_mixer_outputs(b.graph, _linears(b.model))


def test_baseline_refused_targets_exit_2_and_leave_nothing(tmp_path, monkeypatch, capsys,
                                                           small_data):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    rc = main(["train", "hf:mamba", "--device", "cpu", "--steps", "2", "--seq", "32",
               "--data", str(small_data), "--baseline", "--lora-targets", "in_proj,out_proj",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error:") and "refuses LoRA on out_proj" in err \
        and "in_proj" not in err.split("PEFT says")[0]
    assert not out.exists() and not (tmp_path / "runs").exists()
    # without the baseline the same targets are ours to train: the check passes
    from onboarding.train.launch import check

    check(TrainConfig(model="hf:mamba", device="cpu", seq_len=32, data=str(small_data),
                      lora_targets=["in_proj", "out_proj"]))
