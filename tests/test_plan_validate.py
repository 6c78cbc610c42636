"""`python -m onboarding.plan.validate`: the plan compares like with like against measured runs.

The H200 measurements stored before (commit 83f63f6) predated issue 34's leaner training step,
which the plan had modelled since 458972e: the validation went on comparing the two (-37% to
-66% on memory) without saying so. Those in reference_runs/plan_validation now are of one H100
at 9f358db. These tests keep the two sides' settings one and the same, and the staleness said."""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from onboarding.plan.validate import STEP_PATHS, Case, provenance

STORED = Path(__file__).resolve().parents[1] / "reference_runs" / "plan_validation"


def _trained(argv: list[str]) -> dict:
    """What `onboard train` runs for these options, read by its own parser: the settings a plan
    of that step needs."""
    from onboarding.cli.main import build_parser
    from onboarding.cli.train import config_from_args

    cfg = config_from_args(build_parser().parse_args(["train", *argv]))
    return {"seq": cfg.seq_len, "micro_batch": cfg.micro_batch, "recompute": cfg.recompute_mode,
            "dtype": cfg.dtype, "kernels": cfg.kernels and cfg.device == "cuda",
            "lora_rank": cfg.lora_rank, "expert_lora": cfg.expert_lora,
            "capacity_factor": cfg.capacity_factor, "gpus": cfg.nproc, "ep": cfg.ep}


def _planned(case: Case) -> dict:
    pc = case.plan_config()
    return {k: getattr(pc, k) for k in ("seq", "micro_batch", "recompute", "dtype", "kernels",
                                        "lora_rank", "expert_lora", "capacity_factor", "gpus",
                                        "ep")}


def test_stored_runs_settings_reach_the_plan():
    """Each stored run's recorded command (the step that was measured) and the plan the
    validation makes for its case: the same layout, sequence, recompute, dtype and kernel path."""
    runs = json.loads((STORED / "measured.json").read_text())
    assert runs
    for r in runs:
        argv = shlex.split(r["command"])[2:]  # "onboarding train MODEL ..."
        assert _planned(Case(**r["case"])) == _trained(argv), r["name"]


@pytest.mark.parametrize("case", [
    Case(model="hf:qwen3_moe", seq=1024, kernels=False),
    Case(model="hf:qwen3_moe", seq=1024, micro_batch=1, recompute="selective", dtype="fp32"),
    Case(model="hf:qwen3_moe", seq=512, recompute="full", sets=["num_hidden_layers=2"])])
def test_a_case_trains_and_plans_one_step(case):
    """A case's `onboard train` options and its plan agree on every setting that changes what
    the step keeps (before: the plan always took kernels on and bf16, whatever was measured)."""
    assert _planned(case) == _trained(case.train_args())
    assert ("--no-kernels" in case.train_args()) == (not case.kernels)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


