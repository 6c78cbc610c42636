"""`onboard regress`: facts of a run, their comparison with a golden, the committed golden, the CLI.

Run directories here are small synthetic ones with the structure `onboard run` writes (the
keys `onboarding.regress` reads); no pipeline runs in these tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onboarding import regress
from onboarding.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "reference_runs" / "example" / "golden.json"


def _stats(rel_rms: float) -> dict:
    return {"numel": 64, "p50": rel_rms / 4, "p90": rel_rms / 2, "p99": rel_rms,
            "p999": rel_rms, "max_abs": rel_rms * 3, "rel_rms": rel_rms, "cosine": 1.0,
            "ref_rms": 0.3, "nonfinite": 0, "ref_nonfinite": 0, "discrete_mismatch": 0.0,
            "exact_fraction": None, "max_ulp": None, "ulp_histogram": None}


def _direction(rel_rms: float | None, params: float | None = None, verdict: str = "pass"
               ) -> dict:
    return {"verdict": verdict, "output": None if rel_rms is None else _stats(rel_rms),
            "input": _stats(1e-7), "params": None if params is None else _stats(params),
            "local": None, "local_params": None, "output_ok": True, "input_ok": True,
            "local_ok": None, "source": None, "message": "ok"}


def _block(path: str, kind: str, layer: int | None = None) -> dict:
    return {"path": path, "kind": kind, "layer": layer, "class_name": "X", "evidence": [],
            "op_histogram": {}, "inputs": [{"shape": [1, 8, 32], "dtype": "float32"}],
            "outputs": [], "params": {}, "attrs": {}, "flops": 100, "bytes": 10}


def _cov(path: str, kind: str, op: str, status: str, family: str | None = None,
         variant: str | None = None) -> dict:
    return {"path": path, "kind": kind, "op": op, "status": status, "family": family,
            "variant": variant, "params": {}, "module": None, "shapes": [[1, 8, 32]],
            "dtype": "float32", "reason": "r"}


def make_run(root: Path) -> Path:
    """A finished run of a three-block model: embedding, one RMSNorm (with a passing rmsnorm
    candidate patched in), lm_head."""
    run = root / "run"
    run.mkdir(parents=True)
    params = {"total": 1000, "active": 600, "active_without_embeddings": 400, "embedding": 100,
              "lm_head": 100, "tied_embeddings": False, "routed_experts": 500,
              "by_category": {"embedding": 100, "norm": 32, "moe.experts": 500,
                              "lm_head": 100, "dense": 268},
              "by_component": {"model.norm": 32},
              "moe": [{"path": "model.layers.0.mlp", "experts_path": "model.layers.0.mlp.e",
                       "n_experts": 4, "top_k": 2, "top_k_source": "config",
                       "router_path": None, "routed_params": 500, "shared_paths": []}]}
    (run / "model.json").write_text(json.dumps({
        "ref": None, "name": "tiny", "source": "example", "overrides": {},
        "trust_remote_code": False, "weights": [], "params": params, "proxy": "tiny",
        "proxy_note": "", "full_config": None, "proxy_config": None, "seconds": 0.1,
        "environment": {}}))
    blocks = [_block("model.embed_tokens", "embedding"), _block("model.norm", "norm.rms"),
              _block("lm_head", "lm_head")]
    (run / "opgraph.json").write_text(json.dumps({
        "model": "tiny", "capture": "export", "capture_note": "", "batch": 1, "seq": 8,
        "dtype": "float32", "blocks": blocks, "layer_pattern": "F",
        "layer_kinds": [["mlp.dense"]],
        "param_counts": {"full": params, "proxy": {"total": 1000, "active": 600}},
        "total_flops": 300, "schema_version": 1}))
    entries = [_cov("model.embed_tokens", "embedding", "embedding gather", "torch_fast"),
               _cov("model.norm", "norm.rms", "rmsnorm", "template", "rmsnorm", "plain"),
               _cov("lm_head", "lm_head", "vocabulary projection", "torch_fast")]
    (run / "coverage.json").write_text(json.dumps({
        "model": "tiny", "counts": {"kernel": 0, "template": 1, "torch_fast": 2,
                                    "uncovered": 0}, "entries": entries}))
    checks = [{"name": "sample.out0", "passed": True, "rel_rms": 4e-8},
              {"name": "sample.grad0", "passed": True, "rel_rms": 9e-8}]
    (run / "candidates.json").write_text(json.dumps([{
        "family": "rmsnorm", "variant": "plain", "params": {"eps": 1e-6, "unit_offset": False},
        "path": str(run / "candidates" / "rmsnorm" / "plain_0123abcd.py"),
        "blocks": ["model.norm"], "shapes": [[1, 8, 32]], "status": "passed",
        "checks": checks, "error": "", "seconds": 1.5, "promoted_to": None}]))
    align_blocks = [
        {"path": "model.embed_tokens", "kind": "embedding", "layer": None, "calls": 1,
         "tolerance": {}, "fwd": _direction(0.0), "bwd": _direction(None, 2e-7, "no_grad")},
        {"path": "model.norm", "kind": "norm.rms", "layer": None, "calls": 1, "tolerance": {},
         "fwd": _direction(6e-7), "bwd": _direction(1e-6, 2e-6)},
        {"path": "lm_head", "kind": "lm_head", "layer": None, "calls": 1, "tolerance": {},
         "fwd": _direction(8e-7), "bwd": _direction(9e-7, 1e-6)}]
    (run / "alignment.json").write_text(json.dumps({
        "model": "tiny", "mode": "percentile", "reference_dtype": "float64",
        "candidate_dtype": "float32", "seed": 0, "input_shapes": [[1, 8]],
        "blocks": align_blocks, "forward_order": [b["path"] for b in align_blocks],
        "backward_order": [b["path"] for b in align_blocks[::-1]],
        "logits": {"kl": 4e-14, "kl_max": 7e-14, "top1_agreement": 1.0, "tokens": 8,
                   "stats": _stats(9e-7)},
        "patches": [{"path": "model.norm", "kind": "norm.rms", "family": "rmsnorm",
                     "status": "active", "binding": "x", "detail": ""}],
        "notes": [], "passed": True, "culprit": {"fwd": [], "bwd": []}}))
    nodes = ("load", "parse", "map", "generate", "align", "tune", "train", "report")
    (run / "events.jsonl").write_text("".join(
        json.dumps({"time": 1.0 + i, "node": n, "event": e}) + "\n"
        for i, n in enumerate(nodes) for e in ("start", "done")))
    return run


def edit(run: Path, name: str, change) -> None:
    data = json.loads((run / name).read_text())
    change(data)
    (run / name).write_text(json.dumps(data))


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path)


# ---- facts and comparison -------------------------------------------------------------------------

def test_golden_extracts_the_facts(run):
    f = regress.golden(run)
    json.dumps(f)  # serialisable as is
    assert f["run.config"]["model"] == "tiny" and f["run.config"]["seq"] == 8
    assert f["run.stages"] == "load parse map generate align tune train report"
    assert f["params.totals"]["total"] == 1000 and f["params.totals"]["active"] == 600
    assert f["params.moe"] == {"4 experts, top-k 2": 1}
    assert f["opgraph.layer_pattern"] == "F"
    assert f["opgraph.block_kinds"] == {"embedding": 1, "lm_head": 1, "norm.rms": 1}
    assert f["coverage.entries"]["norm.rms / rmsnorm / rmsnorm/plain"] == "template x1"
    key = "rmsnorm/plain eps=1e-06 unit_offset=False"
    assert f["candidates.status"] == {key: "passed, 2/2 checks"}
    assert f["candidates.worst_rel_rms"] == {key: 9e-8}
    assert f["alignment.verdict"] == "passed"
    assert f["alignment.patches"] == {"rmsnorm": "active x1"}
    assert f["alignment.block_verdicts"] == {"bwd no_grad": 1, "bwd pass": 2, "fwd pass": 3}
    assert f["alignment.worst_fwd_rel_rms"] == 8e-7
    assert f["alignment.worst_bwd_rel_rms"] == 1e-6
    assert f["alignment.worst_param_grad_rel_rms"] == 2e-6
    assert f["alignment.logits_kl"] == 4e-14
    # no timings: seconds and event times are not facts
    assert "1.5" not in json.dumps(f["candidates.status"])


def test_every_float_fact_has_a_tolerance(run):
    for fact, value in regress.golden(run).items():
        values = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, float) for v in values):
            assert fact in regress.TOLERANCES, fact


def test_runs_that_differ_only_in_non_facts_have_no_findings(run, tmp_path):
    """Another directory (so other candidate paths), other timings, event times and environment:
    none of it is a fact. (`test_every_fact_change_is_reported_exactly` shows the same compare
    reports each real change.)"""
    other = make_run(tmp_path / "again")
    edit(other, "candidates.json", lambda d: d[0].update(seconds=99.0))
    edit(other, "model.json", lambda d: d.update(seconds=7.0, environment={"gpu": "H200"}))
    lines = (other / "events.jsonl").read_text().splitlines()
    (other / "events.jsonl").write_text("".join(
        json.dumps({**json.loads(line), "time": 1000.0 + i}) + "\n" for i, line in enumerate(lines)))
    assert regress.compare(regress.golden(run), regress.golden(other)) == []


COMMITTED_FACTS = regress.load_golden(COMMITTED)["facts"] if COMMITTED.is_file() else {}


def _changes(fact: str, value):
    """(a value of `fact` that compare must report, one it must let pass or None): an exact
    fact changed by one step; a float with a tolerance moved past it and within it."""
    tol = regress.TOLERANCES.get(fact)
    if isinstance(value, bool):
        return (not value), None
    if isinstance(value, int):
        return value + 1, None
    if isinstance(value, str):
        return value + "~", None
    if value is None:
        return 0.5, None
    assert isinstance(value, float) and tol is not None, (fact, value)
    if tol.drop is not None:
        return value - 2 * tol.drop, value - tol.drop / 2
    bound = max(value * tol.ratio, tol.floor)
    return 2 * bound, 0.9 * bound


@pytest.mark.parametrize("fact", list(COMMITTED_FACTS))
def test_every_fact_change_is_reported_exactly(fact):
    """Each fact of the committed golden (every entry of a mapping), changed on its own: compare
    reports that one change and nothing else, with both values; a float moved within its
    tolerance is not reported; a mapping's entry removed or added is reported as such."""
    facts = COMMITTED_FACTS
    value = facts[fact]
    entries = list(value.items()) if isinstance(value, dict) else [(None, value)]
    for key, v in entries:
        changed, within = _changes(fact, v)
        for new, reported in ((changed, True), (within, False)):
            if new is None:
                continue
            current = {**facts, fact: {**value, key: new} if key is not None else new}
            found = regress.compare(facts, current)
            if not reported:
                assert found == [], (fact, key, v, new)
                continue
            assert [(f.fact, f.key) for f in found] == [(fact, key)], (key, v, new)
            assert (found[0].golden, found[0].current) == (v, new)
            name = fact if key is None else f"{fact}[{key}]"
            assert found[0].message.startswith(f"{name}: golden "), found[0].message
    if isinstance(value, dict):
        key = next(iter(value))
        gone = regress.compare(facts, {**facts, fact: {k: v for k, v in value.items() if k != key}})
        assert [(f.fact, f.key, f.current) for f in gone] == [(fact, key, None)]
        assert gone[0].message.endswith("now absent")
        new = regress.compare(facts, {**facts, fact: {**value, "extra entry": 1}})
        assert [(f.fact, f.key, f.golden) for f in new] == [(fact, "extra entry", None)]
    missing = regress.compare(facts, {k: v for k, v in facts.items() if k != fact})
    assert [(f.fact, f.key) for f in missing] == [(fact, None)]
    assert regress.compare(facts, facts) == []


