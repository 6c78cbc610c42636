"""Compare the parallel run's loss curve with the single-process reference; plot both.

Tolerances (relative loss difference per step, ``|parallel - reference| / |reference|``):
  - fp32: `FP32_REL_TOL` = 1e-5. Sharding and expert parallelism only change reduction orders,
    so fp32 losses agree to a few ulps of accumulated error over 20 steps.
  - bf16: `BF16_REL_TOL` = 2e-2. bf16 keeps 8 mantissa bits (unit roundoff 3.9e-3); GEMMs of
    different shapes (local expert batches, sharded gathers) round differently in every layer
    and the difference compounds through the AdamW updates; 2e-2 is about five roundoffs. It is a
    band for "the same training", not bitwise agreement: a real bug (a wrong gradient scale, a
    dropped token, a mis-routed expert) moves the loss by far more within a few steps.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from onboarding.rundir import write_json

FP32_REL_TOL = 1e-5
BF16_REL_TOL = 2e-2
METRICS = ("tokens_per_s", "mfu", "a2a_share", "a2a_exposed_share", "peak_mem_bytes",
           "step_time_s")


def tolerance(dtype: str) -> float:
    return BF16_REL_TOL if dtype == "bf16" else FP32_REL_TOL


def read_rows(path: Path) -> dict[int, dict[str, Any]]:
    """Rows of a ``<role>.jsonl`` by step (the last row wins: a resumed run rewrites steps)."""
    rows: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a truncated last line of a killed run
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows[row["step"]] = row
    return dict(sorted(rows.items()))


def _median(values: list) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def _imbalance(load: Any) -> float | None:
    """Largest per-layer max/mean expert load from a row's ``expert_load`` field: a list of
    per-layer dicts (``max_over_mean`` or ``tokens``), or a dict of layer -> such a dict/list."""
    layers = list(load.values()) if isinstance(load, dict) else load
    if not isinstance(layers, list):
        return None
    vals = []
    for v in layers:
        if isinstance(v, dict):
            if isinstance(v.get("max_over_mean"), (int, float)):
                vals.append(float(v["max_over_mean"]))
                continue
            v = v.get("tokens")
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            mean = sum(v) / len(v)
            if mean > 0:
                vals.append(max(v) / mean)
    return max(vals) if vals else None


def run_peak(rows: Iterable[dict]) -> int | None:
    """The run's peak memory from its step rows: each row's own step's peak and, since per-step
    peaks, the run's up to it (``run_peak_mem_bytes``); None without either."""
    return max((max(r.get("peak_mem_bytes") or 0, r.get("run_peak_mem_bytes") or 0)
                for r in rows), default=None) or None


def summarize(rows: dict[int, dict]) -> dict[str, Any]:
    """Medians of the per-step metrics, the first step (compilation, warm-up) left out."""
    steady = [r for s, r in rows.items() if s != min(rows)] if len(rows) > 1 else \
        list(rows.values())
    out = {m: _median([r.get(m) for r in steady]) for m in METRICS}
    out["peak_mem_bytes"] = run_peak(rows.values())
    imb = [_imbalance(r.get("expert_load")) for r in rows.values()]
    out["expert_max_imbalance"] = max((x for x in imb if x is not None), default=None)
    dropped = [r["dropped_tokens"] for r in rows.values()
               if isinstance(r.get("dropped_tokens"), (int, float))]
    shares = [r["dropped_share"] for r in rows.values()
              if isinstance(r.get("dropped_share"), (int, float))]
    # capacity-factor drops over the whole run: (token, expert) pairs, and their mean share
    out["dropped_tokens"] = int(sum(dropped)) if dropped else None
    out["dropped_share"] = sum(shares) / len(shares) if shares else None
    out["steps"] = len(rows)
    return out


