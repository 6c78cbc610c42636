"""The nightly regression suite off the GPU: verdicts on synthetic rows of known noise, the A/A
timing of a case with injected timers, training rows, the history and its change points, the
dashboard's structure, the baseline's refusal to be replaced silently, the workflow files."""

from __future__ import annotations

import math
import random
import re
import sqlite3
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from onboarding.bench import compare as C
from onboarding.bench.harness import BenchCase
from onboarding.bench.history import History, change_points, series_change_points
from onboarding.bench.suite import (NightlyConfig, NightlyRow, TrainModel, nightly_cases,
                                    row_env, time_case, train_rows)
from onboarding.cli.main import main
from onboarding.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
ENV = {"gpu": "NVIDIA Test", "commit": "abc1234", "date": "2026-12-02 01:00:00", "torch": "x",
       "triton": "y", "transformers": "z", "onboard": "0.1.0"}


def _row(value: float, noise: float, rounds: int = 5, *, key: str = "kernels/fam/case/ours",
         unit: str = "ms", better: str = "lower", seed: int = 0, status: str = "ok") -> dict:
    """A timed row whose A/A pairs scatter with relative sigma `noise` around `value`."""
    rng = random.Random(seed)
    pairs = [[value * math.exp(rng.gauss(0, noise)), value * math.exp(rng.gauss(0, noise))]
             for _ in range(rounds)]
    return {"key": key, "group": key.split("/")[1], "unit": unit, "better": better,
            "value": value, "status": status, "error": "" if status == "ok" else "boom",
            "pairs": pairs, "noise": C.noise_floor([tuple(p) for p in pairs]), "metric": "time_ms"}


def test_noise_floor_recovers_a_known_sigma():
    rng = random.Random(1)
    pairs = [(math.exp(rng.gauss(0, 0.02)), math.exp(rng.gauss(0, 0.02))) for _ in range(4000)]
    assert C.noise_floor(pairs) == pytest.approx(0.02, rel=0.06)
    assert C.noise_floor([]) is None
    assert C.noise_floor([(1.0, 1.0)] * 5) == C.NOISE_MIN


@pytest.mark.parametrize("now, expected", [
    (dict(value=1.00, noise=0.01, seed=2), "ok"),
    (dict(value=1.30, noise=0.01, seed=3), "regression"),
    (dict(value=0.70, noise=0.01, seed=4), "improvement"),
    (dict(value=1.30, noise=0.01, rounds=2, seed=5), "suspicious"),  # too few A/A rounds
    (dict(value=1.30, noise=0.20, seed=6), "suspicious"),  # noise sets a threshold above 50%
    (dict(value=1.04, noise=0.01, seed=7), "ok"),  # inside the family minimum (5%)
    (dict(value=1.00, noise=0.01, status="error", seed=8), "regression"),  # broke since
])
def test_verdicts_on_synthetic_rows(now, expected):
    base = _row(1.0, 0.01, seed=1)
    v = C.judge(_row(**now), base, 0.05)
    assert v.verdict == expected, v


def test_threshold_follows_the_noise_above_the_family_minimum():
    base, now = _row(1.0, 0.03, seed=1), _row(1.2, 0.03, seed=2)
    v = C.judge(now, base, 0.05)
    assert v.threshold == pytest.approx(C.K_SIGMA * math.hypot(now["noise"], base["noise"]))
    assert v.threshold > 0.05
    quiet = C.judge(_row(1.2, 0.002, seed=2), _row(1.0, 0.002, seed=1), 0.05)
    assert quiet.threshold == 0.05 and quiet.verdict == "regression"


def test_higher_is_better_rows_and_missing_rows():
    tps = dict(key="train/m/small/tokens_per_s", unit="tok/s", better="higher")
    base = _row(1000.0, 0.01, seed=1, **tps)
    assert C.judge(_row(700.0, 0.01, seed=2, **tps), base, 0.05).verdict == "regression"
    assert C.judge(_row(1300.0, 0.01, seed=2, **tps), base, 0.05).verdict == "improvement"
    res = C.compare({"rows": [_row(1.0, 0.01, key="kernels/fam/new/ours")]},
                    {"rows": [_row(1.0, 0.01, key="kernels/fam/old/ours"),
                              _row(1.0, 0.01, key="kernels/other/x/ours")]}, {})
    got = {v.key: (v.verdict, v.reason) for v in res}
    assert got["kernels/fam/new/ours"][0] == "suspicious"  # no baseline row
    assert got["kernels/fam/old/ours"] == ("suspicious", "in the baseline, not measured now")
    assert "kernels/other/x/ours" not in got  # a family this run did not cover


