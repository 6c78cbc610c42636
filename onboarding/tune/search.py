"""The tune stage: Optuna search over a rendered kernel module's tile configs, per shape bucket.

One study per key (family, variant, params hash, shape bucket, dtype, GPU name or
"cpu-interpreter"), in plain Optuna storage (SQLite in a directory by default, any storage URL
accepted), so optuna-dashboard reads it. The study is created once, before workers start:
workers racing to create one SQLite study hit a UNIQUE constraint (docs/design.md).

Every trial, in order:
1. AOT gate (where kernels run in the interpreter; `TuneConfig.aot`): the config is compiled for
   sm_90 on the host (`onboarding.generate.aot`, no GPU) and pruned when a kernel fails to
   compile, needs more shared memory than the limit, or spills more than
   `Limits.max_spill_bytes` (a large bound: spilled configs can still be the fastest; see
   `Limits`). Each kernel's registers and spills are recorded on the trial. Results are cached
   per config. On a GPU host the check's own JIT builds (step 2) are judged by the same limits
   before the timing instead, from the driver's counts (`worker.jit_usage`).
2. In a worker subprocess (`onboarding.tune.worker`, kept alive across trials, killed and
   restarted on a timeout or a crash) the module is loaded, the config pinned, and forward +
   every gradient checked in the tuned dtype against `reference` on fresh random inputs (the
   16-bit gate: `worker._check_at`, bounds from `onboarding.testing.tolerance`). A failing
   config is pruned with its reason in the trial's user_attrs. Workers check and compile
   concurrently. On a GPU host the worker first builds the config's kernels with no launch
   (`worker.compile_ahead`, `TuneConfig.compile_ahead`) outside the GPU gate, so a check holds
   the gate for its kernels' runs, not its JIT compile.
3. Only then is it timed, alone on the GPU (`GpuGate`: no other timing or check runs): median of
   fwd+bwd steps replayed as a CUDA graph (or timed by CUDA events, `TuneConfig.timing`) at the
   real shapes given as `dims` (the family's `timing_inputs`);
   on the CPU interpreter the wall-clock time is meaningless, so `timer(config, result)` (run in
   the parent) may replace it; tests use a deterministic fake one.

After the search, the few fastest configs and the bucket default are re-timed alone, in
interleaved rounds (`TuneConfig.final_rounds`, `retime`): a single timing amid other workers'
compiles carries several percent of spread, and the best and the gain over the default are
chosen from these medians.

Best configs are written to `<module>.tuned.json` beside the module (`store`);
`apply_tuned` pins them per bucket so kernels dispatch to the nearest bucket at run time.
Entry points: `tune_module` (one bucket), `tune_buckets` (several), `compare_grid` (exhaustive
grid vs TPE on the same space, `grid`); `onboarding.tune.run` tunes a whole run. A trial's
steps 1-3 are `_objective.Objective`; the workers and open searches a run's studies share are
`_searches`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from onboarding.tune.store import (TUNED_SUFFIX, BucketResult, apply_tuned,  # noqa: F401
                                    bucket_default, enqueue_warm_start, gpu_name, load_tuned,
                                    markdown_table, module_meta, plot_history, result_dict,
                                    result_from_dict, tuned_path, warm_start_configs,
                                    write_tuned)
from onboarding.tune.worker import Cancelled
from onboarding.backend import on_gpu
from onboarding.errors import InputError
from onboarding.tune._objective import (GPU_GATES, TIMINGS, AotCache, Objective,  # noqa: F401
                                        TimingMode, _optuna, aot_usage, check_limits,
                                        phase_seconds)  # (re-exported: the tune API)
from onboarding.tune._searches import Search, current_pool, open_searches, shared_workers

Timer = Callable[[dict[str, Any], dict[str, Any]], float]  # (config, worker result) -> ms




@dataclass(kw_only=True, slots=True)
class Limits:
    """AOT pruning limits for sm_90 (H100/H200).

    No register limit: ptxas never gives a thread more than sm_90's 255 registers, nor more than
    the 64K-register file holds for the block's threads (Triton declares them, `.maxntid`); it
    spills the rest, and it reports the count it used, never an excess (a `n_regs > 255` rule
    could not fire). The registers and spills of every kernel are recorded on each trial
    (`aot_kernels`, `spill_bytes`) and the best and default configs' spills show in the results.
    """

    max_shared_bytes: int = 232448  # opt-in max dynamic shared memory per block
    # Spill stores or loads per thread, in bytes, of the worst kernel; None: spills never prune.
    # A spill is a cost that the timing measures, not a reason to skip a config: on the H200 the
    # GDN config that spills 6.8 KB in one backward kernel ran fwd+bwd 1.34x faster than the
    # default that spills 544 bytes (docs/LOG.md, fourth session), and the k_le_128 default now
    # spills 4.3 KB. The bound only skips configs whose spilling is heavy enough that timing
    # them likely wastes the trial: at rmsnorm's d_le_64k the config spilling 21.9 KB ran
    # fwd+bwd 2.3x slower than the default's 2.9 KB, and random GDN configs spill up to 86 KB
    # (H200, issue 36). 32 KB is 4.7x the spill of the fastest config measured.
    max_spill_bytes: int | None = 32768


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
    # the AOT gate (step 1 of the module docstring). None: on where kernels run in the interpreter
    # (no other sm_90 build to judge a config by), off on a GPU host, where the check's JIT build is
    # the GPU's own and its usage (`worker.jit_usage`) is judged by the same limits instead: the
    # gate's build of every trial's config was a second compile on the GPU host's cores. A build
    # gets at most what is left of the study's budget (then its trial is pruned as "budget").
    aot: bool | None = None
    aot_timeout_s: float = 300.0
    limits: Limits = field(default_factory=Limits)
    dtype: str = "bf16"  # timing dtype, and the check's (emulated in the interpreter)
    repeats: int = 20
    warm_start: bool = True
    warm_start_dirs: tuple[Path, ...] = ()  # other tuned.json files of the same family
    isolate: bool = True  # False: run trials in-process (no timeout; for tests/debugging)
    progress: bool = True
    # a sub-space {key: values} of TUNING_SPACE; the bucket's default values are always kept,
    # so the gain over the default is measured. Studies over a sub-space get their own names.
    space: Mapping[str, Sequence[Any]] | None = None
    space_only: bool = False  # True: keys `space` does not name stay at the bucket's default
    # After the search, the FINALISTS best configs and the default are re-timed alone, this many
    # interleaved rounds, and the best is chosen by their medians (GPU or injected timer; 0: off)
    final_rounds: int = 3
    # Seconds for one study (search, then re-timing): once spent, no new trial starts (the
    # trials in flight finish) and the result says "stopped at budget"; the re-timing runs one
    # round, then more only while time is left. None: no time limit (n_trials alone).
    budget_s: float | None = None
    # Studies of one run (`tune_run`) at once, each on its own thread and workers: their compiles
    # run on cores of their own while timings still take the GPU one at a time (`GpuGate`).
    # None: `study_slots`' choice (three per four cores on a GPU host, one on the CPU).
    parallel_studies: int | None = None
    # How checks and timings share the GPU (`GPU_GATES`). "strict": a timing has it alone, and a
    # check holds it through its run (and its JIT compile, without `compile_ahead`: then every
    # timing waits for the slowest compile in flight, the main command at 90 s on an H100 spending
    # 45-61 s of a study's ~76 s waiting; docs/LOG.md, forty-fourth session). "overlap": timings
    # exclusive among themselves only, checks (tiny kernels at sample shapes) beside them: more trials,
    # noisier search timings; the finalists' re-timing, after every study's search has ended,
    # picks the best. Not yet measured on a GPU, so not the default.
    gpu_gate: str = "strict"
    # Build a config's kernels before its check takes its place at the GPU gate (the worker's
    # ``compile``: every launch a compile-only warmup, the builds on threads), so the gate is held
    # for the check's kernels, not its JIT compile. The pass still runs the module's torch ops
    # (routing, allocations, a torch GEMM it calls) at the timing shapes, beside whatever timing
    # holds the gate: search timings can be that much noisier, and the finalists' re-timing
    # picks the best. A pass whose worker dies or times out turns passes off for that objective
    # (the check then builds as before). None: on a GPU host (no builds in the interpreter).
    # Each pass is bounded by the study's budget: one that would end past it is stopped and its
    # trial pruned ("budget"). Every study's pass builds at once, on up to 8 threads each: on an
    # H100 (16 cores, 11 studies, `onboard tune --tune-budget 90`) that gave 30 of 30 trials to
    # nine studies where the check's JIT build under the gate gave 3, and limiting the passes to
    # four at once (4 threads each) gave 9-16 (docs/LOG.md, forty-sixth session).
    compile_ahead: bool | None = None
    # How a trial is timed on a GPU (`TIMINGS`): "graph", the step replayed as a CUDA graph
    # (kernels only); "events", CUDA events around each launched forward + backward step (Python
    # and launch time included). A study whose step cannot be captured times by events from then
    # on, and its result says why (`BucketResult.timing`). On one H100 with the example's eleven
    # studies at once (`onboard tune --tune-budget 90`), graph captured every study's step and
    # timed its kernels at 0.010-0.17 ms; events timed the same steps at 0.11-2.5 ms, set by the
    # other studies' builds on the host's cores, not by the config: one default config took
    # 0.114 and 0.233 ms in two runs (docs/LOG.md, forty-seventh session).
    timing: str = "graph"
    # A run's study threads with no study left to start join the searches still running as one
    # more worker each (`OpenSearches`; at most 3 a search): the heaviest studies get the cores
    # the light ones leave. On one H100 (`onboard tune --tune-budget 90`, the example's eleven
    # studies) moe_experts ran 8 trials with helpers and 3 without, gated_delta 10 and 7; two
    # light studies helped in turn ended at 21 and 28 trials instead of 30 (docs/LOG.md,
    # forty-seventh session).
    join_studies: bool = True


# ---- keys, spaces and storage -----------------------------------------------------------------

def search_space(module: ModuleType, bucket: str,
                 restrict: Mapping[str, Sequence[Any]] | None = None,
                 only: bool = False) -> dict[str, list]:
    """The searched space: TUNING_SPACE, or `restrict` (validated) plus the bucket default;
    `only`: the keys `restrict` does not name take the bucket default alone."""
    full = {k: list(v) for k, v in module.TUNING_SPACE.items()}
    if not restrict:
        if only:
            raise InputError("tune: --space-only needs --space KEY=V1,V2 to search")
        return full
    unknown = sorted(set(restrict) - set(full))
    if unknown:
        raise InputError(f"tune --space: unknown keys {unknown}; {module.FAMILY} has "
                         f"{sorted(full)}")
    default = bucket_default(module, bucket)
    out = {}
    for k, values in full.items():
        if k not in restrict:
            out[k] = [default[k]] if only else values
            continue
        bad = [v for v in restrict[k] if v not in values]
        if bad or not restrict[k]:
            raise InputError(f"tune --space: {k}={list(restrict[k])} must be a non-empty subset "
                             f"of {values}")
        keep = set(restrict[k]) | {default[k]}
        out[k] = [v for v in values if v in keep]
    return out


def space_size(space: Mapping[str, Sequence]) -> int:
    return math.prod(len(v) for v in space.values())


def study_name(module: ModuleType, bucket: str, dtype: str, gpu: str | None = None,
               space: Mapping[str, Sequence] | None = None, suffix: str = "") -> str:
    """`family.variant.params_hash.bucket.dtype.gpu`, plus a space hash for a sub-space."""
    m = module_meta(module)
    gpu = (gpu or gpu_name()).replace(" ", "_")
    name = f"{m['family']}.{m['variant']}.{m['params_hash']}.{bucket}.{dtype}.{gpu}"
    if space is not None and dict(space) != {k: list(v) for k, v in module.TUNING_SPACE.items()}:
        name += ".space-" + hashlib.sha256(json.dumps(space, sort_keys=True).encode()
                                           ).hexdigest()[:8]
    return name + suffix


def storage_url(cfg: TuneConfig) -> str:
    if cfg.storage:
        return cfg.storage
    if cfg.storage_dir is None:
        raise InputError("tune: give storage (an Optuna URL) or storage_dir")
    Path(cfg.storage_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(cfg.storage_dir).resolve() / 'tune.db'}"


def _sampler(kind: str, space: Mapping[str, Sequence], seed: int):
    optuna = _optuna()
    if kind == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in space.items()}, seed=seed)
    if kind != "tpe":
        raise InputError(f"tune: unknown sampler {kind!r}; known: tpe, grid")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # multivariate/constant_liar are "experimental"
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                          n_startup_trials=min(8, space_size(space) // 4 + 1))


# One thread at a time opens a study: two studies of a run started at once on a new SQLite file
# both tried to create its tables ("table studies already exists").
_OPEN = threading.Lock()


def create_study(name: str, storage: str, space: Mapping[str, Sequence], seed: int = 0,
                 sampler: str = "tpe"):
    """Create (or load) the study once, in this process, before any worker starts."""
    optuna = _optuna()
    with _OPEN:
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                    sampler=_sampler(sampler, space, seed), load_if_exists=True)
    study.set_user_attr("tuning_space", {k: list(v) for k, v in space.items()})
    study.set_user_attr("sampler", sampler)
    return study


def _load_study(name: str, storage: str, seed: int, space: Mapping[str, Sequence],
                sampler: str = "tpe"):
    with _OPEN:
        return _optuna().load_study(study_name=name, storage=storage,
                                    sampler=_sampler(sampler, space, seed))


# ---- running ----------------------------------------------------------------------------------

_ASK = threading.Lock()


def _one_trial(study, objective: Objective, stop: threading.Event) -> None:
    """Ask, evaluate, tell. `ask` is serialized in this process: two threads popping the queued
    (warm-start, grid) trials of one SQLite study at once can take the same trial. Once `stop`
    is set (an interrupt killed the workers), the outcome is not told: the trial stays RUNNING
    and a resumed grid runs its config again."""
    optuna = _optuna()
    with _ASK:
        trial = study.ask()
    try:
        value = objective(trial)
    except optuna.TrialPruned:
        if not stop.is_set():
            _tell(study, trial, state=optuna.trial.TrialState.PRUNED)
    except Exception as e:  # a bug in the objective: recorded, the study goes on
        if not stop.is_set():
            trial.set_user_attr("stage", "error")
            trial.set_user_attr("reason", f"{type(e).__name__}: {e}"[:1000])
            _tell(study, trial, state=optuna.trial.TrialState.FAIL)
    else:
        if not stop.is_set():
            _tell(study, trial, value)


def _tell(study, trial, *args, **kwargs) -> None:
    """`study.tell`, except that GridSampler's `study.stop()` once every grid point ran raises
    outside `optimize`. The trial's state is stored before that (optuna's tell stores it in a
    `finally`), and the claim counter ends the workers, so the error is only noise."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


