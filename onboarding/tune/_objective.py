"""A study's trial objective and what it shares with the other studies of the process.

`Objective` runs one trial: the AOT gate (where kernels run in the interpreter), the compile pass
ahead of the check on a GPU host, the check and the timing in a worker subprocess, each phase's
seconds on the trial. `GpuGate` keeps a timing alone on the GPU; `TimingMode` is a study's way
of timing (a CUDA graph replay until a step cannot be captured, then CUDA events). The search
around it is `search.tune_module`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from onboarding.backend import on_gpu
from onboarding.errors import InputError
from onboarding.tune._searches import current_pool
from onboarding.tune.store import bucket_default, module_meta
from onboarding.tune.worker import Worker, WorkerDied, WorkerTimeout, close_all, handle

if TYPE_CHECKING:
    from onboarding.tune.search import Limits, Timer, TuneConfig


def _optuna():
    try:
        import optuna
    except ImportError as e:  # pragma: no cover
        raise InputError("the tune stage needs optuna: pip install optuna") from e
    return optuna


class GpuGate:
    """Checks (which run kernels too) share the GPU; a timing has it alone. Writer-preferring:
    once a timing waits, no new check starts, so timings are not starved."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.readers = self.waiting = 0
        self.writing = False

    @contextlib.contextmanager
    def shared(self):
        with self.cond:
            self.cond.wait_for(lambda: not self.writing and not self.waiting)
            self.readers += 1
        try:
            yield
        finally:
            with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self.cond:
            self.waiting += 1
            self.cond.wait_for(lambda: not self.writing and not self.readers)
            self.waiting -= 1
            self.writing = True
        try:
            yield
        finally:
            with self.cond:
                self.writing = False
                self.cond.notify_all()


_GPU = GpuGate()  # one process's trials: timings never share the GPU with other work
# `TuneConfig.gpu_gate` "overlap": timings exclusive among themselves only; checks run beside them
_TIMING = threading.Lock()
GPU_GATES = ("strict", "overlap")
TIMINGS = ("events", "graph")


class TimingMode:
    """A study's way of timing, shared by its workers and its re-timing: "graph" until a step
    cannot be captured, then "events" for the rest of the study (`why` says what failed)."""

    def __init__(self, kind: str) -> None:
        self.graph = kind == "graph"
        self.why: str | None = None

    def fell_back(self, why: str) -> None:
        if self.graph:
            self.graph, self.why = False, why

    def describe(self) -> str:
        if self.graph:
            return "cuda-graph"
        return f"cuda-events (graph capture failed: {self.why})" if self.why else "cuda-events"


class AotCache:
    """AOT results per (module sha, config, dtype, size), shared by worker threads."""

    def __init__(self) -> None:
        self.cache: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def key(self, path: str, config: Mapping, dtype: str, size: int) -> str:
        sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
        return json.dumps([sha, dict(sorted(config.items())), dtype, size])


def check_limits(kernels: list[dict[str, Any]], limits: Limits) -> str:
    """Why a config is impossible on the target, or not worth timing ("" when it is kept)."""
    for k in kernels:
        if not k["ok"]:
            return f"{k['kernel']}: compile error: {k['error'][:300]}"
        if k.get("shared_bytes") is not None and k["shared_bytes"] > limits.max_shared_bytes:
            return f"{k['kernel']}: shared memory {k['shared_bytes']} > {limits.max_shared_bytes}"
        if (limits.max_spill_bytes is not None and k.get("n_spills") is not None
                and k["n_spills"] > limits.max_spill_bytes):
            return (f"{k['kernel']}: spills {k['n_spills']} bytes per thread > "
                    f"{limits.max_spill_bytes} ({k.get('n_regs')} registers, "
                    f"{k.get('num_warps')} warps)")
    return ""


def aot_usage(kernels: list[dict[str, Any]]) -> tuple[dict[str, list], int | None]:
    """Per kernel [registers, spill bytes, shared bytes] of an AOT result, and the largest spill
    (None when ptxas reported none: no ptxas, or a kernel did not compile)."""
    usage = {k["kernel"]: [k.get("n_regs"), k.get("n_spills"), k.get("shared_bytes")]
             for k in kernels if k.get("ok")}
    spills = [u[1] for u in usage.values()]
    ok = bool(usage) and len(usage) == len(kernels) and all(v is not None for v in spills)
    return usage, (max(spills) if ok else None)


class OutOfBudget(Exception):
    """A trial's build was cut by its study's budget: pruned as "budget", nothing cached."""


