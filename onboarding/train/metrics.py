"""Per-step training metrics: expert load, all-to-all share from the profiler, peak memory, rows.

The all-to-all share comes from ``torch.profiler`` on sampled steps. On CUDA the intervals are
device kernels: all-to-all kernels (NCCL send/recv, all-to-all) against every other kernel;
on the CPU (gloo) the intervals are host ops. ``a2a_ms`` is the union of all-to-all intervals,
``a2a_exposed_ms`` the part of it during which no compute interval runs.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

A2A_MARKERS = ("all_to_all", "alltoall", "sendrecv", "all2all")
# Host-side bookkeeping that is not compute (waits, profiler and autograd plumbing).
_NOT_COMPUTE = ("wait", "profiler", "record_param_comms", "cudaStream", "cudaEvent",
                "cudaDeviceSynchronize", "nccl", "c10d", "gloo", "barrier", "all_reduce",
                "allreduce", "reduce_scatter", "all_gather", "allgather", "broadcast")


def expert_load(counts: torch.Tensor, paths: list[str]) -> list[dict[str, Any]]:
    """Per MoE layer: pairs per expert (all ranks), max/mean imbalance, experts with none."""
    out = []
    for path, c in zip(paths, counts.tolist()):
        mean = sum(c) / len(c) if c else 0.0
        out.append({"layer": path, "tokens": [int(x) for x in c],
                    "max_over_mean": round(max(c) / mean, 4) if mean else None,
                    "empty_experts": sum(1 for x in c if x == 0)})
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in iv)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_stats(a2a: list[tuple[float, float]], compute: list[tuple[float, float]]
                  ) -> tuple[float, float]:
    """(total, exposed) time of the ``a2a`` intervals; exposed = not covered by ``compute``."""
    ua, uc = _union(a2a), _union(compute)
    total = _length(ua)
    return total, total - _intersect(ua, uc)


def _is_a2a(name: str) -> bool:
    n = name.lower()
    return any(m in n for m in A2A_MARKERS)


def a2a_from_profile(prof: Any) -> dict[str, float]:
    """All-to-all total and exposed milliseconds of one profiled step."""
    events = list(prof.events())
    cuda = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    if cuda:
        pool = cuda
        a2a = [(e.time_range.start, e.time_range.end) for e in pool if _is_a2a(e.name)]
        comp = [(e.time_range.start, e.time_range.end) for e in pool
                if not _is_a2a(e.name) and "nccl" not in e.name.lower()]
    else:
        # Host ops: all-to-all ops against leaf aten compute ops (no children: no double count).
        a2a = [(e.time_range.start, e.time_range.end) for e in events if _is_a2a(e.name)]
        comp = [(e.time_range.start, e.time_range.end) for e in events
                if e.name.startswith("aten::") and not e.cpu_children
                and not any(m in e.name.lower() for m in _NOT_COMPUTE)]
    total, exposed = overlap_stats(a2a, comp)
    return {"a2a_ms": total / 1e3, "a2a_exposed_ms": exposed / 1e3}


# Kernel categories by name (first match wins), for the step breakdown.
KERNEL_CATEGORIES = (
    ("all-to-all / collectives", ("nccl", "all_to_all", "alltoall")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam", "_foreach")),
    ("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "grouped_mm", "cublas", "splitk")),
    ("copy / cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("reduction", ("reduce", "softmax", "norm_kernel", "argsort", "sort", "scan", "cub::")),
    ("index / gather / scatter", ("index", "gather", "scatter", "embedding")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "sigmoid", "mul_", "add_")),
)
PHASES = ("forward", "backward", "optimizer")


def _category(name: str) -> str:
    n = name.lower()
    for cat, marks in KERNEL_CATEGORIES:
        if any(m in n for m in marks):
            return cat
    return "triton / other"


def _phase(evt) -> tuple[str, str]:
    """(phase, label) of the CPU op that launched kernels: its enclosing ``step:<phase>`` range,
    or the autograd node running it (backward, on the engine's thread); the label is the
    innermost ``block:<kind>`` range in the forward, the autograd node in the backward."""
    label, e = "", evt
    while e is not None:
        name = e.name
        if name.startswith("block:") and not label:
            label = name[len("block:"):]
        if name.startswith("autograd::engine::evaluate_function: "):
            return "backward", name.rpartition(": ")[2]
        if name.startswith("step:"):
            return name[len("step:"):], label
        e = e.cpu_parent
    return "other", label


def step_breakdown(prof: Any, step_s: float, top: int = 25) -> dict[str, Any]:
    """Where one profiled step's time went on the device: kernel time per phase (forward,
    backward, optimizer), per block kind (forward), per autograd node (backward), per kernel
    category and per kernel; and the device's busy time (the union of kernel intervals) against
    the step's wall time, the rest being host gaps (launch overhead, syncs, Python)."""
    events = list(prof.events())
    by_phase: dict[str, float] = {}
    by_block: dict[str, float] = {}
    by_node: dict[str, float] = {}
    by_cat: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    launched = [(e, [(k.name, k.duration) for k in e.kernels]) for e in events
                if getattr(e, "kernels", None)]
    if not launched:  # a CPU run: the leaf aten ops and their own time stand for the kernels
        launched = [(e, [(e.name, e.self_cpu_time_total)]) for e in events
                    if e.name.startswith("aten::") and not e.cpu_children]
    for e, ks in launched:
        phase, label = _phase(e)
        for kname, us in ks:
            ms = us / 1e3
            by_phase[phase] = by_phase.get(phase, 0.0) + ms
            if phase == "forward":
                by_block[label or "(outside blocks)"] = by_block.get(label or "(outside blocks)", 0.0) + ms
            elif phase == "backward":
                by_node[label] = by_node.get(label, 0.0) + ms
            cat = _category(kname)
            by_cat[cat] = by_cat.get(cat, 0.0) + ms
            kernels.setdefault(kname, []).append(ms)
    dev = [(e.time_range.start, e.time_range.end) for e in events
           if str(getattr(e, "device_type", "")).endswith("CUDA")]
    busy = _length(_union(dev)) / 1e3 if dev else sum(by_cat.values())

    def ranked(d: dict[str, float], n: int | None = None) -> dict[str, float]:
        return {k: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}

    wall = step_s * 1e3
    return {"wall_ms": round(wall, 3), "device_busy_ms": round(busy, 3),
            "host_gap_ms": round(max(wall - busy, 0.0), 3),
            "kernel_ms": round(sum(by_cat.values()), 3), "by_phase": ranked(by_phase),
            "by_block_forward": ranked(by_block), "by_autograd_node": ranked(by_node, top),
            "by_category": ranked(by_cat),
            "top_kernels": [{"name": n[:160], "calls": len(v), "ms": round(sum(v), 3)}
                            for n, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]]}