class PlainProgress:
    """`progress_bar`'s interface for output that is not a terminal: one plain line per update
    (a log a pipe or a CI job can read), no cursor movement."""

    def __init__(self, file=None, *, silent: bool = False) -> None:
        self.file, self.silent = file, silent
        self.tasks: list[Any] = []  # like rich's: description, total, completed, fields

    def add_task(self, description: str, total: int | None = None, **fields) -> int:
        from types import SimpleNamespace

        self.tasks.append(SimpleNamespace(description=description, total=total, completed=0,
                                          fields=dict(fields)))
        return len(self.tasks) - 1

    def update(self, task: int, advance: int = 0, **fields) -> None:
        t = self.tasks[task]
        t.completed += advance
        t.fields.update(fields)
        if not self.silent:
            print(f"{t.description}: {t.completed}/{t.total} best {t.fields.get('best', '-')}",
                  file=self.file or sys.stderr, flush=True)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(console=None):
    """A rich progress bar with one row per study: trials done, elapsed, and a text field `best`
    (best so far against the default, time left of the budget), on stderr (stdout may hold a
    command's --json). Not a terminal: `PlainProgress`, one plain line per update; the
    ``onboarding`` logger set above INFO (``onboard -q``): nothing."""
    import logging

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if logging.getLogger("onboarding").level > logging.INFO:
        return PlainProgress(silent=True)
    console = console or Console(stderr=True)
    if not console.is_terminal:
        return PlainProgress(console.file)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("best {task.fields[best]}"), transient=False,
                    console=console)


