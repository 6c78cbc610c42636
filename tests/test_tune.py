"""The tune stage on the CPU: pruning (AOT limits, correctness, timeout, crash), the shared
SQLite study, warm start, tuned.json round trip and dispatch, the search with a fake timer."""

from __future__ import annotations

import json
import math

import optuna
import pytest

from onboarding.tune import _objective, _searches
from onboarding.tune import search as tune
from onboarding.tune.worker import WorkerPool
from onboarding.errors import InputError
from onboarding.generate.templating import load_module, render_to

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
    return out * 1.03 if block_n == 2 else out  # 3x bf16's relative-RMS bound (the tuned dtype)
'''


# rmsnorm tiles its backward separately; the searches here vary only the forward tile and keep
# the d_le_512 bucket's backward defaults, so the fake timer's optimum is unique.
_BWD = {"BWD_BLOCK_N": 8, "bwd_warps": 4, "programs_per_sm": 4}
FWD_ONLY = {k: [v] for k, v in _BWD.items()}


def _full(block_n, num_warps):
    return {"BLOCK_N": block_n, "num_warps": num_warps, **_BWD}


@pytest.fixture(autouse=True)
def _unpinned():
    """`load_module` shares one module per rendered source, and the kernel tests pin CPU tiles on
    theirs (`set_config`): a test here that renders the same source must see it unpinned, and
    the pins (which in-process trials clear) come back afterwards."""
    from onboarding.generate import templating

    saved = {m: (m._CONFIG_OVERRIDE, dict(m._TUNED)) for m in templating._LOADED.values()}
    for m in saved:
        m.set_config(None)
    yield
    for m, (override, tuned) in saved.items():
        m._CONFIG_OVERRIDE = override
        m._TUNED.clear()
        m._TUNED.update(tuned)


def _fake_timer(config, result):
    """Deterministic 'time' with its minimum far from the default: BLOCK_N=32, num_warps=1."""
    return 1.0 + (math.log2(config["BLOCK_N"]) - 5) ** 2 + math.log2(config["num_warps"]) ** 2


@pytest.fixture(scope="module")
def rms_path(tmp_path_factory):
    return render_to(tmp_path_factory.mktemp("kernels"), "rmsnorm", "plain")


def _rms_objective(rms_path, cfg, **kw):
    """One worker's objective over the rendered RMSNorm module at size 64 (its own AOT cache)."""
    return _objective.Objective(path=str(rms_path), module=load_module(rms_path), size=64,
                           shapes=[[64]], dims=None, space={}, cfg=cfg, timer=None,
                           aot=_objective.AotCache(), **kw)


def _cfg(tmp_path, **kw):
    base = dict(storage_dir=tmp_path / "studies", aot=False, progress=False, repeats=1,
                trial_timeout_s=20, warm_start=False, final_rounds=0)
    return tune.TuneConfig(**{**base, **kw})


def _trials(result, storage_dir):
    study = optuna.load_study(study_name=result.study_name,
                              storage=f"sqlite:///{storage_dir / 'tune.db'}")
    return sorted(study.get_trials(), key=lambda t: t.number)


@pytest.mark.slow  # ~35 s on 2 cores (a hung config waits out its timeout)
def test_subprocess_gate_prunes_wrong_hung_and_crashing_configs(tmp_path):
    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    path.write_text(path.read_text() + _SABOTAGE)
    mod = load_module(path)
    # The timeout bounds the hung config; a shorter one also cuts off honest trials when other
    # jobs share the two cores (the first check loads the module and runs the interpreter).
    cfg = _cfg(tmp_path, n_trials=4, trial_timeout_s=15, space=FWD_ONLY)
    space = tune.search_space(mod, "d_le_512", cfg.space)
    study = tune.create_study(tune.study_name(mod, "d_le_512", cfg.dtype, space=space),
                              tune.storage_url(cfg), space)
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
    assert res.best_config == _full(8, 4)
    assert res.pruned == {"correctness": 1, "timeout": 1, "crash": 1}


def test_aot_gate_prunes_config_over_the_limits(tmp_path, rms_path):
    cfg = _cfg(tmp_path, n_trials=1, aot=True, warm_start=True,
               limits=tune.Limits(max_shared_bytes=0))
    res = tune.tune_module(rms_path, size=64, config=cfg)
    (t,) = _trials(res, tmp_path / "studies")
    assert t.state == optuna.trial.TrialState.PRUNED and t.user_attrs["stage"] == "aot"
    assert "shared memory" in t.user_attrs["reason"] and "> 0" in t.user_attrs["reason"]
    # the trial records each kernel's [registers, spill bytes, shared bytes] from ptxas
    usage = t.user_attrs["aot_kernels"]
    assert set(usage) == {s["kernel"] for s in load_module(rms_path).aot_specs("bf16", 64)}
    assert all(0 < regs <= 255 and shared >= 0 for regs, _, shared in usage.values()), usage
    assert t.user_attrs["spill_bytes"] == max(spill for _, spill, _ in usage.values())
    # the gate's build is the pruned trial's only phase, and the study's sum says so
    assert set(t.user_attrs["seconds"]) == {"aot"} and res.phase_s["aot"] > 0


def _aot(**kw):
    """An AOT gate result as the worker sends it (`AotResult.as_dict`)."""
    from onboarding.generate.aot import AotResult

    base = dict(kernel="k", arch=90, num_warps=4, ok=True, shared_bytes=1024, n_regs=64,
                n_spills=0)
    return AotResult(**{**base, **kw}).as_dict()


def test_check_limits_reasons():
    lim = tune.Limits()
    assert tune.check_limits([_aot()], lim) == ""
    assert "compile error" in tune.check_limits([_aot(ok=False, error="boom")], lim)
    assert "shared memory" in tune.check_limits([_aot(shared_bytes=1 << 20)], lim)
    # ptxas caps a thread at 255 registers and spills the rest: 255 is a count, not an excess
    assert tune.check_limits([_aot(n_regs=255, n_spills=544)], lim) == ""
    # spills cost time, which the timing measures: the 6.8 KB of the H200's fastest GDN config
    # is kept by default; only a spill over the stated bound prunes
    assert tune.check_limits([_aot(n_regs=255, n_spills=6800)], lim) == ""
    bound = lim.max_spill_bytes
    assert bound is not None and bound >= 4 * 6800
    assert tune.check_limits([_aot(n_regs=255, n_spills=bound)], lim) == ""
    why = tune.check_limits([_aot(), _aot(kernel="bwd", n_regs=255, n_spills=bound + 1)], lim)
    assert why.startswith("bwd: spills") and f"> {bound}" in why and "255 registers" in why
    assert tune.check_limits([_aot(n_spills=10 ** 6)], tune.Limits(max_spill_bytes=None)) == ""
    # without ptxas (n_regs / n_spills None) nothing prunes on registers or spills
    assert tune.check_limits([_aot(n_regs=None, n_spills=None)], lim) == ""


def test_aot_usage_records_registers_and_the_largest_spill():
    kernels = [_aot(kernel="fwd", n_regs=128, n_spills=0),
               _aot(kernel="bwd", n_regs=255, n_spills=6800, shared_bytes=4096)]
    usage, spill = tune.aot_usage(kernels)
    assert usage == {"fwd": [128, 0, 1024], "bwd": [255, 6800, 4096]} and spill == 6800
    assert tune.aot_usage([*kernels, _aot(n_regs=None, n_spills=None)])[1] is None  # no ptxas
    assert tune.aot_usage([*kernels, _aot(ok=False, error="boom")])[1] is None


def test_spills_prune_only_over_the_bound_and_show_in_the_results(tmp_path, monkeypatch):
    """AOT results with spills (as ptxas reports them) through the tuner: the config spilling
    over the bound is pruned with the reason, the one spilling 6.8 KB is timed and wins, and the
    best's and the default's spills reach the result, the table and tuned.json."""
    bound = tune.Limits().max_spill_bytes
    spills = {8: 544, 16: 6800, 32: bound + 1}  # by BLOCK_N; 8 is the bucket default
    real = _objective.handle

    def fake_aot(req):
        if req["op"] != "aot":
            return real(req)
        n = spills[req["args"]["config"]["BLOCK_N"]]
        return {"ok": True, "kernels": [_aot(kernel="fwd", n_regs=96), _aot(
            kernel="bwd", n_regs=255, n_spills=n)]}

    monkeypatch.setattr(_objective, "handle", fake_aot)
    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    cfg = _cfg(tmp_path, n_trials=3, isolate=False, aot=True,
               space={"BLOCK_N": [16, 32], "num_warps": [4], **FWD_ONLY}, space_only=True)
    res = tune.tune_module(path, size=64, config=cfg, timer=_fake_timer, sampler="grid")
    by_bn = {t.params["BLOCK_N"]: t for t in _trials(res, tmp_path / "studies")}
    assert by_bn[32].state == optuna.trial.TrialState.PRUNED
    assert by_bn[32].user_attrs["stage"] == "aot"
    assert f"bwd: spills {bound + 1} bytes per thread > {bound}" in by_bn[32].user_attrs["reason"]
    assert by_bn[16].user_attrs["spill_bytes"] == 6800
    assert by_bn[16].user_attrs["aot_kernels"] == {"fwd": [96, 0, 1024], "bwd": [255, 6800, 1024]}
    assert res.best_config == _full(16, 4) and res.spill_bytes == [6800, 544]
    assert "| 6800 / 544 |" in tune.markdown_table([res])
    tuned = tune.write_tuned(path, [res])
    assert json.loads(tuned.read_text())["buckets"]["d_le_512"]["spill_bytes"] == 6800


def test_fake_timer_search_finds_best_in_few_trials(tmp_path, rms_path):
    cfg = _cfg(tmp_path, n_trials=14, isolate=False, warm_start=True, seed=1, space=FWD_ONLY)
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=_fake_timer)
    assert res.best_config == _full(32, 1), res  # 14 of 36 configs
    assert res.default_ms == _fake_timer(_full(8, 4), {})
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
                          pruned={"aot": 1}, history=[],
                          timing="cuda-events (graph capture failed: RuntimeError: capture)"),
    ]
    out = tune.write_tuned(path, results[:1], dtype="bf16")
    tune.write_tuned(path, results[1:], dtype="bf16")  # merges, keeps d_le_512
    assert out == path.with_name("plain.tuned.json")
    data = json.loads(out.read_text())
    assert set(data["buckets"]) == {"d_le_512", "d_le_4k"}
    entry = data["buckets"]["d_le_4k"]
    for key in ("gpu", "torch", "triton", "date", "trials", "study", "dtype"):
        assert key in entry
    # each bucket says how its study timed it; a result without one, how this host times
    assert entry["timing"] == "cuda-events (graph capture failed: RuntimeError: capture)"
    assert data["buckets"]["d_le_512"]["timing"] == "cpu-wallclock (meaningless)"
    notes = tune.markdown_table(results)
    assert "`d_le_4k`: timed by cuda-events (graph capture failed" in notes
    assert "`d_le_512`: timed by" not in notes
    mod = load_module(path)
    def own(name):  # keys a tuned.json leaves out keep the bucket's own values
        return {**mod.DEFAULT_CONFIG, **next(b["config"] for b in mod.SHAPE_BUCKETS
                                             if b["name"] == name)}

    try:
        applied = tune.apply_tuned(mod, out)
        assert applied["d_le_4k"] == {"BLOCK_N": 2, "num_warps": 16}
        assert mod.config_for(300) == {**own("d_le_512"), "BLOCK_N": 32, "num_warps": 1}
        assert mod.config_for(3000) == {**own("d_le_4k"), "BLOCK_N": 2, "num_warps": 16}
        assert mod.config_for(1000) == own("d_le_2k")  # untuned: the bucket's default
        mod.set_config(None, "d_le_4k")
        other = json.loads(out.read_text())
        other["buckets"]["d_le_4k"]["gpu"] = "Another GPU"  # tuned elsewhere: not applied
        out.write_text(json.dumps(other))
        assert set(tune.apply_tuned(mod, out)) == {"d_le_512"}
        assert mod.config_for(3000) == own("d_le_4k")
        out.write_text(json.dumps(data))
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
    dflt = mod.DEFAULT_CONFIG
    assert configs == [_full(8, 4),  # the bucket's default first
                       {**dflt, "BLOCK_N": 4, "num_warps": 2},  # nearest neighbour bucket
                       {**dflt, "BLOCK_N": 1, "num_warps": 32},
                       {**dflt, "BLOCK_N": 16, "num_warps": 8}]  # same family, another model
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


def test_studies_of_one_run_share_their_worker_subprocesses(tmp_path, monkeypatch):
    """`tune_buckets` (as `tune_run`) runs its studies on one pool of worker subprocesses: two
    buckets' studies in isolated workers start the trial worker once, not once per study (a start
    imports torch: on a GPU host it was most of a study's budget share), every trial completes in
    both, and the pool's workers end with the run."""
    from onboarding.tune import worker as tune_worker

    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    started, real_start = [], tune_worker.Worker._start

    def start(self):
        real_start(self)
        started.append(self)
    monkeypatch.setattr(tune_worker.Worker, "_start", start)
    cfg = _cfg(tmp_path, n_trials=2, isolate=True, space=FWD_ONLY)
    res = tune.tune_buckets(path, [64, 600], config=cfg, timer=_fake_timer)
    assert [r.bucket for r in res] == ["d_le_512", "d_le_2k"]
    assert all(r.n_complete == 2 for r in res), [(r.n_complete, r.prune_reasons) for r in res]
    # where each study's time went, per phase (no AOT gate here)
    assert all(set(r.phase_s) == {"wait", "check", "time"} and r.phase_s["check"] > 0 for r in res)
    assert f"- `d_le_512`, trials' seconds by phase: wait {res[0].phase_s['wait']:.1f}, check " \
        in tune.markdown_table(res)
    assert len(started) == 1  # aot=False: no AOT worker; one trial worker for both studies
    assert all(w.proc is None for w in started)  # closed when the run ended


def test_search_space_restriction_keeps_the_default_and_rejects_bad_values(rms_path):
    mod = load_module(rms_path)
    space = tune.search_space(mod, "d_le_512", {"BLOCK_N": [16, 32], "num_warps": [1],
                                                "programs_per_sm": [2]})
    # the bucket default (BLOCK_N 8, num_warps 4, programs_per_sm 4) stays in; others in full
    assert space == {**{k: list(v) for k, v in mod.TUNING_SPACE.items()},
                     "BLOCK_N": [8, 16, 32], "num_warps": [1, 4], "programs_per_sm": [2, 4]}
    assert tune.space_size(space) == 3 * 2 * 2 * 6 * 6
    full = tune.search_space(mod, "d_le_512")
    assert tune.study_name(mod, "d_le_512", "bf16", space=full) == \
        tune.study_name(mod, "d_le_512", "bf16")
    assert ".space-" in tune.study_name(mod, "d_le_512", "bf16", space=space)
    only = tune.search_space(mod, "d_le_512", {"BLOCK_N": [16, 32]}, only=True)
    assert only == {"BLOCK_N": [8, 16, 32], "num_warps": [4], **FWD_ONLY}  # others: the default
    with pytest.raises(InputError, match="--space-only needs"):
        tune.search_space(mod, "d_le_512", None, only=True)
    with pytest.raises(InputError, match="BLOCK_Q"):
        tune.search_space(mod, "d_le_512", {"BLOCK_Q": [1]})
    with pytest.raises(InputError, match="BLOCK_N=\\[3\\]"):
        tune.search_space(mod, "d_le_512", {"BLOCK_N": [3]})


def test_compare_grid_with_tpe_on_a_small_space(tmp_path, rms_path):
    from onboarding.tune.grid import compare_grid, plot_comparison

    cfg = _cfg(tmp_path, isolate=False, warm_start=True, final_rounds=1,
               space={"BLOCK_N": [16, 32], "num_warps": [1, 2], **FWD_ONLY})
    cmp = compare_grid(rms_path, size=64, config=cfg, timer=_fake_timer, tpe_fraction=0.34)
    # Both bests and the default re-timed together after the searches (the fake timer is exact)
    assert cmp.final_ms == {"grid": 1.0, "tpe": cmp.tpe.best_ms, "default": 9.0}
    assert cmp.best() is cmp.grid or cmp.tpe.best_ms == 1.0
    # The grid ran every config of the 3 x 3 space (default values added) exactly once.
    assert cmp.grid.n_trials == 9 and cmp.grid.n_complete == 9
    trials = _trials(cmp.grid, tmp_path / "studies")
    assert len({json.dumps(t.params, sort_keys=True) for t in trials}) == 9
    assert cmp.grid.best_config == _full(32, 1) and cmp.grid.best_ms == 1.0
    assert cmp.default_ms == 9.0 and cmp.gain(cmp.grid) == 9.0
    # TPE got floor(0.34 * 9) = 3 trials (never over the fraction), the bucket default first.
    assert cmp.tpe.n_trials == 3 and cmp.trials_fraction == pytest.approx(3 / 9)
    assert _trials(cmp.tpe, tmp_path / "studies")[0].params == _full(8, 4)
    assert cmp.ratio == pytest.approx(cmp.tpe.best_ms / 1.0)
    assert not cmp.goal_met  # a third of the grid's trials is over the 15% budget
    d = cmp.to_dict()
    assert d["gain_grid"] == 9.0 and d["ratio"] == cmp.ratio
    md = cmp.markdown()
    assert "| trials | 9 | 3 (33.3% of the grid) |" in md and "9.00x" in md
    assert "| best re-timed together (default 9 ms) | 1 |" in md
    assert plot_comparison(cmp, tmp_path / "cmp.png").stat().st_size > 1000
    # Resuming runs nothing new: both studies are complete.
    again = compare_grid(rms_path, size=64, config=cfg, timer=_fake_timer, tpe_fraction=0.34)
    assert (again.grid.n_trials, again.tpe.n_trials) == (9, 3)


def test_final_retiming_replaces_a_lucky_single_timing(tmp_path, rms_path):
    """A config timed once during the search at half its real time wins the search; the final
    interleaved re-timing of the finalists and the default measures it again and picks the
    config that is really fastest."""
    import collections

    calls = collections.Counter()

    def lucky(config, result):
        key = (config["BLOCK_N"], config["num_warps"])
        calls[key] += 1
        return 0.5 if key == (16, 2) and calls[key] == 1 else _fake_timer(config, result)

    cfg = _cfg(tmp_path, n_trials=9, isolate=False, final_rounds=2,
               space={"BLOCK_N": [16, 32], "num_warps": [1, 2], **FWD_ONLY})
    prog = tune.progress_bar()
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=lucky, sampler="grid",
                           progress=prog)
    (final,) = [t for t in prog.tasks if t.description.startswith("re-timing")]
    assert final.completed == final.total == (tune.FINALISTS + 1) * 2
    assert min(v for v in res.history if v is not None) == 0.5  # the search's lucky best
    assert res.best_config == _full(32, 1) and res.best_ms == 1.0
    assert res.default_ms == 9.0  # the bucket default (8, 4), re-timed with the finalists
    assert len(res.final) == tune.FINALISTS + 1
    assert res.final[json.dumps(_full(16, 2), sort_keys=True)] == 3.0
    assert calls[(16, 2)] == 1 + 2  # once in the search, once per final round
    table = tune.markdown_table([res])
    assert "finalists re-timed in interleaved rounds (medians): 1 ms" in table


def test_plan_jobs_reads_buckets_and_timing_dims_off_the_op_graph(tmp_path, parse_model):
    import torch

    from onboarding.tune.worker import timing_inputs
    from onboarding.generate.candidates import render_candidates, save_candidates
    from onboarding.stages import run_map
    from onboarding.tune import run as tune_run_mod
    from onboarding.tune.run import plan_jobs

    graph = parse_model("onboard_hybrid")
    graph.save(tmp_path / "opgraph.json")
    cands = render_candidates(run_map(graph, tmp_path), tmp_path / "candidates")
    for c in cands:  # plan_jobs reads only the verdict of generate's checks
        c.status = "failed" if c.family == "conv1d" else "passed"
    save_candidates(cands, tmp_path / "candidates.json")
    jobs, notes = plan_jobs(tmp_path)
    by = {(j.family, j.variant): j for j in jobs}
    moe = by["moe_experts", "swiglu"]
    assert moe.dims == {"N": 64, "D": 256, "E": 16, "TOPK": 4, "F": 128}
    assert (moe.bucket, moe.size, len(moe.blocks)) == ("d_le_1k", 256, 8)
    gdn = by["gated_delta", "chunk"]
    assert gdn.dims == {"B": 1, "T": 64, "HV": 4, "V": 64, "K": 64, "HK": 2}
    assert gdn.bucket == "k_le_64"
    assert by["moe_router", "softmax"].size == 16  # E from the block's n_experts
    assert ("conv1d", "causal") not in by and any("conv1d" in n and "failed" in n for n in notes)
    assert len({(j.module, j.bucket) for j in jobs}) == len(jobs)  # one study per bucket
    # Heaviest first, by the roofline seconds of the blocks each serves: the MoE experts (8 blocks
    # of 202 MFLOP) before the gated delta rule (6 of 47 MFLOP), every norm last.
    blocks = {b.path: b for b in graph.blocks}
    assert [j.weight_s for j in jobs] == sorted((j.weight_s for j in jobs), reverse=True)
    assert jobs[0] is moe and moe.weight_s == pytest.approx(sum(tune_run_mod.block_seconds(blocks[p])
                                                                for p in moe.blocks))
    assert jobs.index(gdn) < min(i for i, j in enumerate(jobs) if j.family == "rmsnorm")
    # Timing inputs at those dims are valid arguments of the family's reference.
    gen = torch.Generator().manual_seed(0)
    for job in (moe, gdn):
        args = timing_inputs(job.family, job.variant, {}, job.dims, torch.float32, "cpu", gen)
        out = load_module(job.module).reference(*args)
        o = out[0] if isinstance(out, tuple) else out
        assert o.shape[:2] == ((64, 256) if job is moe else (1, 64))
        assert torch.isfinite(o).all()
    with pytest.raises(InputError, match="missing \\['F'\\]"):
        timing_inputs("moe_experts", "swiglu", {}, {k: v for k, v in moe.dims.items() if k != "F"},
                      torch.float32, "cpu", gen)


def test_gpu_gate_times_alone():
    import threading
    import time

    gate, log = _objective.GpuGate(), []

    def check(i):
        with gate.shared():
            log.append(f"in{i}")
            time.sleep(0.05)
            log.append(f"out{i}")

    def timing():
        with gate.exclusive():
            log.append("T")
            time.sleep(0.05)
            log.append("/T")

    threads = [threading.Thread(target=check, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=timing)]
    threads += [threading.Thread(target=check, args=(i,)) for i in range(3, 6)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    t0, t1 = log.index("T"), log.index("/T")
    assert t1 == t0 + 1  # nothing else ran while timing
    inside = sum(x.startswith("in") for x in log[:t0]) - sum(x.startswith("out") for x in log[:t0])
    assert inside == 0 and len(log) == 14


def test_low_precision_check_accepts_the_kernel_and_rejects_a_wrong_one(rms_path):
    """The GPU-side gate (kernel in the tuned dtype vs the fp32 reference on the same rounded
    values), run here in fp16: the interpreter's fp16 is exact enough, its bf16 is not."""
    import torch

    from onboarding.tune.worker import _check_at
    from onboarding.patching.core import entry_function
    from onboarding.families import get_family

    mod = load_module(rms_path)
    args = get_family("rmsnorm").sample_inputs("plain", dict(mod.PARAMS), [[64]],
                                                torch.Generator().manual_seed(0))
    good = _check_at(entry_function(mod), mod.reference, args, torch.float16)
    assert len(good) == 3 and all(c["passed"] for c in good), good  # out, dx, dw
    bad = _check_at(lambda *a: entry_function(mod)(*a) * 1.05, mod.reference, args,
                    torch.float16)
    assert not bad[0]["passed"] and "tune.out0" in bad[0]["message"]


def test_low_precision_check_judges_a_failing_config_against_the_default(rms_path):
    """The default config's error on the same inputs excuses single elements only: a config
    3.5% off fails in fp16 also when the default is 3% off (before issue 36 it passed as "no
    worse than the default"), a spiked element passes when the default has the same spike, and
    the default itself is judged by its relative RMS only. (tests/test_tune_gate.py plants
    errors through the worker's whole check.)"""
    import contextlib

    import torch

    from onboarding.tune.worker import _check_at
    from onboarding.patching.core import entry_function
    from onboarding.families import get_family

    mod = load_module(rms_path)
    args = get_family("rmsnorm").sample_inputs("plain", dict(mod.PARAMS), [[64]],
                                                torch.Generator().manual_seed(0))
    err = {"now": 0.0, "spike": 0.0}

    @contextlib.contextmanager
    def default_off_by(e, spike=0.0):
        saved = dict(err)
        err.update(now=e, spike=spike)
        try:
            yield
        finally:
            err.update(saved)

    def entry(*a):  # off by err["now"], one element off by err["spike"] x the output's RMS
        y = entry_function(mod)(*a) * (1 + err["now"])
        rms = y.detach().float().pow(2).mean().sqrt().to(y.dtype)
        return y + torch.zeros_like(y).index_put_((torch.tensor([0]),) * y.dim(),
                                                  err["spike"] * rms)

    err["now"] = 0.035  # 3.5% off: outside fp16's bound
    assert not _check_at(entry, mod.reference, args, torch.float16)[0]["passed"]
    bad = _check_at(entry, mod.reference, args, torch.float16, lambda: default_off_by(0.03))
    assert not bad[0]["passed"] and "rel_rms 3.50e-02 > 2.0e-03" in bad[0]["message"]
    assert "the default config on the same inputs: rel_rms 3.0" in bad[0]["message"]
    err["now"] = 0.0
    err["spike"] = 0.05  # one element off by 5% of the output's RMS: single elements only
    assert not _check_at(entry, mod.reference, args, torch.float16)[0]["passed"]
    ok = _check_at(entry, mod.reference, args, torch.float16, lambda: default_off_by(0, 0.04))
    assert all(c["passed"] for c in ok), ok
    assert ok[0]["relative_to_default"] and "no worse than the default" in ok[0]["message"]
    assert not _check_at(entry, mod.reference, args, torch.float16,
                         lambda: default_off_by(0, 0.01))[0]["passed"]  # 5x the default's
    # the default itself is the yardstick: its relative RMS is judged, not single elements
    own = _check_at(entry, mod.reference, args, torch.float16, is_default=True)
    assert all(c["passed"] for c in own) and "the bucket default" in own[0]["message"], own
    err.update(now=0.035, spike=0.0)
    assert not _check_at(entry, mod.reference, args, torch.float16, is_default=True)[0]["passed"]


def test_kernels_for_dispatches_to_tuned_configs(tmp_path):
    """What patching, alignment and training load (`kernels_for`) runs the tuned.json beside
    each module: a tuned bucket's config, untuned buckets their defaults."""
    from onboarding.generate.candidates import Candidate, kernels_for
    from onboarding.coverage import Coverage, CoverageEntry

    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    mod = load_module(path)
    params = dict(mod.PARAMS)
    best = {"BLOCK_N": 32, "num_warps": 1}
    tune.write_tuned(path, [tune.BucketResult(
        bucket="d_le_512", study_name="s", best_config=best, best_ms=1.0, default_ms=2.0,
        n_trials=3, n_complete=3, pruned={}, history=[])])
    cov = Coverage(model="m", entries=[CoverageEntry(
        path="model.norm", kind="norm.rms", op="rmsnorm", status="template", family="rmsnorm",
        variant="plain", params=params)])
    cand = Candidate(family="rmsnorm", variant="plain", params=params, path=str(path),
                     status="passed")
    try:
        got = kernels_for(cov, [cand])[("model.norm", "rmsnorm")]
        own = {b["name"]: {**got.DEFAULT_CONFIG, **b["config"]} for b in got.SHAPE_BUCKETS}
        assert got.config_for(256) == {**own["d_le_512"], **best}
        assert got.config_for(1000) == own["d_le_2k"]  # untuned: the bucket's default
    finally:
        mod.set_config(None, "d_le_512")


def _marked_pids(mark: str) -> list[int]:
    """Live processes whose environment holds `mark` (the CLI and its worker subprocesses)."""
    import os

    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark.encode() in f.read():
                        with open(f"/proc/{d}/stat") as st:
                            if st.read().split(") ")[-1][0] != "Z":
                                pids.append(int(d))
            except OSError:
                continue
    return pids


@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="needs /proc")
def test_interrupt_stops_the_tuner_and_its_workers(tmp_path):
    """SIGINT (Ctrl-C, `timeout -s INT`) ends `onboard tune` promptly with its worker
    subprocesses, instead of the worker threads running the remaining trials."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    mark = f"ONBOARD_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, mark.split("=")[0]: mark.split("=")[1]}
    proc = subprocess.Popen([sys.executable, "-m", "onboarding.cli.main", "tune", "--kernel",
                             "rmsnorm", "--shapes", "64", "--trials", "200", "--workers", "2",
                             "--no-aot", "--out", str(tmp_path / "t")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as at a terminal: a test run started in the background by a
                            # non-interactive shell ignores SIGINT, and children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while len(_marked_pids(mark)) < 3 and time.monotonic() < deadline:  # CLI + 2 workers
            time.sleep(0.5)
        assert len(_marked_pids(mark)) >= 3, "the workers did not start"
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0 and "interrupted" in err, err
        time.sleep(1)
        assert _marked_pids(mark) == []  # no worker left behind
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _marked_pids(mark):
            os.kill(pid, signal.SIGKILL)


def test_timing_inputs_are_made_in_the_timed_dtype_and_oom_names_the_workers(monkeypatch):
    import torch

    from onboarding.tune import worker as _tune_worker
    from onboarding.tune.worker import handle, timing_inputs

    dims = {"N": 33, "D": 16, "E": 4, "TOPK": 2, "F": 8}
    a = timing_inputs("moe_experts", "swiglu", {}, dims, torch.bfloat16, "cpu", torch.Generator().manual_seed(3))
    b = timing_inputs("moe_experts", "swiglu", {}, dims, torch.bfloat16, "cpu", torch.Generator().manual_seed(3))
    assert [t.dtype for t in a] == [torch.bfloat16, torch.int64, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # the seed decides them
    assert a[3].float().std() < 0.5  # scaled by D ** -0.5
    up = timing_inputs("moe_experts", "mlp", {}, dims, torch.float32, "cpu", torch.Generator().manual_seed(3))[3]
    assert up.shape == (4, 8, 16)  # non-gated experts: up [E, F, D]

    def oom(**_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")

    monkeypatch.setattr(_tune_worker, "check_one", oom)
    out = handle({"op": "check", "args": {}})
    assert not out["ok"] and "fewer --workers" in out["reason"] and "7.00 GiB" in out["reason"]


def test_block_dims_reads_the_expert_width_in_either_weight_orientation():
    from types import SimpleNamespace

    from onboarding.tune.run import block_dims

    entry = SimpleNamespace(shapes=[[2, 33, 64], [66, 4]], variant="swiglu")
    want = {"N": 66, "D": 64, "E": 8, "TOPK": 4, "F": 24}
    for layout, gate_up, down in (("out_in", [8, 48, 64], [8, 64, 24]), ("in_out", [8, 64, 48], [8, 24, 64])):
        block = SimpleNamespace(attrs={"n_experts": 8, "weight_layout": layout},
                                params={"w1": gate_up, "w2": down, "b1": [8, 48], "b2": [8, 64]})
        assert block_dims("moe_experts", entry, block) == want, layout
    # non-gated up [E, F, D] beside down [E, D, F], and F == D
    block = SimpleNamespace(attrs={"n_experts": 8}, params={"a": [8, 64, 64], "b": [8, 64, 64]})
    assert block_dims("moe_experts", entry, block)["F"] == 64


def test_grouped_linear_timing_dims_and_inputs(tmp_path):
    """A split-linear experts block's real dims (rows S, K in, N out, E experts) come off its input
    shape and classifier attrs; the timing inputs at those dims are valid reference arguments."""
    from types import SimpleNamespace

    import torch

    from onboarding.tune.worker import timing_inputs
    from onboarding.generate.templating import load_module, render_to
    from onboarding.tune.run import block_dims

    block = SimpleNamespace(attrs={"n_experts": 4, "in_features": 24, "out_features": 40},
                            params={"weight": [4, 40, 24]})
    dims = block_dims("grouped_linear", SimpleNamespace(shapes=[[37, 24]], variant="sorted"), block)
    assert dims == {"S": 37, "K": 24, "N": 40, "E": 4}
    assert block_dims("grouped_linear", SimpleNamespace(shapes=[[37, 16]], variant="sorted"), block) is None
    x, counts, w = timing_inputs("grouped_linear", "sorted", {}, dims, torch.float32, "cpu",
                                 torch.Generator().manual_seed(0))
    assert x.shape == (37, 24) and w.shape == (4, 40, 24) and counts.shape == (4,) and int(counts.sum()) == 37
    mod = load_module(render_to(tmp_path, "grouped_linear", "sorted", {}))
    assert mod.reference(x, counts, w).shape == (37, 40)


def test_time_budget_stops_the_study_and_says_so(tmp_path, rms_path):
    """No trial starts once the study's budget is spent; the result says "stopped at budget"
    with the trials done, and each trial reports best vs default and the time left."""
    import time

    def slow(config, result):
        time.sleep(0.4)
        return _fake_timer(config, result)

    seen = []
    cfg = _cfg(tmp_path, n_trials=40, isolate=False, warm_start=True, budget_s=1.0,
               space=FWD_ONLY)
    t0 = time.monotonic()
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=slow, on_trial=seen.append)
    assert time.monotonic() - t0 < 30
    assert res.trials_run is not None and 1 <= res.trials_run < 40
    assert res.stopped == f"stopped at budget (1 s) after {res.trials_run} of 40 trials"
    assert res.budget_s == 1.0 and res.seconds is not None
    assert [s["done"] for s in seen] == list(range(1, res.trials_run + 1))
    assert seen[0]["default_ms"] == seen[0]["best_ms"] == 9.0  # the warm-started default first
    assert all(s["left_s"] is not None and s["total"] == 40 for s in seen)
    assert "stopped at budget" in tune.markdown_table([res])
    # without a budget the same call runs every trial and stops for no budget
    cfg = _cfg(tmp_path / "b", n_trials=3, isolate=False, space=FWD_ONLY)
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=_fake_timer)
    assert res.stopped is None and res.trials_run == 3


def test_progress_text_and_plain_progress_lines(capsys):
    assert tune.progress_text(0.5, 1.0, 12.3) == "0.5 ms vs default 1 ms (2.00x), 12 s left"
    assert tune.progress_text(None, None) == "- vs default -"
    prog = tune.progress_bar()  # pytest's stderr is no terminal: plain lines
    assert isinstance(prog, tune.PlainProgress)
    task = prog.add_task("rmsnorm d_le_512", total=4, best="-")
    prog.update(task, advance=1, best=tune.progress_text(0.5, 1.0, 3))
    # on stderr: stdout may hold a command's --json
    assert capsys.readouterr().err == ("rmsnorm d_le_512: 1/4 best 0.5 ms vs default 1 ms "
                                       "(2.00x), 3 s left\n")


def test_a_spent_budget_skips_the_re_timing(tmp_path, rms_path):
    import time

    def slow(config, result):
        time.sleep(1.2)  # one trial spends the whole 1 s budget
        return _fake_timer(config, result)

    cfg = _cfg(tmp_path, n_trials=10, isolate=False, warm_start=True, budget_s=1.0,
               final_rounds=2, space=FWD_ONLY)
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=slow)
    assert res.trials_run == 1 and res.final == {}
    assert res.stopped == ("stopped at budget (1 s) after 1 of 10 trials; finalists not "
                           "re-timed (budget spent)")


def test_study_slots_and_shares():
    """Studies at once: as asked, else three per four cores on a GPU host and one on the CPU, never
    more than the jobs; a study's share of what is left grows with the studies beside it."""
    from onboarding.tune.run import study_share, study_slots

    assert study_slots(11, None, on_gpu=True, cpus=16) == 11  # 12 slots, 11 studies
    assert study_slots(20, None, on_gpu=True, cpus=16) == 12
    assert study_slots(3, None, on_gpu=True, cpus=16) == 3
    assert study_slots(11, None, on_gpu=True, cpus=1) == 1
    assert study_slots(11, None, on_gpu=False, cpus=16) == 1
    assert study_slots(11, 4, on_gpu=False, cpus=2) == 4
    assert study_slots(0, None, on_gpu=True, cpus=16) == 1
    with pytest.raises(InputError, match="parallel studies 0"):
        study_slots(3, 0, on_gpu=True)
    assert study_share(40.0, 10, 1) == pytest.approx(4.0)  # one at a time: an equal share
    assert study_share(40.0, 10, 5) == pytest.approx(20.0)
    assert study_share(40.0, 3, 8) == pytest.approx(40.0)  # all the rest start now: all of it
    assert study_share(40.0, 3, 2, running=1) == pytest.approx(20.0)  # one started beside it
    assert study_share(-1.0, 3, 1) == 0.0


def _fake_jobs(n):
    from onboarding.tune.run import TuneJob

    return [TuneJob(family="f", variant=f"v{i}", module=f"/m{i}.py", bucket="b", size=8,
                    size_source="D", shapes=[[8]], dims=None, weight_s=float(n - i)) for i in range(n)]


def test_tune_run_runs_studies_at_once_in_job_order(tmp_path, monkeypatch):
    """With parallel_studies 2 two studies overlap in time (each on its own thread), the results
    keep the heaviest-first job order, and each study's budget is its share when it starts
    (`study_share`): the first two get half of the 40 s budget each (2 slots, 4 jobs); a study
    that raises cancels the run's worker pool and its error reaches the caller."""
    import threading
    import time

    from onboarding.tune import run as tune_run_mod
    from onboarding.tune.store import BucketResult

    spans, budgets, threads = {}, {}, set()

    def fake_tune_module(module, *, config, budget_from, **kw):
        t0 = time.monotonic()
        budgets[module] = config.budget_s
        assert budget_from <= t0  # the budget counts from its grant, before this call
        threads.add(threading.get_ident())
        time.sleep({"/m1.py": 0.6, "/m2.py": 0.1}.get(module, 0.3))
        spans[module] = (t0, time.monotonic())
        return BucketResult(bucket="b", study_name=module, best_config=None, best_ms=None,
                            default_ms=None, n_trials=0, n_complete=0, pruned={}, history=[])

    monkeypatch.setattr(tune_run_mod, "plan_jobs", lambda run_dir, families, exclude: (_fake_jobs(4), []))
    monkeypatch.setattr(tune_run_mod, "tune_module", fake_tune_module)
    monkeypatch.setattr(tune_run_mod, "plot_history", lambda *a, **k: None)
    cfg = _cfg(tmp_path, parallel_studies=2)
    data = tune_run_mod.tune_run(tmp_path, cfg, budget_s=40.0)
    assert data["parallel_studies"] == 2 and len(threads) == 2
    assert [s["variant"] for s in data["studies"]] == ["v0", "v1", "v2", "v3"]
    (a0, a1), (b0, b1) = spans["/m0.py"], spans["/m1.py"]
    assert a0 < b1 and b0 < a1  # the first two ran at the same time
    assert budgets["/m0.py"] == pytest.approx(20.0, abs=0.5)
    assert budgets["/m1.py"] == pytest.approx(20.0, abs=0.5)
    # m2 starts when m0 ends (0.3 s in) beside m1: 2 slots over 3 studies; m3 when m2 ends
    # (0.4 s in), m1 still running: all that is left
    assert budgets["/m2.py"] == pytest.approx(39.7 * 2 / 3, abs=0.3)
    assert budgets["/m3.py"] == pytest.approx(39.6, abs=0.3)
    # one at a time (the CPU's default): the same order, an equal share of what is left
    budgets.clear()
    data = tune_run_mod.tune_run(tmp_path, _cfg(tmp_path), budget_s=40.0)
    assert data["parallel_studies"] == 1 and budgets["/m0.py"] == pytest.approx(10.0, abs=0.5)

    def failing(module, **kw):
        if module == "/m1.py":
            raise RuntimeError("study m1 broke")
        return fake_tune_module(module, **kw)
    monkeypatch.setattr(tune_run_mod, "tune_module", failing)
    cancelled = []
    real_cancel = WorkerPool.cancel
    monkeypatch.setattr(WorkerPool, "cancel", lambda self: (cancelled.append(1), real_cancel(self)))
    with pytest.raises(RuntimeError, match="study m1 broke"):
        tune_run_mod.tune_run(tmp_path, cfg, budget_s=40.0)
    assert cancelled


def test_a_study_thread_with_nothing_left_helps_the_searches_still_running(tmp_path, rms_path,
                                                                             monkeypatch):
    """Two studies on two slots (`_run_at_once`): a short one and a long one whose trials take
    0.4 s each (at 0.15 s a loaded 2-core host ran the helper's trial between, not beside, the
    study's own). Once the short one ends, its thread joins the long one as a second worker: two
    of the long study's trials run at the same time, and it still runs its 8 trials and no
    more. With `join_studies` off the trials never overlap."""
    import threading
    import time

    from onboarding.tune.run import _run_at_once

    monkeypatch.setattr(_objective, "handle", lambda req: (
        {"ok": True, "stage": "timed", "time_ms": 1.0, "timing": "fake"} if req["op"] == "time"
        else {"ok": True, "stage": "checked", "checks": 1, "timing_shapes": "sample"}))

    def run(join: bool) -> tuple[list, list]:
        spans, lock, results = [], threading.Lock(), []

        def timer(config, result):  # the long study's trials are slow
            t0 = time.monotonic()
            time.sleep(0.4)
            with lock:
                spans.append((t0, time.monotonic()))
            return 1.0 + config["BLOCK_N"] / 64

        def job(i: int) -> None:
            cfg = _cfg(tmp_path / f"j{join}", n_trials=(8, 2)[i], isolate=False,
                       join_studies=join, space={"BLOCK_N": [1, 2, 4, 8, 16, 32],
                                                 "num_warps": [1, 2, 4, 8], **FWD_ONLY})
            results.append(tune.tune_module(rms_path, size=(64, 4096)[i], config=cfg,
                                            timer=timer if i == 0 else _fake_timer))

        with tune.shared_workers() as pool:
            _run_at_once(job, 2, 2, pool)
        return spans, results

    spans, results = run(True)  # (a config TPE proposes again is answered without a run)
    assert sorted(r.n_trials for r in results) == [2, 8] and 4 <= len(spans) <= 8
    long = next(r for r in results if r.n_trials == 8)
    assert 1 <= long.helper_trials < 8 and all(r.helper_trials == 0 for r in results if r is not long)
    assert f"{long.helper_trials} of its trials run by helpers" in tune.markdown_table([long])
    spans.sort()
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), spans  # two at once
    spans, results = run(False)
    spans.sort()
    assert sorted(r.n_trials for r in results) == [2, 8] and 4 <= len(spans) <= 8
    assert all(r.helper_trials == 0 for r in results)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans


def test_open_searches_pick_the_least_helped_and_close_what_has_nothing_left():
    """`OpenSearches.help`: a helper joins the open search with the fewest helpers, then the
    first opened (the heaviest study); one that answers 0 trials is closed and not joined again;
    at most MAX_HELPERS at once in one search; `help` ends when none is open."""
    board = _searches.OpenSearches()
    calls = []
    a = _searches.Search(lambda: calls.append("a") or (1 if calls.count("a") < 3 else 0))
    b = _searches.Search(lambda: calls.append("b") or 0)
    board.add(a)
    board.add(b)
    assert board.help() == 2 and calls == ["a", "a", "a", "b"] and not board.open
    assert a.done and b.done and a.helpers == b.helpers == 0
    calls.clear()
    first, second = (_searches.Search(lambda n=n: calls.append(n) or 0) for n in ("first", "second"))
    board.add(first)
    board.add(second)
    second.helpers = 1
    busy = _searches.Search(lambda: calls.append("busy") or 0)
    board.open.insert(0, busy)
    busy.helpers = 2  # opened first, but more helped than the others
    assert board.help() == 0 and calls == ["first", "second", "busy"]
    full = _searches.Search(lambda: 1)
    full.helpers = _searches.OpenSearches.MAX_HELPERS
    board.add(full)
    assert board.help() == 0  # no room in it


def test_a_cancelled_pool_stops_a_study_without_recording_its_trial(tmp_path, rms_path):
    """Within `shared_workers`, an interrupt heard by another thread cancels the pool
    (`WorkerPool.cancel`): the study in flight ends with `Cancelled`, its trial not told (it stays
    RUNNING, as after Ctrl-C), and the pool refuses new workers."""
    from onboarding.tune.worker import Cancelled

    cfg = _cfg(tmp_path, n_trials=3, isolate=False, space={"BLOCK_N": [16, 32], "num_warps": [1, 2],
                                                            **FWD_ONLY})
    with tune.shared_workers() as pool:
        def timer(config, result):
            pool.cancel()
            return 1.0
        with pytest.raises(Cancelled):
            tune.tune_module(rms_path, size=64, config=cfg, timer=timer)
        with pytest.raises(Cancelled):
            pool.take(interpret=None, startup_timeout_s=1)
    study = optuna.load_study(study_name=tune.study_name(load_module(rms_path), "d_le_512", "bf16",
                                                         space=tune.search_space(load_module(rms_path), "d_le_512", cfg.space)),
                              storage=f"sqlite:///{tmp_path / 'studies' / 'tune.db'}")
    states = [t.state for t in study.get_trials()]
    assert states == [optuna.trial.TrialState.RUNNING], states


def test_two_real_studies_at_once_in_isolated_workers(tmp_path, parse_model):
    """The example's two RMSNorm studies (plain, gated) at once on real worker subprocesses: both
    complete their trials into the one SQLite file, each writes its tuned.json, and the run's pool
    started one trial worker per study thread (two), ended with the run."""
    from onboarding.generate.candidates import render_candidates, save_candidates
    from onboarding.stages import run_map
    from onboarding.tune import worker as tune_worker
    from onboarding.tune.run import tune_run

    graph = parse_model("onboard_hybrid")
    graph.save(tmp_path / "opgraph.json")
    cands = render_candidates(run_map(graph, tmp_path), tmp_path / "candidates")
    for c in cands:
        c.status = "passed"
    save_candidates(cands, tmp_path / "candidates.json")
    started = []
    real_start = tune_worker.Worker._start

    def start(self):
        real_start(self)
        started.append(self)
    import unittest.mock
    with unittest.mock.patch.object(tune_worker.Worker, "_start", start):
        data = tune_run(tmp_path, _cfg(tmp_path, n_trials=2, isolate=True, parallel_studies=2,
                                       storage_dir=None, space=FWD_ONLY),
                        families=["rmsnorm"], timer=_fake_timer)
    assert data["parallel_studies"] == 2
    studies = data["studies"]
    assert sorted(s["variant"] for s in studies) == ["gated", "plain"]
    assert all(s["result"]["n_complete"] == 2 for s in studies), [s["result"] for s in studies]
    assert (tmp_path / "tune.db").is_file()
    for s in studies:
        assert tune.tuned_path(tmp_path / s["module"]).is_file()
    assert len(started) == 2 and all(w.proc is None for w in started)


def test_without_the_aot_gate_the_checks_own_builds_are_judged_before_timing(tmp_path, monkeypatch):
    """On a GPU host (no AOT gate) the worker's check returns its JIT builds' usage: a config whose
    build spills over the bound is pruned at stage "limits" and never timed; the others record
    their usage from the JIT build, and the default's spills reach the result."""
    bound = tune.Limits().max_spill_bytes
    spills = {8: 0, 16: 64, 32: bound + 8}  # by BLOCK_N; 8 is the bucket default
    real, timed = _objective.handle, []

    def with_jit_usage(req):
        out = real(req)
        if req["op"] == "check" and out["ok"]:
            n = spills[req["args"]["config"]["BLOCK_N"]]
            out["kernels"] = [{"kernel": "fwd", "ok": True, "n_regs": 90, "n_spills": n,
                               "shared_bytes": 512, "source": "jit"}]
            if n == 64:  # a kernel whose usage could not be read: recorded on the trial
                out["kernels_error"] = "AttributeError: no device_caches"
        if req["op"] == "time":
            timed.append(1)
        return out

    monkeypatch.setattr(_objective, "handle", with_jit_usage)
    path = render_to(tmp_path / "k", "rmsnorm", "plain")
    cfg = _cfg(tmp_path, n_trials=3, isolate=False, aot=False,
               space={"BLOCK_N": [16, 32], "num_warps": [4], **FWD_ONLY}, space_only=True)
    res = tune.tune_module(path, size=64, config=cfg, timer=_fake_timer, sampler="grid")
    by_bn = {t.params["BLOCK_N"]: t for t in _trials(res, tmp_path / "studies")}
    assert by_bn[32].state == optuna.trial.TrialState.PRUNED
    assert by_bn[32].user_attrs["stage"] == "limits"
    assert f"fwd: spills {bound + 8} bytes per thread > {bound}" in by_bn[32].user_attrs["reason"]
    assert len(timed) == 2  # BLOCK_N 8 and 16; 32 was not timed
    assert by_bn[16].user_attrs["usage_from"] == "jit" and by_bn[16].user_attrs["spill_bytes"] == 64
    assert by_bn[16].user_attrs["aot_kernels"] == {"fwd": [90, 64, 512]}
    assert by_bn[16].user_attrs["usage_error"].startswith("AttributeError")
    assert "usage_error" not in by_bn[32].user_attrs
    assert res.spill_bytes[1] == 0  # the default's, from its JIT build


def test_aot_gate_and_builds_ahead_default_follow_the_interpreter(tmp_path, rms_path, monkeypatch):
    """TuneConfig.aot None: the gate runs where kernels run in the interpreter and not on a GPU
    host, which then starts no AOT worker; compile_ahead None: the other way round (a GPU host
    builds a config's kernels before its check); True / False are taken as asked."""

    def objective(interp, **kw):
        monkeypatch.setattr(_objective, "on_gpu", lambda: not interp)
        return _rms_objective(rms_path, _cfg(tmp_path, **kw))

    for aot, interp, want in ((None, True, True), (None, False, False), (True, False, True),
                              (False, True, False)):
        obj = objective(interp, aot=aot)
        try:
            assert obj.use_aot is want and (obj.aot_worker is not None) is want, (aot, interp)
        finally:
            obj.close()
    for ahead, interp, want in ((None, True, False), (None, False, True), (True, True, True),
                                (False, False, False)):
        obj = objective(interp, aot=False, compile_ahead=ahead)
        try:
            assert obj.compile_first is want, (ahead, interp)
        finally:
            obj.close()


def test_jit_usage_reads_the_builds_that_ran():
    """`worker.jit_usage`: per kernel the largest registers, local bytes and shared memory of its
    builds on the device; a build never loaded (no registers yet) and helpers without builds are
    left out."""
    from types import ModuleType, SimpleNamespace

    import torch
    import triton
    import triton.language as tl

    from onboarding.tune.worker import jit_usage

    def kern(x):
        tl.store(x, 1.0)

    def helper(x):
        tl.store(x, 2.0)

    # JITFunction itself: under TRITON_INTERPRET `triton.jit` gives an interpreted function
    kern, helper = triton.runtime.jit.JITFunction(kern), triton.runtime.jit.JITFunction(helper)

    def build(regs, spills, shared):
        return SimpleNamespace(n_regs=regs, n_spills=spills, metadata=SimpleNamespace(shared=shared))

    kern.device_caches = {0: ({"a": build(40, 0, 1024), "b": build(96, 16, 512),
                               "c": SimpleNamespace(metadata=None)}, {}, None, None, None)}
    helper.device_caches = {}
    mod = ModuleType("m")
    mod.kern, mod.helper, mod.other = kern, helper, 3
    mod.tuned = SimpleNamespace(fn=kern)  # as an autotuner wraps a kernel
    want = {"ok": True, "n_regs": 96, "n_spills": 16, "shared_bytes": 1024, "source": "jit"}
    assert jit_usage(mod, torch.device("cuda", 0)) == [{"kernel": "kern", **want},
                                                       {"kernel": "tuned", **want}]
    assert jit_usage(mod, torch.device("cuda", 1)) == []


@pytest.mark.parametrize("gate", ["strict", "overlap"])
def test_gpu_gate_strict_keeps_checks_off_a_timing_and_overlap_lets_them_run_beside_it(
        tmp_path, rms_path, monkeypatch, gate):
    """Two objectives on threads: one times (0.4 s) while the other starts a check. "strict":
    the check waits until the timing ends; "overlap": it runs beside it. Timings stay exclusive
    among themselves either way."""
    import threading
    import time

    spans = {}

    def fake(req):
        t0 = time.monotonic()
        time.sleep(0.4 if req["op"] == "time" else 0.05)
        spans.setdefault(req["op"], []).append((t0, time.monotonic()))
        return ({"ok": True, "stage": "timed", "time_ms": 1.0, "timing": "fake"} if req["op"] == "time"
                else {"ok": True, "stage": "checked", "checks": 1, "timing_shapes": "sample"})

    monkeypatch.setattr(_objective, "handle", fake)
    cfg = _cfg(tmp_path, isolate=False, gpu_gate=gate)
    objs = [_rms_objective(rms_path, cfg) for _ in range(3)]
    try:
        timer = threading.Thread(target=objs[0]._check_and_time, args=({}, 0))
        timer.start()
        time.sleep(0.15)  # the first objective's check is done, its timing under way
        checker = threading.Thread(target=objs[1]._check_and_time, args=({}, 1))
        checker.start()
        time.sleep(0.1)  # the second objective's check done (overlap) or waiting (strict)
        third = threading.Thread(target=objs[2]._check_and_time, args=({}, 2))
        third.start()
        for t in (timer, checker, third):
            t.join()
    finally:
        for o in objs:
            o.close()
    first_time = min(spans["time"])
    second_check = sorted(spans["check"])[1]
    if gate == "strict":
        assert second_check[0] >= first_time[1] - 0.01  # after the timing ended
    else:
        assert second_check[1] <= first_time[1]  # done while the timing ran
    times = sorted(spans["time"])
    assert all(a[1] <= b[0] + 0.01 for a, b in zip(times, times[1:]))  # timings never overlap
    with pytest.raises(InputError, match="GPU gate 'loose'"):
        tune.tune_module(rms_path, size=64, config=_cfg(tmp_path, gpu_gate="loose"))


def test_compile_only_turns_launches_into_warmups_and_puts_them_back():
    """Within `compile_only` a `kernel[grid](...)` is Triton's warmup (build, no launch); after
    it, or after an error in it, launches are launches again. Threads > 1 run the builds under
    Triton's AsyncCompileMode."""
    from triton.runtime._async_compile import active_mode
    from triton.runtime.jit import KernelInterface

    from onboarding.tune import worker

    calls, modes = [], []

    class Fake(KernelInterface):
        def run(self, *args, grid, warmup, **kwargs):
            calls.append((args, warmup))
            modes.append(active_mode.get())

    k = Fake()
    with worker.compile_only(threads=1, jit_cls=Fake) as seen:
        k[(2,)](1, 2)
        k[(1, 1)](3)
    k[(1,)](4)
    assert calls == [((1, 2), True), ((3,), True), ((4,), False)]
    assert seen == {"calls": 2, "threads": 1} and modes == [None, None, None]
    with pytest.raises(ValueError), worker.compile_only(jit_cls=Fake):
        raise ValueError("the block fails")
    k[(1,)](5)
    assert calls[-1] == ((5,), False)
    with worker.compile_only(threads=2, jit_cls=Fake) as seen:
        k[(1,)](6)
    assert calls[-1] == ((6,), True) and modes[-1] is not None and seen["threads"] == 2
    assert active_mode.get() is None
    k[(1,)](7)
    assert calls[-1] == ((7,), False) and modes[-1] is None


def test_compile_ahead_builds_nothing_without_a_gpu(rms_path):
    from onboarding.tune import worker

    res = worker.handle({"op": "compile", "args": {
        "path": str(rms_path), "config": {}, "family": "rmsnorm", "variant": "plain", "params": {},
        "shapes": [[64]], "seed": 0, "dtype": "bf16"}})
    assert res == {"ok": True, "stage": "compiled", "calls": 0, "skipped": "no GPU"}


def _gate_spans(monkeypatch, answers: dict | None = None):
    """A fake worker whose requests sleep (compile 0.1 s, check 0.05, time 0.4) and record their
    spans by op; `answers` replaces an op's answer."""
    import time

    spans: dict[str, list] = {}

    def fake(req):
        t0 = time.monotonic()
        time.sleep({"compile": 0.1, "time": 0.4}.get(req["op"], 0.05))
        spans.setdefault(req["op"], []).append((t0, time.monotonic()))
        if answers and req["op"] in answers:
            return answers[req["op"]]
        return {"time": {"ok": True, "stage": "timed", "time_ms": 1.0, "timing": "fake"},
                "compile": {"ok": True, "stage": "compiled", "calls": 3}}.get(
            req["op"], {"ok": True, "stage": "checked", "checks": 1, "timing_shapes": "sample"})

    monkeypatch.setattr(_objective, "handle", fake)
    return spans


def test_compile_ahead_builds_beside_a_timing_and_the_check_still_waits(tmp_path, rms_path,
                                                                         monkeypatch):
    """With `compile_ahead` under the strict gate, a second objective's build runs while the
    first one's timing holds the GPU; its check waits for that timing to end; its seconds
    say so ("compile")."""
    import threading
    import time

    spans = _gate_spans(monkeypatch)
    cfg = _cfg(tmp_path, isolate=False, compile_ahead=True)
    objs = [_rms_objective(rms_path, cfg) for _ in range(2)]
    seconds: list[dict] = [{}, {}]
    try:
        first = threading.Thread(target=objs[0]._check_and_time, args=({}, 0, seconds[0]))
        first.start()
        time.sleep(0.25)  # its compile and check done, its timing under way
        second = threading.Thread(target=objs[1]._check_and_time, args=({}, 1, seconds[1]))
        second.start()
        for t in (first, second):
            t.join()
    finally:
        for o in objs:
            o.close()
    timing = min(spans["time"])
    build, check = sorted(spans["compile"])[1], sorted(spans["check"])[1]
    assert timing[0] <= build[0] and build[1] <= timing[1]  # built while the timing ran
    assert check[0] >= timing[1] - 0.01  # checked after it
    assert set(seconds[1]) == {"compile", "wait", "check", "time"} and seconds[1]["compile"] >= 0.1
    assert seconds[1]["wait"] >= 0.05


def test_a_build_pass_that_errs_or_dies_leaves_the_trial_to_the_check(tmp_path, rms_path,
                                                                        monkeypatch):
    """A pass that raises: the check goes on. One whose worker dies or times out: the check goes
    on too (it builds one kernel at a time, as without the pass), and the objective makes no more
    passes."""
    cfg = _cfg(tmp_path, isolate=False, compile_ahead=True)
    obj = _rms_objective(rms_path, cfg)
    try:
        spans = _gate_spans(monkeypatch, {"compile": {"ok": False, "stage": "error",
                                                      "reason": "KeyError: 'x'"}})
        assert obj._check_and_time({}, 0)["stage"] == "timed"
        assert [len(spans[k]) for k in ("compile", "check", "time")] == [1, 1, 1]
        assert obj.compile_first
        died = {"ok": False, "stage": "crash", "reason": "compile: the worker died"}
        spans = _gate_spans(monkeypatch, {"compile": died})
        assert obj._check_and_time({}, 1)["stage"] == "timed"
        assert [len(spans[k]) for k in ("compile", "check", "time")] == [1, 1, 1]
        assert not obj.compile_first
        spans = _gate_spans(monkeypatch)
        assert obj._check_and_time({}, 2)["stage"] == "timed"
        assert "compile" not in spans and len(spans["check"]) == 1
    finally:
        obj.close()
    off = _rms_objective(rms_path, _cfg(tmp_path, isolate=False))
    try:  # the default off a GPU: no build ahead (the interpreter builds nothing)
        spans = _gate_spans(monkeypatch)
        off._check_and_time({}, 0)
        assert "compile" not in spans
    finally:
        off.close()


def test_a_build_pass_is_bounded_by_the_studys_budget(tmp_path, rms_path, monkeypatch):
    """A compile pass gets at most what is left of the study's budget as its timeout; one that
    runs out prunes its trial as "budget", without a check, and keeps the passes on (the worker
    is fine). With more time left than a trial's timeout, a timeout is the worker's: the check
    goes on and the passes stop, as before."""
    import time

    cfg = _cfg(tmp_path, isolate=False, compile_ahead=True, trial_timeout_s=50)
    obj = _rms_objective(rms_path, cfg)
    calls = []

    def run(worker, op, args, timeout):
        calls.append((op, timeout))
        if op == "compile":
            return {"ok": False, "stage": "timeout", "reason": "compile: timed out"}
        return {"ok": True, "stage": "timed" if op == "time" else "checked", "checks": 1,
                "time_ms": 1.0, "timing": "fake"}

    monkeypatch.setattr(obj, "_run", run)
    try:
        obj.deadline = time.monotonic() + 5
        res = obj._check_and_time({}, 0)
        assert res["stage"] == "budget" and "during the compile pass" in res["reason"], res
        (op, timeout), = calls
        assert op == "compile" and 4 < timeout <= 5
        assert obj.compile_first  # a pass cut by the budget does not turn passes off
        calls.clear()
        obj.deadline = time.monotonic() + 100  # the trial timeout is the smaller bound
        assert obj._check_and_time({}, 1)["stage"] == "timed"
        assert [op for op, _ in calls] == ["compile", "check", "time"] and calls[0][1] == 50
        assert not obj.compile_first
    finally:
        obj.close()


def test_an_aot_build_is_bounded_by_the_studys_budget(tmp_path, rms_path, monkeypatch):
    """The AOT gate's build gets at most what is left of the study's budget; one cut by it
    raises `OutOfBudget` (the trial is pruned as "budget") and is not cached, so the config is
    built again later. Without a deadline a timeout is the gate's verdict on the config, cached."""
    import time

    cfg = _cfg(tmp_path, isolate=False, aot=True, aot_timeout_s=50)
    obj = _rms_objective(rms_path, cfg)
    timeouts = []

    def run(worker, op, args, timeout):
        timeouts.append(timeout)
        return {"ok": False, "stage": "timeout", "reason": "aot: timed out"}

    monkeypatch.setattr(obj, "_run", run)
    try:
        obj.deadline = time.monotonic() + 5
        with pytest.raises(_objective.OutOfBudget, match="during the AOT build"):
            obj._aot_reason({"BLOCK_N": 8})
        assert 4 < timeouts[-1] <= 5 and not obj.aot.cache
        obj.deadline = None
        assert obj._aot_reason({"BLOCK_N": 8}) == "aot timeout: aot: timed out"
        assert timeouts[-1] == 50 and len(obj.aot.cache) == 1
    finally:
        obj.close()


def test_compile_ahead_passes_the_inputs_the_check_makes(tmp_path, monkeypatch):
    """The pass calls the entry with the check's inputs: the sample rounded to the tuned dtype,
    the timing inputs in the dtypes the family gives (GDN's gate stays fp32). Casting the
    timing inputs too built other specializations, and on an H100 the check then built two
    kernels the pass had not (forty-sixth session)."""
    import contextlib

    import torch

    import onboarding.backend
    import onboarding.patching.core
    from onboarding.tune import worker

    path = render_to(tmp_path, "gated_delta", "chunk")
    dims = {"B": 1, "T": 128, "HK": 2, "K": 32}
    calls = []

    def entry(*xs):
        calls.append([x.dtype for x in xs if isinstance(x, torch.Tensor)])
        return sum(x.float().sum() for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point())

    @contextlib.contextmanager
    def no_builds(threads):
        yield {"calls": 0, "threads": threads}

    monkeypatch.setattr(onboarding.backend, "on_gpu", lambda: True)
    monkeypatch.setattr(onboarding.patching.core, "entry_function", lambda mod: entry)
    monkeypatch.setattr(worker, "compile_only", no_builds)
    res = worker.compile_ahead(str(path), {}, "gated_delta", "chunk", {}, [[64]], 3, "bf16", dims)
    assert res["ok"] and not res.get("errors"), res
    sample, timing = calls
    assert set(sample) == {torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    want = [x.dtype for x in worker.timing_inputs("gated_delta", "chunk", {}, dims, torch.bfloat16,
                                                  torch.device("cpu"), gen)
            if isinstance(x, torch.Tensor)]
    assert timing == want and torch.float32 in timing


def test_a_study_times_by_graph_until_a_capture_fails_then_by_events(tmp_path, rms_path,
                                                                      monkeypatch):
    """`TuneConfig.timing` "graph": the worker is asked for graph timings until one answers that
    its capture failed; from then on the study's objectives ask for events, and its re-timing,
    when a capture fails there, times every round again by events (no median mixes the two).
    The result says how it timed; an unknown timing is bad input."""
    calls = []

    def fake(req):
        if req["op"] == "time":
            graph = req["args"]["graph"]
            calls.append(graph)
            out = {"ok": True, "stage": "timed", "time_ms": 1.0 if graph else 2.0,
                   "timing": "cuda-graph" if graph else "cuda-events"}
            if graph and len(calls) >= 3:
                out.update(time_ms=2.0, timing="cuda-events", graph_error="RuntimeError: capture")
            return out
        return {"ok": True, "stage": "checked", "checks": 1, "timing_shapes": "sample"}

    monkeypatch.setattr(_objective, "handle", fake)
    cfg = _cfg(tmp_path, isolate=False, timing="graph")
    mode = _objective.TimingMode("graph")
    objs = [_rms_objective(rms_path, cfg, timing=mode) for _ in range(2)]
    try:
        for i in range(5):
            objs[i % 2]._check_and_time({}, i)
    finally:
        for o in objs:
            o.close()
    assert calls == [True, True, True, False, False]  # both workers follow the study's mode
    assert mode.describe() == "cuda-events (graph capture failed: RuntimeError: capture)"
    calls.clear()
    mode = _objective.TimingMode("graph")
    ms = tune.retime(rms_path, [{"BLOCK_N": 8}, {"BLOCK_N": 16}], size=64, config=cfg,
                     rounds=2, timing=mode)
    # two configs x two rounds: by graph until the third timing failed, the fourth by events,
    # then both rounds again by events
    assert calls == [True, True, True, False] + [False] * 4 and ms == [2.0, 2.0]
    assert _objective.TimingMode("events").describe() == "cuda-events"
    with pytest.raises(InputError, match="timing 'wall'"):
        tune.tune_module(rms_path, size=64, config=_cfg(tmp_path, timing="wall"))


def _n_builds(mod) -> int:
    """Builds in this process's kernel caches, over the module's Triton kernels."""
    from onboarding.tune.worker import jit_kernels

    return sum(len(c[0]) for _, fn in jit_kernels(mod)
               for c in getattr(fn, "device_caches", {}).values())


@pytest.mark.parametrize("family,variant,dims", [
    ("rmsnorm", "plain", {"N": 4096, "D": 2048}),
    ("gated_delta", "chunk", {"B": 1, "T": 1024, "HK": 4, "K": 128}),
])
def test_compile_ahead_builds_every_kernel_the_check_launches_on_a_gpu(tmp_path, family, variant,
                                                                       dims):
    """On a GPU: the worker's ``compile`` builds the kernels and launches none; the check and
    timing step that follow (sample and real shapes) build nothing more, and pass."""
    import torch

    from onboarding.backend import on_gpu
    from onboarding.tune import worker

    if not on_gpu():
        pytest.skip("builds Triton kernels for a GPU")
    path = render_to(tmp_path, family, variant)
    mod = load_module(path)
    args = {"path": str(path), "config": {}, "family": family, "variant": variant, "params": {},
            "shapes": [[64]], "seed": 3, "dtype": "bf16", "dims": dims}
    before = _n_builds(mod)
    # the check as a study's default trial makes it: its own config is the yardstick, judged
    # against the bound or the sample's noise floor (a GDN sample is off by 3e-2 in bf16 on
    # some seeds, over the bound but under its floor: the H100, forty-sixth session)
    check = {**args, "default": {**mod.DEFAULT_CONFIG}}
    torch.cuda.synchronize()
    res = worker.handle({"op": "compile", "args": args})
    assert res["ok"] and res["calls"] > 0 and not res.get("errors"), res
    built = _n_builds(mod)
    assert built > before
    res = worker.handle({"op": "check", "args": check})
    assert res["ok"], res
    assert _n_builds(mod) == built  # the check and the timing step's step found them built
    res = worker.handle({"op": "time", "args": {"repeats": 3}})
    assert res["ok"] and res["time_ms"] > 0 and res["timing"] == "cuda-events"
    assert worker.handle({"op": "check", "args": check})["ok"]
    res = worker.handle({"op": "time", "args": {"repeats": 3, "graph": True}})
    assert res["ok"] and res["time_ms"] > 0, res
    if family == "rmsnorm":  # no host sync in its step: it is captured
        assert res["timing"] == "cuda-graph", res
    else:
        assert res["timing"] == "cuda-graph" or res.get("graph_error"), res


def test_a_study_budget_counts_from_when_it_was_granted(tmp_path, rms_path):
    """`budget_from`: a study's set-up before its search (module load, study creation: seconds
    when a run's studies start at once) is spent from its budget, not added after it."""
    import time

    cfg = _cfg(tmp_path, n_trials=10, isolate=False, budget_s=2.0, space=FWD_ONLY)
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=_fake_timer,
                           budget_from=time.monotonic() - 2.5)
    assert res.trials_run == 0 and res.stopped.startswith("stopped at budget (2 s) after 0 of 10")
    assert res.seconds >= 2.5
    # a fresh grant runs its trials (a budget wide enough for a loaded 2-core host's interpreter)
    cfg = _cfg(tmp_path / "b", n_trials=2, isolate=False, budget_s=120.0, space=FWD_ONLY)
    res = tune.tune_module(rms_path, size=64, config=cfg, timer=_fake_timer,
                           budget_from=time.monotonic())
    assert res.trials_run == 2 and not res.stopped


def test_closing_workers_kills_every_child_before_waiting_for_any():
    """`WorkerPool.close` and `cancel` end their workers' children all at once (`close_all`):
    every kill before the first wait, so that the exits overlap rather than queue at the end of a
    run whose pool holds a dozen GPU workers."""
    from onboarding.tune.worker import Worker

    events = []

    class Proc:
        def __init__(self, i):
            self.i = i

        def kill(self):
            events.append(("kill", self.i))

        def wait(self):
            events.append(("wait", self.i))

    for end in ("close", "cancel"):
        events.clear()
        pool = WorkerPool()
        workers = [pool.take(interpret=True, startup_timeout_s=1.0) for _ in range(3)]
        for i, w in enumerate(workers):
            w.proc = Proc(i)
        for w in workers[:2] if end == "close" else []:
            pool.give(w)  # close ends the idle workers only; cancel every worker made
        getattr(pool, end)()
        n = 2 if end == "close" else 3
        assert sorted(events) == sorted([("kill", i) for i in range(n)] + [("wait", i) for i in range(n)])
        assert [e for e, _ in events] == ["kill"] * n + ["wait"] * n, events
        assert all(w.proc is None for w in workers[:n])
        assert isinstance(workers[0], Worker)
