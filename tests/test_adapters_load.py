"""Adapters that `onboard train` exports load with PEFT and give the trained model's logits.

A one-process run (the reference role, which exports when it is the only process; what
`onboard train --nproc 1` starts, run here in the test's process) trains two steps on the CPU; then the exported adapters are loaded as a user would, onto the base the
export names (``base_model_name_or_path``), and their logits compared in fp32 with the logits
the trained model itself gave on the probe tokens (``onboard_probe.safetensors``).
"""

from __future__ import annotations

import json

import pytest
import torch

from onboarding.train.config import TrainConfig
from onboarding.train.peft_export import PROBE_FILE

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, same ops in the same order: only summation order differs


def _train(tmp_path, graph, model: str, **kw) -> TrainConfig:
    from onboarding.train.worker import run

    graph.save(tmp_path / "opgraph.json")  # the session's parse (setup's seq and seed): no export
    cfg = TrainConfig(model=model, out=str(tmp_path), steps=2, seq_len=16, micro_batch=1,
                      lora_rank=4, lora_alpha=8.0, lr=1e-2, **kw)
    stamp = (tmp_path / "opgraph.json").stat().st_mtime_ns
    run(cfg, "reference")
    assert (tmp_path / "opgraph.json").stat().st_mtime_ns == stamp  # it was not parsed again
    return cfg


def _probe(adapter):
    from safetensors.torch import load_file

    probe = load_file(str(adapter / PROBE_FILE))
    return probe["input_ids"], probe["logits"]


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids, use_cache=False).logits


def _check_loads(adapter, *, remote_code: bool):
    """Both PEFT loaders give the trained logits; the base alone does not."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["task_type"] == "CAUSAL_LM"
    ids, trained = _probe(adapter)
    auto = AutoPeftModelForCausalLM.from_pretrained(str(adapter), trust_remote_code=remote_code)
    torch.testing.assert_close(_logits(auto, ids), trained, **TOL)
    base = AutoModelForCausalLM.from_pretrained(conf["base_model_name_or_path"],
                                                trust_remote_code=remote_code)
    assert not torch.allclose(_logits(base, ids), trained, atol=1e-4)  # the adapters matter
    peft = PeftModel.from_pretrained(base, str(adapter))
    torch.testing.assert_close(_logits(peft, ids), trained, **TOL)
    return conf, auto


def test_example_adapter_loads_onto_the_repo(tmp_path, parse_model):
    """tiny_dense: the proxy is the example itself with its shipped weights, so the adapters
    name the example's folder as their base; generate() runs through PEFT."""
    _train(tmp_path, parse_model("tiny_dense"), "tiny_dense")
    adapter = tmp_path / "train" / "adapter"
    conf, auto = _check_loads(adapter, remote_code=True)
    assert conf["base_model_name_or_path"].endswith("examples/tiny_dense")
    assert json.loads((adapter / "onboard_adapter.json").read_text())["base"]["saved"] is False
    ids, _ = _probe(adapter)
    gen = auto.generate(input_ids=ids[:, :4], max_new_tokens=3, do_sample=False)
    x = ids[:, :4]
    for _ in range(3):  # greedy by hand: generate() must not cut the prefix (no KV cache)
        x = torch.cat([x, _logits(auto, x)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen, x)


@pytest.mark.parametrize("model,kw", [
    # remote code: gated delta + sparse attention + MoE; slow: its export (~15-60 s) unless an
    # earlier test of the session parsed it
    pytest.param("onboard_hybrid", {"expert_lora": True}, marks=pytest.mark.slow),
    ("hf:qwen3_moe", {"expert_lora": True}),  # transformers' own MoE
])
def test_trained_proxy_adapter_loads_with_its_saved_base(tmp_path, parse_model, model, kw):
    """A seeded proxy exists nowhere else: the export saves it under train/base/ (with the
    model's code) and the adapters, expert ones included, load onto it."""
    cfg = _train(tmp_path, parse_model(model), model, **kw)
    adapter = tmp_path / "train" / "adapter"
    conf, _ = _check_loads(adapter, remote_code=model != "hf:qwen3_moe")
    assert conf["base_model_name_or_path"] == str((tmp_path / "train" / "base").resolve())
    assert conf["target_parameters"]  # the experts' adapters are in the export
    record = json.loads((adapter / "onboard_adapter.json").read_text())
    assert record["base"]["saved"] and record["model"] == cfg.model
