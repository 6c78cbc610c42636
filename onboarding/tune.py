"""The tune stage: Optuna search over a rendered kernel module's tile configs, per shape bucket.

One study per key (family, variant, params hash, shape bucket, dtype, GPU name or
"cpu-interpreter"), in plain Optuna storage (SQLite in a directory by default, any storage URL
accepted), so optuna-dashboard reads it. The study is created once, before workers start:
workers racing to create one SQLite study hit a UNIQUE constraint (DESIGN.md).

Every trial, in order:
1. AOT gate: the config is compiled for sm_90 on the host (`onboarding.aot`, no GPU) and pruned
   when a kernel fails to compile, needs more shared memory than the limit, or spills registers.
   Results are cached per config.
2. In a worker subprocess (kept alive across trials, killed and restarted on a timeout or a
   crash) the module is loaded, the config pinned with `set_config`, and forward + every gradient
   checked against `reference` on fresh random inputs (`generate._check_one`). A failing config
   is pruned with its reason in the trial's user_attrs.
3. Only then is it timed: median of event-timed fwd+bwd steps on a GPU (`bench.harness.time_fn`);
   on the CPU interpreter the wall-clock time is meaningless, so `timer(config, result)` (run in
   the parent) may replace it; tests use a deterministic fake one.

Best configs are written to `<module>.tuned.json` beside the module; `apply_tuned` pins them per
bucket so kernels dispatch to the nearest bucket at run time (`config_for` in the module).
Entry point for the CLI / agent node: `tune_module(...)` (one bucket) or `tune_buckets(...)`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from onboarding.errors import InputError

TUNED_SUFFIX = ".tuned.json"
Timer = Callable[[dict[str, Any], dict[str, Any]], float]  # (config, worker result) -> ms


@dataclass(kw_only=True, slots=True)
class Limits:
    """AOT pruning limits for sm_90 (H100/H200)."""

    max_shared_bytes: int = 232448  # opt-in max dynamic shared memory per block
    max_spill_bytes: int = 0
    max_registers: int = 255


@dataclass(kw_only=True, slots=True)
class TuneConfig:
    """Knobs of one tuning run (all have working defaults)."""

    n_trials: int = 30
    n_workers: int = 1  # concurrent worker threads, each with its own subprocess
    seed: int = 0
    storage: str | None = None  # Optuna URL; default sqlite:///<storage_dir>/tune.db
    storage_dir: Path | None = None
    trial_timeout_s: float = 120.0
    startup_timeout_s: float = 120.0
    aot: bool = True
    aot_timeout_s: float = 300.0
    limits: Limits = field(default_factory=Limits)
    dtype: str = "bf16"  # timing dtype; correctness is checked in fp32 (interpreter-safe)
    repeats: int = 20
    warm_start: bool = True
    warm_start_dirs: tuple[Path, ...] = ()  # other tuned.json files of the same family
    isolate: bool = True  # False: run trials in-process (no timeout; for tests/debugging)
    progress: bool = True


@dataclass(kw_only=True)
class BucketResult:
    bucket: str
    study_name: str
    best_config: dict[str, Any] | None
    best_ms: float | None
    default_ms: float | None
    n_trials: int
    n_complete: int
    pruned: dict[str, int]  # reason stage -> count
    history: list[float | None]  # best-so-far per trial number (None before the first)


# ---- keys and storage ------------------------------------------------------------------------

def gpu_name() -> str:
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return torch.cuda.get_device_name(0)
    return "cpu-interpreter"


def _module_meta(module: ModuleType) -> dict[str, Any]:
    from onboarding.templating import params_hash

    fam, var = getattr(module, "FAMILY", "unknown"), getattr(module, "VARIANT", "unknown")
    params = dict(getattr(module, "PARAMS", {}))
    return {"family": fam, "variant": var, "params": params,
            "params_hash": params_hash(fam, var, getattr(module, "TEMPLATE_VERSION", 0), params)}


def study_name(module: ModuleType, bucket: str, dtype: str, gpu: str | None = None) -> str:
    m = _module_meta(module)
    gpu = (gpu or gpu_name()).replace(" ", "_")
    return f"{m['family']}.{m['variant']}.{m['params_hash']}.{bucket}.{dtype}.{gpu}"


def storage_url(cfg: TuneConfig) -> str:
    if cfg.storage:
        return cfg.storage
    if cfg.storage_dir is None:
        raise InputError("tune: give storage (an Optuna URL) or storage_dir")
    Path(cfg.storage_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(cfg.storage_dir).resolve() / 'tune.db'}"


def _optuna():
    try:
        import optuna
    except ImportError as e:  # pragma: no cover
        raise InputError("the tune stage needs optuna: pip install optuna") from e
    return optuna


def create_study(name: str, storage: str, space: Mapping[str, list], seed: int = 0):
    """Create (or load) the study once, in this process, before any worker starts."""
    optuna = _optuna()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # multivariate/constant_liar are "experimental"
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                             n_startup_trials=min(8, _space_size(space) // 4 + 1))
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                sampler=sampler, load_if_exists=True)
    study.set_user_attr("tuning_space", {k: list(v) for k, v in space.items()})
    return study


def _load_study(name: str, storage: str, seed: int, space: Mapping[str, list]):
    optuna = _optuna()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                             n_startup_trials=min(8, _space_size(space) // 4 + 1))
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler)


def _space_size(space: Mapping[str, list]) -> int:
    n = 1
    for v in space.values():
        n *= len(v)
    return n


# ---- worker subprocess -----------------------------------------------------------------------

class WorkerDied(RuntimeError):
    pass


class WorkerTimeout(RuntimeError):
    pass


class _Worker:
    """A long-lived `python -m onboarding.tune --worker` child speaking JSON lines.

    Importing torch + triton costs seconds, so one child serves many trials; it is killed and
    restarted after a timeout or a crash. Kernel prints go to stderr (kept in a temp file whose
    tail explains a crash); the protocol uses a duplicate of the original stdout.
    """

    def __init__(self, *, interpret: bool | None, startup_timeout_s: float):
        self.interpret, self.startup_timeout_s = interpret, startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = dict(os.environ)
        if self.interpret is False:
            env.pop("TRITON_INTERPRET", None)  # AOT codegen fails once the interpreter is active
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "onboarding.tune", "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()
        self._read(self.startup_timeout_s)  # the "ready" line

    @staticmethod
    def _pump(proc: subprocess.Popen, q: queue.Queue) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            q.put(line)
        q.put(None)

    def _read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise WorkerTimeout(f"no answer within {timeout:g} s") from None
        if line is None:
            self.proc.wait()  # type: ignore[union-attr]
            rc = self.proc.returncode  # type: ignore[union-attr]
            self.err.seek(0)
            tail = self.err.read()[-1500:]
            self.proc = None
            raise WorkerDied(f"worker exited with rc={rc}: {tail.strip()[-800:]}")
        return json.loads(line)

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read(timeout)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _worker_main() -> int:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the kernels print goes to stderr, not into the protocol
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = _handle(req)
        except Exception as e:
            out = {"ok": False, "stage": "error", "reason": f"{type(e).__name__}: {e}"[:1500]}
        proto.write(json.dumps(out, default=str) + "\n")
        proto.flush()
    return 0


def _handle(req: dict[str, Any]) -> dict[str, Any]:
    return _aot_one(**req["args"]) if req["op"] == "aot" else _trial_one(**req["args"])


def _aot_one(path: str, config: dict, dtype: str, size: int) -> dict[str, Any]:
    from onboarding.aot import compile_module
    from onboarding.templating import load_module

    mod = load_module(path)
    mod.set_config(config)
    try:
        res = compile_module(mod, dtype=dtype, size=size)
    finally:
        mod.set_config(None)
    return {"ok": True, "kernels": [r.as_dict() for r in res]}


_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _trial_one(path: str, config: dict, family: str, variant: str, params: dict,
               shapes: list, seed: int, dtype: str, repeats: int) -> dict[str, Any]:
    import torch

    from onboarding.backend import kernel_device
    from onboarding.generate import _check_one
    from onboarding.patching import entry_function
    from onboarding.templating import get_family, load_module

    mod = load_module(path)
    spec = get_family(family)
    if spec.sample_inputs is None:
        raise InputError(f"family {family} declares no sample_inputs")
    device = kernel_device()
    mod.set_config(config)
    try:
        gen = torch.Generator().manual_seed(seed)
        args = [a.to(device) if isinstance(a, torch.Tensor) else a
                for a in spec.sample_inputs(variant, params, shapes, gen)]
        checks = _check_one(entry_function(mod), mod.reference, tuple(args), "tune")
        bad = [c for c in checks if not c["passed"]]
        if not checks or bad:
            why = "; ".join(f"{c['name']}: {c.get('message', '')}"[:200] for c in bad) or "no checks"
            return {"ok": False, "stage": "correctness", "reason": why, "checks": checks}
        time_ms, how = _time(entry_function(mod), args, dtype, repeats, device)
        return {"ok": True, "stage": "timed", "time_ms": time_ms, "timing": how,
                "checks": len(checks)}
    finally:
        mod.set_config(None)


def _time(entry, args: list, dtype: str, repeats: int, device) -> tuple[float, str]:
    """Median ms of forward + backward; event timing on a GPU, wall clock otherwise."""
    import statistics

    import torch

    tdt = getattr(torch, _TORCH_DTYPES.get(dtype, "float32"))
    if device.type != "cuda":  # interpreter: numbers mean nothing, keep it short
        tdt, repeats = torch.float32, min(repeats, 2)
    xs = [a.detach().to(tdt).requires_grad_(True) if isinstance(a, torch.Tensor)
          and a.is_floating_point() else a for a in args]
    out = entry(*xs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    cot = [torch.randn_like(o) for o in outs]

    def step(i: int) -> None:
        y = entry(*xs)
        ys = [o for o in (y if isinstance(y, tuple) else (y,))
              if isinstance(o, torch.Tensor) and o.requires_grad]
        if ys:
            torch.autograd.backward(ys, cot)

    if device.type == "cuda":
        from onboarding.bench.harness import time_fn

        return time_fn(step, warmup=3, repeats=repeats, n_sets=1).median_ms, "cuda-events"
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        step(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), "cpu-wallclock"


# ---- the tuner --------------------------------------------------------------------------------

class _Aot:
    """AOT results per (module sha, config, dtype, size), shared by worker threads."""

    def __init__(self) -> None:
        self.cache: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def key(self, path: str, config: Mapping, dtype: str, size: int) -> str:
        sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
        return json.dumps([sha, dict(sorted(config.items())), dtype, size])


def check_limits(kernels: list[dict[str, Any]], limits: Limits) -> str:
    """Why a config is impossible on the target ("" when it fits)."""
    for k in kernels:
        if not k["ok"]:
            return f"{k['kernel']}: compile error: {k['error'][:300]}"
        if k.get("shared_bytes") is not None and k["shared_bytes"] > limits.max_shared_bytes:
            return f"{k['kernel']}: shared memory {k['shared_bytes']} > {limits.max_shared_bytes}"
        if k.get("n_regs") is not None and k["n_regs"] > limits.max_registers:
            return f"{k['kernel']}: {k['n_regs']} registers > {limits.max_registers}"
        if k.get("n_spills") is not None and k["n_spills"] > limits.max_spill_bytes:
            return f"{k['kernel']}: spills {k['n_spills']} bytes > {limits.max_spill_bytes}"
    return ""


class _Objective:
    """One per worker thread: owns a trial worker and an AOT worker subprocess."""

    def __init__(self, *, path: str, module: ModuleType, size: int, shapes: list,
                 cfg: TuneConfig, timer: Timer | None, aot: _Aot):
        self.path, self.module, self.size, self.shapes = path, module, size, shapes
        self.cfg, self.timer, self.aot = cfg, timer, aot
        self.meta = _module_meta(module)
        self.space = {k: list(v) for k, v in module.TUNING_SPACE.items()}
        interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.trial_worker = _Worker(interpret=None, startup_timeout_s=cfg.startup_timeout_s)
        self.aot_worker = _Worker(interpret=False if interp else None,
                                  startup_timeout_s=cfg.startup_timeout_s)

    def close(self) -> None:
        self.trial_worker.close()
        self.aot_worker.close()

    def _run(self, worker: _Worker, op: str, args: dict, timeout: float) -> dict[str, Any]:
        if not self.cfg.isolate:
            try:
                return _handle({"op": op, "args": args})
            except Exception as e:
                return {"ok": False, "stage": "error", "reason": f"{type(e).__name__}: {e}"[:1500]}
        try:
            return worker.call({"op": op, "args": args}, timeout)
        except WorkerTimeout as e:
            return {"ok": False, "stage": "timeout", "reason": f"{op}: {e}"}
        except WorkerDied as e:
            return {"ok": False, "stage": "crash", "reason": f"{op}: {e}"}

    def _aot_reason(self, config: dict) -> str:
        key = self.aot.key(self.path, config, self.cfg.dtype, self.size)
        with self.aot.lock:
            hit = self.aot.cache.get(key)
        if hit is None:
            hit = self._run(self.aot_worker, "aot", {"path": self.path, "config": config,
                                                     "dtype": self.cfg.dtype, "size": self.size},
                            self.cfg.aot_timeout_s)
            with self.aot.lock:
                self.aot.cache[key] = hit
        if not hit["ok"]:
            return f"aot {hit['stage']}: {hit['reason']}"
        return check_limits(hit["kernels"], self.cfg.limits)

    def __call__(self, trial) -> float:
        optuna = _optuna()
        config = {k: trial.suggest_categorical(k, v) for k, v in self.space.items()}
        # TPE re-proposes configs; a finished twin answers without re-running.
        for t in trial.study.get_trials(deepcopy=False):
            if t.number != trial.number and t.params == config and t.state.is_finished():
                trial.set_user_attr("duplicate_of", t.number)
                if t.state == optuna.trial.TrialState.COMPLETE:
                    return float(t.value)
                for k in ("stage", "reason"):
                    trial.set_user_attr(k, t.user_attrs.get(k, ""))
                raise optuna.TrialPruned(t.user_attrs.get("reason", "duplicate of a pruned trial"))
        if self.cfg.aot:
            why = self._aot_reason(config)
            if why:
                trial.set_user_attr("stage", "aot")
                trial.set_user_attr("reason", why[:1000])
                raise optuna.TrialPruned(why)
        res = self._run(self.trial_worker, "trial", {
            "path": self.path, "config": config, "family": self.meta["family"],
            "variant": self.meta["variant"], "params": self.meta["params"], "shapes": self.shapes,
            "seed": self.cfg.seed * 100003 + trial.number, "dtype": self.cfg.dtype,
            "repeats": self.cfg.repeats}, self.cfg.trial_timeout_s)
        trial.set_user_attr("stage", res["stage"])
        if not res["ok"]:
            trial.set_user_attr("reason", res["reason"][:1000])
            raise optuna.TrialPruned(res["reason"][:200])
        trial.set_user_attr("measured_ms", res["time_ms"])
        trial.set_user_attr("timing", res["timing"])
        value = float(self.timer(config, res)) if self.timer else float(res["time_ms"])
        if self.timer:
            trial.set_user_attr("timing", "injected timer")
        return value


# ---- warm start --------------------------------------------------------------------------------

def tuned_path(module_path: Path | str) -> Path:
    p = Path(module_path)
    return p.with_name(p.stem + TUNED_SUFFIX)


def warm_start_configs(module: ModuleType, module_path: Path | str, bucket: str,
                       search_dirs: Iterable[Path | str] = ()) -> list[dict[str, Any]]:
    """Configs to try first: the bucket's default, then neighbouring buckets' tuned bests of this
    module (nearest first), then same-family bests from other tuned.json files."""
    names = [b["name"] for b in module.SHAPE_BUCKETS]
    i = names.index(bucket)
    b = module.SHAPE_BUCKETS[i]
    out = [{**module.DEFAULT_CONFIG, **b["config"]}]
    own = tuned_path(module_path)
    files = [own] + sorted(f for d in search_dirs for f in Path(d).rglob(f"*{TUNED_SUFFIX}")
                           if f.resolve() != own.resolve())
    fam = getattr(module, "FAMILY", None)
    for n, f in enumerate(files):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if data.get("family") != fam:
            continue
        same_variant = n == 0 or data.get("variant") == getattr(module, "VARIANT", None)
        ranked = sorted(data.get("buckets", {}).items(),
                        key=lambda kv: abs(names.index(kv[0]) - i) if kv[0] in names else 99)
        for name, entry in ranked:
            if n == 0 and name == bucket and not same_variant:
                continue
            out.append(dict(entry["config"]))
    seen, uniq = set(), []
    for c in out:
        if any(k not in module.TUNING_SPACE or v not in module.TUNING_SPACE[k] for k, v in c.items()):
            continue
        c = {**module.DEFAULT_CONFIG, **c}
        key = json.dumps(c, sort_keys=True)
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


def enqueue_warm_start(study, configs: list[dict[str, Any]]) -> int:
    """Enqueue configs not yet tried or queued in `study`; returns how many were enqueued."""
    before = len(study.get_trials(deepcopy=False))
    for c in configs:
        study.enqueue_trial(c, user_attrs={"warm_start": True}, skip_if_exists=True)
    return len(study.get_trials(deepcopy=False)) - before


# ---- running ----------------------------------------------------------------------------------

def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("best {task.fields[best]}"), transient=False)


def tune_module(module_path: Path | str, *, size: int, shapes: list[list[int]] | None = None,
                config: TuneConfig | None = None, timer: Timer | None = None) -> BucketResult:
    """Tune the bucket of a rendered module that holds `size` (its bucketed dimension, e.g. D).

    `shapes` are the block's input shapes, handed to the family's `sample_inputs` (default: the
    bucket's dimension as the last width). Creates/loads the study, enqueues warm starts, runs
    `config.n_trials` more trials over `config.n_workers` threads and returns the bucket's result.
    Does not write tuned.json: call `write_tuned` with the results.
    """
    from onboarding.templating import load_module

    cfg = config or TuneConfig()
    path = str(Path(module_path).resolve())
    module = load_module(path)
    bucket = module.shape_bucket(size)
    shapes = shapes if shapes is not None else [[size]]
    name = study_name(module, bucket, cfg.dtype)
    url = storage_url(cfg)
    space = {k: list(v) for k, v in module.TUNING_SPACE.items()}
    study = create_study(name, url, space, cfg.seed)  # once, before any worker
    study.set_user_attr("module", path)
    study.set_user_attr("bucket", bucket)
    study.set_user_attr("size", size)
    if cfg.warm_start:
        enqueue_warm_start(study, warm_start_configs(module, path, bucket, cfg.warm_start_dirs))
    aot = _Aot()
    lock = threading.Lock()
    done = [0]
    prog = _progress(cfg.n_trials, cfg.progress)
    task = prog.add_task(name, total=cfg.n_trials, best="-") if prog else None

    def claim() -> bool:
        with lock:
            if done[0] >= cfg.n_trials:
                return False
            done[0] += 1
            return True

    def work(wid: int) -> None:
        st = study if cfg.n_workers == 1 else _load_study(name, url, cfg.seed + wid, space)
        obj = _Objective(path=path, module=module, size=size, shapes=shapes, cfg=cfg,
                         timer=timer, aot=aot)

        def on_done(s, t) -> None:
            if prog is None:
                return
            try:
                best = f"{s.best_value:.4g} ms {s.best_params}"
            except ValueError:
                best = "-"
            prog.update(task, advance=1, best=best)

        try:
            while claim():
                st.optimize(obj, n_trials=1, callbacks=[on_done], catch=(Exception,),
                            gc_after_trial=False, show_progress_bar=False)
        finally:
            obj.close()

    optuna = _optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if prog:
        prog.start()
    try:
        if cfg.n_workers == 1:
            work(0)
        else:
            threads = [threading.Thread(target=work, args=(w,)) for w in range(cfg.n_workers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        if prog:
            prog.stop()
    return summarize(_load_study(name, url, cfg.seed, space), module, bucket)


def summarize(study, module: ModuleType, bucket: str) -> BucketResult:
    optuna = _optuna()
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    best, hist, pruned = None, [], {}
    for t in trials:
        if t.state == optuna.trial.TrialState.COMPLETE and (best is None or t.value < best.value):
            best = t
        elif t.state == optuna.trial.TrialState.PRUNED:
            stage = t.user_attrs.get("stage", "pruned")
            pruned[stage] = pruned.get(stage, 0) + 1
        if t.state.is_finished():
            hist.append(best.value if best else None)
    b = next(x for x in module.SHAPE_BUCKETS if x["name"] == bucket)
    default = {**module.DEFAULT_CONFIG, **b["config"]}
    dms = [t.value for t in trials if t.state == optuna.trial.TrialState.COMPLETE
           and {**module.DEFAULT_CONFIG, **t.params} == default]
    return BucketResult(
        bucket=bucket, study_name=study.study_name,
        best_config={**module.DEFAULT_CONFIG, **best.params} if best else None,
        best_ms=best.value if best else None, default_ms=dms[0] if dms else None,
        n_trials=len(hist), n_complete=sum(t.state == optuna.trial.TrialState.COMPLETE
                                           for t in trials),
        pruned=pruned, history=hist)


def tune_buckets(module_path: Path | str, sizes: Iterable[int], *,
                 shapes_for: Callable[[int], list[list[int]]] | None = None,
                 config: TuneConfig | None = None, timer: Timer | None = None,
                 write: bool = True) -> list[BucketResult]:
    """Tune each bucket hit by `sizes` (one size per bucket, the first wins), in bucket order so
    later buckets warm-start from earlier ones; writes `<module>.tuned.json` when `write`."""
    from onboarding.templating import load_module

    cfg = config or TuneConfig()
    module = load_module(module_path)
    by_bucket: dict[str, int] = {}
    for s in sizes:
        by_bucket.setdefault(module.shape_bucket(s), s)
    out = []
    for s in by_bucket.values():
        r = tune_module(module_path, size=s, shapes=shapes_for(s) if shapes_for else None,
                        config=cfg, timer=timer)
        out.append(r)
        if write and r.best_config is not None:
            write_tuned(module_path, [r], dtype=cfg.dtype, timing="injected timer" if timer
                        else None)
    return out


# ---- persistence and dispatch -----------------------------------------------------------------

def write_tuned(module_path: Path | str, results: Iterable[BucketResult], *, dtype: str = "bf16",
                gpu: str | None = None, timing: str | None = None) -> Path:
    """Merge the best config of each result into `<module>.tuned.json` (other buckets kept)."""
    import torch
    import triton

    from onboarding.templating import load_module

    module = load_module(module_path)
    path = tuned_path(module_path)
    data = json.loads(path.read_text()) if path.exists() else {}
    meta = _module_meta(module)
    data.update({k: meta[k] for k in ("family", "variant", "params", "params_hash")})
    data["module_sha256"] = hashlib.sha256(Path(module_path).read_bytes()).hexdigest()[:12]
    buckets = data.setdefault("buckets", {})
    for r in results:
        if r.best_config is None:
            continue
        buckets[r.bucket] = {
            "config": r.best_config, "best_ms": r.best_ms, "default_ms": r.default_ms,
            "trials": r.n_trials, "complete": r.n_complete, "pruned": r.pruned,
            "study": r.study_name, "dtype": dtype, "gpu": gpu or gpu_name(),
            "timing": timing or ("cuda-events" if gpu_name() != "cpu-interpreter"
                                 else "cpu-wallclock (meaningless)"),
            "torch": torch.__version__, "triton": triton.__version__,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def apply_tuned(module: ModuleType, path: Path | str | None = None) -> dict[str, dict[str, Any]]:
    """Pin every bucket's tuned config of `path` with `module.set_config(config, bucket)`;
    returns what was applied. A missing file applies nothing; a file for other parameters, or a
    config outside TUNING_SPACE, raises InputError.

    Pass `path`: `load_module` caches by content, so two identical module files share one module
    object whose `__file__` names the first one loaded (the default is beside that file)."""
    path = Path(path) if path else tuned_path(module.__file__)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    meta = _module_meta(module)
    if data.get("params_hash") not in (None, meta["params_hash"]):
        raise InputError(f"{path}: tuned for params hash {data.get('params_hash')}, the module "
                         f"has {meta['params_hash']}")
    applied = {}
    for bucket, entry in data.get("buckets", {}).items():
        try:
            module.set_config(entry["config"], bucket)
        except ValueError as e:
            raise InputError(f"{path}: bucket {bucket}: {e}") from e
        applied[bucket] = dict(entry["config"])
    return applied


# ---- report ------------------------------------------------------------------------------------

def load_tuned(module_path: Path | str) -> ModuleType:
    """Load a rendered module and apply the tuned.json beside that path (if any)."""
    from onboarding.templating import load_module

    module = load_module(module_path)
    apply_tuned(module, tuned_path(module_path))
    return module


def plot_history(results: Iterable[BucketResult], out: Path | str) -> Path:
    """Best-so-far vs trial number, one line per bucket (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        xs = [i + 1 for i, v in enumerate(r.history) if v is not None]
        ax.step(xs, [v for v in r.history if v is not None], where="post", label=r.bucket)
    ax.set_xlabel("trial")
    ax.set_ylabel("best so far (ms)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


def markdown_table(results: Iterable[BucketResult]) -> str:
    rows = ["| bucket | trials | complete | pruned | best config | best ms | default ms | gain |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        gain = (f"{r.default_ms / r.best_ms:.2f}x" if r.best_ms and r.default_ms else "-")
        pr = ", ".join(f"{k} {v}" for k, v in sorted(r.pruned.items())) or "0"
        fmt = (lambda v: f"{v:.4g}" if v is not None else "-")
        rows.append(f"| {r.bucket} | {r.n_trials} | {r.n_complete} | {pr} | "
                    f"`{json.dumps(r.best_config, sort_keys=True)}` | {fmt(r.best_ms)} | "
                    f"{fmt(r.default_ms)} | {gain} |")
    return "\n".join(rows) + "\n"


def result_dict(r: BucketResult) -> dict[str, Any]:
    return asdict(r)


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.exit(_worker_main())
