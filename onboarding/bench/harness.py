"""GPU timing harness: event timing, rotated inputs, ceilings measured in the same run.

Every family registers `BenchCase`s (real model shapes, the baselines to compare with). A case's
`setup(device)` returns named callables — ``ours`` plus anchors such as ``eager``,
``compile`` or ``liger`` — each running one full step (forward, or forward + backward) on the
*i*-th of several input sets, so that repeats rotate past the L2 cache. Rows carry the GPU name,
versions, commit and date, and ratios against the anchors measured in the same run.

Ratios come from interleaved rounds: after every step of a case has been timed (and compiled),
ours and its anchors are timed again in turn, RATIO_ROUNDS times, and each ratio is the median
of the per-round ratios. Timed one after the other, the same config measured 3.38 and 3.01 ms
in one H200 run (docs/LOG.md, fifth session): a drift that a sequential ratio takes for a speed
difference.

A case's ``check`` guards our rows: when it raises, returns ``ok`` 0, or reports a non-finite
error, every row of our kernel (``ours``, ``ours_fwd``, ``ours@cfg``) is left untimed, with
status ``check failed``, the reason in ``error`` and no ratios; the anchors are still timed.
A wrong kernel's time is not a result.

An anchor from outside the tree (mamba-ssm's Triton SSD) is timed only when asked for: its
impls are in the case's ``on_request`` and run only when ``--impl`` names them
(`cases.select_cases`). An anchor with a check of its own (``anchor_checks``: its output against
ours) is timed only when that check passes; a step or check that raises `Unavailable` (the
anchor is not there) leaves the anchor's rows untimed with status ``skipped`` and the reason.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

Step = Callable[[int], Any]  # step(i) runs once on input set i % n_sets


@dataclass(kw_only=True)
class BenchCase:
    family: str
    name: str
    shape: dict[str, int]
    min_bytes: int  # fewest bytes the step must move (each input read once, output written once)
    flops: int
    setup: Callable[[torch.device], dict[str, Step]]
    check: Callable[[torch.device], dict[str, float]] | None = None  # bf16 errors vs fp32 ref
    note: str = ""
    # impls that `setup` returns but that run only when --impl names them (anchors loaded from
    # outside the tree: never picked up because they are installed)
    on_request: tuple[str, ...] = ()
    # per anchor X: a check that X computes our function (X's output against ours); it guards
    # the rows X and X_fwd as `check` guards ours
    anchor_checks: dict[str, Callable[[torch.device], dict[str, float]]] = field(default_factory=dict)


class Unavailable(RuntimeError):
    """An anchor that is not there (not installed, no source tree given): its rows are
    ``skipped``, with this error's message as the reason."""


@dataclass(kw_only=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int


@dataclass(kw_only=True)
class Row:
    family: str
    case: str
    shape: dict[str, int]
    impl: str
    timing: Timing | None
    # "ok"; "error" (setup or timing raised); "check failed" (our kernel's check raised or
    # failed: the row is not timed and gets no ratios); "skipped" (an anchor that is not there,
    # `Unavailable`). `error` says why.
    status: str = "ok"
    error: str = ""
    gbps: float | None = None
    tflops: float | None = None
    roofline_frac: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)  # anchor time / our time
    # medians of the interleaved rounds the ratios come from (ours and its anchors)
    rounds_ms: list[float] = field(default_factory=list)
    check: dict[str, float] = field(default_factory=dict)
    # GPU time as a CUDA graph (no launch overhead), for steps under GRAPH_MAX_MS; None when
    # the step cannot be captured
    graph_ms: float | None = None
    graph_roofline_frac: float | None = None
    graph_ratios: dict[str, float] = field(default_factory=dict)
    # per-kernel GPU time of one step (`--profile`; our rows, `profiled`): where time goes
    kernels: list[dict[str, Any]] = field(default_factory=list)


GRAPH_MAX_MS = 5.0  # above this, launch overhead is noise: skip the graph replay
RATIO_ROUNDS, ROUND_BUDGET_S = 3, 0.5  # interleaved rounds of ours and its anchors, per step
PROFILE_STEPS, PROFILE_TOP = 5, 12


def aggregate_kernels(events: list[tuple[str, float, int]], steps: int,
                      top: int = PROFILE_TOP) -> list[dict[str, Any]]:
    """(kernel name, total GPU µs, calls) over `steps` steps -> per-step rows, slowest first:
    ms and calls per step and the share of the step's kernel time; the rest folded into one
    "(other kernels)" row."""
    per: dict[str, list[float]] = {}
    for name, us, calls in events:
        acc = per.setdefault(name, [0.0, 0])
        acc[0] += us
        acc[1] += calls
    total = sum(us for us, _ in per.values())
    rows = sorted(({"kernel": k, "ms": us / steps / 1e3, "calls": c / steps,
                    "share": us / total if total else 0.0} for k, (us, c) in per.items()),
                  key=lambda r: -r["ms"])
    if len(rows) > top:
        rest = rows[top - 1:]
        rows = rows[:top - 1] + [{"kernel": "(other kernels)", "ms": sum(r["ms"] for r in rest),
                                  "calls": sum(r["calls"] for r in rest),
                                  "share": sum(r["share"] for r in rest)}]
    return rows


