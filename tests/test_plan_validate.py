"""`python -m onboarding.plan.validate`: the plan compares like with like against measured runs.

The H200 measurements stored before (commit 83f63f6) predated issue 34's leaner training step,
which the plan had modelled since 458972e: the validation went on comparing the two (-37% to
-66% on memory) without saying so. Those in reference_runs/plan_validation now are of one H100
at 9f358db. These tests keep the two sides' settings one and the same, and the staleness said."""

from __future__ import annotations

import json
import shlex
import subprocess
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
