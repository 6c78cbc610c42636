"""A block whose recurrence is a weightless module of its own (`core_module`: xLSTM's mLSTM cell
inside the layer that holds its q, k, v, gate and out projections) gets its kernel task at that
module: the task's module, source and boundary shapes are the core's, an LLM-written family or the
Inductor swap replaces the core's forward, the decision and coverage stay the block's (its
recurrence entry served, its projections' GEMMs on the torch path), and the PR candidates find
the LLM's record at the core. Our own fixture (`tests/fixtures/recurrent_cell_models.py`); the
end to end run on hf:xlstm is `tests/test_llm_run.py` (slow)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from onboarding.coverage import build_coverage
from onboarding.load.spec import ModelSpec

REF = "tests/fixtures/recurrent_cell_models.py:RecurrentCellLM"
BLOCKS = ["layers.0.mixer", "layers.1.mixer"]
CORES = [f"{b}.cell" for b in BLOCKS]
CORE, GEMM = "linear-attention recurrence", "projections (GEMM)"


@pytest.fixture(scope="module")
def graph(parse_model):
    return parse_model(REF, seq=12)


def _outcome(family: str):  # what `onboarding.generate.llm.propose` returns, as the loop reads it
    return SimpleNamespace(accepted=True, reason="", family=family, variant="plain",
                           folder=None, summary="", attempts=[object()])


def _check(calls: list[str]):
    from onboarding.generate.blockcheck import BlockVerdict

    def check(spec, path, run_dir, **kw):
        calls.append(path)
        return BlockVerdict(path=path, replacement="torch.compile (Inductor)", passed=True,
                            artifacts={"fp32": {"backend": "inductor"}})
    return check


def test_the_task_is_the_weightless_core_module(graph):
    """Before: the task was the whole mixer (its class and source, its 7 projections' weights,
    its boundary), so a kernel writer had to write the GEMMs too, and answers written for the
    cell's signature were rejected."""
    from onboarding.generate.llm.prompt import task_prompt
    from onboarding.generate.tasks import KernelTask, build_tasks, core_path

    by = {b.path: b for b in graph.blocks}
    assert [by[b].attrs["core_module"] for b in BLOCKS] == ["cell", "cell"]
    assert core_path(by[BLOCKS[0]]) == CORES[0] and core_path(by["layers.0.ffn"]) == "layers.0.ffn"
    tasks = build_tasks(graph=graph, coverage=build_coverage(graph), spec=ModelSpec(ref=REF),
                        full_size=False)
    assert [(t.path, t.block) for t in tasks] == list(zip(CORES, BLOCKS))
    t = tasks[0]
    assert t.class_name == "DecayCell" and "class DecayCell" in t.source
    assert "class CellMixer" not in t.source and t.params == {}
    qkv, gate = {"shape": [1, 4, 12, 8], "dtype": "float32"}, {"shape": [1, 4, 12], "dtype": "float32"}
    assert t.inputs == [qkv, qkv, qkv, gate, gate] and t.outputs == [qkv]
    # the structure is the block's: what its family serves, one problem for both layers
    assert t.kind == "linear_attention.other" and t.op_histogram == by[BLOCKS[0]].op_histogram
    assert tasks[1].key == t.key
    assert "inside block" in task_prompt(t) and BLOCKS[0] in task_prompt(t)
    assert KernelTask.from_dict(json.loads(json.dumps(t.to_dict()))) == t


@pytest.mark.parametrize("llm", [True, False])
def test_decided_at_the_core_keyed_by_the_block(graph, tmp_path, llm):
    """The LLM is asked for (or Inductor checks) the core; the decision is the block's and names
    the core; coverage serves the block's recurrence entry and keeps its GEMMs torch_fast (a
    whole-block family takes them: `test_a_generated_family_serves_every_op_of_its_block`); an
    Inductor swap replaces the core's forward and is recorded at the block."""
    from onboarding.generate.decide import apply_to_coverage, decide, swaps
    from onboarding.generate.tasks import build_tasks

    cov = build_coverage(graph)
    tasks = build_tasks(graph=graph, coverage=cov, full_size=False)
    asked, checked = [], []

    def propose(task, client, **kw):
        asked.append(task.path)
        return _outcome("cell_family")

    ds = decide(tasks, ModelSpec(ref=REF), tmp_path, graph=graph, check=_check(checked),
                client=object() if llm else None, propose=propose)
    decision = "generated" if llm else "inductor"
    assert [(d.path, d.core, d.decision) for d in ds] == [(b, c, decision)
                                                          for b, c in zip(BLOCKS, CORES)]
    assert ds[1].same_as == BLOCKS[0] and (asked, checked) == (([CORES[0]], []) if llm
                                                               else ([], [CORES[0]]))
    assert f"for {CORES[0]}" in ds[0].why()
    apply_to_coverage(cov, ds)
    mixer = [(e.op, e.status, e.family) for e in cov.entries if e.path == BLOCKS[0]]
    assert mixer == [(GEMM, "torch_fast", None),
                     (CORE, decision, "cell_family" if llm else None)]
    assert [(s.path, s.module) for s in swaps(ds)] == ([] if llm else list(zip(BLOCKS, CORES)))