def profiled(impl: str) -> bool:
    """Whether `--profile` breaks a row down by kernel: ours and ours_fwd, their sweep rows
    (``ours@...``: where a config's time goes against the default's) and `--against`'s rows
    (``rev:...``, ``tpl:...``); not the anchors."""
    return impl.split("@")[0] in ("ours", "ours_fwd") or impl.startswith(("rev:", "tpl:"))


def kernel_breakdown(step: Step, steps: int = PROFILE_STEPS,
                     top: int = PROFILE_TOP) -> list[dict[str, Any]]:
    """GPU time per kernel of `step` (torch.profiler, CUDA activity), after a warm-up; the
    `top` slowest kernels, the rest folded into one row (`aggregate_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    return aggregate_kernels([(e.key, e.self_device_time_total, e.count)
                              for e in prof.key_averages() if e.self_device_time_total > 0],
                             steps, top)


def time_fn(step: Step, *, warmup: int = 5, repeats: int = 50, n_sets: int = 4,
            budget_s: float = 3.0) -> Timing:
    """Median and p20/p80 of per-call event times; warm-up calls excluded.

    Slow steps (a torch fallback at long sequences) get fewer repeats, at least 5, so that one
    implementation takes about ``budget_s`` seconds.
    """
    t0 = time.perf_counter()
    step(0)  # may compile
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for i in range(1, warmup):
        step(i)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t1) / (warmup - 1) if warmup > 1 else t1 - t0
    repeats = max(5, min(repeats, int(budget_s / max(per_step, 1e-6))))
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=10)
    return Timing(median_ms=statistics.median(times), p20_ms=q[1], p80_ms=q[7], repeats=repeats)


def interleaved_rounds(steps: dict[str, Step], rounds: int,
                       timer: Callable[[Step], float]) -> dict[str, list[float]]:
    """`timer(step)` (ms) of every step, round by round, each round in a rotated order: a slow
    drift of the GPU's state (clocks, temperature, memory) falls on all steps alike."""
    names = list(steps)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for n in names[k:] + names[:k]:
            out[n].append(timer(steps[n]))
    return out


def paired_ratios(rounds: dict[str, list[float]], ours: str) -> dict[str, float]:
    """Per anchor, the median over rounds of (anchor time / our time) in the same round."""
    base = rounds[ours]
    return {n: statistics.median(a / b for a, b in zip(ts, base))
            for n, ts in rounds.items() if n != ours}


def _round_timer(step: Step) -> float:
    return time_fn(step, warmup=2, repeats=20, budget_s=ROUND_BUDGET_S).median_ms


def graph_time(step: Step, *, repeats: int = 50) -> Timing:
    """GPU time of one step replayed as a CUDA graph: kernels only, no Python or launch overhead.

    The step is captured once on input set 0 (after warm-up on a side stream). Raises when the
    step cannot be captured (host syncs, CPU-side control flow on GPU values).
    """
    graph = capture_graph(step)
    return time_fn(lambda i: graph.replay(), warmup=3, repeats=repeats)