def test_a_value_of_another_type_is_a_change():
    """False and 0, 1 and 1.0 compare equal in Python; as facts they differ."""
    g = {"params.totals": {"tied_embeddings": False, "total": 1}, "opgraph.total_flops": 5}
    found = regress.compare(g, {"params.totals": {"tied_embeddings": 0, "total": 1.0},
                                "opgraph.total_flops": 5.0})
    assert [(f.fact, f.key) for f in found] == [("params.totals", "tied_embeddings"),
                                                ("params.totals", "total"),
                                                ("opgraph.total_flops", None)]


def test_changed_coverage_entry(run):
    before = regress.golden(run)

    def uncover(d):
        d["entries"][1].update(status="uncovered", family=None, variant=None,
                               op="rmsnorm")
        d["counts"].update(template=0, uncovered=1)

    edit(run, "coverage.json", uncover)
    found = regress.compare(before, regress.golden(run))
    msgs = [f.message for f in found]
    assert {f.fact for f in found} == {"coverage.counts", "coverage.entries"}, msgs
    gone = next(f for f in found if f.key == "norm.rms / rmsnorm / rmsnorm/plain")
    assert "golden 'template x1', now absent" in gone.message
    new = next(f for f in found if f.key == "norm.rms / rmsnorm")
    assert new.current == "uncovered x1" and "new" in new.message
    assert any("coverage.counts[template]: golden 1, now 0" in m for m in msgs), msgs


