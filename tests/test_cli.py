"""The command line: bad input exits 2 with one clear line and leaves no run directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onboarding.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
FIX = Path(__file__).resolve().parent / "fixtures" / "user_models.py"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _bad(workdir, capsys, argv, needle):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert needle in err, err
    assert len(err.splitlines()) <= 3, err  # one message (rich may wrap a long line)
    assert not (workdir / "runs").exists() or not any((workdir / "runs").iterdir())


def test_missing_path(workdir, capsys):
    _bad(workdir, capsys, ["run", "does/not/exist"], "no such path")


def test_directory_without_config(workdir, capsys):
    (workdir / "empty").mkdir()
    _bad(workdir, capsys, ["run", "empty"], "no config.json")


def test_malformed_json(workdir, capsys):
    (workdir / "m").mkdir()
    (workdir / "m" / "config.json").write_text('{"model_type": "llama",')
    _bad(workdir, capsys, ["run", "m"], "malformed JSON")


def test_unknown_model_type(workdir, capsys):
    (workdir / "m").mkdir()
    (workdir / "m" / "config.json").write_text('{"model_type": "no_such_arch"}')
    _bad(workdir, capsys, ["run", "m"], "unknown model_type")
    _bad(workdir, capsys, ["parse", "hf:no_such_arch"], "unknown model_type")


def test_remote_code_needs_the_flag(workdir, capsys):
    shutil.copytree(ROOT / "examples" / "onboard_hybrid", workdir / "hybrid")
    _bad(workdir, capsys, ["run", "hybrid"], "--trust-remote-code")


def test_module_ref_that_is_not_a_module(workdir, capsys):
    _bad(workdir, capsys, ["run", f"{FIX}:NOT_A_MODULE"], "not an nn.Module")
    _bad(workdir, capsys, ["run", "collections:OrderedDict"], "not a torch.nn.Module")


def test_forward_that_raises(workdir, capsys):
    _bad(workdir, capsys, ["run", f"{FIX}:RaisingModel"], "forward raised RuntimeError")


def test_bad_set(workdir, capsys):
    _bad(workdir, capsys, ["run", "hf:mixtral", "--set", "no_such_key=1"],
         "unknown config key")
    _bad(workdir, capsys, ["run", "hf:mixtral", "--set", "hidden_size=wide"], "expected int")
    _bad(workdir, capsys, ["run", f"{FIX}:make_tiny", "--set", "depth=3"], "unknown key")


def test_out_dir_not_overwritten(workdir, capsys):
    (workdir / "mine").mkdir()
    (workdir / "mine" / "notes.txt").write_text("keep me")
    _bad(workdir, capsys, ["run", "hf:mixtral", "--out", "mine"], "not empty")
    assert (workdir / "mine" / "notes.txt").read_text() == "keep me"


def test_parse_json_and_set(workdir, capsys):
    code = main(["parse", f"{FIX}:make_tiny", "--set", "width=24", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    g = json.loads(out)
    assert g["capture"] == "dispatch"
    emb = next(b for b in g["blocks"] if b["kind"] == "embedding")
    assert emb["outputs"][0]["shape"][-1] == 24


def test_parse_writes_out_dir(workdir, capsys):
    assert main(["parse", "hf:qwen3_moe", "--out", "o"]) == 0
    assert (workdir / "o" / "opgraph.json").is_file() and (workdir / "o" / "model.json").is_file()
    assert "layer pattern" in capsys.readouterr().out


def _onboard(*args, cwd):
    return subprocess.run([sys.executable, "-m", "onboarding.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~58 s on 2 cores; test_robustness keeps a signal-stopped resumable run in CI
def test_run_killed_between_nodes_resumes(tmp_path):
    run_dir = tmp_path / "r"
    first = _onboard("run", "hf:qwen3_moe", "--out", str(run_dir), "--stop-after", "parse",
                     cwd=tmp_path)
    assert first.returncode == -9, first.stderr  # SIGKILL after parse's checkpoint
    assert (run_dir / "opgraph.json").exists() and not (run_dir / "report.md").exists()
    second = _onboard("run", "--resume", str(run_dir), cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "resuming" in second.stdout and "report" in second.stdout
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    starts = [e["node"] for e in events if e["event"] == "start"]
    # Finished nodes are not redone; report may have begun before the kill landed.
    assert starts.count("load") == 1 and starts.count("parse") == 1
    assert starts[-1] == "report"
    report = (run_dir / "report.md").read_text()
    assert "## Operator graph" in report and "## Model" in report
    third = _onboard("run", "--resume", str(run_dir), cwd=tmp_path)
    assert third.returncode == 0 and "already complete" in " ".join(third.stdout.split())


def test_resume_of_non_run_dir(workdir, capsys):
    (workdir / "x").mkdir()
    _bad(workdir, capsys, ["run", "--resume", "x"], "not a run directory")


def test_default_run_is_the_hybrid_example(workdir, capsys):
    # Every kernel in the Triton interpreter makes the agent's alignment take minutes on 2 CPU
    # cores; here two families are patched (tests/test_align.py and test_patching.py cover
    # the others).
    assert main(["run", "--out", "demo", "--seq", "16", "--kernels", "rmsnorm,swiglu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sparse_attention.topk" in out and "linear_attention.gated_delta" in out
    report = (workdir / "demo" / "report.md").read_text()
    assert "params_by_kind.png" in report and (workdir / "demo" / "params_by_kind.png").exists()
    # On the CPU the tune node runs but skips tuning by default, and says so in the report.
    assert "## Tuning" in report and "skipped: no GPU" in report
    assert "## Training" in report and "Training skipped: no GPU" in report  # likewise
    # the summary screen: a verdict line per stage, skips with their reason, then the paths
    assert "summary load: " in out and "map: coverage: kernel" in out and "align: passed (attempt 1)" in out
    assert "plan: fits on 8 GPUs of " in out  # no GPU here: the plan's default of 8
    assert "coverable blocks checked" in out and "tune: not run (skipped: no GPU" in out
    assert "train: not run (skipped: no GPU" in out and "run dir: demo" in out
    assert "done align (" in out  # each finished stage with its wall time


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("<!-- test-command -->")[1].split("```")[1].strip().splitlines()
    assert blocks == ["pip install torch==2.13.0 -e '.[dev]' && pytest -q -n 2 -m \"not slow\""]
    # what the CI command leaves out runs nightly
    assert "pytest -q -n 2 -m slow" in (ROOT / ".ci" / "nightly").read_text()
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


def test_map_json(workdir, capsys):
    assert main(["map", "hf:qwen3_moe", "--json"]) == 0
    cov = json.loads(capsys.readouterr().out)
    statuses = {e["status"] for e in cov["entries"]}
    assert {"template", "torch_fast"} <= statuses <= {"kernel", "template", "torch_fast",
                                                      "uncovered"}
    # served by our kernel: a template, or the reviewed module in kernels/ rendered from it
    assert any(e["kind"] == "moe.experts" and e["status"] in ("template", "kernel")
               for e in cov["entries"])
    assert not (workdir / "runs").exists()


def test_generate_writes_checked_candidates(workdir, capsys):
    assert main(["generate", "hf:qwen3_moe", "--out", "g"]) == 0
    cands = json.loads((workdir / "g" / "candidates.json").read_text())
    assert cands and all(c["status"] == "passed" for c in cands)
    for c in cands:
        assert (workdir / c["path"]).is_file() or Path(c["path"]).is_file()
    assert "passed" in capsys.readouterr().out


def test_align_bad_kernels_and_bitwise_identity(workdir, capsys):
    _bad(workdir, capsys, ["align", "hf:qwen3_moe", "--kernels", "nosuch"], "unknown families")
    code = main(["align", "tiny_dense", "--dtype", "fp32", "--reference", "fp32", "--mode",
                 "bitwise", "--kernels", "none", "--seq", "16", "--out", "bw"])
    assert code == 0
    result = json.loads((workdir / "bw" / "alignment.json").read_text())
    assert result["passed"] is True
    assert (workdir / "bw" / "alignment.png").is_file()


def test_tune_one_family(workdir, capsys):
    assert main(["tune", "--kernel", "rmsnorm", "--shapes", "64", "--trials", "2",
                 "--out", "t"]) == 0
    tuned = json.loads(next((workdir / "t" / "kernels" / "rmsnorm").glob("*.tuned.json"))
                       .read_text())
    assert "d_le_512" in json.dumps(tuned)
    capsys.readouterr()
    _bad(workdir, capsys, ["tune", "--kernel", "nosuch", "--shapes", "64"], "unknown kernel family")


def test_tune_bad_input(workdir, capsys):
    _bad(workdir, capsys, ["tune"], "give MODEL")
    _bad(workdir, capsys, ["tune", "tiny_dense", "--shapes", "64"], "without MODEL")
    _bad(workdir, capsys, ["tune", "--out", "nothing_here"], "no generated run there")
    _bad(workdir, capsys, ["tune", "--kernel", "moe_experts", "--shapes", "256", "--dims",
                           "N=64,E=8"], "missing ['F', 'TOPK']")
    _bad(workdir, capsys, ["tune", "--kernel", "conv1d", "--shapes", "256", "--dims", "N=64"],
         "no real-shape timing inputs for conv1d")
    _bad(workdir, capsys, ["tune", "--kernel", "rmsnorm", "--shapes", "64", "--space",
                           "BLOCK_N=3"], "--space BLOCK_N=[3]")
    _bad(workdir, capsys, ["tune", "--kernel", "rmsnorm", "--shapes", "64", "--compare-grid",
                           "--tpe-fraction", "0"], "--tpe-fraction")
    _bad(workdir, capsys, ["tune", "--kernel", "rmsnorm", "--shapes", "64", "--space-only"],
         "--space-only needs --space")
    # the full rmsnorm space is a 5184-config grid: refused, and its run directory removed
    _bad(workdir, capsys, ["tune", "--kernel", "rmsnorm", "--shapes", "64", "--compare-grid",
                           "--out", "big"], "the grid holds 5184 configs")
    assert not (workdir / "nothing_here").exists() and not (workdir / "big").exists()


def test_tune_model_end_to_end(workdir, capsys):
    """parse -> map -> generate into a fresh run directory, then one study per bucket of the
    chosen family, tuned.json beside the candidate, tune.json and the plot for the report."""
    assert main(["tune", "tiny_dense", "--seq", "16", "--kernel", "rmsnorm", "--trials", "1",
                 "--no-aot", "--repeats", "1", "--out", "r"]) == 0
    data = json.loads((workdir / "r" / "tune.json").read_text())
    (study,) = data["studies"]  # tiny_dense: every RMSNorm has D=64, one bucket
    assert (study["family"], study["bucket"], study["size"]) == ("rmsnorm", "d_le_512", 64)
    assert study["dims"] == {"N": 16, "D": 64} and len(study["blocks"]) >= 3
    tuned = json.loads((workdir / "r" / Path(study["module"]).with_suffix("")
                        ).with_suffix(".tuned.json").read_text())
    assert tuned["buckets"]["d_le_512"]["config"] == study["result"]["best_config"]
    assert (workdir / "r" / "tune_best.png").is_file()
    assert "d_le_512" in capsys.readouterr().out
    # The agent's tune node on the same run: it continues the study and records the attempt.
    from agents.nodes import tune_node
    from agents.state import RunConfig, RunState
    from onboarding.report import build_report

    update = tune_node(RunState(config=RunConfig(tune_trials=1, tune_kernels=["rmsnorm"],
                                                 tune_aot=False), run_dir="r"))
    (attempt,) = update["tune_attempts"]
    assert attempt["attempt"] == 1 and attempt["studies"] == 1
    (best,) = attempt["best"]
    assert (best["family"], best["bucket"], best["trials"]) == ("rmsnorm", "d_le_512", 2)
    assert best["best_ms"] > 0 and update["summary"]["tuned_studies"] == 1
    report = build_report(workdir / "r", title="t").read_text()
    assert "## Tuning" in report and "### rmsnorm/plain — bucket `d_le_512`" in report
    assert "| d_le_512 | 2 | 2 |" in report and "tune_best.png" in report
    # Default config on the CPU: the node skips tuning and says why.
    update = tune_node(RunState(config=RunConfig(), run_dir="r"))
    assert "no GPU" in update["tune_attempts"][0]["skipped"]
    assert "skipped: no GPU" in build_report(workdir / "r", title="t").read_text()



def test_bench_case_and_impl_selection():
    from onboarding.bench.cases import select_cases
    from onboarding.bench.harness import BenchCase
    from onboarding.errors import InputError

    def case(name):
        return BenchCase(family="f", name=name, shape={}, min_bytes=1, flops=0,
                         setup=lambda device: {"ours": 1, "ours@BLOCK=64": 2, "fla": 3, "eager": 4})

    cases = [case("B2T4096"), case("B1T8192"), case("B1T32768")]
    picked = select_cases(cases, ["T8192", "T32768"], ["ours", "fla"])
    assert [c.name for c in picked] == ["B1T8192", "B1T32768"]
    assert set(picked[0].setup("cpu")) == {"ours", "ours@BLOCK=64", "fla"}
    # a sweep row named by itself runs without its "ours" row
    assert set(select_cases(cases, ["T8192"], ["ours@BLOCK=64", "fla"])[0].setup("cpu")) == {"ours@BLOCK=64", "fla"}
    assert select_cases(cases) == cases
    with pytest.raises(InputError, match="no benchmark case matches"):
        select_cases(cases, ["T99"])


def test_bench_list_names_the_cases_without_a_gpu(workdir, capsys, monkeypatch):
    """`onboard bench list` prints the selected cases (shape, FLOPs, anchors on request) without
    building them: no GPU, nothing allocated; a family without cases exits 2 naming the known ones."""
    from onboarding.bench.cases import cases_for

    assert main(["bench", "list", "--family", "ssd", "--case", "H128", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    want = [c for c in cases_for(["ssd"]) if "H128" in c.name]
    assert [r["case"] for r in rows] == [c.name for c in want] and rows
    assert rows[0]["shape"]["H"] == 128 and rows[0]["gflop"] == round(want[0].flops / 1e9, 3)
    assert "mamba_ssm" in rows[0]["on_request"]
    # the rows a run would time, sweeps included, named by building the case on the meta device
    sweep = [r for r in rows[0]["rows"] if r.startswith("ours@")]
    assert rows[0]["rows"][:2] == ["ours", "ours_fwd"] and "mamba_ssm" not in rows[0]["rows"]
    assert sweep and all(r.count("=") >= 1 for r in sweep), rows[0]["rows"]
    assert main(["bench", "list", "--family", "ssd", "--case", "H128", "--impl",
                 f"ours_fwd,{sweep[0]},mamba_ssm", "--json"]) == 0
    picked = json.loads(capsys.readouterr().out)[0]
    assert sorted(picked["rows"]) == sorted(["ours_fwd", sweep[0], "mamba_ssm"]) and not picked["on_request"]
    monkeypatch.setenv("COLUMNS", "240")  # the table unfolded: each name on one line
    assert main(["bench", "list", "--family", "ssd"]) == 0
    out = capsys.readouterr().out
    assert "B1T8192H64P64G8N128" in out and "sweep rows" in out
    assert all(f"ssd/{rows[0]['case']} │ {r} " in out for r in sweep), out
    _bad(workdir, capsys, ["bench", "list", "--family", "nope"], "no benchmark cases for ['nope']")


def test_impl_list_keeps_a_sweep_rows_own_commas():
    from onboarding.bench.cases import split_impls

    assert split_impls("ours_fwd,ours@a=1,b=2,mamba_ssm,ours@c=3_fwd,eager") == [
        "ours_fwd", "ours@a=1,b=2", "mamba_ssm", "ours@c=3_fwd", "eager"]
    assert split_impls("ours,fla") == ["ours", "fla"] and split_impls(None) is None


def test_bench_list_dry_rows_meta_device_and_its_limits(tmp_path, monkeypatch):
    """`dry_rows` builds a case on the meta device: seeded generators work there, our kernels
    render into a folder it removes, and a setup that needs data (bincount) gives no rows and
    the reason instead of failing."""
    import tempfile

    from onboarding.bench.cases import dry_rows, kernel
    from onboarding.bench.harness import BenchCase

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # torch's inductor puts its cache under the temp dir the first time a process asks for it
    # (this test alone, not after others had): not this test's business
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path.parent / "inductor_cache"))

    def setup(device):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(4, 8, device=device, generator=g) * 0.5
        assert x.device.type == "meta"
        kernel("rmsnorm", "plain")
        return {"ours": lambda i: x, "ours@BLOCK_N=4": lambda i: x, "eager": lambda i: x}

    def needs_data(device):
        torch.bincount(torch.zeros(4, dtype=torch.long, device=device))
        return {"ours": lambda i: None}

    case = BenchCase(family="f", name="c", shape={}, min_bytes=1, flops=0, setup=setup)
    assert dry_rows(case) == (["ours", "ours@BLOCK_N=4", "eager"], "")
    assert list(tmp_path.iterdir()) == []  # the rendered kernel's folder is gone
    assert torch.Generator(device="cpu").device.type == "cpu"  # the real class is back
    rows, why = dry_rows(BenchCase(family="f", name="d", shape={}, min_bytes=1, flops=0,
                                   setup=needs_data))
    assert rows is None and "bincount" in why

def test_bench_case_names_anchor_at_start_and_end():
    """`--case` is a substring; ``PAT$`` only at the name's end (``/fwd$`` leaves ``/fwdbwd``
    out), ``^PAT`` only at its start, ``^NAME$`` the whole name."""
    from onboarding.bench.cases import select_cases
    from onboarding.bench.harness import BenchCase

    names = ["mla-T8192/fwd", "mla-T8192/fwdbwd", "mla-T32768/fwd", "xmla-T8192/fwd"]
    cases = [BenchCase(family="f", name=n, shape={}, min_bytes=1, flops=0, setup=lambda d: {})
             for n in names]

    def pick(*pats):
        return [c.name for c in select_cases(cases, list(pats))]

    assert pick("T8192/fwd") == ["mla-T8192/fwd", "mla-T8192/fwdbwd", "xmla-T8192/fwd"]
    assert pick("T8192/fwd$") == ["mla-T8192/fwd", "xmla-T8192/fwd"]
    assert pick("^mla-T8192") == ["mla-T8192/fwd", "mla-T8192/fwdbwd"]
    assert pick("^mla-T8192/fwd$") == ["mla-T8192/fwd"]
    assert pick("/fwd$", "^xmla") == ["mla-T8192/fwd", "mla-T32768/fwd", "xmla-T8192/fwd"]
    with pytest.raises(Exception, match="no benchmark case matches"):
        pick("^T8192")


def test_bench_kernel_breakdown_aggregates_per_step_and_folds_the_tail():
    from onboarding.bench.harness import aggregate_kernels, format_table

    events = [("gemm", 3000.0, 5), ("norm", 1000.0, 10), ("gemm", 1000.0, 5)]
    events += [(f"tiny{i}", 10.0, 5) for i in range(4)]
    rows = aggregate_kernels(events, steps=5, top=4)
    assert [r["kernel"] for r in rows] == ["gemm", "norm", "tiny0", "(other kernels)"]
    assert rows[0]["ms"] == pytest.approx(0.8) and rows[0]["calls"] == 2
    assert rows[1]["ms"] == pytest.approx(0.2) and rows[1]["calls"] == 2
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert rows[-1]["ms"] == pytest.approx(3 * 10 / 5 / 1e3) and rows[-1]["calls"] == 3
    row = {"family": "f", "case": "c", "impl": "ours", "timing": None, "gbps": None,
           "roofline_frac": None, "ratios": {}, "error": "", "check": {}, "kernels": rows}
    text = format_table({"rows": [row]})
    assert "f/c ours: kernels 1.008 ms per step" in text and "(other kernels)" in text


# ---- exit codes: README's table, one case per command ----------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["map", "does/not/exist"], "no such path"),
    (["generate", "does/not/exist"], "no such path"),
    (["align", "does/not/exist"], "no such path"),
    (["tune", "--kernel", "no_such_family", "--shapes", "64"], "no_such_family"),
    (["bench", "--family", "no_such_family"], "no_such_family"),
    (["regress", "does/not/exist"], "does/not/exist"),
    (["train", "does/not/exist", "--dry-run"], "no such path"),
    (["scale", "does/not/exist", "--gpus", "2", "--ep", "1"], "no such path"),
    (["run", "hf:qwen3_moe", "--max-align-retries", "-1"], "--max-align-retries"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_bad_input_exits_2_for_every_command(workdir, capsys, argv, needle):
    _bad(workdir, capsys, argv, needle)


def test_internal_failure_exits_1(workdir, capsys, monkeypatch):
    import onboarding.cli.analyse as cli

    def broken(args, console):
        raise RuntimeError("a bug in onboard")

    monkeypatch.setattr(cli, "cmd_analyse", broken)
    assert main(["map", "hf:qwen3_moe"]) == 1
    assert "internal error: RuntimeError: a bug in onboard" in capsys.readouterr().err


def _last_line(out: str) -> str:
    return " ".join(out.split()).rsplit("report:", 1)[-1]


def test_run_whose_model_fails_alignment_exits_3_without_a_useless_retry(workdir, capsys):
    """CancellingLM's own code is 2.6% off in fp32: no kernel of ours is to blame, so the agent
    must not re-run the same alignment, and the run's verdict is exit 3, said on the last line."""
    code = main(["run", f"{FIX}:CancellingLM", "--out", "c", "--seq", "16"])
    out = capsys.readouterr().out
    assert code == 3, out
    last = _last_line(out)
    assert "alignment FAILED after 1 attempt(s)" in last and "no retry" in last, last
    assert "logits rel_rms" in last and "(exit 3)" in last, last
    events = [json.loads(x) for x in (workdir / "c" / "events.jsonl").read_text().splitlines()]
    assert [e["node"] for e in events if e["event"] == "start"].count("align") == 1
    d = json.loads((workdir / "c" / "alignment.json").read_text())
    assert d["passed"] is False and d["logits"]["passed"] is False
    assert d["culprit"] == {"fwd": [], "bwd": []}
    # `onboard align` says the same with exit 3
    assert main(["align", f"{FIX}:CancellingLM", "--seq", "16"]) == 3