def progress_text(best_ms: float | None, default_ms: float | None,
                  left_s: float | None = None) -> str:
    """'0.0123 ms vs default 0.0150 ms (1.22x), 23 s left': a study's standing, in words."""
    fmt = (lambda v: "-" if v is None else f"{v:.4g} ms")
    text = fmt(best_ms) + f" vs default {fmt(default_ms)}"
    if best_ms and default_ms:
        text += f" ({default_ms / best_ms:.2f}x)"
    if left_s is not None:
        text += f", {max(0.0, left_s):.0f} s left"
    return text


def tune_module(module_path: Path | str, *, size: int, shapes: list[list[int]] | None = None,
                dims: dict[str, int] | None = None, config: TuneConfig | None = None,
                timer: Timer | None = None, sampler: str = "tpe", suffix: str = "",
                progress=None, on_trial: Callable[[dict[str, Any]], None] | None = None,
                budget_from: float | None = None) -> BucketResult:
    """Tune the bucket of a rendered module that holds `size` (its bucketed dimension, e.g. D).

    `shapes` are the block's input shapes, handed to the family's `sample_inputs` for the
    correctness check (default: `size` as the last width); `dims` the real problem dimensions
    for timing on a GPU (the family's `timing_dims`; None: time at the sample shapes).
    Creates/loads the study (`sampler` "tpe" or "grid", name + `suffix`), enqueues warm starts,
    runs `config.n_trials` more trials over `config.n_workers` threads and returns the bucket's
    result. `progress`: a `progress_bar()` to add a row to (default: its own, if enabled).
    `config.budget_s` bounds the study's time: no trial starts once it is spent, and the result
    says so (`BucketResult.stopped`); it counts from `budget_from` (time.monotonic(), when the
    budget was granted: the study's set-up is in it) or, without one, from the search's start.
    `on_trial(info)` is called after each trial with done,
    total, best_ms, default_ms and left_s (None without a budget).
    Does not write tuned.json: call `write_tuned` with the results.
    """
    from onboarding.generate.templating import load_module

    cfg = config or TuneConfig()
    if cfg.gpu_gate not in GPU_GATES:
        raise InputError(f"tune: GPU gate {cfg.gpu_gate!r}: expected one of {', '.join(GPU_GATES)}")
    if cfg.timing not in TIMINGS:
        raise InputError(f"tune: timing {cfg.timing!r}: expected one of {', '.join(TIMINGS)}")
    path = str(Path(module_path).resolve())
    module = load_module(path)
    bucket = module.shape_bucket(size)
    shapes = shapes if shapes is not None else [[size]]
    space = search_space(module, bucket, cfg.space, cfg.space_only)
    name = study_name(module, bucket, cfg.dtype, space=space, suffix=suffix)
    url = storage_url(cfg)
    study = create_study(name, url, space, cfg.seed, sampler)  # once, before any worker
    for k, v in (("module", path), ("bucket", bucket), ("size", size), ("dims", dims)):
        study.set_user_attr(k, v)
    if cfg.warm_start and sampler == "tpe":
        ws = [c for c in warm_start_configs(module, path, bucket, cfg.warm_start_dirs)
              if all(v in space[k] for k, v in c.items())]
        enqueue_warm_start(study, ws)
    # `stop`: set by an interrupt; within a run's `shared_workers`, the pool's, so that an
    # interrupt heard by another thread (studies run at once, `tune_run`) stops this study too
    pool = current_pool()
    stop = pool.cancelled if pool is not None else threading.Event()
    aot, lock, claimed, objectives = AotCache(), threading.Lock(), [0], []
    mode = TimingMode(cfg.timing)  # the study's: its workers', helpers' and re-timing's
    started = time.monotonic() if budget_from is None else budget_from
    deadline = None if cfg.budget_s is None else started + cfg.budget_s
    # the search leaves a quarter of the budget to the re-timing that follows it
    retimes = bool(cfg.final_rounds) and timing_is_real(timer)
    search_end = None if deadline is None else started + cfg.budget_s * (0.75 if retimes
                                                                        else 1.0)
    at_budget, finished = threading.Event(), [0]
    default_cfg = bucket_default(module, bucket)
    own = progress is None and cfg.progress
    prog = progress_bar() if own else progress
    task = prog.add_task(name.split(".", 2)[0] + f" {bucket}{suffix}", total=cfg.n_trials,
                         best="-") if prog else None

    def claim() -> bool:
        with lock:
            if stop.is_set() or claimed[0] >= cfg.n_trials:
                return False
            if search_end is not None and time.monotonic() >= search_end:
                at_budget.set()
                return False
            claimed[0] += 1
            return True

    def on_done(s) -> None:
        with lock:
            finished[0] += 1
            done = finished[0]
        if prog is None and on_trial is None:
            return
        complete = [t for t in s.get_trials(deepcopy=False)
                    if t.state == optuna.trial.TrialState.COMPLETE]
        best = min((t.value for t in complete), default=None)
        dflt = next((t.value for t in complete
                     if {**module.DEFAULT_CONFIG, **t.params} == default_cfg), None)
        left = None if search_end is None else search_end - time.monotonic()
        if prog is not None:
            prog.update(task, advance=1, best=progress_text(best, dflt, left))
        if on_trial is not None:
            try:  # a progress display that fails must not end the study
                on_trial({"done": done, "total": cfg.n_trials, "best_ms": best,
                          "default_ms": dflt, "left_s": left})
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"tune progress callback failed: {type(e).__name__}: {e}")

    def work(wid: int) -> int:
        """One worker's trials, until `claim` says no more; the count. Workers past the first
        (`n_workers`, or helpers) sample from their own seeded study object."""
        st = study if wid == 0 else _load_study(name, url, cfg.seed + wid, space, sampler)
        try:
            obj = Objective(path=path, module=module, size=size, shapes=shapes, dims=dims,
                             space=space, cfg=cfg, timer=timer, aot=aot, timing=mode)
        except Cancelled:  # the run's pool was cancelled before this worker took its own
            return 0
        obj.deadline = deadline
        with lock:
            objectives.append(obj)
            stopped = stop.is_set()  # interrupted before this worker's objective was listed
        if stopped:
            obj.close()
            return 0
        ran = 0
        try:
            while claim():
                _one_trial(st, obj, stop)
                on_done(st)
                ran += 1
        finally:
            obj.close()
        return ran

    # Helpers (`OpenSearches`): one more worker each, while this study's own workers run; the
    # study waits for them before its result. Without a run's board (one study alone) none come.
    board, helpers = open_searches(), threading.Condition(lock)
    n_helpers, next_wid, helped = [0], [cfg.n_workers], [0]

    def join() -> int:
        with lock:
            if search is None or search.done or stop.is_set():
                return 0
            n_helpers[0] += 1
            wid, next_wid[0] = next_wid[0], next_wid[0] + 1
        n = 0
        try:
            n = work(wid)
            return n
        finally:
            with lock:
                n_helpers[0] -= 1
                helped[0] += n
                helpers.notify_all()

    search = Search(join) if board is not None and cfg.join_studies else None

    optuna = _optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if own:
        prog.start()
    try:
        # On Ctrl-C / SIGINT no new trial starts, the worker subprocesses are killed (their
        # trials stay RUNNING: a resumed grid queues them again) and the interrupt propagates
        # instead of waiting for the trials in flight.
        def interrupted() -> None:
            stop.set()
            with lock:
                for obj in objectives:
                    obj.close(keep=False)
            if pool is not None:
                pool.cancel()

        if search is not None:
            board.add(search)
        try:
            run_threads(work, range(cfg.n_workers), interrupted)
        finally:
            if search is not None:
                board.close(search)  # no new helper; those in flight end their trials
                with lock:
                    helpers.wait_for(lambda: n_helpers[0] == 0)
        if stop.is_set():  # interrupted in another thread (`WorkerPool.cancel`): no result
            raise Cancelled("the tuning run was interrupted")
        final_study = _load_study(name, url, cfg.seed, space, sampler)
        result = summarize(final_study, module, bucket)
        if at_budget.is_set():
            result = dataclasses.replace(
                result, stopped=f"stopped at budget ({cfg.budget_s:.0f} s) after "
                                f"{finished[0]} of {cfg.n_trials} trials")
        result = _finalize(result, final_study, module, path, size=size, shapes=shapes,
                           dims=dims, cfg=cfg, timer=timer, progress=prog, deadline=deadline,
                           timing=mode)
        return dataclasses.replace(result, trials_run=finished[0], budget_s=cfg.budget_s,
                                   seconds=round(time.monotonic() - started, 2),
                                   helper_trials=helped[0],
                                   timing="injected timer" if timer
                                   else mode.describe() if on_gpu() else None)
    finally:
        if own:
            prog.stop()