@contextlib.contextmanager
def block_ranges(model: Any, graph: Any, skip: tuple[str, ...] = ()):
    """``block:<kind>`` profiler ranges around the forward of each block of ``graph`` (the
    innermost wins in `step_breakdown`), except blocks inside the modules at the paths ``skip``
    (compiled decoder layers: a hook added inside one changes what dynamo guarded, so the
    profiled step would recompile the layer, and the compiled code ignores the ranges anyway)."""
    from torch.profiler import record_function

    modules = dict(model.named_modules())
    hooks, open_ranges = [], []

    def enter(kind):
        def pre(module, args):
            r = record_function(f"block:{kind}")
            r.__enter__()
            open_ranges.append(r)
        return pre

    def leave(module, args, out):
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    for b in graph.blocks:
        mod = modules.get(b.path) if b.path else None
        if mod is not None and not any(b.path.startswith(p + ".") for p in skip):
            hooks.append(mod.register_forward_pre_hook(enter(b.kind)))
            hooks.append(mod.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        while open_ranges:
            open_ranges.pop().__exit__(None, None, None)


def phases(on: bool, model: Any, graph: Any, skip: tuple[str, ...] = ()):
    """``phase(name)``: a ``step:<name>`` profiler range (the forward's also with `block_ranges`,
    which leaves out the blocks inside the modules at ``skip``) when ``on``, else nothing."""
    from torch.profiler import record_function

    @contextlib.contextmanager
    def phase(name: str):
        if not on:
            yield
            return
        ranges = block_ranges(model, graph, skip) if name == "forward" else \
            contextlib.nullcontext()
        with record_function(f"step:{name}"), ranges:
            yield
    return phase


def write_breakdown(path: Path, prof: Any, step_s: float) -> None:
    """`step_breakdown` of a profiled step as JSON (best effort: a profiler whose events lack a
    field leaves a note instead)."""
    try:
        data = step_breakdown(prof, step_s)
    except (AttributeError, TypeError, ValueError) as exc:
        data = {"error": f"{type(exc).__name__}: {exc}"}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


# Receives every finished step profile (`profile_every`) while `trace_sink` is active: the
# nightly benchmark keeps one training step's kernels and Chrome trace this way.
_TRACE_SINK: list = []


@contextlib.contextmanager
def trace_sink(callback):
    """Inside this block, each profiled training step's profiler is passed to `callback`."""
    _TRACE_SINK.append(callback)
    try:
        yield
    finally:
        _TRACE_SINK.remove(callback)


def profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sinks = list(_TRACE_SINK)
    return profile(activities=acts,
                   on_trace_ready=(lambda prof: [f(prof) for f in sinks]) if sinks else None)


# Linux: the process's peak resident set (VmHWM), which writing "5" to clear_refs resets
_STATUS, _CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"


def _vm_hwm() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory(device: torch.device) -> int:
    """Peak bytes since the last `reset_peak_memory` (else since the process began): the CUDA
    allocator's peak on a GPU; on the CPU the process's peak resident set (Linux's VmHWM; the
    max RSS of ``getrusage`` where there is no /proc, which nothing resets)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new `peak_memory` from what is allocated now (CUDA: the allocator's peak stats;
    the CPU: the peak resident set, by clear_refs). False where it cannot be reset (a CPU
    without /proc): `peak_memory` then stays the process's peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return _vm_hwm() is not None


class StepPeaks:
    """Each step's own peak, and the run's: `start` before a step's work reads the peak since the
    last reset into the run's (the set-up before step 1, whatever ran between steps) and resets
    it; `step` after the step's work returns (the step's peak, the run's peak so far). A step's
    row reported the run's peak before (the counter was never reset between steps), so a peak
    set in step 1 (kernel calibration, compiles) read the same in every row."""

    def __init__(self, device: torch.device):
        self.device, self.run = device, 0

    def start(self) -> None:
        self.run = max(self.run, peak_memory(self.device))
        reset_peak_memory(self.device)

    def step(self) -> tuple[int, int]:
        peak = peak_memory(self.device)
        self.run = max(self.run, peak)
        return peak, self.run


class JsonlWriter:
    """``<out>/train/<role>.jsonl``: one row per step; on resume, rows past the resumed step go."""

    def __init__(self, path: Path, *, resume_step: int = 0, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if int(row.get("step", 0)) <= resume_step:
                    kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


# The per-step row fields that also go to TensorBoard (tag = field name).
TB_SCALARS = ("loss", "ce", "aux", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu",
              "expert_imbalance", "dropped_tokens", "dropped_share", "a2a_share",
              "a2a_exposed_share")


class TensorBoard:
    """The row's scalars as TensorBoard events in ``logdir`` (`onboarding.train.tensorboard`):
    the fields of `TB_SCALARS`, peak memory in GiB, and each MoE layer's max/mean expert load
    under ``expert_imbalance/<layer path>``."""

    def __init__(self, logdir: Path):
        from onboarding.train.tensorboard import EventWriter

        self.events = EventWriter(logdir)

    def write(self, row: dict[str, Any]) -> None:
        vals = {k: row.get(k) for k in TB_SCALARS}
        if isinstance(row.get("peak_mem_bytes"), (int, float)):
            vals["peak_mem_gib"] = row["peak_mem_bytes"] / 2 ** 30
        for layer in row.get("expert_load") or []:
            vals[f"expert_imbalance/{layer['layer']}"] = layer.get("max_over_mean")
        self.events.scalars(int(row["step"]), vals)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