PLANT_AT = "model.layers.0.post_attention_layernorm"


@pytest.fixture
def planted_rmsnorm(monkeypatch):
    """Our rmsnorm kernel at PLANT_AT made 5% too large (forward), while it is patched."""
    import onboarding.patching.core as patching
    from onboarding.testing.planted import plant

    real = patching.patch_model

    def patch_and_plant(model, graph, kernels, kinds=None):
        patches = real(model, graph, kernels, kinds)
        if any(r.path == PLANT_AT and r.status in ("pending", "active") for r in patches.records):
            patches._undo.append(plant(model.get_submodule(PLANT_AT), "scale", 0.05))
        return patches

    monkeypatch.setattr(patching, "patch_model", patch_and_plant)


def test_run_with_a_planted_kernel_error_exits_3_naming_the_block(workdir, capsys,
                                                                 planted_rmsnorm):
    code = main(["run", "hf:qwen3_moe", "--out", "p", "--seq", "16", "--kernels", "rmsnorm",
                 "--max-align-retries", "0"])
    out = capsys.readouterr().out
    assert code == 3, out
    last = _last_line(out)
    assert "alignment FAILED after 1 attempt(s)" in last and PLANT_AT in last, last
    d = json.loads((workdir / "p" / "alignment.json").read_text())
    assert d["culprit"]["fwd"][0] == PLANT_AT


