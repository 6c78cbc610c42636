"""After alignment leaves a family out: the retry's prompt says how it failed (the measured errors,
their bars, the shapes and dtypes: `onboarding.generate.retry`).

The alignment failure is recorded (`tests/fixtures/alignment_failure.json`: its ``recorded`` key
says how): the tiny CumLM's norms patched with the rmsnorm kernel, one of them made 5% wrong."""

from __future__ import annotations

import json
from pathlib import Path

from onboarding.coverage import Coverage, CoverageEntry
from onboarding.graph.opgraph import Block, OpGraph, TensorMeta

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NORM = "layers.0.norm"
PARAMS = {"activation": "silu", "eps": 1e-06, "has_weight": True, "unit_offset": False}


def _recorded() -> dict:
    return json.loads((FIXTURES / "alignment_failure.json").read_text())


def _norm(path: str) -> Block:
    return Block(path=path, kind="norm.rms", layer=0, class_name="RMSNorm",
                 op_histogram={"add": 1, "mean": 1, "mul": 2, "pow": 1, "rsqrt": 1},
                 inputs=[TensorMeta(shape=[1, 16, 16], dtype="float32")],
                 outputs=[TensorMeta(shape=[1, 16, 16], dtype="float32")],
                 params={"weight": [16]},
                 attrs={"dim": 16, "eps": 1e-06, "unit_offset": False, "has_weight": True},
                 flops=816, bytes=7616)


def _graph(paths: list[str]) -> OpGraph:
    return OpGraph(model="m", capture="export", capture_note="", batch=1, seq=16,
                   dtype="float32", blocks=[_norm(p) for p in paths], layer_pattern="",
                   layer_kinds=[], param_counts={}, total_flops=0)


def _coverage(paths: list[str]) -> Coverage:
    return Coverage(model="m", entries=[
        CoverageEntry(path=p, kind="norm.rms", op="rmsnorm", status="template", family="rmsnorm",
                      variant="plain", params=dict(PARAMS), shapes=[[1, 16, 16]],
                      dtype="float32", reason="rmsnorm/plain matches it") for p in paths])


# -- 1. the retry prompt carries the numbers ---------------------------------------------------

def test_the_retry_prompt_says_what_alignment_measured_against_which_bar():
    """A block whose family alignment left out is asked again with the failure's numbers: per
    failing direction each measured relative RMS error and its bar, the block's shapes and the
    dtypes, alignment's message. Before, the prompt said only "left out after alignment
    attempt 1"."""
    from onboarding.generate.llm.prompt import task_prompt
    from onboarding.generate.tasks import build_tasks

    rec = _recorded()
    row = next(b for b in rec["blocks"] if b["path"] == NORM)
    (task,) = build_tasks(graph=_graph([NORM]), coverage=_coverage([NORM]), full_size=False,
                          failed={NORM: "rmsnorm: left out after alignment attempt 1"},
                          alignment=rec)
    assert task.failed_family == "rmsnorm" and task.alignment_failure["failing"]
    prompt = task_prompt(task)
    section = prompt[prompt.index("## How the family that served it failed alignment"):
                     prompt.index("## Its source")]
    bar = row["tolerance"]["max_rel_rms"]
    for d, field in (("fwd", "output"), ("fwd", "local"), ("bwd", "output"), ("bwd", "params")):
        assert f"rel_rms {row[d][field]['rel_rms']:.2e} > bar {bar:.2e}" in section, (d, field)
    assert "forward: fail" in section and "backward: fail" in section
    assert "float32, against the eager model in float64" in section
    assert "inputs [1, 16, 16] float32 -> outputs [1, 16, 16] float32" in section
    assert row["fwd"]["message"][:80] in section
    assert f"logits: rel_rms {rec['logits']['stats']['rel_rms']:.2e}" in section
    # a first-pass task (no family failed) has no such section
    (first,) = build_tasks(graph=_graph([NORM]), coverage=Coverage(model="m", entries=[
        CoverageEntry(path=NORM, kind="norm.rms", op="rmsnorm", status="uncovered")]),
        full_size=False, alignment=rec)
    assert not first.alignment_failure and "## How the family" not in task_prompt(first)


def test_the_failure_in_the_prompt_is_bounded():
    """Many failing blocks inside the left-out one, with long messages: the first few are
    listed (culprit first) and the rest counted; messages are cut."""
    from onboarding.generate.retry import MAX_BLOCKS, MAX_MESSAGE, alignment_failure, prompt_lines

    rec = _recorded()
    row = next(b for b in rec["blocks"] if b["path"] == NORM)
    inner = [f"{NORM}.part{i}" for i in range(10)]
    rec["blocks"] += [{**row, "path": p, "fwd": {**row["fwd"], "message": "x" * 5000}}
                      for p in inner]
    rec["forward_order"] = [*reversed(inner), NORM]
    failure = alignment_failure(rec, NORM, "rmsnorm")
    assert [f["block"] for f in failure["failing"]] == [*reversed(inner)][:MAX_BLOCKS]
    assert failure["more_failing_blocks"] == len(inner) + 1 - MAX_BLOCKS
    text = "\n".join(prompt_lines(failure, "rmsnorm"))
    assert "and 7 more failing blocks" in text and "x" * (MAX_MESSAGE + 1) not in text
    assert len(text) < 8000


def test_a_retry_task_reads_the_runs_alignment(tmp_path, monkeypatch):
    """`run_decide` on a retry gives its tasks what the run's alignment.json measured."""
    import onboarding.generate.decide as decide_mod
    from onboarding.stages import run_decide

    (tmp_path / "alignment.json").write_text(json.dumps(_recorded()))
    seen = []
    monkeypatch.setattr(decide_mod, "decide", lambda tasks, *a, **k: seen.extend(tasks) or [])
    run_decide(None, _graph([NORM]), _coverage([NORM]), tmp_path, earlier=[],
               failed={NORM: "rmsnorm: left out after alignment attempt 1"})
    (task,) = seen
    assert task.alignment_failure["failing"][0]["block"] == NORM