def compare(run_dir: Path, *, dtype: str = "fp32", plot: bool = True) -> dict[str, Any]:
    """Per-step relative loss difference and the verdict; writes ``train/compare.json``."""
    train = Path(run_dir) / "train"
    ref, par = read_rows(train / "reference.jsonl"), read_rows(train / "parallel.jsonl")
    tol = tolerance(dtype)
    steps, problems = [], []
    for s in sorted(set(ref) | set(par)):
        r, p = ref.get(s, {}).get("loss"), par.get(s, {}).get("loss")
        if r is None or p is None:
            problems.append(f"step {s} missing in the {'parallel' if p is None else 'reference'} "
                            "run")
            continue
        rel = abs(p - r) / max(abs(r), 1e-30) if math.isfinite(r) and math.isfinite(p) \
            else float("inf")
        steps.append({"step": s, "reference": r, "parallel": p, "rel_diff": rel})
    if not steps:
        problems.append("no step present in both runs")
    worst = max((x["rel_diff"] for x in steps), default=float("inf"))
    passed = not problems and worst <= tol
    summary = (f"loss parallel vs reference over {len(steps)} steps ({dtype}): max relative "
               f"difference {worst:.2e} (tolerance {tol:.0e}): {'PASS' if passed else 'FAIL'}")
    if problems:
        summary += "; " + "; ".join(problems[:3])
    base = read_rows(train / "baseline.jsonl") if (train / "baseline.jsonl").exists() else {}
    result = {"passed": passed, "dtype": dtype, "tolerance": tol, "max_rel_diff": worst,
              "steps": steps, "problems": problems, "summary": summary,
              "metrics": {"reference": summarize(ref) if ref else None,
                          "parallel": summarize(par) if par else None,
                          "baseline": summarize(base) if base else None}}
    train.mkdir(parents=True, exist_ok=True)
    write_json(train / "compare.json", result)
    if plot:
        plot_loss(result, train / "loss.png")
        runs = {"reference": ref, "parallel": par, **({"baseline": base} if base else {})}
        plot_metrics(runs, train / "metrics.png")
    return result


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(result: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [s["step"] for s in result["steps"]]
    ax.plot(xs, [s["reference"] for s in result["steps"]], "o-", ms=3, label="reference (1 proc)")
    ax.plot(xs, [s["parallel"] for s in result["steps"]], "x--", ms=4, label="parallel")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.semilogy(xs, [max(s["rel_diff"], 1e-12) for s in result["steps"]], color="0.6", lw=0.8,
                 label="relative difference")
    ax2.axhline(result["tolerance"], color="tab:red", ls=":", lw=0.8)
    ax2.set_ylabel("|parallel - reference| / |reference|")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="center right")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"loss: {'PASS' if result['passed'] else 'FAIL'} "
                 f"(max rel. diff {result['max_rel_diff']:.1e}, tol {result['tolerance']:.0e})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_metrics(runs: dict[str, dict[int, dict]], path: Path) -> Path:
    plt = _plt()
    panels = (("tokens_per_s", "tokens/s", 1.0), ("mfu", "MFU", 1.0),
              ("a2a_share", "all-to-all share of step", 1.0),
              ("peak_mem_bytes", "peak memory (GiB)", 2.0 ** -30))
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, (key, label, scale) in zip(axes.flat, panels):
        for role, rows in runs.items():
            pts = [(s, r[key] * scale) for s, r in rows.items()
                   if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=role)
            if key == "a2a_share":
                pts = [(s, r["a2a_exposed_share"]) for s, r in rows.items()
                       if isinstance(r.get("a2a_exposed_share"), (int, float))]
                if pts:
                    ax.plot(*zip(*pts), ls=":", marker=".", label=f"{role} (exposed)")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center",
                    transform=ax.transAxes, color="0.5")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_balance(rows: dict[int, dict], path: Path) -> Path | None:
    """Expert-load imbalance (max/mean, per MoE layer) and the capacity factor's dropped share,
    per step; None when the rows carry no expert load."""
    layers: dict[str, list[tuple[int, float]]] = {}
    for s, r in sorted(rows.items()):
        for x in r.get("expert_load") or []:
            if isinstance(x.get("max_over_mean"), (int, float)):
                layers.setdefault(x["layer"], []).append((s, x["max_over_mean"]))
    if not layers:
        return None
    plt = _plt()
    drops = [(s, 100 * r["dropped_share"]) for s, r in sorted(rows.items())
             if isinstance(r.get("dropped_share"), (int, float))]
    fig, axes = plt.subplots(1, 2 if drops else 1, figsize=(10 if drops else 6, 3.8),
                             squeeze=False)
    a = axes[0][0]
    for name, pts in layers.items():
        a.plot(*zip(*pts), lw=1, marker="." if len(pts) < 40 else None,
               label=name if len(layers) <= 8 else None)
    a.axhline(1.0, color="grey", ls="--", lw=0.8)
    a.set(title="expert load max/mean per MoE layer (1 = uniform)", xlabel="step")
    if len(layers) <= 8:
        a.legend(fontsize=6)
    if drops:
        b = axes[0][1]
        b.plot(*zip(*drops), "o-", ms=3)
        b.set(title="dropped by the capacity factor (% of routed pairs)", xlabel="step",
              ylim=(0, None))
    for ax in axes[0]:
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