def run_threads(target: Callable[[Any], None], args: Iterable[Any],
                interrupted: Callable[[], None]) -> None:
    """`target(a)` for each of `args` on daemon threads, joined here. Each runs in a copy of this
    context, so a callback that reads context variables (LangGraph's stream writer, in the agent's
    tune node; the run's worker pool) works from it. On Ctrl-C `interrupted()` runs and the
    interrupt propagates at once, without waiting for the threads."""
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(target, a), daemon=True)
               for a in args]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        interrupted()
        raise


def summarize(study, module: ModuleType, bucket: str) -> BucketResult:
    optuna = _optuna()
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    best, hist, pruned, reasons = None, [], {}, {}
    for t in trials:
        if t.state == optuna.trial.TrialState.COMPLETE and (best is None or t.value < best.value):
            best = t
        elif t.state == optuna.trial.TrialState.PRUNED:
            stage = t.user_attrs.get("stage", "pruned")
            pruned[stage] = pruned.get(stage, 0) + 1
            reasons.setdefault(stage, str(t.user_attrs.get("reason", ""))[:300])
        if t.state.is_finished():
            hist.append(best.value if best else None)
    default = bucket_default(module, bucket)
    dms = [t.value for t in trials if t.state == optuna.trial.TrialState.COMPLETE
           and {**module.DEFAULT_CONFIG, **t.params} == default]
    best_config = {**module.DEFAULT_CONFIG, **best.params} if best else None
    return BucketResult(
        bucket=bucket, study_name=study.study_name, best_config=best_config,
        best_ms=best.value if best else None, default_ms=dms[0] if dms else None,
        n_trials=len(hist), n_complete=sum(t.state == optuna.trial.TrialState.COMPLETE
                                           for t in trials),
        pruned=pruned, history=hist, prune_reasons=reasons,
        spill_bytes=spills_of(trials, module, [best_config, default]),
        phase_s=phase_seconds(trials))