def test_failed_candidate(run):
    before = regress.golden(run)

    def fail(d):
        d[0]["status"] = "failed"
        d[0]["checks"][1].update(passed=False, rel_rms=3e-3)

    edit(run, "candidates.json", fail)
    found = {(f.fact, f.key): f for f in regress.compare(before, regress.golden(run))}
    key = "rmsnorm/plain eps=1e-06 unit_offset=False"
    status = found[("candidates.status", key)]
    assert status.golden == "passed, 2/2 checks" and status.current == "failed, 1/2 checks"
    assert "candidates.status[rmsnorm/plain" in status.message
    assert "allowed <=" in found[("candidates.worst_rel_rms", key)].message


@pytest.mark.parametrize("factor, regressed", [(0.01, False), (2.0, False), (10.0, True)],
                         ids=["better", "within-4x", "10x-worse"])
def test_alignment_metric_tolerance(run, factor, regressed):
    before = regress.golden(run)
    edit(run, "alignment.json",
         lambda d: d["blocks"][2]["fwd"]["output"].update(rel_rms=8e-7 * factor))
    found = regress.compare(before, regress.golden(run))
    assert [f.fact for f in found] == (["alignment.worst_fwd_rel_rms"] if regressed else [])
    if regressed:
        assert "golden 8.00e-07, now 8.00e-06" in found[0].message, found[0].message
        assert "allowed <= 3.20e-06" in found[0].message


