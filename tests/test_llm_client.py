"""The LLM path without the kernel check: the replay server, the client's failures (each a typed,
recorded reason), the answer contract, the static anti-cheat check and the runtime monitor.
No network: an OpenAI-compatible server on 127.0.0.1 replays recorded answers, max_retries=0."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
import triton
import triton.language as tl

from fixtures.llm_replay import ReplayServer, answer_from_folder
from onboarding.generate.llm import AnswerError, LLMClient, LLMConfig, LLMError, parse_answer, propose
from onboarding.generate.llm.contract import response_format
from onboarding.generate.llm.runtime import Monitor
from onboarding.generate.llm.static import check_source
from onboarding.generate.tasks import KernelTask
from onboarding.load.spec import ModelSpec

TASK = KernelTask(path="backbone.blocks.0.mlstm_layer.mlstm_backend", kind="linear_attention.other",
                  reason="no family matches this block yet", op="linear-attention recurrence",
                  class_name="xLSTMBackend", op_histogram={"cumsum": 1, "exp": 5, "matmul": 5},
                  batch=1, seq=16, source_note="not included in this test")
SPEC = ModelSpec(ref="hf:xlstm")  # never built here: every scenario ends before the block check
MESSAGES = [{"role": "user", "content": "xLSTMBackend"}]


def _client(server: ReplayServer, model: str = "replay-coder", timeout: float = 5.0) -> LLMClient:
    return LLMClient(LLMConfig(url=server.url, model=model, timeout_s=timeout))


def _propose(tmp_path: Path, cassette: str, attempts: int = 1, **kw):
    with ReplayServer([cassette]) as server:
        out = propose(TASK, _client(server, **kw), attempts=attempts, run_dir=tmp_path, spec=SPEC)
    return out, server


def test_client_is_openai_with_no_retries():
    client = LLMClient(LLMConfig(url="http://127.0.0.1:9", model="m", timeout_s=3))
    assert isinstance(client._client, openai.OpenAI)
    assert client._client.max_retries == 0 and client.config.base_url == "http://127.0.0.1:9/v1"


def test_models_endpoint_and_structured_output():
    with ReplayServer(["mlstm_correct"]) as server:
        models = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).models.list()
        reply = _client(server).complete(MESSAGES, response_format())
    assert [m.id for m in models.data] == ["replay-coder"]
    assert reply.mode == "json_schema" and not reply.fallbacks
    assert server.requests[0]["response_format"] == "json_schema"
    assert parse_answer(reply.text).family == "mlstm_recurrent"


def test_model_name_from_the_server_when_not_given():
    with ReplayServer(["mlstm_correct"]) as server:
        client = LLMClient(LLMConfig(url=server.url + "/v1/", timeout_s=5))
        reply = client.complete(MESSAGES, response_format())
    assert client.config.model == "replay-coder" and reply.model == "replay-coder"


def test_falls_back_when_structured_output_is_refused():
    with ReplayServer(["no_structured_output"]) as server:
        client = _client(server)
        reply = client.complete(MESSAGES, response_format())
        again = client.complete(MESSAGES, response_format())
    assert reply.mode == "json_object" and "json_schema" in reply.fallbacks[0]
    assert again.mode == "json_object" and not again.fallbacks  # remembered
    assert [r["response_format"] for r in server.requests] == ["json_schema", "json_object", "json_object"]
    parse_answer(reply.text)


def test_malformed_json_goes_back_to_the_model(tmp_path):
    out, server = _propose(tmp_path, "malformed_json", attempts=2)
    assert not out.accepted and [a.stage for a in out.attempts] == ["parse", "parse"]
    assert out.attempts[0].reason.startswith("malformed JSON")
    assert "malformed JSON" in server.requests[1]["messages"][-1]["content"]
    run = tmp_path / "generated" / "llm" / TASK.path
    assert (run / "attempt-1" / "answer.txt").read_text().startswith('{"family"')
    summary = json.loads((run / "summary.json").read_text())
    assert summary["attempts"][1]["prompt_hash"] != summary["attempts"][0]["prompt_hash"]


def test_empty_answer(tmp_path):
    out, _ = _propose(tmp_path, "empty_answer")
    assert not out.accepted and out.attempts[0].stage == "empty"
    assert "empty answer" in out.reason


def test_timeout(tmp_path):
    out, _ = _propose(tmp_path, "timeout", timeout=1.0)
    assert not out.accepted and out.attempts[0].stage == "timeout"
    assert "no reply within 1 s" in out.reason


def test_http_500_is_retried_within_the_bound(tmp_path):
    out, server = _propose(tmp_path, "http_500", attempts=2)
    assert [a.stage for a in out.attempts] == ["http", "http"] and len(server.requests) == 2
    assert "HTTP 500" in out.reason


def test_wrong_model_name_is_not_retried(tmp_path):
    out, server = _propose(tmp_path, "mlstm_correct", attempts=3, model="no-such-model")
    assert len(out.attempts) == 1 and out.attempts[0].stage == "model_not_found"
    assert "'no-such-model' not found" in out.reason and len(server.requests) == 1


def test_unreachable_server_and_spent_budget_end_the_attempts(tmp_path):
    client = LLMClient(LLMConfig(url="http://127.0.0.1:9", model="m", timeout_s=3))
    out = propose(TASK, client, attempts=3, run_dir=tmp_path / "a", spec=SPEC)
    assert len(out.attempts) == 1 and out.attempts[0].stage == "connection"
    out = propose(TASK, client, attempts=3, budget_s=0, run_dir=tmp_path / "b", spec=SPEC)
    assert not out.attempts and "budget of 0 s spent after 0 attempt(s)" in out.reason


def test_a_family_name_taken_by_another_block_goes_back(tmp_path):
    other = tmp_path / "generated" / "families" / "mlstm_recurrent"
    other.mkdir(parents=True)
    (other / "spec.json").write_text(json.dumps({"written_for": {"path": "model.mixer", "kind": "x", "key": "k"}}))
    out, _ = _propose(tmp_path, "mlstm_correct")
    assert out.attempts[0].stage == "folder" and "taken by the generated family for model.mixer" in out.reason


def test_the_name_alignment_left_out_goes_back(tmp_path, monkeypatch):
    """A retry's answer named as the family alignment left out at this block goes back before
    the gate: alignment's exclusions go by (block, family name), so it would be left out too."""
    import dataclasses

    import onboarding.generate.llm.attempts as attempts_mod

    monkeypatch.setattr(attempts_mod, "gate", lambda *a, **k: pytest.fail("gated"))
    task = dataclasses.replace(TASK, failed_family="mlstm_recurrent")
    with ReplayServer(["mlstm_correct"]) as server:
        out = propose(task, _client(server), attempts=1, run_dir=tmp_path, spec=SPEC)
    assert out.attempts[0].stage == "folder"
    assert "'mlstm_recurrent' is the family alignment left out at this block" in out.reason


