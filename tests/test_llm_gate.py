"""The LLM path's gate on real answers for a real uncovered block: the mLSTM cell of hf:xlstm
(a tiny config), each recorded answer accepted or rejected for the right reason. The answers
are in tests/fixtures/llm_cassettes (a correct Triton family, and broken or cheating variants
of it), served by the replay server on 127.0.0.1; the block check runs in a subprocess with
Triton in the interpreter."""

from __future__ import annotations

import json

import pytest

from fixtures.llm_replay import ReplayServer
from onboarding.generate.llm import LLMClient, LLMConfig, propose
from onboarding.generate.tasks import KernelTask
from onboarding.load.spec import ModelSpec

# two heads of DK 8 / DV 16, chunks of 4: seq 8 runs the chunkwise path, 5 the chunk + step path
SPEC = ModelSpec(ref="hf:xlstm", overrides={"num_heads": 2, "hidden_size": 32, "embedding_dim": 32,
                                             "num_blocks": 1, "num_hidden_layers": 1, "chunk_size": 4,
                                             "vocab_size": 64})
TASK = KernelTask(path="backbone.blocks.0.mlstm_layer.mlstm_backend", kind="linear_attention.other",
                  reason="no family matches this block yet", op="linear-attention recurrence",
                  class_name="xLSTMBackend", batch=1, seq=8, source_note="not included in this test",
                  op_histogram={"cumsum": 1, "exp": 5, "log_sigmoid": 1, "matmul": 5, "tril": 1})
SIZES = [[1, 8], [1, 8], [1, 5], [3, 5]]


def _run(tmp_path, cassette: str, attempts: int = 1, in_process: bool = False):
    with ReplayServer([cassette]) as server:
        client = LLMClient(LLMConfig(url=server.url, model="replay-coder", timeout_s=30))
        return propose(TASK, client, attempts=attempts, run_dir=tmp_path, spec=SPEC, sizes=SIZES,
                       gate_timeout_s=600, check_in_process=in_process)


@pytest.mark.slow
def test_correct_kernel_is_accepted_as_a_family_folder(tmp_path):
    out = _run(tmp_path, "fix_after_feedback", attempts=2)
    assert out.accepted, out.reason
    assert [a.verdict for a in out.attempts] == ["rejected", "accepted"]
    folder = tmp_path / "generated" / "families" / "mlstm_recurrent"
    assert out.folder == str(folder)
    assert {p.name for p in folder.iterdir()} >= {"family.py", "binding.py", "spec.json", "reference.py",
                                                   "mlstm_recurrent.py.j2", "gate.json"}
    gate = json.loads((folder / "gate.json").read_text())
    check = gate["details"]["check"]
    assert check["passed"] and [(s["batch"], s["seq"]) for s in check["sizes"]] == [tuple(s) for s in SIZES]
    record = check["artifacts"]["fp32"]
    assert record["launches"] >= 8 and not record["forbidden"] and not record["state_changes"]
    assert set(record["kernels"]) == {"mlstm_fwd_kernel", "mlstm_bwd_kernel"}
    assert record["reference"]["checked"] and not record["reference"]["reason"]
    assert all(r["ok"] for r in gate["details"]["aot"])
    # the folder loads like any plug-in family and serves blocks of the task's structure
    from onboarding.families import add_dirs, get_family, reset
    from onboarding.graph.opgraph import Block

    try:
        add_dirs([folder.parent])
        spec = get_family("mlstm_recurrent")
        block = Block(path="x", kind=TASK.kind, layer=0, class_name="Anything",
                      op_histogram=dict(TASK.op_histogram), attrs={})
        assert spec.match(block) == {"variant": "plain", "params": {"chunk": 16}}
        assert spec.match(Block(path="x", kind="norm.rms", layer=0, class_name="", attrs={})) is None
    finally:
        from onboarding.families import discover

        discover._EXTRA_DIRS.remove(folder.parent.resolve())
        reset()


@pytest.mark.slow
@pytest.mark.parametrize("cassette, stage, why", [
    ("mlstm_numerics_off", "numerics", "rel_rms"),
    ("mlstm_hidden_reference", "runtime", "torch ops do the work outside Triton kernels"),
    ("mlstm_cached", "runtime", "module-level state written during calls: _SEEN"),
    ("mlstm_example_shape", "numerics", "batch 3"),
])
def test_broken_or_cheating_kernel_is_rejected_for_the_right_reason(tmp_path, cassette, stage, why):
    # the block check in this process (the subprocess path is the accepted kernel's test's)
    out = _run(tmp_path, cassette, in_process=True)
    assert not out.accepted and len(out.attempts) == 1
    att = out.attempts[0]
    assert att.stage == stage and why in att.reason, att.reason
    assert not (tmp_path / "generated" / "families").exists()
    verdict = json.loads((tmp_path / "generated" / "llm" / TASK.path / "attempt-1" / "verdict.json").read_text())
    assert verdict["stage"] == stage and verdict["details"]["static"]["ok"]