def capture_graph(step: Step) -> torch.cuda.CUDAGraph:
    """`step` on input set 0 captured as a CUDA graph, after warm-up on a side stream; raises
    when it cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(0)
    return graph


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, on random data."""
    n = 1 << 30  # 2 GiB of bf16 per buffer: far past the L2
    src = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_fn(lambda i: dst.copy_(src), warmup=3, repeats=20)
    copy = 2 * src.numel() * 2 / (t.median_ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = time_fn(lambda i: a @ b, warmup=3, repeats=20)
    mm = 2 * 8192**3 / (t.median_ms * 1e-3) / 1e12
    return {"copy_tb_s": round(copy, 3), "matmul_bf16_tflops": round(mm, 1)}  # buffers freed:
    # the caller empties the cache once they are out of scope


def check_failure(check: dict[str, Any]) -> str:
    """Why a case's check result fails ('' when it passes): it raised (``error``), said ``ok`` 0,
    or reported a non-finite error."""
    if "error" in check:
        return f"check raised {check['error']}"
    if "ok" in check and not check["ok"]:
        bad = {k: v for k, v in check.items() if k != "ok"}
        return "check failed: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in bad.items())
    nonfinite = [k for k, v in check.items() if isinstance(v, float) and not math.isfinite(v)]
    if nonfinite:
        return f"check failed: non-finite {', '.join(nonfinite)}"
    return ""


def _anchor_checks(case: BenchCase, steps: dict[str, Step], device: torch.device,
                   log: Callable[[str], None]) -> dict[str, tuple[dict, str, str]]:
    """Per anchor of `case.anchor_checks` with a row in `steps`: (its check's result, the
    status its rows get instead of being timed ('' when they are timed), why)."""
    out: dict[str, tuple[dict, str, str]] = {}
    for name, fn in case.anchor_checks.items():
        if name not in steps and name + "_fwd" not in steps:
            continue
        try:
            res, status, why = fn(device), "", ""
        except Unavailable as exc:
            res, status, why = {}, "skipped", str(exc)
        except Exception as exc:  # noqa: BLE001 - reported on the anchor's rows
            res = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            status, why = "", ""
        if not status:
            why = check_failure(res)
            status = "check failed" if why else ""
        if status:
            log(f"  {case.family}/{case.name} {name}: {why[:120]}: not timed")
        out[name] = (res, status, why)
    return out


def _ours(impl: str) -> bool:
    """A row of our kernel (the one the case's check covers)."""
    return impl == "ours" or impl.startswith(("ours_", "ours@"))


def environment() -> dict[str, Any]:
    from onboarding.stages import environment as env

    return env()


def run_cases(cases: list[BenchCase], device: torch.device | None = None,
              log: Callable[[str], None] = print,
              partial: Callable[[dict[str, Any]], None] | None = None,
              profile: bool = False, *, timer: Callable[[Step], Timing] = time_fn,
              round_timer: Callable[[Step], float] | None = None,
              graph_timer: Callable[[Step], Timing] | None = graph_time,
              ceilings: dict[str, float] | None = None) -> dict[str, Any]:
    """Run every case; ``partial`` receives the result so far after each case (so a run that is
    cut short still leaves its finished rows behind). ``profile``: also break our rows down by
    kernel (`kernel_breakdown`). ``timer`` / ``round_timer`` / ``graph_timer`` (None: no graph
    replay) and given ``ceilings`` replace the GPU's (tests run the harness on the CPU)."""
    device = device or torch.device("cuda")
    round_timer = round_timer or _round_timer
    on_gpu = torch.device(device).type == "cuda"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    if ceilings is None:
        ceilings = measure_ceilings(device)
        torch.cuda.empty_cache()  # the ceilings' 4 GiB of buffers
    log(f"ceilings: {ceilings}")
    rows: list[Row] = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            steps = case.setup(device)
        except Exception as exc:
            rows.append(Row(family=case.family, case=case.name, shape=case.shape, impl="setup",
                            timing=None, status="error",
                            error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        check: dict[str, Any] = {}
        if case.check is not None:
            try:
                check = case.check(device)
            except Exception as exc:
                check = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        failed = check_failure(check)
        if failed:
            log(f"  {case.family}/{case.name}: {failed[:120]}: our rows are not timed")
        steps = {k: v for k, v in steps.items() if k not in case.on_request}
        anchor = _anchor_checks(case, steps, device, log)
        case_rows = []
        for impl, step in steps.items():
            own = anchor.get(impl.removesuffix("_fwd"))
            row = Row(family=case.family, case=case.name, shape=case.shape, impl=impl,
                      timing=None, check=check if impl == "ours" else own[0] if own else {})
            case_rows.append(row)
            if failed and _ours(impl):
                row.status, row.error = "check failed", failed[:300]
                continue
            if own and own[1]:
                row.status, row.error = own[1], own[2][:300]
                continue
            try:
                row.timing = timing = timer(step)
            except Unavailable as exc:
                timing = None
                row.status, row.error = "skipped", str(exc)[:300]
            except Exception as exc:
                timing = None
                row.status, row.error = "error", f"{type(exc).__name__}: {exc}"[:300]
            if profile and timing and profiled(impl):
                try:
                    row.kernels = kernel_breakdown(step)
                except Exception as exc:  # noqa: BLE001 - the timing stands without it
                    row.kernels = [{"kernel": f"profiler failed: {type(exc).__name__}: {exc}"[:200],
                                    "ms": 0.0, "calls": 0, "share": 0.0}]
            if graph_timer is not None and timing and timing.median_ms < GRAPH_MAX_MS:
                try:
                    row.graph_ms = graph_timer(step).median_ms
                except Exception:  # noqa: BLE001 - not capturable: the wall time stands alone
                    sync()
            # min_bytes/flops describe the full step; forward-only rows ("*_fwd") get none
            if timing and not impl.endswith("_fwd"):
                sec = timing.median_ms * 1e-3
                row.gbps = case.min_bytes / sec / 1e9
                row.tflops = case.flops / sec / 1e12 if case.flops else None
                row.roofline_frac = row.gbps / (ceilings["copy_tb_s"] * 1e3)
                if row.graph_ms:
                    row.graph_roofline_frac = (case.min_bytes / (row.graph_ms * 1e-3) / 1e12
                                               / ceilings["copy_tb_s"])
            log(f"  {case.family}/{case.name} {impl}: "
                + (f"{timing.median_ms:.3f} ms" if timing else row.error[:80])
                + f" ({time.perf_counter() - t0:.0f}s into the case)")
        # Ratios compare like with like: "X" with "ours", "X_fwd" with "ours_fwd". A row whose
        # check failed has no timing, hence no ratios.
        for suffix in ("", "_fwd"):
            ours = next((r for r in case_rows if r.impl == "ours" + suffix and r.timing), None)
            if ours is None:
                continue
            anchors = [r for r in case_rows if r.timing and r is not ours and
                       not _ours(r.impl) and r.impl.endswith("_fwd") == bool(suffix)]
            for r in anchors:
                ours.ratios[r.impl] = r.timing.median_ms / ours.timing.median_ms
                if r.graph_ms and ours.graph_ms:
                    ours.graph_ratios[r.impl] = r.graph_ms / ours.graph_ms
            if not anchors:
                continue
            group = [ours, *anchors]
            try:  # the ratios above stand when a re-timing fails
                rounds = interleaved_rounds({r.impl: steps[r.impl] for r in group}, RATIO_ROUNDS,
                                            round_timer)
            except Exception as exc:  # noqa: BLE001
                log(f"  interleaved rounds failed ({type(exc).__name__}: {str(exc)[:80]}): "
                    "sequential ratios")
                sync()
                continue
            for r in group:
                r.rounds_ms = rounds[r.impl]
            ours.ratios.update(paired_ratios(rounds, ours.impl))
        rows.extend(case_rows)
        if on_gpu:
            torch.cuda.empty_cache()
        log(f"{case.family}/{case.name}: {time.perf_counter() - t0:.1f}s")
        if partial is not None:
            partial({"environment": environment(), "ceilings": ceilings,
                     "rows": [asdict(r) for r in rows], "complete": False})
    return {"environment": environment(), "ceilings": ceilings,
            "rows": [asdict(r) for r in rows], "complete": True}


def format_table(result: dict[str, Any]) -> str:
    """The rows as a terminal table: a status column (ok / error / check failed) and, for a row
    that is not ok, the reason after its ratios."""
    lines = [f"{'case':38s} {'impl':8s} {'status':12s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} "
             f"{'graph':>7s} {'%copy':>6s}  ratios (anchor/ours: interleaved rounds; graph)"]
    for r in result["rows"]:
        t = r["timing"]
        status = r.get("status") or ("error" if r["error"] else "ok")  # rows from before status
        ms = f"{t['median_ms']:.3f}" if t else "-"
        gb = f"{r['gbps']:.0f}" if r["gbps"] else "-"
        frac = f"{100 * r['roofline_frac']:.0f}" if r["roofline_frac"] else "-"
        ratios = " ".join(f"{k}={v:.2f}x" for k, v in r["ratios"].items())
        if r.get("graph_ratios"):
            ratios += "; " + " ".join(f"{k}={v:.2f}x" for k, v in r["graph_ratios"].items())
        gms = f"{r['graph_ms']:.3f}" if r.get("graph_ms") else "-"
        gfrac = f"{100 * r['graph_roofline_frac']:.0f}" if r.get("graph_roofline_frac") else "-"
        err = f"  {status.upper()}: {r['error'][:100]}" if r["error"] else ""
        chk = "  " + " ".join(f"{k}={v:.1e}" for k, v in r["check"].items()
                              if isinstance(v, float)) if r["check"] else ""
        lines.append(f"{r['family'] + '/' + r['case']:38s} {r['impl']:8s} {status:12s} {ms:>8s} "
                     f"{gb:>7s} {frac:>6s} {gms:>7s} {gfrac:>6s}  {ratios}{err}{chk}")
    if any(r["ratios"] for r in result["rows"]):
        # two rows' ms columns come from their own timing runs, minutes apart: their quotient can
        # differ from the same-run ratio (call M, ssd: 1.37x by medians, 1.02x by rounds)
        lines.append("ms, graph: each row's own median. ratios: anchor / ours in the same run, the "
                     "median over interleaved rounds, then by graph time; compare rows by these")
    for r in result["rows"]:
        if r.get("kernels"):
            total = sum(k["ms"] for k in r["kernels"])
            lines += ["", f"{r['family']}/{r['case']} {r['impl']}: kernels {total:.3f} ms per step"]
            lines += [f"  {k['ms']:8.3f} ms {100 * k['share']:5.1f}% {k['calls']:5.1f}x  "
                      f"{k['kernel'][:90]}" for k in r["kernels"]]
    return "\n".join(lines)