def spills_of(trials, module: ModuleType, configs: Sequence[dict | None]) -> list[int | None]:
    """The largest spill (bytes per thread, from the AOT gate) of each config, from the first
    trial of it that recorded one; None: not compiled ahead of time (`--no-aot`), or no ptxas."""
    out = []
    for c in configs:
        out.append(next((t.user_attrs["spill_bytes"] for t in trials
                         if c is not None and t.user_attrs.get("spill_bytes") is not None
                         and {**module.DEFAULT_CONFIG, **t.params} == c), None))
    return out


FINALISTS = 3  # best distinct configs of a search re-timed with the default (final_rounds)


def retime(module_path: Path | str, configs: Sequence[dict[str, Any]], *, size: int,
           shapes: list[list[int]] | None = None, dims: dict[str, int] | None = None,
           config: TuneConfig | None = None, timer: Timer | None = None,
           rounds: int | None = None, progress=None,
           deadline: float | None = None, timing: TimingMode | None = None
           ) -> list[float | None]:
    """Median ms of each config over `rounds` interleaved rounds (the order rotates each round),
    on one worker after the search, when no check or compile competes for the machine. A search
    times each config once, amid other workers' compiles: one config timed 6.51 and 6.03 ms in
    two studies of one run (docs/LOG.md, fourth session). None: the config failed every round.
    `deadline` (time.monotonic()): after the first round, no round starts once it has passed.
    `timing`: the study's way of timing; if a graph capture fails here, the rounds are timed
    again by events, so that no median mixes the two."""
    import statistics

    from onboarding.generate.templating import load_module

    cfg = config or TuneConfig()
    rounds = cfg.final_rounds if rounds is None else rounds
    path = str(Path(module_path).resolve())
    module = load_module(path)
    obj = Objective(path=path, module=module, size=size, shapes=shapes or [[size]], dims=dims,
                     space={}, cfg=cfg, timer=timer, aot=AotCache(), timing=timing)
    try:
        graph = obj.timing.graph
        times = _retime_rounds(obj, configs, cfg, rounds, progress, deadline)
        if graph and not obj.timing.graph:  # a capture failed in these rounds: events for all
            times = _retime_rounds(obj, configs, cfg, rounds, progress, deadline)
    finally:
        obj.close()
    return [statistics.median(t) if t else None for t in times]


