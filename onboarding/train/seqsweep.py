"""Sequence-length sweep (`onboard train ... --seq-sweep 4096,16384,65536`).

One short training run per length, each in fresh processes (the run that trains: the
single-process run at ``--nproc 1``, else the torchrun run; no reference comparison), so each
length's peak memory is its own. Per length: tokens/s (median over the steps after the first),
peak memory (CUDA allocator peak; the process's max RSS on the CPU), whether every loss was
finite, and the outcome: ok, OOM (out-of-memory in the run's log), an alert, or an error. A length
that fails is a row that says so and the sweep goes on. Writes ``seq_sweep.json`` (after every
length), ``seq_sweep.md`` and ``seq_sweep.png`` into the sweep's directory; the run report shows
them (`onboarding.report`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onboarding.errors import EXIT_ALERT, InputError
from onboarding.formatting import or_dash
from onboarding.rundir import write_json
from onboarding.train.config import TrainConfig

RESULTS_FILE, TABLE_FILE, PLOT_FILE = "seq_sweep.json", "seq_sweep.md", "seq_sweep.png"
OOM_MARKERS = ("OutOfMemoryError", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
               "Cannot allocate memory")


def lengths(values: list[int]) -> list[int]:
    if not values:
        raise InputError("--seq-sweep: give at least one sequence length")
    bad = [v for v in values if v <= 0]
    if bad:
        raise InputError(f"--seq-sweep {bad[0]}: sequence lengths must be positive")
    if len(set(values)) != len(values):
        raise InputError(f"--seq-sweep {values}: a length is listed twice")
    return list(values)


def role(cfg: TrainConfig) -> str:
    return "reference" if cfg.nproc == 1 else "parallel"


def configs(base: TrainConfig, seqs: list[int], out: Path) -> list[TrainConfig]:
    """One config per length, in ``out/seq<L>``; checkpoints and the adapter export off (a sweep
    measures, it does not resume or ship: at full size the export writes the whole base), no
    baseline."""
    return [dataclasses.replace(base, seq_len=s, out=str(out / f"seq{s}"), baseline=False,
                                checkpoint_interval=0, checkpoint_dir=None, export=False)
            for s in seqs]


def _outcome(log: Path, rc: int) -> str:
    if rc == 0:
        return "ok"
    text = log.read_text(errors="replace") if log.exists() else ""
    if any(m in text for m in OOM_MARKERS):
        return "OOM"
    if rc == EXIT_ALERT:
        return "alert"
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    return f"error (exit {rc}): {last[:160]}"


def collect(cfg: TrainConfig, rc: int) -> dict[str, Any]:
    """The table row of one finished (or failed) length."""
    from onboarding.train.compare import read_rows, summarize

    train = Path(cfg.out) / "train"
    r = role(cfg)
    rows = read_rows(train / f"{r}.jsonl") if (train / f"{r}.jsonl").exists() else {}
    m = summarize(rows) if rows else {}
    losses = [row.get("loss") for row in rows.values()]
    peak = m.get("peak_mem_bytes")
    return {"seq": cfg.seq_len, "rc": rc, "outcome": _outcome(train / f"{r}.log", rc),
            "steps": len(rows), "tokens_per_s": m.get("tokens_per_s"),
            "peak_mem_gib": peak / 2 ** 30 if peak else None,
            "loss_finite": (all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses)
                            if losses else None),
            "last_loss": losses[-1] if losses else None, "run_dir": cfg.out}


def reuse_setup(src: Path, dst: Path) -> None:
    """Give a length's run the first length's kernel candidates and verdicts (the op graph is
    shared by the caller): they do not depend on the sequence length (rendered and checked at the
    graph's widths), and at full size rendering and checking them on the device is a large part
    of a run's set-up.
    The run verifies each module against its recorded hash before it imports it."""
    import shutil

    kernels = src / "train" / "kernels"
    if (kernels / "candidates.json").is_file() and not (dst / "train" / "kernels").exists():
        shutil.copytree(kernels, dst / "train" / "kernels",
                        ignore=shutil.ignore_patterns("experts", "__pycache__"))


def run_sweep(base: TrainConfig, seqs: list[int], out: Path,
              run_one: Callable[[TrainConfig], int],
              on_row: Callable[[list[str]], None] | None = None) -> dict[str, Any]:
    """``run_one`` each length in turn; ``on_row`` gets each length's table row (`TABLE_HEAD`)
    as soon as it is known, so a long sweep shows its results while it goes on."""
    rows: list[dict[str, Any]] = []
    result = {"model": base.model, "proxy": base.proxy, "overrides": base.overrides,
              "nproc": base.nproc, "ep": base.ep, "micro_batch": base.micro_batch,
              "dtype": base.dtype, "recompute": base.recompute_mode, "steps": base.steps,
              "device": base.device, "rows": rows}
    first: Path | None = None
    for cfg in configs(base, seqs, out):
        if first is not None:
            reuse_setup(first, Path(cfg.out))
        rows.append(collect(cfg, run_one(cfg)))
        write_json(out / RESULTS_FILE, result)
        if on_row is not None:
            on_row(table_rows({"rows": rows[-1:]})[0])
        first = first or Path(cfg.out)
    (out / TABLE_FILE).write_text(markdown(result))
    plot(result, out / PLOT_FILE)
    return result


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    return [[str(r["seq"]), or_dash(r.get("tokens_per_s"), ",.0f"),
             or_dash(r.get("peak_mem_gib"), ".2f"),
             {True: "yes", False: "NO", None: "—"}[r.get("loss_finite")], r["outcome"]]
            for r in result["rows"]]


TABLE_HEAD = ["seq", "tokens/s", "peak GiB", "loss finite", "outcome"]


def markdown(result: dict[str, Any]) -> str:
    from onboarding.formatting import table

    return (f"Sequence-length sweep of {result['model']} (proxy {result['proxy']}): "
            f"{result['nproc']} process(es), micro-batch {result['micro_batch']}, "
            f"{result['dtype']}, recompute {result['recompute']}, {result['steps']} steps per "
            "length (tokens/s: median after the first step; peak: CUDA allocator, or the "
            "process's max RSS on the CPU).\n\n"
            + table(TABLE_HEAD, table_rows(result)) + "\n")


def plot(result: dict[str, Any], path: Path) -> Path | None:
    rows = result["rows"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((a, "tokens_per_s", "tokens/s"), (b, "peak_mem_gib", "peak GiB")):
        ok = [r for r in rows if r.get(key) is not None]
        if ok:
            ax.plot([r["seq"] for r in ok], [r[key] for r in ok], "o-")
        for r in rows:
            if r["outcome"] != "ok":
                ax.axvline(r["seq"], color="tab:red", ls=":", lw=1)
                ax.annotate(r["outcome"].split(":")[0], (r["seq"], 0), rotation=90,
                            xycoords=("data", "axes fraction"), va="bottom", color="tab:red",
                            fontsize=8)
        ax.set(title=f"{title} vs sequence length (recompute {result['recompute']})",
               xlabel="sequence length", ylim=(0, None))
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["seq"] for r in rows], [str(r["seq"]) for r in rows])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
