"""The tune stage on the CPU: pruning (AOT limits, correctness, timeout, crash), the shared
SQLite study, warm start, tuned.json round trip and dispatch, the search with a fake timer."""

from __future__ import annotations

import json
import math

import optuna
import pytest

from onboarding import tune
from onboarding.templating import load_module, render_to

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

# Appended to a rendered rmsnorm module: one config value gives wrong output, one hangs, one
# kills the process. The kernels themselves stay untouched.
_SABOTAGE = '''

import os as _os
import time as _time

_clean_entry = entry


def entry(*args, **kwargs):
    block_n = (_CONFIG_OVERRIDE or {}).get("BLOCK_N")
    if block_n == 16:
        _time.sleep(600)
    if block_n == 32:
        _os.abort()
    out = _clean_entry(*args, **kwargs)
    return out * 1.01 if block_n == 2 else out
'''


def _fake_timer(config, result):
    """Deterministic 'time' with its minimum far from the default: BLOCK_N=32, num_warps=1."""
    return 1.0 + (math.log2(config["BLOCK_N"]) - 5) ** 2 + math.log2(config["num_warps"]) ** 2


@pytest.fixture(scope="module")
def rms_path(tmp_path_factory):
    return render_to(tmp_path_factory.mktemp("kernels"), "rmsnorm", "plain")


def _cfg(tmp_path, **kw):
    base = dict(storage_dir=tmp_path / "studies", aot=False, progress=False, repeats=1,
                trial_timeout_s=20, warm_start=False)
    return tune.TuneConfig(**{**base, **kw})


def _trials(result, storage_dir):
    study = optuna.load_study(study_name=result.study_name,
                              storage=f"sqlite:///{storage_dir / 'tune.db'}")
    return sorted(study.get_trials(), key=lambda t: t.number)


def test_subprocess_gate_prunes_wrong_hung_and_crashing_configs(tmp_path):
    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    path.write_text(path.read_text() + _SABOTAGE)
    mod = load_module(path)
    cfg = _cfg(tmp_path, n_trials=4, trial_timeout_s=5)
    study = tune.create_study(tune.study_name(mod, "d_le_512", cfg.dtype), tune.storage_url(cfg),
                              mod.TUNING_SPACE)
    for bn in (2, 16, 32, 8):
        study.enqueue_trial({"BLOCK_N": bn, "num_warps": 4})
    res = tune.tune_module(path, size=64, config=cfg, timer=_fake_timer)
    by_bn = {t.params["BLOCK_N"]: t for t in _trials(res, tmp_path / "studies")}
    pruned = optuna.trial.TrialState.PRUNED
    assert by_bn[2].state == pruned and by_bn[2].user_attrs["stage"] == "correctness"
    assert "tune.out0" in by_bn[2].user_attrs["reason"]
    assert by_bn[16].state == pruned and by_bn[16].user_attrs["stage"] == "timeout"
    assert by_bn[32].state == pruned and by_bn[32].user_attrs["stage"] == "crash"
    assert "rc=" in by_bn[32].user_attrs["reason"]
    # The study went on after the hang and the crash, on a restarted worker.
    assert by_bn[8].state == optuna.trial.TrialState.COMPLETE
    assert res.best_config == {"BLOCK_N": 8, "num_warps": 4}
    assert res.pruned == {"correctness": 1, "timeout": 1, "crash": 1}


def test_aot_gate_prunes_config_over_the_limits(tmp_path, rms_path):
    cfg = _cfg(tmp_path, n_trials=1, aot=True, warm_start=True,
               limits=tune.Limits(max_shared_bytes=0))
    res = tune.tune_module(rms_path, size=64, config=cfg)
    (t,) = _trials(res, tmp_path / "studies")
    assert t.state == optuna.trial.TrialState.PRUNED and t.user_attrs["stage"] == "aot"
    assert "shared memory" in t.user_attrs["reason"] and "> 0" in t.user_attrs["reason"]


def test_check_limits_reasons():
    ok = {"kernel": "k", "ok": True, "shared_bytes": 1024, "n_regs": 64, "n_spills": 0}
    lim = tune.Limits()
    assert tune.check_limits([ok], lim) == ""
    assert "compile error" in tune.check_limits([{**ok, "ok": False, "error": "boom"}], lim)
    assert "spills" in tune.check_limits([{**ok, "n_spills": 8}], lim)
    assert "shared memory" in tune.check_limits([{**ok, "shared_bytes": 1 << 20}], lim)


def test_fake_timer_search_finds_best_in_few_trials(tmp_path, rms_path):
    cfg = _cfg(tmp_path, n_trials=14, isolate=False, warm_start=True, seed=1)
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=_fake_timer)
    assert res.best_config == {"BLOCK_N": 32, "num_warps": 1}, res  # 14 of 36 configs
    assert res.default_ms == _fake_timer({"BLOCK_N": 8, "num_warps": 4}, {})
    # Best-so-far never rises; the report pieces render.
    vals = [v for v in res.history if v is not None]
    assert vals == sorted(vals, reverse=True)
    png = tune.plot_history([res], tmp_path / "best.png")
    assert png.stat().st_size > 1000
    table = tune.markdown_table([res])
    assert "| d_le_512 | 14 |" in table and "9.00x" in table
    # Resuming the study continues it.
    res2 = tune.tune_module(rms_path, size=64, config=cfg, timer=_fake_timer)
    assert res2.n_trials == 28 and res2.study_name == res.study_name