def test_the_core_forward_is_replaced_the_record_is_the_blocks(graph):
    """A generated family's binding and an Inductor swap both replace the core module's forward
    (the family's block_forward gets the cell and the cell's arguments); the patch record is the
    block's, which alignment judges."""
    import torch

    from onboarding.generate.llm.folder import bind_block_forward
    from onboarding.load.model import load_model
    from onboarding.patching.core import BlockSwap, PatchRecord, PatchSet, swap_blocks

    model = load_model(REF).build(None, seed=0).eval()
    ids = torch.randint(0, 64, (1, 12))
    want = model(ids)
    block = next(b for b in graph.blocks if b.path == BLOCKS[0])
    seen = []

    def block_forward(module, *args, **kwargs):
        seen.append((type(module).__name__, len(args)))
        return type(module).forward(module, *args, **kwargs)

    record = PatchRecord(path=block.path, kind=block.kind, family="cell_family")
    undo = bind_block_forward(block, model.get_submodule(block.path),
                              [SimpleNamespace(block_forward=block_forward)], record, model)
    swapped = swap_blocks(model, [BlockSwap(path=BLOCKS[1], module=CORES[1], label="inductor",
                                            make=lambda m: m.forward)], PatchSet())
    torch.testing.assert_close(model(ids), want)
    assert seen and seen[0] == ("DecayCell", 5) and record.status == "active"
    assert record.binding == "block_forward(module.cell, *args, **kwargs)"
    assert [(r.path, r.status) for r in swapped.records] == [(BLOCKS[1], "active")]
    undo()
    swapped.restore()


def test_pr_candidates_read_the_llm_record_at_the_core(tmp_path):
    from onboarding.generate.decide import DECISIONS_FILE, Decision, Evidence, save_decisions
    from onboarding.generate.llm.attempts import block_dir
    from onboarding.generate.llm.review import pr_candidates

    folder = tmp_path / "generated" / "families" / "cell_family"
    folder.mkdir(parents=True)
    ds = [Decision(path=b, core=c, kind="linear_attention.other", op=CORE, key="k",
                   decision="generated", family="cell_family", folder=str(folder),
                   same_as=BLOCKS[0] if b != BLOCKS[0] else None,
                   evidence=[Evidence(option="llm", outcome="accepted", reason="ok")])
          for b, c in zip(BLOCKS, CORES)]
    save_decisions(ds, tmp_path / DECISIONS_FILE)
    llm = tmp_path / "generated" / "llm" / block_dir(CORES[0])
    llm.mkdir(parents=True)
    (llm / "summary.json").write_text(json.dumps({"attempts": [
        {"verdict": "accepted", "prompt_hash": "h"}]}))
    (tmp_path / "alignment.json").write_text(json.dumps({
        "blocks": [{"path": b, "fwd": {"verdict": "pass"}, "bwd": {"verdict": "pass"}}
                   for b in BLOCKS],
        "patches": [{"path": b, "family": "cell_family", "status": "active"} for b in BLOCKS]}))
    (c,) = pr_candidates(tmp_path)
    assert c["status"] == "candidate" and c["llm"]["attempts"] == 1
    assert [b["path"] for b in c["blocks"]] == BLOCKS


def test_a_block_level_tuning_job_runs_the_family_on_the_core(graph, tmp_path, monkeypatch):
    """`onboard tune` times an LLM-written family's block_forward on the module it replaces:
    the core (before: the block, whose forward the family was never written for)."""
    import onboarding.tune.block as block_tuning
    from onboarding.tune.run import TuneJob, _tune_block_job
    from onboarding.tune.search import TuneConfig

    graph.save(tmp_path / "opgraph.json")
    (tmp_path / "model.json").write_text(json.dumps({"ref": REF}))
    seen = []
    monkeypatch.setattr(block_tuning, "tune_block", lambda module, spec, path, **kw:
                        seen.append(path) or [])
    job = TuneJob(family="cell_family", variant="plain", module="m.py", bucket="(block)", size=0,
                  size_source="", shapes=[], dims=None, blocks=list(BLOCKS), level="block")
    assert _tune_block_job(tmp_path, job, TuneConfig(), None, None) == []
    assert seen == [CORES[0]]