def test_tolerance_floor_and_drop():
    rel = regress.TOLERANCES["alignment.worst_fwd_rel_rms"]
    assert rel.problem(0.0, 5e-7) is None  # an exact golden may pick up fp32 noise
    assert rel.problem(0.0, 5e-6) is not None
    top1 = regress.TOLERANCES["alignment.top1_agreement"]
    assert top1.problem(1.0, 0.985) is None and top1.problem(1.0, 0.95) is not None


def test_failed_alignment_and_missing_or_new_facts(run):
    before = regress.golden(run)

    def fail(d):
        d["passed"] = False
        d["culprit"]["fwd"] = ["model.norm"]
        d["blocks"][1]["fwd"]["verdict"] = "fail"
        d["logits"]["kl"] = None  # _json_safe stores a NaN as null

    edit(run, "alignment.json", fail)
    after = regress.golden(run)
    found = {(f.fact, f.key) for f in regress.compare(before, after)}
    assert {("alignment.verdict", None), ("alignment.culprits", "fwd"),
            ("alignment.block_verdicts", "fwd pass"), ("alignment.block_verdicts", "fwd fail"),
            ("alignment.logits_kl", None)} == found
    del after["opgraph.capture"]
    after["new.fact"] = 1
    msgs = [f.message for f in regress.compare(before, after)]
    assert "opgraph.capture: in the golden, missing from this run" in msgs
    assert any(m.startswith("new.fact: not in the golden") for m in msgs)