@pytest.mark.slow  # 26-31 s in CI; the planted-error exit (test_run_with_a_planted_kernel_error_exits_3_naming_the_block) stays
def test_retry_leaves_the_culprits_kernel_out_and_then_passes(workdir, capsys, planted_rmsnorm):
    code = main(["run", "hf:qwen3_moe", "--out", "r", "--seq", "16", "--kernels", "rmsnorm"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "alignment passed (attempt 2)" in _last_line(out)
    report = (workdir / "r" / "report.md").read_text()
    assert "### Alignment attempts" in report and f"`{PLANT_AT}` (rmsnorm)" in report
    d = json.loads((workdir / "r" / "alignment.json").read_text())
    rec = [p for p in d["patches"] if p["path"] == PLANT_AT]
    assert d["passed"] and not rec  # the second attempt ran the model's own norm there
    assert any(p["family"] == "rmsnorm" and p["status"] == "active" for p in d["patches"])


def test_run_verdict_fails_on_a_failed_training_loss_check_and_never_passes_what_did_not_run():
    from rich.console import Console

    from agents.state import RunConfig, RunState
    from onboarding.cli.run import _run_verdict

    aligned = {"attempt": 1, "passed": True, "culprits": [], "excluded_before": [], "stop": None}
    state = RunState(config=RunConfig(), run_dir="x", align_attempts=[aligned],
                     train_attempts=[{"attempt": 1, "steps": 5, "passed": False, "exit_code": 0,
                                      "summary": "loss 2.31 vs 2.29 at step 5: rel 8.7e-3 > 1e-5"}])
    console = Console(record=True, width=200)
    assert _run_verdict(state.model_dump(), console) == 3
    text = console.export_text()
    assert "training loss check FAILED: loss 2.31" in text and "(exit 3)" in text
    # training that wrote no verdict is a failure too, never a pass
    state.train_attempts = [{"attempt": 1, "steps": 5, "passed": None, "exit_code": 1}]
    assert _run_verdict(state.model_dump(), Console(record=True)) == 3
    # skipped training is said as not run; the run passes on its alignment
    state.train_attempts = [{"attempt": 1, "steps": 0, "skipped": "skipped: no GPU"}]
    passed, line = state.verdict()
    assert passed and "training not run (skipped: no GPU)" in line
    state.align_attempts = []
    assert "alignment not run" in state.verdict()[1]


def test_python_dash_m_version_and_default_model(workdir, capsys):
    from onboarding import __version__

    out = subprocess.run([sys.executable, "-m", "onboarding", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"onboard {__version__}", out
    bad = subprocess.run([sys.executable, "-m", "onboarding", "map", "no/such/dir"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no such path" in bad.stderr
    # MODEL is optional where the help names a default: the built-in example
    assert main(["map"]) == 0
    assert "onboard_hybrid" in " ".join(capsys.readouterr().out.split())


def test_run_summary_screen_has_one_verdict_line_per_stage(tmp_path):
    """The summary after `onboard run`: coverage counts, the alignment verdict with what it did
    not check, tuning best vs default (and a budget stop), training tok/s, MFU and the loss
    verdict, skips with their reason, stage times, then the report and run directory."""
    from rich.console import Console

    from agents.state import RunConfig, RunState
    from onboarding.cli.run import print_summary

    (tmp_path / "report.md").write_text("# r\n")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "compare.json").write_text(json.dumps(
        {"passed": True, "metrics": {"parallel": {"tokens_per_s": 12345.6, "mfu": 0.123}}}))
    events = [{"time": 10.0, "node": "align", "event": "start"},
              {"time": 22.5, "node": "align", "event": "done"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    state = RunState(
        config=RunConfig(), run_dir=str(tmp_path), model_name="m",
        completed=["load", "parse", "map", "generate", "align", "tune", "train", "report"],
        summary={"total_params": 17_400_000, "active_params": 17_400_000, "capture": "export",
                 "layer_pattern": "LA", "blocks": 30, "unknown_blocks": 0,
                 "coverage": {"kernel": 0, "template": 20, "torch_fast": 9, "uncovered": 1},
                 "candidates": 6, "candidates_passed": 6},
        align_attempts=[{"attempt": 1, "passed": True, "culprits": [], "coverable": 20,
                         "not_checked": [{"path": "model.norm", "kind": "norm.rms",
                                          "family": "rmsnorm", "reason": "not selected"}]}],
        tune_attempts=[{"attempt": 1, "studies": 1, "budget_s": 60.0, "best": [
            {"family": "rmsnorm", "variant": "plain", "bucket": "d_le_512", "best_ms": 0.5,
             "default_ms": 1.0, "trials": 3, "complete": 3,
             "stopped": "stopped at budget (60 s) after 3 of 20 trials"}]}],
        train_attempts=[{"attempt": 1, "steps": 20, "nproc": 1, "passed": True}])
    console = Console(record=True, width=300)
    print_summary(state.model_dump(), tmp_path, console)
    text = console.export_text()
    assert "map:      coverage: kernel 0, template 20, torch_fast 9, uncovered 1" in text
    assert ("align:    passed (attempt 1); 19 of 20 coverable blocks checked; not checked: "
            "model.norm (not selected) [12.5 s]") in text
    assert ("tune:     1 study within 60 s: rmsnorm d_le_512 0.5 ms vs default 1 ms (2.00x), "
            "3 trials (stopped at budget)") in text
    assert "train:    20 steps on 1 process: 12,346 tok/s, MFU 12.3%; loss matches" in text
    assert f"report:   {tmp_path / 'report.md'}" in text and f"run dir:  {tmp_path}" in text
    # skips say why
    state.tune_attempts = [{"attempt": 1, "skipped": "skipped: no GPU"}]
    state.train_attempts = [{"attempt": 1, "steps": 0, "skipped": "skipped: no GPU (set ...)"}]
    console = Console(record=True, width=300)
    print_summary(state.model_dump(), tmp_path, console)
    text = console.export_text()
    assert "tune:     not run (skipped: no GPU)" in text
    assert "train:    not run (skipped: no GPU (set ...))" in text


@pytest.mark.parametrize("flags,want", [
    ([], ("strict", None, True, "graph")),
    (["--tune-gpu-gate", "overlap", "--tune-no-compile-ahead", "--tune-no-join-studies",
      "--tune-timing", "events"], ("overlap", False, False, "events"))])
def test_run_hands_its_gpu_sharing_choices_to_the_tune_stage(workdir, monkeypatch, flags, want):
    """`onboard run --tune-gpu-gate / --tune-no-compile-ahead / --tune-no-join-studies /
    --tune-timing` reach the RunConfig as `onboard run` builds it, and the tune node gives them to
    TuneConfig (the tune stage itself faked: no GPU here)."""
    from agents.nodes import tune_node
    from agents.state import RunConfig, RunState
    from onboarding.cli.common import gpu_sharing
    from onboarding.cli.main import build_parser
    from onboarding.tune import run as tune_run_mod

    args = build_parser().parse_args(["run", *flags])
    seen = {}

    def fake(run_dir, cfg, **kw):
        seen["cfg"] = cfg
        return {"studies": [], "notes": [], "seconds": 0.0}

    monkeypatch.setattr(tune_run_mod, "tune_run", fake)
    (workdir / "r").mkdir()
    config = RunConfig(tune_trials=1, **{f"tune_{k}": v for k, v in gpu_sharing(args, "tune-").items()})
    tune_node(RunState(config=config, run_dir="r"))
    cfg = seen["cfg"]
    assert (cfg.gpu_gate, cfg.compile_ahead, cfg.join_studies, cfg.timing) == want


@pytest.mark.parametrize("flags,gate,ahead,join,timing", [
    ([], "strict", None, True, "graph"),
    (["--gpu-gate", "overlap", "--no-compile-ahead", "--no-join-studies", "--timing", "events"],
     "overlap", False, False, "events")])
def test_tune_hands_its_gpu_sharing_choices_to_tune_config(tmp_path, monkeypatch, flags, gate,
                                                           ahead, join, timing):
    """`onboard tune --gpu-gate / --no-compile-ahead / --no-join-studies / --timing` reach
    TuneConfig (the model's tuning itself faked)."""
    from rich.console import Console

    from onboarding.cli import tune as tune_cli
    from onboarding.cli.main import build_parser

    seen = {}
    monkeypatch.setattr(tune_cli, "_tune_model", lambda args, cfg, console: seen.setdefault("cfg", cfg) and 0)
    args = build_parser().parse_args(["tune", "--out", str(tmp_path / "r"), *flags])
    tune_cli.cmd_tune(args, Console(record=True))
    cfg = seen["cfg"]
    assert (cfg.gpu_gate, cfg.compile_ahead, cfg.join_studies, cfg.timing) == \
        (gate, ahead, join, timing)