class Objective:
    """One per worker thread: holds a trial worker and an AOT worker subprocess (its own, or taken
    from the `shared_workers` pool and given back by `close`)."""

    def __init__(self, *, path: str, module: ModuleType, size: int, shapes: list,
                 dims: dict[str, int] | None, space: dict[str, list], cfg: TuneConfig,
                 timer: Timer | None, aot: AotCache, timing: TimingMode | None = None):
        self.path, self.module, self.size, self.shapes = path, module, size, shapes
        self.dims, self.space = dims, space
        self.cfg, self.timer, self.aot = cfg, timer, aot
        self.timing = timing or TimingMode(cfg.timing)
        self.meta = module_meta(module)
        self.default = bucket_default(module, module.shape_bucket(size))  # the check's yardstick
        gpu = on_gpu()
        self.use_aot = cfg.aot if cfg.aot is not None else not gpu
        self.compile_first = cfg.compile_ahead if cfg.compile_ahead is not None else gpu
        self.deadline: float | None = None  # the study's budget end (time.monotonic()): bounds a pass
        self.pool = current_pool()
        make = self.pool.take if self.pool is not None else Worker
        self.trial_worker = make(interpret=None, startup_timeout_s=cfg.startup_timeout_s)
        self.aot_worker = (make(interpret=None if gpu else False, startup_timeout_s=cfg.startup_timeout_s)
                           if self.use_aot else None)

    def close(self, keep: bool = True) -> None:
        """Ends the workers, or with `keep` gives them back to the pool they came from (an
        interrupt passes keep=False: their trials in flight must die)."""
        workers = [w for w in (self.trial_worker, self.aot_worker) if w is not None]
        if keep and self.pool is not None:
            for w in workers:
                self.pool.give(w)
        else:
            close_all(workers)

    def _run(self, worker: Worker, op: str, args: dict, timeout: float) -> dict[str, Any]:
        if not self.cfg.isolate:
            return handle({"op": op, "args": args})
        try:
            return worker.call({"op": op, "args": args}, timeout)
        except WorkerTimeout as e:
            return {"ok": False, "stage": "timeout", "reason": f"{op}: {e}"}
        except WorkerDied as e:
            return {"ok": False, "stage": "crash", "reason": f"{op}: {e}"}

    def _run_in_budget(self, worker: Worker, op: str, args: dict, limit: float, what: str
                       ) -> tuple[dict[str, Any], str | None]:
        """`_run` with `limit`, or what is left of the study's budget (`deadline`) when that is
        less, as its timeout. The second value is why, when the budget and not `limit` cut it
        (`what`: the build it cut)."""
        timeout = limit if self.deadline is None else \
            max(0.0, min(limit, self.deadline - time.monotonic()))
        res = self._run(worker, op, args, timeout)
        if res.get("stage") == "timeout" and timeout < limit:
            return res, f"the study's budget ran out during the {what} ({timeout:.1f} s left)"
        return res, None

    def _aot_reason(self, config: dict, trial=None) -> str:
        """Why the AOT gate prunes `config` ("": kept); records its registers and spills on
        `trial`. A build cut by the study's budget raises `OutOfBudget` (and is not cached:
        the config is not wrong)."""
        key = self.aot.key(self.path, config, self.cfg.dtype, self.size)
        with self.aot.lock:
            hit = self.aot.cache.get(key)
        if hit is None:
            hit, cut = self._run_in_budget(
                self.aot_worker, "aot", {"path": self.path, "config": config,
                                         "dtype": self.cfg.dtype, "size": self.size},
                self.cfg.aot_timeout_s, "AOT build")
            if cut:
                raise OutOfBudget(cut)
            with self.aot.lock:
                self.aot.cache[key] = hit
        if not hit["ok"]:
            return f"aot {hit['stage']}: {hit['reason']}"
        if trial is not None:
            _record_usage(trial, hit["kernels"], "aot")
        return check_limits(hit["kernels"], self.cfg.limits)

    def _check_and_time(self, config: dict, seed: int, seconds: dict[str, float] | None = None,
                        trial=None) -> dict[str, Any]:
        """The worker's check then its timing; `seconds` gets each one's wall time and the time
        spent waiting for the GPU gate ("wait"). With `compile_first` the kernels are built first,
        outside the gate ("compile"); else the check's JIT compile runs inside it. Without the AOT
        gate, the check's own builds (on a GPU) are recorded on `trial` and judged by the limits
        before the timing (stage "limits")."""
        seconds = {} if seconds is None else seconds
        strict = self.cfg.gpu_gate == "strict"
        args = {"path": self.path, "config": config, "family": self.meta["family"],
                "variant": self.meta["variant"], "params": self.meta["params"],
                "shapes": self.shapes, "seed": seed, "dtype": self.cfg.dtype, "dims": self.dims}
        if self.compile_first:
            pre = self._compile(args, seconds)
            if pre["stage"] == "budget":
                return pre
            if pre["stage"] in ("timeout", "crash"):
                # the worker is restarted; the check builds one at a time, as without the pass,
                # and meets a build that really fails itself. No more passes for this objective.
                self.compile_first = False
            if trial is not None and (not pre["ok"] or pre.get("errors")):  # left to the check
                trial.set_user_attr("compile_ahead", (pre.get("reason") or "; ".join(pre["errors"]))[:500])
        t0 = time.monotonic()
        with _GPU.shared() if strict else contextlib.nullcontext():
            t1 = time.monotonic()
            res = self._run(self.trial_worker, "check", {**args, "default": self.default},
                            self.cfg.trial_timeout_s)
        t2 = time.monotonic()
        seconds["wait"], seconds["check"] = t1 - t0, t2 - t1
        if trial is not None and res.get("kernels_error"):  # the JIT builds' usage unread
            trial.set_user_attr("usage_error", res["kernels_error"])
        if res["ok"] and res.get("kernels") and trial is not None and not self.use_aot:
            _record_usage(trial, res["kernels"], "jit")
            why = check_limits(res["kernels"], self.cfg.limits)
            if why:
                return {"ok": False, "stage": "limits", "reason": why}
        if res["ok"]:
            with _GPU.exclusive() if strict else _TIMING:
                t3 = time.monotonic()
                res = self._run(self.trial_worker, "time",
                                {"repeats": self.cfg.repeats, "graph": self.timing.graph},
                                self.cfg.trial_timeout_s)
            if res.get("graph_error"):
                self.timing.fell_back(res["graph_error"])
            seconds["wait"] += t3 - t2
            seconds["time"] = time.monotonic() - t3
        return res

    def _compile(self, args: dict, seconds: dict[str, float]) -> dict[str, Any]:
        """The worker's compile pass within the study's budget: one that cannot end before
        `deadline` gives stage "budget" (its worker is stopped and restarted, as at any
        timeout). Without the bound, the first GPU run's moe_experts pass (~35 s) ended its
        study 24 s past the budget (docs/LOG.md, forty-sixth session)."""
        tc = time.monotonic()
        pre, cut = self._run_in_budget(self.trial_worker, "compile", args,
                                       self.cfg.trial_timeout_s, "compile pass")
        seconds["compile"] = time.monotonic() - tc
        return {"ok": False, "stage": "budget", "reason": cut} if cut else pre

    def measure(self, config: dict, seed: int) -> float | None:
        """Check and time one config outside any trial; None when it fails either."""
        res = self._check_and_time(config, seed)
        if not res["ok"]:
            return None
        return float(self.timer(config, res)) if self.timer else float(res["time_ms"])

    def _prune(self, trial, stage: str, why: str):
        trial.set_user_attr("stage", stage)
        trial.set_user_attr("reason", why[:1000])
        return _optuna().TrialPruned(why[:200])

    def __call__(self, trial) -> float:
        optuna = _optuna()
        config = {k: trial.suggest_categorical(k, v) for k, v in self.space.items()}
        # TPE re-proposes configs; a finished twin answers without re-running.
        for t in trial.study.get_trials(deepcopy=False):
            if t.number != trial.number and t.params == config and t.state.is_finished():
                trial.set_user_attr("duplicate_of", t.number)
                for k in ("aot_kernels", "spill_bytes"):
                    if k in t.user_attrs:
                        trial.set_user_attr(k, t.user_attrs[k])
                if t.state == optuna.trial.TrialState.COMPLETE:
                    return float(t.value)
                raise self._prune(trial, t.user_attrs.get("stage", ""),
                                  t.user_attrs.get("reason", "duplicate of a pruned trial"))
        # each phase's wall seconds (`phase_seconds` sums them per study)
        seconds: dict[str, float] = {}
        if self.use_aot:
            t0 = time.monotonic()
            try:
                why, stage = self._aot_reason(config, trial), "aot"
            except OutOfBudget as e:
                why, stage = str(e), "budget"
            seconds["aot"] = time.monotonic() - t0
            if why:
                trial.set_user_attr("seconds", _rounded(seconds))
                raise self._prune(trial, stage, why)
        res = self._check_and_time(config, self.cfg.seed * 100003 + trial.number, seconds, trial)
        trial.set_user_attr("seconds", _rounded(seconds))
        trial.set_user_attr("stage", res["stage"])
        if not res["ok"]:
            raise self._prune(trial, res["stage"], res["reason"])
        trial.set_user_attr("measured_ms", res["time_ms"])
        trial.set_user_attr("timing", "injected timer" if self.timer else res["timing"])
        return float(self.timer(config, res)) if self.timer else float(res["time_ms"])


def _record_usage(trial, kernels: list[dict], source: str) -> None:
    """Each kernel's registers, spills and shared memory on `trial`, from the AOT gate's builds
    or the check's JIT builds (`source`)."""
    usage, spill = aot_usage(kernels)
    trial.set_user_attr("aot_kernels", usage)
    trial.set_user_attr("spill_bytes", spill)
    trial.set_user_attr("usage_from", source)


def _rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in seconds.items()}


def phase_seconds(trials) -> dict[str, float]:
    """Seconds a study's trials spent per phase (aot: the AOT gate's build; compile: the
    kernels' builds ahead of the check; wait: for the GPU gate; check: the worker's check, with
    the JIT compile when not built ahead; time: the timing), summed: where a tuning budget goes."""
    out: dict[str, float] = {}
    for t in trials:
        for k, v in (t.user_attrs.get("seconds") or {}).items():
            out[k] = round(out.get(k, 0.0) + v, 2)
    return out
