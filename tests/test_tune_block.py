"""Tuning an accepted LLM-written family over its declared space (onboarding.tune.block): the
recorded mLSTM answer for hf:xlstm's uncovered block (tests/fixtures/llm_cassettes), written as a
family folder and rendered like any candidate, is tuned on the block itself by `onboard tune`'s
run path: each config checked against the block's own forward and gradients, then timed (an
injected timer: the CPU interpreter's wall time means nothing), the best written to the tuned.json
that alignment loads. Triton runs in the interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_llm_gate import SPEC, TASK

from onboarding.generate.llm.contract import Answer
from onboarding.generate.llm.folder import write_folder

CASSETTE = Path(__file__).parent / "fixtures" / "llm_cassettes" / "families" / "mlstm_recurrent"
SPACE = {"num_warps": [2, 4], "BLOCK_H": [1, 2]}


def _run_dir(tmp_path, fam) -> Path:
    """A run folder as generate leaves it for one accepted family: its folder registered, the
    block's coverage entry, the rendered candidate (passed), the op graph's capture size."""
    from onboarding.coverage import Coverage, CoverageEntry
    from onboarding.generate.candidates import render_candidates, save_candidates

    data = json.loads((CASSETTE / "answer.json").read_text())
    data.setdefault("template", (CASSETTE / "mlstm_recurrent.py.j2").read_text())
    data.setdefault("reference", (CASSETTE / "reference.py").read_text())
    write_folder(Answer.model_validate(data), TASK, tmp_path / "families")
    fam.add_dirs([tmp_path / "families"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.json").write_text(json.dumps({"ref": SPEC.ref, "overrides": SPEC.overrides,
                                                "proxy": SPEC.proxy}))
    (run / "opgraph.json").write_text(json.dumps({
        "model": "xlstm", "capture": "dispatch", "capture_note": "", "batch": 1, "seq": 8,
        "dtype": "fp32", "blocks": [], "layer_pattern": "", "layer_kinds": [],
        "param_counts": {}, "total_flops": 0, "schema_version": 1}))
    spec = fam.get_family("mlstm_recurrent")
    cov = Coverage(model="xlstm", entries=[CoverageEntry(
        path=TASK.path, kind=TASK.kind, op=TASK.op, status="generated", family=spec.name,
        variant="plain", params=spec.resolve("plain"), shapes=[[1, 2, 8, 8]])])
    cov.save(run / "coverage.json")
    cands = render_candidates(cov, run / "candidates")
    for c in cands:
        c.status = "passed"
    save_candidates(cands, run / "candidates.json")
    return run


@pytest.mark.slow  # 18 s of CPU (16 interpreted kernel launches), 30-70 s wall under load
def test_accepted_llm_family_tuned_on_its_block(tmp_path, families):
    from onboarding.generate.templating import load_module
    from onboarding.tune.run import plan_jobs, tune_run
    from onboarding.tune.search import TuneConfig
    from onboarding.tune.store import load_tuned, tuned_path

    run = _run_dir(tmp_path, families)
    jobs, notes = plan_jobs(run)
    assert [(j.family, j.level, j.blocks) for j in jobs] == [("mlstm_recurrent", "block",
                                                               [TASK.path])], notes
    module_path = jobs[0].module
    kmod = load_module(module_path)
    real = kmod.block_forward

    def wrong_at_8_warps_of_2_rows(module, *a, **k):  # one config computes the wrong thing
        out = real(module, *a, **k)
        c = kmod.config_for(8 * 16)
        if (c["num_warps"], c["BLOCK_H"]) == (4, 2):
            h, state = out
            return h * 1.01, state
        return out

    kmod.block_forward = wrong_at_8_warps_of_2_rows
    timed = []

    def timer(config, result):  # 4 warps fastest; (4, 2) would be faster still, were it right
        timed.append(dict(config))
        return {(2, 1): 3.0, (2, 2): 2.5, (4, 1): 2.0, (4, 2): 1.0}[(config["num_warps"],
                                                                     config["BLOCK_H"])]

    try:
        data = tune_run(run, TuneConfig(n_trials=8, dtype="fp32", space=SPACE, progress=False),
                        timer=timer)
    finally:
        kmod.block_forward = real
    (study,) = data["studies"]
    r = study["result"]
    assert study["level"] == "block" and study["bucket"] == "state_le_4k"  # DK 8 x DV 16
    assert r["best_config"] == {"BLOCK_H": 1, "num_warps": 4} and r["best_ms"] == 2.0
    assert r["default_ms"] == 3.0 and r["n_trials"] == 4 and r["n_complete"] == 3
    assert r["pruned"] == {"correctness": 1} and "out0: rel_rms" in r["prune_reasons"]["correctness"]
    assert {(c["num_warps"], c["BLOCK_H"]) for c in timed} == {(2, 1), (2, 2), (4, 1)}
    saved = json.loads(tuned_path(module_path).read_text())
    assert saved["buckets"]["state_le_4k"]["config"] == {"BLOCK_H": 1, "num_warps": 4}
    assert load_tuned(module_path).config_for(8 * 16) == {"BLOCK_H": 1, "num_warps": 4}
