"""`onboard tune MODEL`: tune every kernel a run uses, at the shapes seen in its op graph.

A run directory holds `opgraph.json`, `coverage.json` and `candidates.json` (parse, map,
generate). `plan_jobs` turns them into one job per (candidate module, shape bucket): the
bucketed dimension (`ShapeBucket.dim`) and the real problem dims for timing are read off each
block by structure (input shapes, weight shapes, attrs: the family's `problem_dims` hook); the
first block of a bucket gives its shapes. `tune_run` runs one study per job (key: family,
variant, params, bucket, dtype, GPU), writes `<variant>.tuned.json` beside each candidate
module, `tune.json` (every result, for the report) and `tune_best.png`. Reviewed kernels
(`kernels/`) are not tuned here: their tuned configs are reviewed like their code. A candidate
whose module exports ``block_forward`` (an accepted LLM-written family) and whose bucketed
dimension no rule reads is tuned on its block instead (`onboarding.tune.block`, job level
"block"): on the run's proxy at its capture size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from onboarding.errors import InputError
from onboarding.rundir import write_json
from onboarding.tune.search import (BucketResult, Timer, TuneConfig, plot_history, progress_bar,
                             result_dict, tune_module, write_tuned)

RESULTS_FILE = "tune.json"
PLOT_FILE = "tune_best.png"
RUN_ARTIFACTS = ("opgraph.json", "coverage.json", "candidates.json")


@dataclass(kw_only=True)
class TuneJob:
    family: str
    variant: str
    module: str  # the candidate module's path
    bucket: str
    size: int  # the bucketed dimension's value
    size_source: str  # how `size` was read off the block
    shapes: list[list[int]]  # the block's input shapes (for the correctness sample)
    dims: dict[str, int] | None  # real problem dims for timing (None: sample shapes)
    blocks: list[str] = field(default_factory=list)
    # "kernel": the module's entry on sample/timing inputs (the worker's trials); "block": a
    # module exporting block_forward, tuned on the block itself (`onboarding.tune.block`)
    level: str = "kernel"
    kind: str = ""
    # roofline seconds of `blocks` at the run's shapes (`block_seconds`): the order studies run in
    weight_s: float = 0.0


def block_dims(family: str, entry, block) -> dict[str, int] | None:
    """The real problem dims of one coverage entry's block: the family's `problem_dims` hook
    (None: unknown, or the family declares none)."""
    from onboarding.families import get_family

    hook = get_family(family).problem_dims
    return hook(entry, block) if hook is not None else None


def bucket_size(spec, entry, block, dims: dict[str, int] | None) -> tuple[int | None, str]:
    """The value of the family's bucketed dimension for one block, and where it came from: the
    family's problem dims when it declares them (they are its whole say: None is not tuned),
    else generic rules by the dim's name."""
    dim = spec.shape_buckets[0].dim
    if dims and dim in dims:
        return int(dims[dim]), f"{dim} from the block's problem dims"
    if spec.problem_dims is not None:
        return None, ""
    attrs = block.attrs if block is not None else {}
    if dim == "C" and attrs.get("channels"):
        return int(attrs["channels"]), "C from the block's channels"
    if dim == "E" and attrs.get("n_experts"):
        return int(attrs["n_experts"]), "E from the block's n_experts"
    if dim in ("D", "F", "I") and entry.shapes and entry.shapes[0]:
        return int(entry.shapes[0][-1]), f"{dim}: the block input's last dim"
    if dim == "D_QK" and len(entry.shapes) >= 2 and entry.shapes[1]:
        return int(entry.shapes[1][-1]), "D_QK: the head dim of the rotary table"
    return None, ""


def block_seconds(block) -> float:
    """A block's roofline time at the op graph's shapes: its FLOPs at the planner's dense GEMM
    rate or its bytes at its HBM bandwidth (`onboarding.plan.config.Rates`), whichever is longer;
    0 for a block the graph does not have."""
    from onboarding.plan.config import Rates

    if block is None:
        return 0.0
    r = Rates()
    return max(block.flops / (r.gemm_tflops * 1e12), block.bytes / (r.hbm_tbps * 1e12))


def timing_dims(spec, dims: dict[str, int] | None) -> dict[str, int] | None:
    """`dims` when they hold every dim of the family's real-shape timing inputs, else None
    (timed at the sample shapes)."""
    if not dims or spec.timing_inputs is None or not set(spec.timing_dims) <= set(dims):
        return None
    return dims


