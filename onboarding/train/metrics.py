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


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak on a GPU, the process's max RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


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
