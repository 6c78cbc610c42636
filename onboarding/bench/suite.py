"""The nightly regression suite (``onboard bench --suite nightly``): a fixed subset of every
family's benchmark cases with their anchors, the training step of two proxies, and the built-in
example's alignment facts, each row carrying the GPU, versions, commit and date.

Parts:

- ``kernels``: each family's `NightlySpec` cases and impls. Every step is compiled and warmed
  up, captured as a CUDA graph when it can be (kernels only, no launch overhead: graph times of
  the same source agree within 0.3% across processes where wall times of short kernels drift
  by 10%, docs/LOG.md), then timed as an A/A pair: the step twice per round (``#A``, ``#B``),
  interleaved with the case's other steps in a rotating order, over `NightlyConfig.rounds`
  rounds. The row's value is the median of all its samples; its noise floor comes from the
  pairs (`onboarding.bench.compare.noise_floor`). Rows carry bytes, FLOPs, GB/s, TFLOP/s and the
  fraction of the copy ceiling measured at the start of the same run.
- ``train``: LoRA training of each `TrainModel` in one process, on the GPU, with our kernels
  (`onboarding.train.worker.run`, role reference): after `train_warmup` steps, 2 x rounds steps
  alternate as the A/A pair; rows tokens/s, LoRA-correct MFU and peak memory. One more step at
  the end is profiled (kept out of the timings): its time per kernel and Chrome trace go to the
  dashboard.
- ``align``: the built-in example through load, parse, map, generate and align as ``onboard
  run`` does, and the ``alignment.*`` facts `onboard regress` keeps (`regress.alignment_facts`).

Before anything is timed, `warm_up` compiles in parallel processes what the timed parts will
run (each kernel case's steps once, two steps of each training run, which also leave their op
graph for the timed run to load) and aligns the example there (facts, not timings). On a cold
Triton cache that is most of the suite's time, spread over the CPU cores; the pool is shut down
before the first timing, so the GPU runs one thing at a time while it is timed.

``--against REF`` (`onboarding.bench.revision`) adds rows of our kernels rendered from REF's
templates; their `baseline_key` is the tree's row, so a comparison judges REF against the
stored baseline.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from onboarding.bench.compare import noise_floor
from onboarding.bench.harness import (GRAPH_MAX_MS, ROUND_BUDGET_S, BenchCase, Step,
                                      aggregate_kernels, capture_graph, check_failure,
                                      interleaved_rounds, time_fn)
from onboarding.errors import InputError

PARTS = ("kernels", "train", "align")
TRAIN_MIN_THRESHOLD = 0.05  # tokens/s and MFU: a training step moves more than one kernel
MEMORY_MIN_THRESHOLD = 0.02  # peak memory is deterministic up to the allocator's rounding
TRAIN_GROUP, MEMORY_GROUP, ALIGN_GROUP = "train", "train.memory", "align"
TIMELINE_EVENTS = 6000  # kernel launches of the profiled step kept for the dashboard


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainModel:
    """A model whose LoRA training step the nightly times (any MODEL form `onboard train` takes)."""

    ref: str
    proxy: str = "small"
    seq_len: int = 2048
    micro_batch: int = 2

    @property
    def label(self) -> str:
        return self.ref.removeprefix("hf:").replace("/", "_")


# a hybrid (gated delta net + attention, MoE) and a plain MoE transformer
TRAIN_MODELS = (TrainModel(ref="hf:qwen3_next"), TrainModel(ref="hf:qwen3_moe"))


@dataclass(kw_only=True)
class NightlyConfig:
    parts: tuple[str, ...] = PARTS
    families: tuple[str, ...] | None = None  # None: every family with a NightlySpec
    rounds: int = 5  # A/A rounds per row
    train_models: tuple[TrainModel, ...] = TRAIN_MODELS
    train_warmup: int = 3
    graph: bool = True  # time CUDA-graph replays where a step can be captured
    against: tuple[Path, str] | None = None  # (templates dir, row label) of --against
    work_dir: Path | None = None  # training and alignment write here (a temp dir if None)
    trace_path: Path | None = None  # Chrome trace of the first model's profiled step
    # Processes for the warm-up (0: none): see `warm_up`
    warm_workers: int = 12

    def __post_init__(self) -> None:
        bad = [p for p in self.parts if p not in PARTS]
        if bad or not self.parts:
            raise InputError(f"--parts: unknown {bad or 'nothing'}; choose from {', '.join(PARTS)}")
        if not 2 <= self.rounds <= 50:
            raise InputError(f"--rounds {self.rounds}: between 2 and 50")


@dataclass(kw_only=True)
class NightlyRow:
    key: str  # "<part>/<group>/<case>/<impl or metric>": the row's identity across runs
    part: str  # kernels | train | align
    group: str  # the family, or train / train.memory / align: where the minimum comes from
    case: str
    impl: str  # kernels: ours, an anchor, or an --against label; train and align: the metric
    metric: str  # time_ms, tokens_per_s, mfu, peak_mem_bytes, or the fact's name
    unit: str  # ms | tok/s | fraction | bytes | fact
    better: str  # lower | higher | equal
    value: Any = None
    status: str = "ok"  # ok | error | check failed
    error: str = ""
    pairs: list[list[float]] = field(default_factory=list)  # A/A samples, one pair per round
    noise: float | None = None  # relative sigma of one sample, from `pairs`
    baseline_key: str | None = None  # the baseline row this one is judged against (default key)
    timing: str = ""  # graph | wall (kernels)
    shape: dict[str, int] = field(default_factory=dict)
    min_bytes: int | None = None
    flops: int | None = None
    gbps: float | None = None
    tflops: float | None = None
    roofline_frac: float | None = None
    env: dict[str, Any] = field(default_factory=dict)  # gpu, versions, commit, date


def row_env(env: dict[str, Any]) -> dict[str, Any]:
    return {k: env.get(k) for k in ("gpu", "commit", "date", "torch", "triton", "transformers",
                                    "onboard")}


# ---- kernels -------------------------------------------------------------------------------------

def nightly_cases(names: list[str] | None = None) -> tuple[list[tuple[BenchCase, tuple[str, ...]]],
                                                          dict[str, float]]:
    """([(case, impls)] of the families' NightlySpecs, {family: min_threshold})."""
    from onboarding.bench.cases import cases_for
    from onboarding.families import families

    specs = {n: f.bench_nightly for n, f in families().items()
             if f.bench_nightly is not None and f.bench_cases is not None}
    unknown = [n for n in names or [] if n not in specs]
    if unknown:
        raise InputError(f"no nightly cases for {unknown}; families with some: {sorted(specs)}")
    picked = names or list(specs)
    out = []
    for fam in picked:
        by_name = {c.name: c for c in cases_for([fam])}
        for case_name, impls in specs[fam].cases.items():
            if case_name not in by_name:
                raise InputError(f"{fam}: nightly case {case_name!r} is not one of its bench cases")
            out.append((by_name[case_name], tuple(impls)))
    return out, {fam: specs[fam].min_threshold for fam in picked}


def _kept(name: str, impls: tuple[str, ...], label: str | None) -> bool:
    if name in impls:
        return True
    return label is not None and name.startswith(label) and \
        "ours" + name.removeprefix(label) in impls


def _round_timer(step: Step) -> float:
    return time_fn(step, warmup=2, repeats=20, budget_s=ROUND_BUDGET_S).median_ms


def time_case(case: BenchCase, impls: tuple[str, ...], device: torch.device, cfg: NightlyConfig,
              ceilings: dict[str, float], env: dict[str, Any], log: Callable[[str], None],
              *, round_timer: Callable[[Step], float] = _round_timer,
              warm: Callable[[Step], float] | None = None) -> list[NightlyRow]:
    """One case's rows: setup, check, warm-up (+ graph capture), then the A/A rounds."""
    label = cfg.against[1] if cfg.against else None
    on_gpu = torch.device(device).type == "cuda"

    def row(impl: str, **kw) -> NightlyRow:
        base = None
        if label and impl.startswith(label):
            base = f"kernels/{case.family}/{case.name}/ours{impl.removeprefix(label)}"
        return NightlyRow(key=f"kernels/{case.family}/{case.name}/{impl}", part="kernels",
                          group=case.family, case=case.name, impl=impl, metric="time_ms",
                          unit="ms", better="lower", baseline_key=base, shape=dict(case.shape),
                          env=row_env(env), **kw)

    try:
        steps = {k: v for k, v in case.setup(device).items() if _kept(k, impls, label)}
    except Exception as exc:  # noqa: BLE001 - the other cases still run
        return [row(i, status="error", error=f"setup: {type(exc).__name__}: {exc}"[:300])
                for i in impls]
    missing = [i for i in impls if i not in steps]
    rows = [row(i, status="error", error="the case has no such impl on this machine")
            for i in missing]
    failed = ""
    if case.check is not None:
        try:
            failed = check_failure(case.check(device))
        except Exception as exc:  # noqa: BLE001
            failed = f"check raised {type(exc).__name__}: {exc}"
    timed: dict[str, Step] = {}
    modes: dict[str, str] = {}
    graphs = []
    for name, step in steps.items():
        r = row(name)
        if failed and (name == "ours" or name.startswith("ours_")):
            r.status, r.error = "check failed", failed[:300]
            rows.append(r)
            continue
        try:
            ms = (warm or (lambda s: time_fn(s, warmup=3, repeats=5, budget_s=0.5).median_ms))(step)
        except Exception as exc:  # noqa: BLE001
            r.status, r.error = "error", f"{type(exc).__name__}: {exc}"[:300]
            rows.append(r)
            if on_gpu:
                torch.cuda.synchronize()
            continue
        modes[name] = "wall"
        timed[name] = step
        if cfg.graph and on_gpu and ms < GRAPH_MAX_MS:
            try:
                g = capture_graph(step)
                graphs.append(g)
                timed[name] = lambda i, g=g: g.replay()
                modes[name] = "graph"
            except Exception:  # noqa: BLE001 - not capturable: wall time it is
                torch.cuda.synchronize()
        rows.append(r)
    if timed:
        pair_steps = {f"{n}#A": s for n, s in timed.items()} | {f"{n}#B": s for n, s in timed.items()}
        try:
            rounds = interleaved_rounds(pair_steps, cfg.rounds, round_timer)
        except Exception as exc:  # noqa: BLE001
            rounds = None
            for r in rows:
                if r.impl in timed:
                    r.status, r.error = "error", f"rounds: {type(exc).__name__}: {exc}"[:300]
        for r in rows:
            if rounds is None or r.impl not in timed:
                continue
            a, b = rounds[f"{r.impl}#A"], rounds[f"{r.impl}#B"]
            r.pairs = [[x, y] for x, y in zip(a, b)]
            r.value = statistics.median(a + b)
            r.noise = noise_floor([(x, y) for x, y in zip(a, b)])
            r.timing = modes[r.impl]
            if not r.impl.endswith("_fwd"):  # bytes and FLOPs describe the full step
                r.min_bytes, r.flops = case.min_bytes, case.flops or None
                sec = r.value * 1e-3
                r.gbps = case.min_bytes / sec / 1e9
                r.tflops = case.flops / sec / 1e12 if case.flops else None
                r.roofline_frac = r.gbps / (ceilings["copy_tb_s"] * 1e3)
    del graphs
    order = {n: i for i, n in enumerate(steps)}
    rows.sort(key=lambda r: order.get(r.impl, -1))
    for r in rows:
        log(f"  {r.key}: " + (f"{r.value:.4f} ms ({r.timing}, noise {100 * r.noise:.2f}%)"
                              if r.value is not None and r.noise is not None
                              else f"{r.status}: {r.error[:100]}"))
    return rows


# ---- training step -------------------------------------------------------------------------------

def _profile_summary(prof: Any, trace_path: Path | None) -> dict[str, Any]:
    """Time per kernel and the kernel timeline of one profiled step (+ its Chrome trace)."""
    kernels = aggregate_kernels([(e.key, e.self_device_time_total, e.count)
                                 for e in prof.key_averages() if e.self_device_time_total > 0],
                                1, top=20)
    events = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    t0 = min((e.time_range.start for e in events), default=0)
    timeline = sorted(([e.name[:120], (e.time_range.start - t0) / 1e3,
                        (e.time_range.end - e.time_range.start) / 1e3] for e in events),
                      key=lambda x: x[1])[:TIMELINE_EVENTS]
    out = {"kernels": kernels, "timeline": timeline, "trace_file": None}
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        out["trace_file"] = trace_path.name
    return out


def train_rows(model: TrainModel, steps: list[dict[str, Any]], warmup: int, rounds: int,
               env: dict[str, Any]) -> list[NightlyRow]:
    """Rows from a training run's per-step rows: steps after `warmup` alternate A and B."""
    timed = steps[warmup:warmup + 2 * rounds]
    a, b = timed[0::2], timed[1::2]
    out = []
    for metric, unit, better, group in (("tokens_per_s", "tok/s", "higher", TRAIN_GROUP),
                                        ("mfu", "fraction", "higher", TRAIN_GROUP),
                                        ("peak_mem_bytes", "bytes", "lower", MEMORY_GROUP)):
        va = [s.get(metric) for s in a]
        vb = [s.get(metric) for s in b]
        r = NightlyRow(key=f"train/{model.label}/{model.proxy}/{metric}", part="train", group=group,
                       case=f"{model.label} --proxy {model.proxy} seq {model.seq_len} x "
                            f"{model.micro_batch}",
                       impl=metric, metric=metric, unit=unit, better=better, env=row_env(env))
        if len(timed) < 2 * rounds or any(v is None for v in va + vb):
            r.status = "error"
            r.error = f"{len(timed)} timed steps of {2 * rounds}; {metric} missing" \
                if len(timed) < 2 * rounds or metric != "mfu" else "no MFU (unknown GPU peak)"
            out.append(r)
            continue
        r.pairs = [[float(x), float(y)] for x, y in zip(va, vb)]
        r.value = float(statistics.median(va + vb)) if metric != "peak_mem_bytes" else \
            float(max(va + vb))
        r.noise = noise_floor([(x, y) for x, y in zip(va, vb)])
        out.append(r)
    return out


def run_train(model: TrainModel, cfg: NightlyConfig, work: Path, env: dict[str, Any],
              log: Callable[[str], None], trace_path: Path | None, device: str = "cuda"
              ) -> tuple[list[NightlyRow], dict[str, Any] | None]:
    """One model's training rows and its profiled step (``device`` cpu: a smoke run)."""
    from onboarding.train import metrics as M
    from onboarding.train import worker

    n_steps = cfg.train_warmup + 2 * cfg.rounds + 1  # the last one profiled, not timed
    out = work / f"train-{model.label}"
    tcfg = _train_config(model, work, n_steps, device)
    profiles: list[Any] = []
    gpu = device == "cuda"
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        with M.trace_sink(profiles.append):
            worker.run(tcfg, "reference")
        steps = M.read_rows(out / "train" / "reference.jsonl")
    except Exception as exc:  # noqa: BLE001 - one model failing leaves the rest of the suite
        err = f"{type(exc).__name__}: {exc}"[:300]
        log(f"  train {model.label}: {err}")
        rows = train_rows(model, [], cfg.train_warmup, cfg.rounds, env)
        for r in rows:
            r.error = err
        return rows, None
    finally:
        if gpu:
            torch.cuda.empty_cache()
    rows = train_rows(model, steps, cfg.train_warmup, cfg.rounds, env)
    prof = None
    if profiles:
        prof = {"model": f"{model.ref} --proxy {model.proxy}",
                **_profile_summary(profiles[-1], trace_path),
                "step_ms": steps[-1]["step_time_s"] * 1e3 if steps else None}
        if steps and steps[0].get("kernels"):  # the first step's row says what was patched
            prof["patched"] = steps[0]["kernels"]
    for r in rows:
        log(f"  {r.key}: " + (f"{r.value:.4g} {r.unit} (noise {100 * r.noise:.2f}%)"
                              if r.value is not None else f"{r.status}: {r.error[:100]}"))
    log(f"train/{model.label}: {time.perf_counter() - t0:.1f}s")
    return rows, prof


# ---- the example's alignment facts ---------------------------------------------------------------

def run_align_facts(work: Path, env: dict[str, Any], log: Callable[[str], None]
                    ) -> list[NightlyRow]:
    """The built-in example aligned as `onboard run` aligns it; one fact row per alignment fact."""
    from onboarding import regress
    from onboarding.backend import ensure_triton_backend
    from onboarding.load.spec import ModelSpec
    from onboarding.stages import run_align, run_generate, run_load, run_map, run_parse

    ensure_triton_backend()  # a spawned warm-up process starts without the CLI's set-up

    out = work / "align-example"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        info = run_load(ModelSpec())
        graph = run_parse(info, out)
        coverage = run_map(graph, out)
        cands = run_generate(coverage, out)
        run_align(info, graph, coverage, cands, out)
        facts = regress.alignment_facts(json.loads((out / "alignment.json").read_text()))
    except Exception as exc:  # noqa: BLE001
        log(f"  align: {type(exc).__name__}: {exc}"[:200])
        return [NightlyRow(key="align/example/alignment.verdict", part="align", group=ALIGN_GROUP,
                           case="example", impl="alignment.verdict", metric="alignment.verdict",
                           unit="fact", better="equal", status="error",
                           error=f"{type(exc).__name__}: {exc}"[:300], env=row_env(env))]
    log(f"align/example: {facts.get('alignment.verdict')} ({time.perf_counter() - t0:.1f}s)")
    return [NightlyRow(key=f"align/example/{k}", part="align", group=ALIGN_GROUP, case="example",
                       impl=k, metric=k, unit="fact", better="equal", value=v, env=row_env(env))
            for k, v in facts.items()]


# ---- warm-up -------------------------------------------------------------------------------------

def _warm_case(family: str, case_name: str, impls: tuple[str, ...],
               against_: tuple[Path, str] | None) -> str:
    """Run each kept step of one case once (compiles its kernels into the shared cache)."""
    t0 = time.perf_counter()
    cases, _ = nightly_cases([family])
    case = next(c for c, _ in cases if c.name == case_name)
    if against_ is not None:
        from onboarding.bench.revision import against

        case = against([case], *against_)[0]
    device = torch.device("cuda")
    label = against_[1] if against_ else None
    for name, step in case.setup(device).items():
        if _kept(name, impls, label):
            step(0)
    torch.cuda.synchronize()
    return f"{family}/{case_name} {time.perf_counter() - t0:.0f}s"


def _train_config(model: TrainModel, work: Path, steps: int, device: str = "cuda"):
    from onboarding.load.spec import ModelSpec
    from onboarding.train.config import TrainConfig

    return TrainConfig.for_model(ModelSpec(ref=model.ref, proxy=model.proxy),
                                 out=str(work / f"train-{model.label}"), steps=steps,
                                 seq_len=model.seq_len, micro_batch=model.micro_batch,
                                 dtype="bf16" if device == "cuda" else "fp32", device=device,
                                 kernels=True, profile_every=steps)


def _warm_train(model: TrainModel, work: Path) -> str:
    """Two training steps: kernels compiled and checked, the op graph left in the run dir."""
    from onboarding.train import worker

    t0 = time.perf_counter()
    worker.run(_train_config(model, work, 2), "reference")
    return f"train/{model.label} {time.perf_counter() - t0:.0f}s"


def _align_task(work: Path, env: dict[str, Any]) -> list[dict[str, Any]]:
    return [asdict(r) for r in run_align_facts(work, env, print)]


def warm_up(cfg: NightlyConfig, cases: list[tuple[BenchCase, tuple[str, ...]]], work: Path,
            env: dict[str, Any], log: Callable[[str], None]) -> list[dict[str, Any]] | None:
    """Compile everything the timed parts run, in `cfg.warm_workers` processes, and align the
    example there; returns the align part's rows (None when it did not run). A failed warm-up
    task is only logged: the timed part meets the same error and records it."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.perf_counter()
    tasks: list[tuple[Callable, tuple]] = []
    if "align" in cfg.parts:
        tasks.append((_align_task, (work, env)))
    if "train" in cfg.parts:
        tasks += [(_warm_train, (m, work)) for m in cfg.train_models]
    tasks += [(_warm_case, (c.family, c.name, impls, cfg.against))
              for c, impls in cases]
    align_rows = None
    with cf.ProcessPoolExecutor(max_workers=min(cfg.warm_workers, len(tasks)),
                                mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(fn, *args): fn for fn, args in tasks}
        for fut in cf.as_completed(futures):
            try:
                got = fut.result()
            except Exception as exc:  # noqa: BLE001
                log(f"  warm-up {futures[fut].__name__}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            if futures[fut] is _align_task:
                align_rows = got
            else:
                log(f"  warm-up {got}")
    log(f"warm-up ({len(tasks)} tasks): {time.perf_counter() - t0:.1f}s")
    return align_rows


# ---- the suite -----------------------------------------------------------------------------------

def min_thresholds(family_minimums: dict[str, float]) -> dict[str, float]:
    return {**family_minimums, TRAIN_GROUP: TRAIN_MIN_THRESHOLD,
            MEMORY_GROUP: MEMORY_MIN_THRESHOLD, ALIGN_GROUP: 0.0}


def run_nightly(cfg: NightlyConfig, log: Callable[[str], None] = print,
                partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the suite on the GPU; the result: environment, ceilings, rows, the profiled training
    step, the minimum threshold per group, and seconds per part."""
    from onboarding.bench.harness import environment, measure_ceilings

    device = torch.device("cuda")
    env = environment()
    cases, family_min = nightly_cases(list(cfg.families) if cfg.families else None) \
        if "kernels" in cfg.parts else ([], {})
    if cfg.against is not None:
        from onboarding.bench.revision import against

        cases = list(zip(against([c for c, _ in cases], *cfg.against), [i for _, i in cases]))
    work = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.mkdtemp(prefix="onboard-nightly-"))
    t_start = time.perf_counter()
    align_rows = None
    if cfg.warm_workers > 0:
        align_rows = warm_up(cfg, cases, work, env, log)
    seconds = {"warm_up": round(time.perf_counter() - t_start, 1)}
    ceilings = measure_ceilings(device)
    torch.cuda.empty_cache()
    log(f"ceilings: {ceilings}")
    result: dict[str, Any] = {"suite": "nightly", "environment": env, "ceilings": ceilings,
                              "rows": [], "train_profile": None,
                              "min_thresholds": min_thresholds(family_min),
                              "parts": list(cfg.parts), "rounds": cfg.rounds,
                              "against": cfg.against[1] if cfg.against else None,
                              "seconds": seconds, "complete": False}

    def done(part: str, t0: float, rows: list[NightlyRow]) -> None:
        result["rows"].extend(asdict(r) for r in rows)
        result["seconds"][part] = round(result["seconds"].get(part, 0) + time.perf_counter() - t0, 1)
        if partial is not None:
            partial(result)

    for case, impls in cases:
        t0 = time.perf_counter()
        rows = time_case(case, impls, device, cfg, ceilings, env, log)
        torch.cuda.empty_cache()
        log(f"{case.family}/{case.name}: {time.perf_counter() - t0:.1f}s")
        done("kernels", t0, rows)
    if "train" in cfg.parts:
        for i, model in enumerate(cfg.train_models):
            t0 = time.perf_counter()
            rows, prof = run_train(model, cfg, work, env, log,
                                   cfg.trace_path if i == 0 else None)
            if prof is not None and result["train_profile"] is None:
                result["train_profile"] = prof
            done("train", t0, rows)
    if "align" in cfg.parts:
        t0 = time.perf_counter()
        if align_rows is not None:  # aligned during the warm-up
            result["rows"].extend(align_rows)
            result["seconds"]["align"] = "in the warm-up"
        else:
            done("align", t0, run_align_facts(work, env, log))
    result["seconds"]["total"] = round(time.perf_counter() - t_start, 1)
    result["complete"] = True
    return result


def format_rows(result: dict[str, Any]) -> str:
    lines = [f"{'row':70s} {'value':>12s} {'unit':8s} {'noise':>7s} {'timing':6s} {'%copy':>6s}"]
    for r in result["rows"]:
        if r["unit"] == "fact":
            v = r["value"] if not isinstance(r["value"], dict) else \
                ", ".join(f"{k}={x}" for k, x in r["value"].items())
            lines.append(f"{r['key'][:70]:70s} {str(v)[:40]}")
            continue
        val = f"{r['value']:.4g}" if r["value"] is not None else r["status"]
        noise = f"{100 * r['noise']:.2f}%" if r["noise"] is not None else "-"
        frac = f"{100 * r['roofline_frac']:.0f}" if r.get("roofline_frac") else "-"
        lines.append(f"{r['key'][:70]:70s} {val:>12s} {r['unit']:8s} {noise:>7s} "
                     f"{r['timing'] or '':6s} {frac:>6s}" + (f"  {r['error'][:80]}" if r["error"] else ""))
    return "\n".join(lines)