def plan_jobs(run_dir: Path, families: list[str] | None = None,
              exclude: Iterable[tuple[str, str]] = ()) -> tuple[list[TuneJob], list[str]]:
    """Jobs for every passing candidate of the run, one per shape bucket, heaviest first (the
    roofline seconds of the blocks each serves, `block_seconds`); and notes on what is not tuned
    (reviewed kernels, failed candidates, blocks whose size is unknown, and the (block path,
    family) pairs in ``exclude``: left out after a failed alignment, no block runs them)."""
    from onboarding.generate.candidates import load_candidates
    from onboarding.graph.opgraph import OpGraph
    from onboarding.coverage import Coverage
    from onboarding.families import get_family
    from onboarding.generate.templating import load_module
    from onboarding.tune.block import has_block_forward

    missing = [a for a in RUN_ARTIFACTS if not (run_dir / a).is_file()]
    if missing:
        raise InputError(f"{run_dir}: not a generated run directory (missing {missing}); "
                         "run `onboard generate MODEL --out DIR` or give MODEL")
    graph = OpGraph.load(run_dir / "opgraph.json")
    blocks = {b.path: b for b in graph.blocks}
    coverage = Coverage.load(run_dir / "coverage.json")
    cands = load_candidates(run_dir / "candidates.json")
    if families is not None and "generated" in families:  # --kernels generated: LLM families
        families = [*families, *{e.family for e in coverage.entries
                                 if e.status == "generated" and e.family}]
    exclude = {tuple(x) for x in exclude}
    jobs: dict[tuple[str, str], TuneJob] = {}
    notes = [f"reviewed kernel {e.family} at {e.path}: not tuned here" for e in coverage.entries
             if e.status == "kernel" and (families is None or e.family in families)]
    for c in cands:
        if families is not None and c.family not in families:
            continue
        left = [e.path for e in coverage.served() if (e.path, e.family) in exclude
                and (e.family, e.variant, e.params) == (c.family, c.variant, c.params)]
        if left or c.status == "left_out":
            notes.append(f"{c.family}/{c.variant} at {_paths(left or c.blocks)}: "
                         f"{LEFT_OUT_NOTE}")
        if c.status == "left_out":
            continue
        if c.status != "passed":
            notes.append(f"{c.family}/{c.variant}: candidate {c.status}, not tuned")
            continue
        path = c.path  # this folder's copy, as rendered (`load_candidates` checks)
        spec, module = get_family(c.family), load_module(path)
        for e in coverage.served():
            if (e.family, e.variant, e.params) != (c.family, c.variant, c.params) or \
                    (e.path, e.family) in exclude:
                continue
            block = blocks.get(e.path)
            dims = block_dims(c.family, e, block)
            size, source = bucket_size(spec, e, block, dims)
            dims = timing_dims(spec, dims)
            if size is None and has_block_forward(module):  # an LLM-written family: its
                # buckets are whatever block_forward looks up on the block (tune_block)
                job = jobs.setdefault((path, "block"), TuneJob(
                    family=c.family, variant=c.variant, module=path, bucket="(block)", size=0,
                    size_source="the buckets block_forward looks up on the block",
                    shapes=e.shapes, dims=None, level="block", kind=e.kind))
                job.blocks.append(e.path)
                job.weight_s += block_seconds(block)
                continue
            if size is None:
                notes.append(f"{c.family}/{c.variant} at {e.path}: bucketed dimension "
                             f"{spec.shape_buckets[0].dim} unknown, not tuned")
                continue
            bucket = module.shape_bucket(size)
            job = jobs.setdefault((path, bucket), TuneJob(
                family=c.family, variant=c.variant, module=path, bucket=bucket, size=size,
                size_source=source, shapes=e.shapes, dims=dims))
            job.blocks.append(e.path)
            job.weight_s += block_seconds(block)
    # heaviest first: a tune budget too short for every study (the README's main command on a GPU
    # tunes two or so of eleven) goes to the kernels that take most of the model's step
    return sorted(jobs.values(), key=lambda j: -j.weight_s), notes


LEFT_OUT_NOTE = "left out after alignment: not tuned"


