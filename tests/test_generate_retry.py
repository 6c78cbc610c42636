"""After alignment leaves a family out: the retry's prompt says how it failed (the measured errors,
their bars, the shapes and dtypes: `onboarding.generate.retry`), and the later stages spend
nothing on the left-out kernel (not checked again, not tuned) and say so.

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


# -- 1b. and the code of the left-out family, when the LLM path wrote it ------------------------

LEFT_OUT = "sparsemixer_router"  # a recorded LLM answer (tests/fixtures/llm_cassettes/families)


def _left_out_family(run_dir: Path) -> tuple[Path, str]:
    """The run's folder of LLM-written families, holding LEFT_OUT as the LLM path writes an
    accepted answer (`folder.write_folder`), and the answer's template."""
    from fixtures.llm_replay import answer_from_folder
    from onboarding.generate.llm import parse_answer
    from onboarding.generate.llm.folder import write_folder
    from onboarding.generate.tasks import KernelTask

    answer = parse_answer(answer_from_folder(f"families/{LEFT_OUT}"))
    root = run_dir / "generated" / "families"
    write_folder(answer, KernelTask(path=NORM, kind="norm.rms", reason="", op="rmsnorm"), root)
    return root, answer.template


def _retry_prompt(rec: dict, generated: Path) -> tuple[object, str]:
    from onboarding.generate.llm.prompt import task_prompt
    from onboarding.generate.tasks import build_tasks

    (task,) = build_tasks(graph=_graph([NORM]), coverage=_coverage([NORM]), full_size=False,
                          failed={NORM: f"{LEFT_OUT}: left out after alignment attempt 1"},
                          alignment=rec, generated=generated)
    return task, task_prompt(task)


def test_the_retry_prompt_shows_the_left_out_familys_code_and_asks_for_a_fix(tmp_path):
    """The family the LLM wrote and alignment left out is in the run: the retry's prompt shows
    its template, reference and spec fields after the failure's numbers, and since the block
    alone, on the reference's inputs, misses its bar (the recorded failure), asks for a fix
    rather than a new start, under a new name. Before, the prompt had no code of it: the model
    wrote the family again from nothing."""
    generated, template = _left_out_family(tmp_path)
    task, prompt = _retry_prompt(_recorded(), generated)
    assert [f["name"] for f in task.previous_family["files"]] == \
        [f"{LEFT_OUT}.py.j2", "reference.py", "spec.json"]
    head = "## The left-out family's code"
    assert prompt.index("## How the family that served it failed alignment") < \
        prompt.index(head) < prompt.index("## Its source")
    section = prompt[prompt.index(head):prompt.index("## Its source")]
    assert template.strip() in section  # whole: under the cap
    ref = (generated / LEFT_OUT / "reference.py").read_text()
    assert ref.strip() in section and '"written_for"' not in section
    assert json.dumps(json.loads((generated / LEFT_OUT / "spec.json").read_text())["summary"]) \
        in section
    assert f"misses a bar at `{NORM}` forward" in section and "rather than starting over" in section
    assert f"under a new family name: alignment leaves `{LEFT_OUT}` out" in section
    assert "the rest is cut" not in section


def test_the_left_out_code_is_cut_with_a_note_and_a_fix_is_asked_only_for_a_local_error(
        tmp_path, monkeypatch):
    """A template over the cap is cut, and its header says how much is shown; where the block
    alone, on the reference's inputs, stays within its bars (the error reached it from the blocks
    before it), the prompt does not ask to fix this code."""
    import onboarding.generate.retry as retry

    generated, template = _left_out_family(tmp_path)
    monkeypatch.setattr(retry, "MAX_TEMPLATE", 500)
    rec = _recorded()
    row = next(b for b in rec["blocks"] if b["path"] == NORM)
    for d in ("fwd", "bwd"):
        for q in ("local", "local_params"):
            if row[d].get(q):
                row[d][q]["rel_rms"] = 0.0
    _, prompt = _retry_prompt(rec, generated)
    section = prompt[prompt.index("## The left-out family's code"):prompt.index("## Its source")]
    assert f"--- {LEFT_OUT}.py.j2 (the first 500 of its {len(template)} characters; the rest " \
        "is cut)" in section
    assert template[:500].rstrip() in section and template[:501] not in section
    assert "rather than starting over" not in section
    assert "do not put the error in this code" in section


