"""Honest verdicts: what alignment did not check is said by path and reason, never a plain PASS;
``--strict`` makes an unpatched coverable block a failure (exit 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onboarding.align.core import AlignmentError, AlignmentResult
from onboarding.align.verdicts import unchecked_blocks
from onboarding.cli.main import main
from onboarding.coverage import Coverage, CoverageEntry
from onboarding.patching.core import PatchRecord

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PLANT_AT = "model.layers.0.post_attention_layernorm"


def _entry(path: str, family: str | None, status: str = "template", kind: str = "norm.rms"):
    return CoverageEntry(path=path, kind=kind, op=family or kind, status=status, family=family)


def test_unchecked_blocks_name_every_reason():
    cov = Coverage(model="m", entries=[
        _entry("a", "rmsnorm"),  # patched
        _entry("a.inner", "rmsnorm"),  # inside an active patch: checked there
        _entry("b", "rmsnorm"),  # rejected
        _entry("c", "rmsnorm"),  # installed, never called
        _entry("d", "rope", kind="rope"),  # a family that cannot patch
        _entry("e", "moe_router", kind="moe.router"),  # not selected
        _entry("f", "rmsnorm"),  # left out after a failed attempt
        _entry("g", "rmsnorm"),  # no passing candidate
        _entry("h", None, status="torch_fast", kind="lm_head"),  # not coverable
        _entry("i", None, status="uncovered", kind="unknown"),
    ])
    recs = [PatchRecord(path="a", kind="norm.rms", family="rmsnorm", status="active"),
            PatchRecord(path="b", kind="norm.rms", family="rmsnorm", status="rejected",
                        detail="structure does not fit the kernel"),
            PatchRecord(path="c", kind="norm.rms", family="rmsnorm", status="pending")]
    available = {(p, "rmsnorm") for p in "abcf"} | {("e", "moe_router"), ("d", "rope")}
    n, out = unchecked_blocks(cov, recs, available=available,
                              bindable=["rmsnorm", "moe_router"], families=["rmsnorm"],
                              exclude={("f", "rmsnorm")})
    assert n == 8
    reasons = {x["path"]: x["reason"] for x in out}
    assert list(reasons) == ["b", "c", "d", "e", "f", "g"]
    assert reasons["b"] == "patch rejected: structure does not fit the kernel"
    assert "never called" in reasons["c"]
    assert "no patch binding" in reasons["d"] and "rope" in reasons["d"]
    assert reasons["e"] == "moe_router not selected (--kernels)"
    assert "left out after a failed alignment" in reasons["f"]
    assert "no candidate passed" in reasons["g"]
    assert {x["family"] for x in out if x["path"] == "e"} == {"moe_router"}


def _result(**kw) -> AlignmentResult:
    logits = {"stats": {"rel_rms": 1e-7}, "kl": 0.0, "kl_max": 0.0, "top1_agreement": 1.0,
              "tokens": 16, "passed": True}
    return AlignmentResult(model="m", mode="percentile", reference_dtype="float64",
                           candidate_dtype="float32", seed=0, input_shapes=[[1, 16]], blocks=[],
                           forward_order=[], backward_order=[], logits=logits, **kw)


def test_verdict_line_never_a_plain_pass_and_strict_fails():
    full = _result(coverable=3)
    assert full.summary().startswith("alignment passed: 3 of 3 coverable blocks patched;")
    miss = [{"path": "model.layers.1.mlp.experts", "kind": "moe.experts", "family": "moe_experts",
             "reason": "patch rejected: structure does not fit the kernel"}]
    r = _result(coverable=3, not_checked=miss)
    line = r.summary()
    assert line.startswith("alignment PASS \u2014 2 of 3 coverable blocks patched; not checked: "
                           "model.layers.1.mlp.experts (patch rejected: structure does not fit "
                           "the kernel)"), line
    assert "**PASS** \u2014 2 of 3 coverable blocks patched" in r.to_markdown()
    assert "- not checked: `model.layers.1.mlp.experts` (moe.experts, moe_experts)" \
        in r.to_markdown()
    assert r.passed and r.verdict_passed and r.to_dict()["not_checked"] == miss
    r.check()
    r.strict = True
    assert r.passed and not r.verdict_passed and r.to_dict()["verdict_passed"] is False
    assert r.summary().startswith("alignment FAILED under --strict")
    assert "**FAIL** (--strict)" in r.to_markdown()
    with pytest.raises(AlignmentError, match="experts"):
        r.check()
    # a patched block whose backward the alignment never ran is said in the verdict too
    nb = _result(coverable=1, backward_not_checked=[
        {"path": "n", "kind": "norm.rms", "family": "rmsnorm",
         "reason": "no gradient flows through it"}])
    assert "PASS \u2014 1 of 1 coverable blocks patched; backward not checked: n (no gradient" \
        in nb.summary()


def test_run_verdict_under_strict_names_the_unpatched_blocks():
    from rich.console import Console

    from agents.state import RunConfig, RunState
    from onboarding.cli.run import _run_verdict

    miss = [{"path": PLANT_AT, "kind": "norm.rms", "family": "rmsnorm",
             "reason": "patch rejected: no binding matched the original"}]
    attempt = {"attempt": 1, "passed": True, "culprits": [], "excluded_before": [], "stop": None,
               "checked": f"13 of 14 coverable blocks patched; not checked: {PLANT_AT} (patch "
                          "rejected: no binding matched the original)",
               "coverable": 14, "not_checked": miss, "backward_not_checked": []}
    state = RunState(config=RunConfig(), run_dir="x", align_attempts=[attempt])
    passed, line = state.verdict()
    assert passed and line.startswith("alignment passed (attempt 1): 13 of 14 coverable") \
        and PLANT_AT in line, line
    state.config.strict = True
    console = Console(record=True, width=300)
    assert _run_verdict(state.model_dump(), console) == 3
    lines = console.export_text().strip().splitlines()
    assert lines[0].startswith(f"not checked: {PLANT_AT} (norm.rms, rmsnorm): patch rejected")
    assert "alignment FAILED under --strict" in lines[-1] and PLANT_AT in lines[-1] \
        and "(exit 3)" in lines[-1], lines


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def rejected_rmsnorm(monkeypatch):
    """The rmsnorm patch at PLANT_AT fails its calibration (every binding 5% off): the real
    first-call check rejects it and gives the block back unpatched."""
    import onboarding.patching.core as patching

    real = patching.patch_model

    def patch_and_spoil(model, graph, kernels, kinds=None):
        patches = real(model, graph, kernels, kinds)
        fwd = model.get_submodule(PLANT_AT).__dict__.get("forward")
        if isinstance(fwd, patching._Calibrated):
            fwd.bindings = {k: (lambda *a, fn=fn, **kw: fn(*a, **kw) * 1.05)
                            for k, fn in fwd.bindings.items()}
        return patches

    monkeypatch.setattr(patching, "patch_model", patch_and_spoil)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow
def test_rejected_patch_is_not_a_plain_pass_and_fails_under_strict(workdir, capsys,
                                                                   rejected_rmsnorm):
    """The must-show: a patch rejected at calibration is listed by path and reason in the
    terminal, alignment.json and the report's table; the verdict says what was checked; exit 0
    without --strict, exit 3 with it, the last line naming the block."""
    code = main(["align", "hf:qwen3_moe", "--seq", "16", "--kernels", "rmsnorm", "--out", "a"])
    out = _flat(capsys.readouterr().out)
    assert code == 0, out
    assert "alignment passed" not in out and "alignment PASS \u2014 " in out, out
    # the reason is the calibration's own comparison: the planted 5% error, element by element
    why = (f"{PLANT_AT} (patch rejected: no binding matched the original (x: tensor: FAIL "
           "rel_rms 5.00e-02 > 1.0e-05;")
    assert why in out, out
    d = json.loads((workdir / "a" / "alignment.json").read_text())
    assert d["passed"] and d["verdict_passed"] and d["coverable"] > len(d["not_checked"])
    rec = [x for x in d["not_checked"] if x["path"] == PLANT_AT]
    assert [{**x, "reason": x["reason"][:81]} for x in rec] == [
        {"path": PLANT_AT, "kind": "norm.rms", "family": "rmsnorm",
         "reason": "patch rejected: no binding matched the original (x: tensor: FAIL rel_rms 5.00e-02"}]
    md = (workdir / "a" / "alignment.md").read_text()  # what the report's section holds
    assert f"- not checked: `{PLANT_AT}` (norm.rms, rmsnorm): patch rejected" in md

    code = main(["align", "hf:qwen3_moe", "--seq", "16", "--kernels", "rmsnorm", "--out", "s",
                 "--strict"])
    out = capsys.readouterr().out
    assert code == 3, out
    last = _flat(out.strip().split("check failed:", 1)[-1])
    assert last.startswith("--strict:") and why in last and last.endswith("(exit 3)"), last
    d = json.loads((workdir / "s" / "alignment.json").read_text())
    assert d["passed"] and not d["verdict_passed"] and d["strict"]


@pytest.mark.slow
def test_run_strict_exits_3_and_the_report_lists_the_rejected_block(workdir, capsys,
                                                                    rejected_rmsnorm):
    code = main(["run", "hf:qwen3_moe", "--out", "r", "--seq", "16", "--kernels", "rmsnorm",
                 "--strict"])
    out = capsys.readouterr().out
    assert code == 3, out
    assert f"not checked: {PLANT_AT} (norm.rms, rmsnorm): patch rejected" in _flat(out), out
    last = _flat(out).rsplit("report:", 1)[-1]
    assert "alignment FAILED under --strict" in last and PLANT_AT in last \
        and "(exit 3)" in last, last
    report = (workdir / "r" / "report.md").read_text()
    assert f"- not checked: `{PLANT_AT}` (norm.rms, rmsnorm)" in report
    assert "coverable not checked" in report  # the attempts table


def test_patched_block_without_gradients_is_flagged_backward_not_checked(workdir, capsys):
    fix = f"{FIXTURES / 'verdict_models.py'}:NoGradNormLM"
    code = main(["align", fix, "--seq", "8", "--kernels", "rmsnorm", "--out", "g"])
    out = _flat(capsys.readouterr().out)
    assert code == 0, out
    d = json.loads((workdir / "g" / "alignment.json").read_text())
    active = {p["path"] for p in d["patches"] if p["status"] == "active"}
    assert {"frozen_norm", "norm_in", "norm"} <= active, d["patches"]
    flagged = {x["path"]: x["reason"] for x in d["backward_not_checked"]}
    assert flagged == {"frozen_norm": "no gradient flows through it"}, flagged
    assert "backward not checked: frozen_norm (no gradient flows through it)" in out, out
    assert "no_grad (backward not checked)" in out  # the table's bwd column