# ---- the committed golden -------------------------------------------------------------------------

def test_committed_example_golden(run):
    assert COMMITTED.is_file(), f"{COMMITTED} is missing: make it with `onboard regress --update`"
    data = regress.load_golden(COMMITTED)
    meta = data["metadata"]
    for key in ("commit", "date", "torch", "triton", "transformers", "python", "gpu", "device",
                "command", "run_command", "modified_files"):
        assert key in meta, key
    assert meta["command"] == "onboard regress --update"
    assert meta["run_command"].startswith("onboard run --out ")
    facts, shape = data["facts"], regress.golden(run)
    assert list(facts) == list(shape)  # the facts `golden` extracts today, in its order
    for fact, value in shape.items():
        assert isinstance(facts[fact], dict) == isinstance(value, dict), fact
    assert regress.compare(facts, facts) == []  # beside test_every_fact_change_is_reported_exactly
    assert facts["run.config"]["model"] == "onboard_hybrid"
    assert facts["alignment.verdict"] == "passed"
    assert all(s.startswith("passed") for s in facts["candidates.status"].values())


# ---- the CLI ----------------------------------------------------------------------------------------

@pytest.fixture
def refs(tmp_path, monkeypatch):
    """reference_runs/ in a temporary folder, and the working directory beside it."""
    root = tmp_path / "reference_runs"
    monkeypatch.setattr(regress, "REFERENCE_DIR", root)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return root


def _out(capsys) -> tuple[str, str]:
    cap = capsys.readouterr()
    return " ".join(cap.out.split()), " ".join(cap.err.split())


def test_cli_missing_golden(run, refs, capsys):
    assert main(["regress", str(run)]) == 2
    out, err = _out(capsys)
    assert "no golden reference" in err and "--update" in err, err
    assert not refs.exists()


def test_cli_bad_run_dir(run, refs, tmp_path, capsys):
    regress.write_golden(refs / "example" / "golden.json", regress.golden(run), {})
    assert main(["regress", str(tmp_path / "nope")]) == 2
    assert "no such directory" in _out(capsys)[1]
    (tmp_path / "empty").mkdir()
    assert main(["regress", str(tmp_path / "empty")]) == 2
    assert "not a run directory" in _out(capsys)[1]
    (run / "alignment.json").unlink()
    assert main(["regress", str(run)]) == 2
    assert "missing alignment.json" in _out(capsys)[1]
    assert main(["regress", str(run), "--reference", "../x"]) == 2
    assert "--reference" in _out(capsys)[1]


def test_cli_unfinished_run(run, refs, capsys):
    lines = (run / "events.jsonl").read_text().splitlines()
    (run / "events.jsonl").write_text("\n".join(lines[:6]) + "\n")  # killed during generate
    assert main(["regress", str(run), "--update"]) == 2
    err = _out(capsys)[1]
    assert "has not finished (done: load, parse, map)" in err and "--resume" in err, err
    assert not refs.exists()


def test_cli_update_then_ok_then_regressed(run, refs, capsys):
    assert main(["regress", str(run), "--update"]) == 0
    gold = refs / "example" / "golden.json"
    data = json.loads(gold.read_text())
    assert data["facts"] == regress.golden(run)
    assert data["metadata"]["command"] == f"onboard regress {run} --update"
    assert [p.name for p in gold.parent.iterdir()] == ["golden.json"]  # no temp file left
    capsys.readouterr()

    assert main(["regress", str(run)]) == 0
    out, _ = _out(capsys)
    assert f"all {len(data['facts'])} facts ok" in out

    edit(run, "opgraph.json", lambda d: d.update(layer_pattern="E"))
    before = gold.read_text()
    assert main(["regress", str(run)]) == 3
    out, err = _out(capsys)
    assert "opgraph.layer_pattern: golden 'F', now 'E'" in out, out
    assert "regression:" in err and "opgraph.layer_pattern" in err and "--update" in err
    assert gold.read_text() == before  # without --update nothing is written