def test_provenance_says_when_the_measured_step_changed(tmp_path):
    """Measurements of a commit whose training step has changed since are called stale (the plan
    models the newer step); a change elsewhere, or none, is not; an unknown commit is said."""
    repo, src = tmp_path / "repo", tmp_path / "measured"
    step = repo / STEP_PATHS[0] / "step.py"
    step.parent.mkdir(parents=True)
    src.mkdir()
    step.write_text("keep = 'fp32 log-probabilities'\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "measured here")
    measured_at = _git(repo, "rev-parse", "--short", "HEAD")
    (src / "meta.json").write_text(json.dumps({"what": "w", "device": "d", "date": "x",
                                               "commit": f"{measured_at} (note)"}))
    assert len(provenance(src, repo)) == 1 and measured_at in provenance(src, repo)[0]
    (repo / "README").write_text("docs only\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "docs")
    assert len(provenance(src, repo)) == 1
    step.write_text("keep = 'bf16 logits'\n")
    _git(repo, "commit", "-q", "-am", "leaner step")
    assert provenance(src, repo)[1].startswith("STALE: 1 commits")
    (src / "meta.json").write_text(json.dumps({"commit": "0123abc"}))
    assert "unknown" in provenance(src, repo)[1]


def _fake_train(monkeypatch, rc: int, output: str, steps: int, *, timeout: bool = False):
    """`validate.measure`'s `onboard train` replaced by one that writes ``steps`` rows (with a
    kernels summary) into its ``--out`` and then exits ``rc`` after printing ``output``, or runs
    past its timeout with ``output`` printed."""
    import onboarding.plan.validate as V

    def run(cmd, **kw):
        out = Path(cmd[cmd.index("--out") + 1]) / "train"
        out.mkdir(parents=True)
        (out / "reference.jsonl").write_text("".join(json.dumps({
            "step": s, "step_time_s": 0.5 if s == 1 else 0.1, "tokens_per_s": 10.0,
            "peak_mem_bytes": 2**30 + s, "kernels": {"gated_delta": 3, "rejected:rmsnorm": 1}})
            + "\n" for s in range(1, steps + 1)))
        if timeout:
            raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=output, stderr="")
        return subprocess.CompletedProcess(cmd, rc, stdout=output, stderr="")

    monkeypatch.setattr(V.subprocess, "run", run)
    return V.measure


def test_a_failed_run_keeps_its_output_with_its_rows(monkeypatch, tmp_path):
    """A run that wrote its steps and then exited non-zero keeps the end of its output (before:
    only a run without rows did, and qwen3_next T16384's exit 1 on the H100 said nothing); its
    rows' numbers and the kernels its last row names are kept too. A clean exit has no error; a
    timeout keeps what the run had printed, the timeout last (the table's line)."""
    case = Case(model="hf:qwen3_next", seq=64, micro_batch=1)
    res = _fake_train(monkeypatch, 1, "step 4 ...\nRuntimeError: export failed\n", 4)(
        case, tmp_path / "a", 4, 9.0)
    assert res["exit_code"] == 1 and res["steps"] == 4 and res["peak_bytes"] == 2**30 + 4
    assert "RuntimeError: export failed" in res["error"]
    assert res["kernels"] == {"gated_delta": 3, "rejected:rmsnorm": 1}
    res = _fake_train(monkeypatch, 0, "done\n", 2)(case, tmp_path / "b", 2, 9.0)
    assert "error" not in res and res["step_s"] == 0.1
    res = _fake_train(monkeypatch, 0, "compiling gated_delta\n", 0, timeout=True)(
        case, tmp_path / "c", 2, 9.0)
    assert res["exit_code"] == 124 and "peak_bytes" not in res
    assert res["error"].startswith("compiling gated_delta")
    assert res["error"].splitlines()[-1] == "timed out after 9 s"


def test_the_plan_is_compared_with_the_steady_steps_peak(monkeypatch, tmp_path):
    """Rows with per-step peaks (`onboard train` since aee64d8): the plan is compared with the
    largest step's own peak after step 1, and the run's peak (here step 1's calibration
    transient, 3 GiB) is kept beside it and shown in the table, not hidden. The kernels summary,
    which the worker writes in step 1's row only, is kept (before: read from the last row, so a
    run of more than one step never recorded it). Rows before per-step peaks (each row the
    run's peak so far) give the run's peak for both, and the table says so."""
    import onboarding.plan.validate as V

    def run(cmd, **kw):
        out = Path(cmd[cmd.index("--out") + 1]) / "train"
        out.mkdir(parents=True)
        rows = [{"step": s, "step_time_s": 0.1, "tokens_per_s": 10.0,
                 "peak_mem_bytes": (3 if s == 1 else 2) * 2**30 + s,
                 "run_peak_mem_bytes": 3 * 2**30 + 1} for s in range(1, 5)]
        rows[0].update(kernels={"linear_attention.gated_delta": 3, "rejected:norm.rms": 1},
                       kernels_rejected={"layers.0.norm": "output 3e-2"})
        out.joinpath("reference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
    monkeypatch.setattr(V.subprocess, "run", run)
    res = V.measure(Case(model="hf:qwen3_next", seq=64), tmp_path, 4, 9.0)
    assert res["peak_bytes"] == 2 * 2**30 + 4 and res["run_peak_bytes"] == 3 * 2**30 + 1
    assert res["peak_of"] == "steps 2-4" and res["rows"][0]["run_peak_mem_bytes"] == 3 * 2**30 + 1
    assert res["kernels"] == {"linear_attention.gated_delta": 3, "rejected:norm.rms": 1}
    assert res["kernels_rejected"] == {"layers.0.norm": "output 3e-2"}
    res["predicted"] = {"allocated": 2 * 2**30, "step_s": 0.1, "params": 5e8}
    row, *notes = V.table([res]).splitlines()[2:]
    assert row.split(" | ")[3:6] == ["2.00", "3.00", "-0.0%"] and not notes
    assert V.peaks(res["rows"][:1])["peak_of"] == "step 1 (the only step)"
    old = V.peaks([{"step": s, "peak_mem_bytes": 2**30 + s} for s in (1, 2)])
    assert old == {"peak_bytes": 2**30 + 2, "run_peak_bytes": 2**30 + 2,
                   "peak_of": "the run's (rows before per-step peaks)"}
    res.update(old)
    *_, blank, note = V.table([res]).splitlines()  # after the table, not a row of it
    assert blank == "" and note.endswith("measured GiB is the run's (rows before per-step peaks)")


def test_stale_counts_only_the_kernel_families_the_runs_used(tmp_path):
    """The STALE check counts commits to onboarding/train, onboarding/patching and the folders of
    the kernel families the measured runs used (their ``kernels`` summaries: a block kind by the
    families `match` gives it in the case's graph, a training kind by `training_kernel`, each
    family's base: kimi_delta extends gated_delta), and names them. Before, every commit under
    kernel_templates counted (4b6ad16 to kimi_delta made the H100 numbers STALE, a family
    neither proxy uses). A case without a summary, or a kind no family is known to serve,
    counts every family, as before; --no-kernels cases count none. A rejected kind's family
    counts (`test_stale_counts_the_families_of_rejected_kinds`)."""
    from onboarding.plan.validate import step_paths

    repo, src = tmp_path / "repo", tmp_path / "measured"
    src.mkdir()
    for d in ("onboarding/train", "kernel_templates/gated_delta", "kernel_templates/kimi_delta",
              "kernel_templates/swiglu", "kernel_templates/rmsnorm"):
        (repo / d).mkdir(parents=True)
        (repo / d / "f.py").write_text("v = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "measured here")
    (src / "meta.json").write_text(json.dumps({"commit": _git(repo, "rev-parse", "HEAD")}))
    case = asdict(Case(model="hf:qwen3_next", seq=64))
    used = {"case": case, "predicted": {"kind_families": {
        "linear_attention.gated_delta": ["kimi_delta"], "norm.rms": ["rmsnorm"]}},
        "kernels": {"linear_attention.gated_delta": 3, "rejected:norm.rms": 4,
                    "moe.experts.weighted_act": 2, "lora.linear": 0}}
    paths = step_paths([used])
    assert paths == ("onboarding/train", "onboarding/patching", "kernel_templates/_common",
                     "kernel_templates/gated_delta", "kernel_templates/kimi_delta",
                     "kernel_templates/rmsnorm", "kernel_templates/swiglu")
    assert step_paths([used, {"case": {**case, "kernels": False}}]) == paths
    assert step_paths([used, {"case": case}]) == STEP_PATHS  # no summary: every family
    assert step_paths([{**used, "kernels": {"new.kind": 1}}]) == STEP_PATHS
    assert step_paths() == STEP_PATHS
    assert provenance(src, repo, [used])[0].endswith(", ".join(paths))
    for d in ("kernel_templates/lora",):  # attached none
        (repo / d).mkdir(exist_ok=True)
        (repo / d / "f.py").write_text("v = 2\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", d)
    assert len(provenance(src, repo, [used])) == 1
    assert provenance(src, repo, [used, {"case": case}])[1].startswith(
        "STALE: 1 commits to onboarding/train, onboarding/patching, kernel_templates between")
    (repo / "kernel_templates/gated_delta/f.py").write_text("v = 2\n")
    _git(repo, "commit", "-q", "-am", "the base of kimi_delta")
    assert provenance(src, repo, [used])[1].startswith(
        f"STALE: 1 commits to {', '.join(paths)} between")


def test_the_first_case_of_each_model_gets_the_compile_allowance(monkeypatch, tmp_path, capsys):
    """`measure_cases`: the first case of each model (its kernels' first compiles: qwen3_moe
    T2048 ran past 70 s after writing its rows, qwen3_next T4096 timed out before its first step)
    runs under ``first_timeout``, every later case of that model under ``timeout``; the
    allowance is never shorter than ``timeout``, and each result says which it ran under."""
    import onboarding.plan.validate as V

    got = []

    def run(cmd, **kw):
        got.append((cmd[cmd.index("train") + 1], kw["timeout"]))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
    monkeypatch.setattr(V.subprocess, "run", run)
    cases = [Case(model="hf:qwen3_moe", seq=64), Case(model="hf:qwen3_moe", seq=128),
             Case(model="hf:qwen3_next", seq=64), Case(model="hf:qwen3_moe", seq=256),
             Case(model="hf:qwen3_next", seq=128)]
    res = list(V.measure_cases(cases, tmp_path, 2, 70.0, 500.0))
    assert got == [("hf:qwen3_moe", 500.0), ("hf:qwen3_moe", 70.0), ("hf:qwen3_next", 500.0),
                   ("hf:qwen3_moe", 70.0), ("hf:qwen3_next", 70.0)]
    assert [r["timeout_s"] for r in res] == [t for _, t in got]
    got.clear()
    list(V.measure_cases(cases[:2], tmp_path, 2, 70.0, 30.0))
    assert got == [("hf:qwen3_moe", 70.0)] * 2
    with pytest.raises(SystemExit):
        V.main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "--first-timeout" in said and "compiles its kernels" in said


def test_stale_counts_the_families_of_rejected_kinds(tmp_path):
    """A kind whose kernel was rejected at the measured commit (its check against the torch path
    failed: ``rejected:<kind>`` counted) ran the torch path there; a later commit to its family's
    templates may make the check pass, and the step then runs the kernel: the measurements are
    stale. Its family counts (it did not: a change to rmsnorm after norm.rms was rejected left
    the numbers current). A kind the kernel was never tried on (``rejected:<kind> (<why>)``, a
    refusal decided in onboarding/train, or a count of 0) adds no family."""
    from onboarding.plan.validate import step_paths

    repo, src = tmp_path / "repo", tmp_path / "measured"
    src.mkdir()
    for d in ("onboarding/train", "kernel_templates/rmsnorm", "kernel_templates/lora",
              "kernel_templates/swiglu"):
        (repo / d).mkdir(parents=True)
        (repo / d / "f.py").write_text("v = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "measured here")
    (src / "meta.json").write_text(json.dumps({"commit": _git(repo, "rev-parse", "HEAD")}))
    case = asdict(Case(model="hf:qwen3_next", seq=64))
    used = {"case": case, "predicted": {"kind_families": {"norm.rms": ["rmsnorm"]}},
            "kernels": {"norm.rms": 0, "rejected:norm.rms": 4, "lora.linear": 0,
                        "rejected:lora.linear": 0, "rejected:lora.linear (dropout)": 6,
                        "moe.experts.weighted_act": 0, "rejected:moe.experts.weighted_act": 0}}
    assert step_paths([used]) == ("onboarding/train", "onboarding/patching",
                                  "kernel_templates/_common", "kernel_templates/rmsnorm")
    for d in ("kernel_templates/lora", "kernel_templates/swiglu"):  # never tried: not stale
        (repo / d / "f.py").write_text("v = 2\n")
        _git(repo, "commit", "-q", "-am", d)
    assert len(provenance(src, repo, [used])) == 1
    (repo / "kernel_templates/rmsnorm/f.py").write_text("v = 2\n")
    _git(repo, "commit", "-q", "-am", "the rejected kernel's template")
    assert provenance(src, repo, [used])[1].startswith(
        "STALE: 1 commits to onboarding/train, onboarding/patching, kernel_templates/_common, "
        "kernel_templates/rmsnorm between")
