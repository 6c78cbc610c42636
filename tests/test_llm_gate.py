"""The LLM path's gate on real answers for a real uncovered block: the mLSTM cell of hf:xlstm
(a tiny config), each broken or cheating variant of the recorded Triton family rejected at the
right stage for the right reason (the correct one is accepted end to end in test_llm_run.py).
The answers are in tests/fixtures/llm_cassettes, served by the replay server on 127.0.0.1;
Triton runs in the interpreter."""

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


SLOW = pytest.mark.slow


# Slow (nightly) but the out-of-bounds row (10 s): the rejection only the interpreter's bounds check
# makes (without it that answer is accepted: its numbers are right).
@pytest.mark.parametrize("cassette, stage, why", [
    pytest.param("mlstm_numerics_off", "numerics", "rel_rms", marks=SLOW),
    pytest.param("mlstm_hidden_reference", "runtime", "torch ops do the work outside Triton kernels", marks=SLOW),
    pytest.param("mlstm_cached", "runtime", "module-level state written during calls: _SEEN", marks=SLOW),
    pytest.param("mlstm_module_cache", "runtime", "wrote attribute(s) _last of the block module", marks=SLOW),
    pytest.param("mlstm_example_shape", "numerics", "batch 3", marks=SLOW),
    pytest.param("mlstm_out_of_bounds", "runtime", "out-of-bounds load in Triton kernel mlstm_fwd_kernel"),
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