def test_static_check_rejects_a_call_of_the_eager_block(tmp_path):
    out, _ = _propose(tmp_path, "mlstm_calls_eager")
    assert not out.accepted and out.attempts[0].stage == "static"
    assert "anti-cheat (static)" in out.reason and "transformers" in out.reason
    assert not (tmp_path / "generated" / "families").exists()


def _answer(**changes) -> str:
    data = json.loads(answer_from_folder("families/mlstm_recurrent"))
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize("text, why", [
    (_answer(extra=1), "unknown key 'extra'"),
    (json.dumps({k: v for k, v in json.loads(_answer()).items() if k != "reference"}), "missing key 'reference'"),
    (_answer(family="MLSTM-cell"), "not a lowercase identifier"),
    (_answer(default_config=[{"key": "num_warps", "value": 3}, {"key": "BLOCK_H", "value": 1}]), "not in the tuning space"),
    (_answer(reference="def ref(module):\n    pass\n"), "named reference"),
    ("[1, 2]", "must be a JSON object"),
], ids=["unknown-key", "missing-key", "bad-name", "config-outside-space", "no-reference", "not-an-object"])
def test_contract_is_strict(text, why):
    with pytest.raises(AnswerError, match=why):
        parse_answer(text)


GOOD = '''
import torch, triton, triton.language as tl

@triton.jit
def k(p_x, p_y, N, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p_y + o, tl.exp(tl.load(p_x + o, mask=o < N)), mask=o < N)

def run(x):
    y = torch.empty_like(x)
    k[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return y

def block_forward(module, x):
    return run(x.contiguous()).view(x.shape)
'''


@pytest.mark.parametrize("edit, why", [
    (("return run(x.contiguous()).view(x.shape)", "return torch.exp(x)"), "calls torch.exp"),
    (("return run(x.contiguous()).view(x.shape)", "return x @ x"), "matrix product"),
    (("return run(x.contiguous()).view(x.shape)", "return run(x).sum()"), ".sum()"),
    (("return run(x.contiguous()).view(x.shape)", "return module(x)"), "calls the module itself"),
    (("def block_forward(module, x):\n    return run(x.contiguous()).view(x.shape)",
      "def reference(module, x):\n    return x\n\ndef block_forward(module, x):\n    run(x)\n"
      "    return reference(module, x)"), "reaches reference"),
    (("    k[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))\n", ""), "no @triton.jit kernel is launched"),
    (("def run(x):\n", "_C = {}\ndef run(x):\n    global _C\n"), "global _C"),
    (("import torch,", "import transformers, torch,"), "imports 'transformers'"),
    (("def run(x):", "@functools.lru_cache\ndef run(x):"), "lru_cache"),
    (("def block_forward", "T = [" + ", ".join(["1.0"] * 80) + "]\ndef block_forward"), "literal table"),
], ids=["torch-exp", "matmul", "sum", "module-call", "reference", "no-launch", "global", "transformers",
        "lru-cache", "table"])
def test_static_check(edit, why):
    assert check_source(GOOD).ok
    report = check_source(GOOD.replace(*edit))
    assert not report.ok and any(why in p for p in report.problems), report.problems


@triton.jit
def _double(p_x, p_y, N, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p_y + o, 2.0 * tl.load(p_x + o, mask=o < N), mask=o < N)


def test_monitor_counts_launches_records_torch_work_and_poisons():
    x = torch.randn(10)
    with Monitor() as mon:
        y = torch.empty_like(x)
        y0 = y.clone()
        _double[(1,)](x, y, 10, BLOCK=16)
        z = torch.softmax(x, 0) + y.view(2, 5).reshape(10)
    assert torch.isnan(y0).all() and torch.equal(y, 2 * x) and z.shape == (10,)
    assert mon.record.launches == 1 and mon.record.kernels == ["_double"]
    assert set(mon.record.forbidden) == {"_softmax", "add"} and "view" in mon.record.ops
    assert "empty_like" not in mon.record.forbidden


def test_bad_llm_url_is_an_input_error():
    from onboarding.errors import InputError

    with pytest.raises(InputError, match="OpenAI-compatible"):
        LLMConfig(url="127.0.0.1:8000")
