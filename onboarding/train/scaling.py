"""Weak scaling of the FSDP2 x EP LoRA training (`onboard scale`).

One `onboard train` run per layout (GPUs x EP degree, FSDP over the remaining ranks), each
with its own single-process reference, and the same per-rank micro-batch and sequence length,
so tokens per GPU stay fixed as the world grows. Per layout: tokens/s per GPU and the
efficiency against the smallest layout, MFU, all-to-all share of the step (total and exposed),
the largest per-layer expert-load imbalance, peak memory and the loss alignment with the
reference. Writes ``scaling.json`` (after every layout), ``scaling.md`` and ``scaling.png``;
the run report shows them (`onboarding.report`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onboarding.errors import InputError
from onboarding.formatting import or_dash
from onboarding.rundir import write_json
from onboarding.train.config import TrainConfig

RESULTS_FILE, TABLE_FILE, PLOT_FILE = "scaling.json", "scaling.md", "scaling.png"


@dataclasses.dataclass(frozen=True)
class Layout:
    gpus: int
    ep: int

    @property
    def fsdp(self) -> int:
        return self.gpus // self.ep

    @property
    def name(self) -> str:
        return f"gpus{self.gpus}-ep{self.ep}"


def layouts(gpus: list[int], eps: list[int]) -> list[Layout]:
    """Pair ``gpus`` with ``eps`` (one EP degree applies to every size); each EP degree must
    divide its GPU count (FSDP takes the rest)."""
    if len(eps) == 1:
        eps = eps * len(gpus)
    if not gpus or len(gpus) != len(eps):
        raise InputError(f"--gpus {gpus} and --ep {eps}: give one EP degree, or one per GPU count")
    out = []
    for n, e in zip(gpus, eps):
        if n < 1 or e < 1 or n % e:
            raise InputError(f"layout {n} GPUs with EP {e}: the EP degree must divide the GPU "
                             "count (FSDP takes the remaining factor)")
        lay = Layout(n, e)
        if lay in out:
            raise InputError(f"layout {n} GPUs with EP {e} is listed twice")
        out.append(lay)
    return out


def configs(base: TrainConfig, lays: list[Layout], out: Path) -> list[TrainConfig]:
    """One train config per layout, in ``out/<layout name>``."""
    return [dataclasses.replace(base, nproc=lay.gpus, ep=lay.ep, fsdp=lay.fsdp,
                                out=str(out / lay.name)) for lay in lays]


def collect(run_dir: Path, lay: Layout, rc: int) -> dict[str, Any]:
    """One table row from a finished run's ``train/compare.json`` (None where it has no value)."""
    row: dict[str, Any] = {"layout": lay.name, "gpus": lay.gpus, "ep": lay.ep, "fsdp": lay.fsdp,
                           "rc": rc}
    path = run_dir / "train" / "compare.json"
    if not path.exists():
        return {**row, "error": "the run wrote no compare.json"}
    cmp = json.loads(path.read_text())
    par = (cmp.get("metrics") or {}).get("parallel") or {}
    tps = par.get("tokens_per_s")
    peak = par.get("peak_mem_bytes")
    row.update(tokens_per_s_per_gpu=tps / lay.gpus if tps else None, mfu=par.get("mfu"),
               a2a_share=par.get("a2a_share"), a2a_exposed_share=par.get("a2a_exposed_share"),
               expert_max_imbalance=par.get("expert_max_imbalance"),
               peak_mem_gib=peak / 2**30 if peak else None,
               loss_max_rel_diff=cmp.get("max_rel_diff"), loss_tolerance=cmp.get("tolerance"),
               loss_passed=cmp.get("passed"))
    return row


def _efficiency(rows: list[dict[str, Any]]) -> None:
    base = next((r.get("tokens_per_s_per_gpu") for r in rows if r.get("tokens_per_s_per_gpu")),
                None)
    for r in rows:
        t = r.get("tokens_per_s_per_gpu")
        r["efficiency"] = t / base if t and base else None


def run_scaling(base: TrainConfig, lays: list[Layout], out: Path,
                launch: Callable[[TrainConfig], int]) -> dict[str, Any]:
    """Run every layout in turn with ``launch`` (a failed layout is recorded and the sweep goes
    on); writes the results, the table and the plot into ``out``."""
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": base.model, "seq_len": base.seq_len,
                              "micro_batch": base.micro_batch, "dtype": base.dtype,
                              "steps": base.steps, "rows": rows}
    for cfg, lay in zip(configs(base, lays, out), lays):
        rows.append(collect(Path(cfg.out), lay, launch(cfg)))
        _efficiency(rows)
        write_json(out / RESULTS_FILE, result)
    (out / TABLE_FILE).write_text(markdown(result))
    plot(result, out / PLOT_FILE)
    return result


def markdown(result: dict[str, Any]) -> str:
    from onboarding.formatting import table

    head = ["GPUs", "EP x FSDP", "tokens/s per GPU", "efficiency", "MFU", "a2a share",
            "a2a exposed", "expert imbalance (max/mean)", "peak mem GiB", "loss vs reference"]
    rows = []
    for r in result["rows"]:
        loss = r.get("error") or (f"{or_dash(r.get('loss_max_rel_diff'), '.1e')} "
                                  f"({'pass' if r.get('loss_passed') else 'FAIL'}, tol "
                                  f"{or_dash(r.get('loss_tolerance'), '.0e')})")
        rows.append([
            r["gpus"], f"{r['ep']} x {r['fsdp']}", or_dash(r.get("tokens_per_s_per_gpu"), ".0f"),
            or_dash(r.get("efficiency"), ".2f"), or_dash(r.get("mfu"), ".1%"),
            or_dash(r.get("a2a_share"), ".1%"),
            or_dash(r.get("a2a_exposed_share"), ".1%"), or_dash(r.get("expert_max_imbalance"), ".2f"),
            or_dash(r.get("peak_mem_gib"), ".1f"), loss])
    return (f"Weak scaling of {result['model']}: seq {result['seq_len']}, micro-batch "
            f"{result['micro_batch']} per GPU, {result['dtype']}, {result['steps']} steps "
            "(medians over the steps after the first).\n\n" + table(head, rows) + "\n")


def plot(result: dict[str, Any], path: Path) -> Path | None:
    rows = [r for r in result["rows"] if r.get("tokens_per_s_per_gpu")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = [r["gpus"] for r in rows]
    labels = [f"{r['gpus']}\nEP{r['ep']}xFSDP{r['fsdp']}" for r in rows]
    a.plot(x, [r["tokens_per_s_per_gpu"] for r in rows], "o-", label="measured")
    a.plot(x, [rows[0]["tokens_per_s_per_gpu"]] * len(x), "--", color="grey", label="ideal")
    a.set(title="tokens/s per GPU (weak scaling)", xlabel="GPUs", ylim=(0, None))
    for key, name in (("a2a_share", "all-to-all, total"), ("a2a_exposed_share", "exposed")):
        ys = [r.get(key) for r in rows]
        if any(y is not None for y in ys):
            b.plot(x, [100 * y if y is not None else float("nan") for y in ys], "o-", label=name)
    b.set(title="all-to-all share of the step (%)", xlabel="GPUs", ylim=(0, None))
    for ax in (a, b):
        ax.set_xticks(x, labels)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