def test_against_rows_are_judged_against_the_trees_baseline_row():
    base = {"rows": [_row(1.0, 0.01, seed=1)]}
    worse = _row(2.0, 0.01, key="kernels/fam/case/tpl:worse", seed=2)
    worse["baseline_key"] = "kernels/fam/case/ours"
    (v,) = C.compare({"rows": [worse]}, base, {"fam": 0.05})
    assert v.verdict == "regression" and v.change == pytest.approx(1.0)


def test_fact_rows():
    fact = {"key": "align/example/alignment.verdict", "group": "align", "unit": "fact",
            "better": "equal", "metric": "alignment.verdict", "value": "passed", "status": "ok"}
    assert C.judge(fact, dict(fact), 0.0).verdict == "ok"
    assert C.judge({**fact, "value": "FAILED"}, fact, 0.0).verdict == "regression"
    err = {**fact, "metric": "alignment.worst_fwd_rel_rms", "value": 1e-7}
    assert C.judge({**err, "value": 3e-7}, err, 0.0).verdict == "ok"  # within 4x
    assert C.judge({**err, "value": 1e-5}, err, 0.0).verdict == "regression"


def test_false_positive_rate_of_pure_noise_is_small():
    """Same implementation, two runs: with the thresholds from the pairs alone (no family
    minimum) at most 1% of 400 rows of 2% noise are called regressions."""
    rng = random.Random(0)
    fp = 0
    for i in range(400):
        base = _row(1.0, 0.02, seed=rng.randrange(10**9))
        now = _row(1.0, 0.02, seed=rng.randrange(10**9))
        now["value"] = statistics_median(now["pairs"])
        base["value"] = statistics_median(base["pairs"])
        fp += C.judge(now, base, 0.0).verdict == "regression"
    assert fp <= 4


def statistics_median(pairs):
    import statistics

    return statistics.median([x for p in pairs for x in p])


def test_time_case_times_an_aa_pair_per_impl_interleaved():
    """A CPU case with injected timers: every impl timed twice a round, rounds rotated; our row
    untimed when the check fails; --against rows point at the tree's row."""
    calls = []
    speeds = {"ours": 1.0, "eager": 3.0}

    def setup(device):
        return {n: (lambda i, n=n: n) for n in ("ours", "eager", "compile", "tpl:x")}

    def timer(step):
        name = step(0)
        calls.append(name)
        return speeds.get(name, 2.0) * (1 + 0.01 * (len(calls) % 3))

    case = BenchCase(family="fam", name="c1", shape={"N": 8}, min_bytes=8_000_000, flops=0,
                     setup=setup)
    cfg = NightlyConfig(parts=("kernels",), rounds=4, graph=False, against=(Path("."), "tpl:x"))
    rows = time_case(case, ("ours", "eager"), torch.device("cpu"), cfg, {"copy_tb_s": 4.0}, ENV,
                     lambda s: None, round_timer=timer, warm=lambda s: 1.0)
    by = {r.impl: r for r in rows}
    assert set(by) == {"ours", "eager", "tpl:x"}  # compile not asked for
    assert calls.count("ours") == 8 and calls.count("eager") == 8  # 2 x 4 rounds
    assert calls[:6] != calls[6:12]  # rounds rotate
    assert len(by["ours"].pairs) == 4 and by["ours"].noise is not None
    assert by["ours"].value == pytest.approx(1.01, abs=0.011)
    assert by["ours"].gbps == pytest.approx(8_000_000 / (by["ours"].value * 1e-3) / 1e9)
    assert by["tpl:x"].baseline_key == "kernels/fam/c1/ours"
    assert by["ours"].env["commit"] == "abc1234" and by["ours"].env["gpu"] == "NVIDIA Test"

    bad = BenchCase(family="fam", name="c2", shape={}, min_bytes=1, flops=0, setup=setup,
                    check=lambda device: {"ok": 0.0, "out0": 0.5})
    rows = time_case(bad, ("ours", "eager"), torch.device("cpu"),
                     NightlyConfig(parts=("kernels",), rounds=3, graph=False), {"copy_tb_s": 4.0},
                     ENV, lambda s: None, round_timer=timer, warm=lambda s: 1.0)
    by = {r.impl: r for r in rows}
    assert by["ours"].status == "check failed" and by["ours"].value is None
    assert by["eager"].status == "ok" and len(by["eager"].pairs) == 3