def _paths(paths: list[str], limit: int = 4) -> str:
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def study_slots(n_jobs: int, asked: int | None, *, on_gpu: bool, cpus: int | None = None) -> int:
    """How many of a run's `n_jobs` studies run at once: `asked` when given; else, on a GPU host,
    three per four cores (a study's trial is mostly CPU work, the JIT compile of its config on its
    own worker subprocess; the timings still take the GPU one at a time), and one on the CPU, whose
    interpreter trials use every core. On a 16-core H100 host with 8 at once, the README example's
    first eight studies each took ~45 s for their first trial and the other three waited
    (docs/LOG.md, forty-fourth session)."""
    import os

    if asked is not None:
        if asked < 1:
            raise InputError(f"tune: parallel studies {asked}: expected at least 1")
        n = asked
    else:
        n = max(1, 3 * (cpus if cpus is not None else os.cpu_count() or 1) // 4) if on_gpu else 1
    return max(1, min(n, n_jobs))


def study_share(left_s: float, remaining: int, slots: int, running: int = 0) -> float:
    """A study's seconds when it starts: what is left of the run's budget over the studies not yet
    started (this one included) and those still `running`, times the studies that run at once, at
    most all that is left. One at a time this is an equal share of what is left, so time a study
    does not use passes on."""
    return max(0.0, left_s) * min(1.0, slots / max(1, remaining + running))


def tune_run(run_dir: Path, config: TuneConfig, *, families: list[str] | None = None,
             timer: Timer | None = None, on_step: Callable[[str], None] | None = None,
             progress: bool = False, budget_s: float | None = None,
             exclude: Iterable[tuple[str, str]] = ()) -> dict[str, Any]:
    """Tune every job of `run_dir`; writes tuned.json files, `tune.json` and `tune_best.png`.
    ``exclude``: (block path, family) pairs a failed alignment left out, not tuned (`plan_jobs`).

    `budget_s`: seconds for the whole run's tuning. A study gets its `study_share` of what is
    left when it starts, capped by `config.budget_s` (a per-kernel budget) when that is set.
    Several studies run at once on a GPU host (`study_slots`, `config.parallel_studies`),
    heaviest first; `on_step` hears each study start and each trial (trials done, best so far vs
    the default, time left).

    Studies live in `config.storage` or, by default, `run_dir/tune.db` (a resumed run continues
    them). Returns the `tune.json` content."""
    import threading
    import time

    import optuna

    from onboarding.backend import on_gpu
    from onboarding.tune.search import gpu_name, progress_text, shared_workers

    run_dir = Path(run_dir)
    if config.storage is None and config.storage_dir is None:
        config = replace(config, storage_dir=run_dir)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    jobs, notes = plan_jobs(run_dir, families, exclude)
    slots = study_slots(len(jobs), config.parallel_studies, on_gpu=on_gpu())
    prog = progress_bar() if progress else None
    results: dict[int, list[tuple[TuneJob, BucketResult]]] = {}
    start, lock, running = time.monotonic(), threading.Lock(), [0]

    def run_job(i: int) -> None:
        with lock:  # the share counts the studies started before this one and still running
            granted, share = time.monotonic(), config.budget_s
            if budget_s is not None:
                left = study_share(budget_s - (granted - start), len(jobs) - i, slots,
                                   running[0])
                share = left if share is None else min(share, left)
            running[0] += 1
        try:
            tune_job(i, share, granted)
        finally:
            with lock:
                running[0] -= 1

    def tune_job(i: int, share: float | None, granted: float) -> None:
        job = jobs[i]
        label = f"{job.family}/{job.variant} {job.bucket} ({i + 1}/{len(jobs)})"
        if on_step:
            on_step(label + (f", {share:.0f} s budget" if share is not None else ""))

        def on_trial(info: dict[str, Any]) -> None:
            if on_step:
                on_step(f"{label}: trial {info['done']}/{info['total']}, best "
                        + progress_text(info["best_ms"], info["default_ms"], info["left_s"]))

        if job.level == "block":
            results[i] = [(replace(job, bucket=r.bucket), r)
                          for r in _tune_block_job(run_dir, job, config, timer, share)]
            return
        r = tune_module(job.module, size=job.size, shapes=job.shapes, dims=job.dims,
                        config=replace(config, progress=False, budget_s=share), timer=timer,
                        progress=prog, on_trial=on_trial, budget_from=granted)
        if r.best_config is not None:
            write_tuned(job.module, [r], dtype=config.dtype,
                        timing="injected timer" if timer else None)
        results[i] = [(job, r)]

    if prog:
        prog.start()
    try:
        with shared_workers() as pool:  # every study of the run on the same worker subprocesses
            if slots == 1:
                for i in range(len(jobs)):
                    run_job(i)
            else:
                _run_at_once(run_job, len(jobs), slots, pool)
    finally:
        if prog:
            prog.stop()
    done = [pair for i in sorted(results) for pair in results[i]]
    data = {"gpu": gpu_name(), "dtype": config.dtype, "trials_per_study": config.n_trials,
            "budget_s": budget_s, "study_budget_s": config.budget_s, "parallel_studies": slots,
            "seconds": round(time.monotonic() - start, 2), "notes": notes,
            "studies": [{**asdict(job), "module": _relative(job.module, run_dir),
                         "result": result_dict(r)} for job, r in done]}
    write_json(run_dir / RESULTS_FILE, data)
    if done:  # one line per study, labelled family/variant bucket
        plot_history([replace(r, bucket=f"{j.family}/{j.variant} {j.bucket}")
                      for j, r in done], run_dir / PLOT_FILE)
    return data


def _run_at_once(run_job: Callable[[int], None], n_jobs: int, slots: int, pool) -> None:
    """`run_job(i)` for every i < n_jobs, in order, on `slots` threads at once (`run_threads`);
    a thread with no job left to start helps the searches still running (`OpenSearches`).
    Ctrl-C here cancels the pool (every study's workers die, no trial in flight is recorded) and
    propagates at once; a study that fails cancels the others and its error is raised here."""
    import threading

    from onboarding.tune.search import open_searches, run_threads
    from onboarding.tune.worker import Cancelled

    lock, nxt, errors = threading.Lock(), [0], []
    board = open_searches()

    def fail(e: BaseException) -> None:
        with lock:
            errors.append(e)
        pool.cancel()

    def loop(_slot: int) -> None:
        while True:
            with lock:
                if errors or pool.cancelled.is_set():
                    return
                if nxt[0] >= n_jobs:
                    break
                i, nxt[0] = nxt[0], nxt[0] + 1
            try:
                run_job(i)
            except Cancelled:
                return
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                fail(e)
                return
        if board is None:
            return
        try:  # no study left to start: one more worker of those still searching
            board.help(pool.cancelled)
        except Cancelled:
            return
        except BaseException as e:  # noqa: BLE001
            fail(e)

    run_threads(loop, range(slots), pool.cancel)
    if errors:
        raise errors[0]


def _tune_block_job(run_dir: Path, job: TuneJob, config: TuneConfig, timer: Timer | None,
                    budget_s: float | None) -> list[BucketResult]:
    """A block-level job (`onboarding.tune.block`) on the run's proxy at its capture size, the
    first block it serves, at the module its family replaces (the block's weightless core module
    when it has one: `onboarding.generate.tasks.core_path`); writes the tuned.json like a kernel
    job."""
    from onboarding.generate.tasks import core_path, spec_from_run
    from onboarding.graph.opgraph import OpGraph
    from onboarding.tune.block import tune_block

    graph = OpGraph.load(run_dir / "opgraph.json")
    block = next((b for b in graph.blocks if b.path == job.blocks[0]), None)
    path = core_path(block) if block is not None else job.blocks[0]
    rs = tune_block(job.module, spec_from_run(run_dir), path, batch=graph.batch or 1,
                    seq=graph.seq or 64, dtype=config.dtype, kind=job.kind,
                    n_trials=config.n_trials,
                    space={k: list(v) for k, v in config.space.items()} if config.space else None,
                    seed=config.seed, timer=(lambda c: timer(c, {})) if timer else None,
                    budget_s=budget_s if budget_s is not None else config.budget_s)
    if any(r.best_config is not None for r in rs):
        write_tuned(job.module, rs, dtype=config.dtype,
                    timing="injected timer" if timer else None)
    return rs


def _relative(path: str, run_dir: Path) -> str:
    p, root = Path(path).resolve(), run_dir.resolve()
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


def load_results(run_dir: Path) -> dict[str, Any] | None:
    f = Path(run_dir) / RESULTS_FILE
    if not f.is_file():
        return None
    return json.loads(f.read_text())