def test_two_workers_share_one_sqlite_study(tmp_path, rms_path):
    cfg = _cfg(tmp_path, n_trials=4, n_workers=2)
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=_fake_timer)
    assert optuna.get_all_study_names(tune.storage_url(cfg)) == [res.study_name]
    trials = _trials(res, tmp_path / "studies")
    assert len(trials) == 4 and all(t.state.is_finished() for t in trials)
    assert res.n_complete >= 1


def test_tuned_json_round_trip_and_dispatch(tmp_path):
    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    results = [
        tune.BucketResult(bucket="d_le_512", study_name="s1", best_config={"BLOCK_N": 32, "num_warps": 1},
                          best_ms=1.0, default_ms=2.0, n_trials=5, n_complete=5, pruned={}, history=[]),
        tune.BucketResult(bucket="d_le_4k", study_name="s2", best_config={"BLOCK_N": 2, "num_warps": 16},
                          best_ms=1.0, default_ms=1.5, n_trials=5, n_complete=4,
                          pruned={"aot": 1}, history=[]),
    ]
    out = tune.write_tuned(path, results[:1], dtype="bf16")
    tune.write_tuned(path, results[1:], dtype="bf16")  # merges, keeps d_le_512
    assert out == path.with_name("plain.tuned.json")
    data = json.loads(out.read_text())
    assert set(data["buckets"]) == {"d_le_512", "d_le_4k"}
    entry = data["buckets"]["d_le_4k"]
    for key in ("gpu", "torch", "triton", "date", "trials", "study", "dtype"):
        assert key in entry
    mod = load_module(path)
    try:
        applied = tune.apply_tuned(mod, out)
        assert applied["d_le_4k"] == {"BLOCK_N": 2, "num_warps": 16}
        assert mod.config_for(300) == {"BLOCK_N": 32, "num_warps": 1}
        assert mod.config_for(3000) == {"BLOCK_N": 2, "num_warps": 16}
        assert mod.config_for(1000) == {"BLOCK_N": 2, "num_warps": 4}  # untuned: bucket default
    finally:
        for b in mod.SHAPE_BUCKETS:
            mod.set_config(None, b["name"])
    data["buckets"]["d_le_4k"]["config"] = {"BLOCK_N": 3}
    out.write_text(json.dumps(data))
    with pytest.raises(Exception, match="d_le_4k"):
        tune.apply_tuned(mod, out)
    for b in mod.SHAPE_BUCKETS:
        mod.set_config(None, b["name"])


def test_warm_start_enqueues_neighbours_and_other_models(tmp_path):
    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    mod = load_module(path)
    own = {"family": "rmsnorm", "variant": "plain", "buckets": {
        "d_le_8k": {"config": {"BLOCK_N": 1, "num_warps": 32}},
        "d_le_2k": {"config": {"BLOCK_N": 4, "num_warps": 2}}}}
    tune.tuned_path(path).write_text(json.dumps(own))
    other = tmp_path / "other" / "rmsnorm"
    other.mkdir(parents=True)
    (other / "gated.tuned.json").write_text(json.dumps({"family": "rmsnorm", "variant": "gated",
        "buckets": {"d_le_512": {"config": {"BLOCK_N": 16, "num_warps": 8}}}}))
    (other / "x.tuned.json").write_text(json.dumps({"family": "swiglu", "variant": "plain",
        "buckets": {"d_le_512": {"config": {"BLOCK_N": 64}}}}))
    configs = tune.warm_start_configs(mod, path, "d_le_512", [tmp_path / "other"])
    assert configs == [{"BLOCK_N": 8, "num_warps": 4},  # the bucket's default first
                       {"BLOCK_N": 4, "num_warps": 2},  # nearest neighbour bucket
                       {"BLOCK_N": 1, "num_warps": 32},
                       {"BLOCK_N": 16, "num_warps": 8}]  # same family, another model
    study = tune.create_study("ws", f"sqlite:///{tmp_path / 'ws.db'}", mod.TUNING_SPACE)
    assert tune.enqueue_warm_start(study, configs) == 4
    assert tune.enqueue_warm_start(study, configs) == 0  # resuming does not re-enqueue
    assert [t.params for t in study.get_trials()] == configs or \
        [t.system_attrs["fixed_params"] for t in study.get_trials()] == configs


def test_tune_buckets_end_to_end_writes_and_applies_tuned_json(tmp_path):
    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    cfg = _cfg(tmp_path, n_trials=3, isolate=False, warm_start=True)
    (res,) = tune.tune_buckets(path, [64, 100], config=cfg, timer=_fake_timer)  # one bucket
    data = json.loads(tune.tuned_path(path).read_text())
    assert data["buckets"]["d_le_512"]["config"] == res.best_config
    assert data["buckets"]["d_le_512"]["timing"] == "injected timer"
    mod = tune.load_tuned(path)
    try:
        assert mod.config_for(64) == res.best_config
    finally:
        mod.set_config(None, "d_le_512")