def test_cli_without_run_dir_runs_the_example(run, refs, monkeypatch, capsys):
    """No RUN_DIR: the example goes through `onboard run` (stubbed here with the synthetic run)
    into runs/, tuning and training off."""
    import shutil

    import onboarding.cli.run as cli

    calls = []

    def fake_run(args, console):
        calls.append(args)
        shutil.copytree(run, args.out, dirs_exist_ok=True)
        return 0

    monkeypatch.setattr(cli, "cmd_run", fake_run)
    assert main(["regress", "--update"]) == 0
    (args,) = calls
    assert args.model is None and args.tune_trials == 0 and args.train_steps == 0
    assert Path(args.out).parent == Path("runs") and "regress-example" in args.out
    meta = json.loads((refs / "example" / "golden.json").read_text())["metadata"]
    assert meta["run_command"] == f"onboard run --out {args.out} --tune-trials 0 --train-steps 0"
    assert main(["regress"]) == 0


@pytest.mark.parametrize("gpu", [None, "NVIDIA H100 80GB HBM3"])
def test_device_is_the_metadatas_device(gpu, monkeypatch):
    """`regress.device()` (what a comparison reads, no git) names the device as `metadata`
    does, with a GPU and without."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    assert regress.device() == regress.metadata(command="")["device"] \
        == (gpu or "cpu (Triton interpreter)")


def test_cli_compare_reads_the_device_without_the_metadata(run, refs, monkeypatch, capsys):
    """Comparing against a golden asks `regress.device()` for this run's device; the whole
    `metadata` (git, versions) is made only for --update."""
    assert main(["regress", str(run), "--update"]) == 0
    gold = refs / "example" / "golden.json"
    data = json.loads(gold.read_text())
    data["metadata"]["device"] = "another GPU"
    gold.write_text(json.dumps(data))
    capsys.readouterr()

    def no_metadata(**kw):
        raise AssertionError("metadata() made for a comparison")

    monkeypatch.setattr(regress, "metadata", no_metadata)
    assert main(["regress", str(run)]) == 0
    out, _ = _out(capsys)
    assert f"the golden was made on another GPU, this run is on {regress.device()}" in out, out


def test_rows_mark_ok_changed_and_new(run):
    g = regress.golden(run)
    c = {**g, "opgraph.capture": "dispatch",
         "coverage.counts": {**g["coverage.counts"], "template": 0, "uncovered": 1}}
    rows = {r[0]: r for r in regress.rows(g, c, regress.compare(g, c))}
    assert rows["opgraph.capture"] == ("opgraph.capture", "export", "dispatch", "changed")
    assert rows["coverage.counts"][3] == "changed (2)"
    assert rows["params.totals"][3] == "ok" and rows["params.totals"][1] == "7 entries"
    assert {r[3] for r in regress.rows({}, g, [])} == {"new"}


def test_cli_a_run_of_another_model_is_not_compared(run, refs, capsys):
    """onboard regress on a run of hf:qwen3_vl_moe compared it with the example's golden (a
    run of onboard_hybrid) and called 76 differences a regression (exit 3); two models' facts
    do not compare: exit 2 naming both and how to make the run's own golden."""
    assert main(["regress", str(run), "--update"]) == 0
    gold = refs / "example" / "golden.json"
    before = gold.read_text()
    capsys.readouterr()
    edit(run, "model.json", lambda d: d.update(name="other_lm", source="hf"))
    assert main(["regress", str(run)]) == 2
    err = _out(capsys)[1]
    assert "other_lm" in err and "--reference NAME --update" in err, err
    assert gold.read_text() == before