def _retime_rounds(obj: Objective, configs: Sequence[dict[str, Any]], cfg: TuneConfig,
                   rounds: int, progress, deadline: float | None) -> list[list[float]]:
    import statistics

    times: list[list[float]] = [[] for _ in configs]
    task = progress.add_task(f"re-timing {len(configs)} configs x {rounds} rounds",
                             total=rounds * len(configs), best="-") if progress else None
    for r in range(rounds):
        if r and deadline is not None and time.monotonic() >= deadline:
            break
        for j in range(len(configs)):
            i = (j + r) % len(configs)
            ms = obj.measure(dict(configs[i]), seed=cfg.seed * 100003 + 7919 * (r + 1) + i)
            if ms is not None:
                times[i].append(ms)
            if task is not None:
                done = [statistics.median(t) for t in times if t]
                progress.update(task, advance=1, best=f"{min(done):.4g} ms" if done else "-")
    return times


def finalists(study, module: ModuleType, bucket: str, n: int = FINALISTS) -> list[dict]:
    """The `n` fastest distinct complete configs of `study`, then the bucket default."""
    optuna = _optuna()
    default = bucket_default(module, bucket)
    done = sorted((t for t in study.get_trials(deepcopy=False)
                   if t.state == optuna.trial.TrialState.COMPLETE), key=lambda t: t.value)
    out: list[dict] = []
    for t in done:
        c = {**module.DEFAULT_CONFIG, **t.params}
        if c not in out and c != default:
            out.append(c)
        if len(out) == n:
            break
    return out + [default]