def test_train_rows_alternate_steps():
    steps = [{"tokens_per_s": 1000.0 + i, "mfu": 0.05, "peak_mem_bytes": 100 + i}
             for i in range(14)]
    rows = {r.metric: r for r in train_rows(TrainModel(ref="hf:m"), steps, 3, 5, ENV)}
    tps = rows["tokens_per_s"]
    assert tps.pairs[0] == [1003.0, 1004.0] and len(tps.pairs) == 5
    assert tps.value == pytest.approx(1007.5) and tps.better == "higher"
    assert rows["peak_mem_bytes"].value == 112 and rows["peak_mem_bytes"].group == "train.memory"
    no_mfu = [{**s, "mfu": None} for s in steps]
    assert {r.metric: r.status for r in train_rows(TrainModel(ref="hf:m"), no_mfu, 3, 5, ENV)
            }["mfu"] == "error"


def test_every_family_nightly_case_exists_and_leaves_fla_out():
    cases, minimums = nightly_cases()
    assert cases and set(minimums) == {c.family for c, _ in cases}
    assert not any(i.startswith("fla") for _, impls in cases for i in impls)
    with pytest.raises(InputError, match="no nightly cases"):
        nightly_cases(["no_such_family"])


def test_change_points_find_a_small_persistent_step():
    rng = random.Random(3)
    flat = [100 * (1 + rng.gauss(0, 0.005)) for _ in range(20)]
    assert change_points(flat) == []
    step = flat[:10] + [x * 1.03 for x in flat[10:]]  # 3%: under a 5% nightly threshold
    (cp,) = change_points(step)
    assert cp.index == 10 and cp.rel == pytest.approx(0.03, abs=0.01)
    night = C.judge(_row(step[10] / 100, 0.005, seed=1), _row(step[9] / 100, 0.005, seed=2), 0.05)
    assert night.verdict == "ok"  # one night's threshold does not see it


def _result(i: int, value: float, commit: str) -> dict:
    env = {**ENV, "commit": commit, "date": f"2026-12-{i + 1:02d} 01:00:00"}

    def kernel_row(key, v, min_bytes, flops):
        r = _row(v, 0.005, key=key, seed=i)
        return asdict(NightlyRow(
            key=key, part="kernels", group=key.split("/")[1], case="case", impl="ours",
            metric="time_ms", unit="ms", better="lower", value=v, pairs=r["pairs"],
            noise=r["noise"], min_bytes=min_bytes, flops=flops or None,
            gbps=min_bytes / (v * 1e-3) / 1e9, tflops=flops / (v * 1e-3) / 1e12 if flops else None,
            env=row_env(env)))

    rows = [kernel_row("kernels/fam/case/ours", value, 8_000_000, 0),
            kernel_row("kernels/mm/case/ours", 2.0, 10**9, 10**12),
            asdict(NightlyRow(key="align/example/alignment.verdict", part="align", group="align",
                              case="example", impl="alignment.verdict",
                              metric="alignment.verdict", unit="fact", better="equal",
                              value="passed", env=row_env(env)))]
    return {"environment": env, "ceilings": {"copy_tb_s": 4.2, "matmul_bf16_tflops": 700.0},
            "rows": rows, "train_profile": {
                "model": "hf:m --proxy small", "step_ms": 40.0, "trace_file": "d_trace.json",
                "kernels": [{"kernel": f"k{j}", "ms": 1.0 / (j + 1), "calls": 2, "share": 0.1}
                            for j in range(5)],
                "timeline": [[f"k{j % 5}", j * 0.1, 0.05] for j in range(50)]}}


@pytest.fixture
def history(tmp_path):
    h = History(f"sqlite:///{tmp_path / 'h.sqlite'}")
    for i in range(12):
        h.append(_result(i, 1.0 if i < 6 else 1.04, f"c{i:02d}"))
    return h