def test_a_first_pass_prompt_is_unchanged_by_the_runs_generated_families(tmp_path):
    """A first-pass task (no family left out) carries no earlier code even where the run holds
    LLM-written families, and its prompt is the one built without them: the recorded cassettes,
    which select a conversation by substrings of the first prompt, still select it."""
    from onboarding.generate.llm.prompt import task_prompt
    from onboarding.generate.tasks import build_tasks

    generated, _ = _left_out_family(tmp_path)
    cov = Coverage(model="m", entries=[
        CoverageEntry(path=NORM, kind="norm.rms", op="rmsnorm", status="uncovered")])
    (first,) = build_tasks(graph=_graph([NORM]), coverage=cov, full_size=False,
                           generated=generated)
    (bare,) = build_tasks(graph=_graph([NORM]), coverage=cov, full_size=False)
    assert first.previous_family == {} and task_prompt(first) == task_prompt(bare)
    assert "## The left-out family's code" not in task_prompt(first)


def test_a_retry_task_reads_the_runs_left_out_family(tmp_path, monkeypatch, families):
    """`run_decide` on a retry gives its task the code of the left-out family the run's LLM path
    wrote (``generated/families``). `run_decide` registers the run's generated families for the
    process: the `families` fixture puts the registry back, or the written family would claim
    other tests' norm blocks in the same worker."""
    import onboarding.generate.decide as decide_mod
    from onboarding.stages import run_decide

    _left_out_family(tmp_path)
    (tmp_path / "alignment.json").write_text(json.dumps(_recorded()))
    seen = []
    monkeypatch.setattr(decide_mod, "decide", lambda tasks, *a, **k: seen.extend(tasks) or [])
    run_decide(None, _graph([NORM]), _coverage([NORM]), tmp_path, earlier=[],
               failed={NORM: f"{LEFT_OUT}: left out after alignment attempt 1"})
    (task,) = seen
    assert task.previous_family["family"] == LEFT_OUT


# -- 2. a left-out kernel is neither checked again nor tuned -------------------------------------

def _run_dir(tmp_path: Path, paths: list[str], exclude=()) -> list:
    from onboarding.generate.candidates import render_candidates, save_candidates

    _graph(paths).save(tmp_path / "opgraph.json")
    cov = _coverage(paths)
    cov.save(tmp_path / "coverage.json")
    cands = render_candidates(cov, tmp_path / "candidates", exclude)
    for c in cands:  # plan_jobs reads only the verdict of generate's checks
        c.status = "passed" if c.status == "rendered" else c.status
    save_candidates(cands, tmp_path / "candidates.json")
    return cands


def test_a_left_out_kernel_is_not_in_the_tune_stages_work_list(tmp_path):
    """Alignment left rmsnorm out at one of the two norms it serves: the study tunes it for the
    other, and the notes say which was left out and not tuned. Before, the left-out block was
    in the study (and with every block left out, the kernel was still tuned)."""
    from onboarding.tune.run import LEFT_OUT_NOTE, plan_jobs

    paths = [NORM, "layers.1.norm"]
    _run_dir(tmp_path, paths)
    (job,) = plan_jobs(tmp_path)[0]
    assert job.blocks == paths
    (job,), notes = plan_jobs(tmp_path, exclude=[[NORM, "rmsnorm"]])
    assert job.blocks == ["layers.1.norm"]
    assert f"rmsnorm/plain at {NORM}: {LEFT_OUT_NOTE}" in notes
    jobs, notes = plan_jobs(tmp_path, exclude=[[p, "rmsnorm"] for p in paths])
    assert jobs == [] and f"rmsnorm/plain at {NORM}, layers.1.norm: {LEFT_OUT_NOTE}" in notes