def timing_is_real(timer: Timer | None) -> bool:
    """Re-timing means something with an injected timer or on a GPU, not in the interpreter."""
    return timer is not None or on_gpu()


def _finalize(result: BucketResult, study, module: ModuleType, module_path, *, size: int,
              shapes, dims, cfg: TuneConfig, timer: Timer | None, progress=None,
              deadline: float | None = None, timing: TimingMode | None = None) -> BucketResult:
    """Re-time the finalists with the default; the best and the default's time come from it.
    Past `deadline` (the study's budget spent) there is no re-timing: the search's timings
    stand, and `result.stopped` says so."""
    if not cfg.final_rounds or result.best_config is None or not timing_is_real(timer):
        return result
    if deadline is not None and time.monotonic() >= deadline:
        why = "finalists not re-timed (budget spent)"
        return dataclasses.replace(result, stopped=f"{result.stopped}; {why}" if result.stopped
                                   else why)
    configs = finalists(study, module, result.bucket)
    ms = retime(module_path, configs, size=size, shapes=shapes, dims=dims, config=cfg,
                timer=timer, progress=progress, deadline=deadline, timing=timing)
    final = {json.dumps(c, sort_keys=True): m for c, m in zip(configs, ms)}
    timed = [(m, c) for c, m in zip(configs, ms) if m is not None]
    if not timed:
        return dataclasses.replace(result, final=final)
    best_ms, best = min(timed, key=lambda x: x[0])
    spills = spills_of(study.get_trials(deepcopy=False), module, [best, configs[-1]])
    return dataclasses.replace(result, best_config=best, best_ms=best_ms,
                               default_ms=ms[-1] if ms[-1] is not None else result.default_ms,
                               final=final, spill_bytes=spills)


def tune_buckets(module_path: Path | str, sizes: Iterable[int], *,
                 shapes_for: Callable[[int], list[list[int]]] | None = None,
                 dims_for: Callable[[int], dict[str, int] | None] | None = None,
                 config: TuneConfig | None = None, timer: Timer | None = None,
                 write: bool = True, progress=None) -> list[BucketResult]:
    """Tune each bucket hit by `sizes` (one size per bucket, the first wins), in bucket order so
    later buckets warm-start from earlier ones; writes `<module>.tuned.json` when `write`."""
    from onboarding.generate.templating import load_module

    cfg = config or TuneConfig()
    module = load_module(module_path)
    by_bucket: dict[str, int] = {}
    for s in sizes:
        by_bucket.setdefault(module.shape_bucket(s), s)
    out = []
    with shared_workers():
        for s in by_bucket.values():
            r = tune_module(module_path, size=s, shapes=shapes_for(s) if shapes_for else None,
                            dims=dims_for(s) if dims_for else None, config=cfg, timer=timer,
                            progress=progress)
            out.append(r)
            if write and r.best_config is not None:
                write_tuned(module_path, [r], dtype=cfg.dtype, timing="injected timer" if timer
                            else None)
    return out