def test_history_store_and_change_point_commit(history, tmp_path, capsys):
    series = history.series()
    assert len(series["kernels/fam/case/ours"]) == 12
    assert "align/example/alignment.verdict" not in series  # facts stay in the JSON
    (cp,) = series_change_points(series["kernels/fam/case/ours"])
    assert cp.commit == "c06" and cp.rel == pytest.approx(0.04, abs=0.01)
    assert series_change_points(series["kernels/mm/case/ours"]) == []
    with sqlite3.connect(tmp_path / "h.sqlite") as con:
        assert con.execute("select count(*) from bench_rows").fetchone()[0] == 24
    assert main(["bench", "history", "--history", f"sqlite:///{tmp_path / 'h.sqlite'}",
                 "--key", "fam/"]) == 0
    out = capsys.readouterr().out
    assert "change point at c06" in out and "kernels/mm" not in out


def test_dashboard_is_self_contained(history):
    from onboarding.bench import dashboard as D

    result = _result(11, 1.04, "c11")
    verdicts = C.verdict_dicts(C.compare(result, _result(0, 1.0, "c00"), {"fam": 0.02}))
    page = D.render(result, history.series(), verdicts)
    for section in D.SECTIONS:
        assert f'id="{section}"' in page
    imgs = re.findall(r'<img src="([^"]*)"', page)
    assert len(imgs) >= 6 and all(s.startswith("data:image/png;base64,") for s in imgs)
    assert not re.search(r"https?://", page)
    assert not re.search(r"<(script|link|iframe)\b", page, re.I)
    assert not re.search(r'(src|href)="(?!data:)', page) and "url(" not in page
    assert "d_trace.json" in page and 'class="regression"' in page


def test_baseline_is_never_replaced_silently(tmp_path, monkeypatch, capsys):
    base = tmp_path / "nightly.json"
    base.write_text('{"keep": true}')
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["bench", "--suite", "nightly", "--update-baseline", str(base),
                 "--no-history"]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert base.read_text() == '{"keep": true}'
    from onboarding.cli.nightly import check_update

    check_update(base, True, False)  # --yes
    check_update(base, False, True)  # a terminal asks after the run
    check_update(tmp_path / "new.json", False, False)  # nothing to overwrite
    with pytest.raises(InputError, match="exists"):
        check_update(base, False, False)


def test_baseline_file_round_trip_and_bad_files(tmp_path):
    p = C.write_baseline(tmp_path / "b" / "nightly.json", _result(0, 1.0, "c0"), {"commit": "c0"})
    assert C.load_baseline(p)["metadata"]["commit"] == "c0"
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="malformed"):
        C.load_baseline(tmp_path / "bad.json")
    assert C.default_baseline("NVIDIA H200").parts[-3:] == ("bench", "nvidia-h200", "nightly.json")


def test_workflows_run_the_ci_scripts():
    yaml = pytest.importorskip("yaml")
    nightly = yaml.safe_load((ROOT / ".github/workflows/nightly.yml").read_text())
    on = nightly.get("on", nightly.get(True))
    assert "schedule" in on and "workflow_dispatch" in on
    job = next(iter(nightly["jobs"].values()))
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    steps = " ".join(str(s.get("run", "")) + str(s.get("uses", "")) for s in job["steps"])
    assert ".ci/nightly" in steps and "upload-artifact" in steps
    ci = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    assert ".ci/run" in " ".join(str(s.get("run", "")) for j in ci["jobs"].values()
                                 for s in j["steps"])
    assert "--compare" in (ROOT / ".ci/nightly").read_text()


def test_nightly_options_need_the_nightly_suite_and_dashboards_are_not_overwritten(tmp_path, capsys):
    assert main(["bench", "--compare", "x.json"]) == 2
    assert "only with --suite nightly" in capsys.readouterr().err
    from onboarding.cli.nightly import DASHBOARD_MARK, check_dashboard

    mine = tmp_path / "notes.html"
    mine.write_text("<html>my notes</html>")
    with pytest.raises(InputError, match="not an onboard dashboard"):
        check_dashboard(mine)
    ours = tmp_path / "dashboard.html"
    ours.write_text(f"<html><head>{DASHBOARD_MARK}</head></html>")
    check_dashboard(ours)  # last night's page may be replaced
    check_dashboard(tmp_path / "new.html")