def test_a_kernel_left_out_everywhere_is_not_checked_again_nor_tuned(tmp_path, monkeypatch):
    """The retry's generate stage renders a kernel left out at every block it serves but does not
    check it ("left_out"); the tune stage, even without the exclusions, skips it with a note, and
    the kernel PR does not propose it."""
    import onboarding.stages as stages
    from onboarding.tune.run import LEFT_OUT_NOTE, plan_jobs

    paths = [NORM, "layers.1.norm"]
    checked = []
    monkeypatch.setattr(stages, "check_candidate", lambda c, shapes: checked.append(c) or c)
    (cand,) = stages.run_generate(_coverage(paths), tmp_path,
                                  exclude=[[p, "rmsnorm"] for p in paths])
    assert checked == [] and cand.status == "left_out" and cand.blocks == paths
    assert Path(cand.path).is_file()  # rendered: the run's record of what was left out
    _graph(paths).save(tmp_path / "opgraph.json")
    _coverage(paths).save(tmp_path / "coverage.json")
    jobs, notes = plan_jobs(tmp_path)
    assert jobs == [] and any(n.endswith(LEFT_OUT_NOTE) for n in notes)
    assert not any("candidate left_out" in n for n in notes)
    # and `onboard pr` proposes nothing of it, saying why (not "failed its correctness check")
    from onboarding.pr.collect import collect

    proposal = collect(tmp_path)
    assert proposal.modules == []
    (why,) = [w for label, w in proposal.left_out if label.startswith("rmsnorm/")]
    assert why.startswith("left out after alignment") and NORM in why


def test_a_kernel_left_out_at_one_of_its_blocks_is_not_proposed(tmp_path):
    """Alignment left rmsnorm out at one of the two norms its one module serves (the same
    params, the same shapes): the other keeps it (alignment judged it there on its own inputs and
    it passed) and the tune stage still tunes it there, but `onboard pr` proposed the module, and
    a reviewed module serves every block of its family and params (`coverage.reviewed_kernels`),
    the block where it failed alignment included. The candidate records the blocks it was left
    out at, and the PR leaves it out, naming them."""
    from onboarding.generate.candidates import load_candidates
    from onboarding.pr.collect import collect

    paths = [NORM, "layers.1.norm"]
    (cand,) = _run_dir(tmp_path, paths, exclude=[[NORM, "rmsnorm"]])
    assert cand.status == "passed" and cand.blocks == ["layers.1.norm"]
    (kept,) = load_candidates(tmp_path / "candidates.json")
    assert kept.left_out_at == [NORM]
    proposal = collect(tmp_path)
    assert proposal.modules == []
    (why,) = [w for label, w in proposal.left_out if label.startswith("rmsnorm/")]
    assert why.startswith("left out after a failed alignment at") and NORM in why
    other = tmp_path / "other"  # a module no alignment left out anywhere is still proposed
    other.mkdir()
    _run_dir(other, paths)
    assert [m.blocks for m in collect(other).modules] == [paths]


def test_the_tune_node_leaves_out_what_alignment_left_out_and_says_so(tmp_path, monkeypatch):
    """The agent's tune node hands the run's exclusions to the tune stage; the run's summary
    line names the kernel left out and not tuned."""
    import onboarding.tune.run as tune_run_mod
    from agents.nodes import tune_node
    from agents.state import RunConfig, RunState
    from onboarding.cli.run import summary_lines
    from onboarding.tune.run import LEFT_OUT_NOTE, plan_jobs

    paths = [NORM, "layers.1.norm"]
    _run_dir(tmp_path, paths)
    planned = []

    def tune_run(run_dir, cfg, *, families=None, exclude=(), **kw):
        jobs, notes = plan_jobs(run_dir, families, exclude)
        planned.extend(jobs)
        return {"studies": [], "notes": notes, "seconds": 0.0}

    monkeypatch.setattr(tune_run_mod, "tune_run", tune_run)
    state = RunState(config=RunConfig(tune_trials=1), run_dir=str(tmp_path),
                     excluded_kernels=[[NORM, "rmsnorm"]])
    out = tune_node(state)
    assert [j.blocks for j in planned] == [["layers.1.norm"]]
    values = {**state.model_dump(), **out}
    (line,) = [t for s, t in summary_lines(values, tmp_path) if s == "tune"]
    assert f"rmsnorm/plain at {NORM}: {LEFT_OUT_NOTE}" in line
