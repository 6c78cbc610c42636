"""A plan for people: the terminal tables, the report's Markdown section and the stacked bar chart
(memory per device by component, one bar per layout, the GPU's memory as a line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onboarding.formatting import table
from onboarding.plan.config import GIB
from onboarding.plan.search import Candidate, Plan, gib, size

PLOT_FILE = "plan.png"
MARKDOWN_FILE = "plan.md"  # the report's section, as the plan stage wrote it
SHOWN = 8  # layouts listed in the terminal and the report (plan.json has them all)


def _ms(s: float) -> str:
    return f"{s:.3g} s" if s >= 10 else f"{s * 1e3:.4g} ms"


def short(c: Candidate) -> str:
    lay = c.layout
    return f"EP{lay.ep}xFSDP{lay.fsdp} rc:{lay.recompute} off:{lay.offload}"


def memory_rows(c: Candidate) -> list[list[str]]:
    rows = [[k, gib(v)] for k, v in c.memory.components().items()]
    rows.append(["total per GPU", gib(c.memory.total)])
    if c.memory.host:
        rows.append(["(in host memory, per GPU)", gib(c.memory.host)])
    return rows


def comm_rows(plan: Plan, c: Candidate) -> list[list[str]]:
    cm, cfg = c.comm, plan.config
    ex = plan.shape["experts"]
    rows = []
    if ex and c.layout.ep > 1:
        e = ex[0]
        rows.append(["all-to-all per MoE layer", f"{size(cm.a2a_layer_bytes)} per GPU per step "
                     f"({cfg.micro_batch * cfg.seq} tokens x top-{e['top_k']} x "
                     f"{plan.shape['hidden']} x bf16, dispatch + combine, fwd + bwd"
                     f"{' + recompute fwd' if c.layout.recompute == 'full' else ''}, "
                     f"(EP-1)/EP leave, x{cfg.imbalance:g} imbalance)"])
        rows.append(["all-to-all, all layers", f"{size(cm.a2a_bytes)}: {_ms(cm.a2a_s)}"])
    elif ex:
        rows.append(["all-to-all", "none (EP 1: every expert local)"])
    rows.append(["FSDP all-gather + reduce-scatter",
                 f"{size(cm.fsdp_gather_bytes)} + {size(cm.fsdp_reduce_bytes)}: "
                 f"{_ms(cm.fsdp_s)}"])
    if cm.offload_bytes:
        rows.append(["offload traffic (PCIe)", f"{size(cm.offload_bytes)}: {_ms(cm.offload_s)}"])
    return rows


def time_rows(c: Candidate) -> list[list[str]]:
    t = c.time
    return [["GEMMs / attention / memory-bound",
             f"{_ms(t.gemm_s)} / {_ms(t.attn_s)} / {_ms(t.memory_s)}"],
            *([["recompute: the forward again (GPU)", _ms(t.rerun_s)]] if t.rerun_s else []),
            ["host (op launches)", _ms(t.host_s)],
            ["compute", _ms(t.compute_s)], ["communication", _ms(c.comm.seconds)],
            ["step, with overlap", _ms(t.overlap_s)], ["step, no overlap", _ms(t.serial_s)],
            ["MFU (with overlap)", f"{t.mfu:.1%}"],
            ["tokens/s (all GPUs)", f"{t.tokens_per_s:,.0f}"]]


def layout_rows(plan: Plan, limit: int | None = SHOWN) -> list[list[str]]:
    rows = []
    for c in plan.fitting[:limit]:
        rows.append(["fits", short(c), gib(c.memory.total), _ms(c.time.overlap_s),
                     f"{c.time.mfu:.1%}", ""])
    # the nearest misses first
    for c in sorted(plan.rejected, key=lambda c: c.memory.total)[:limit]:
        rows.append(["no", short(c), gib(c.memory.total), _ms(c.time.overlap_s), "",
                     c.reason])
    return rows


def print_plan(plan: Plan, console: Any, *, all_layouts: bool = False) -> None:
    from rich.table import Table

    def show(title: str, header: list[str], rows: list[list[str]]) -> None:
        t = Table(title=title, title_justify="left", box=None, padding=(0, 1), pad_edge=False)
        for i, h in enumerate(header):
            t.add_column(h, justify="right" if i and h in ("GiB/GPU", "step", "MFU") else "left",
                         overflow="fold")
        for r in rows:
            t.add_row(*r)
        console.print(t)

    cfg, s = plan.config, plan.shape
    console.print(f"[bold]plan[/bold] {plan.model}: {s['total_params'] / 1e9:.2f}B parameters "
                  f"({s['routed_expert_params'] / 1e9:.2f}B routed experts), {cfg.mode}, "
                  f"{cfg.gpus} GPUs, {cfg.micro_batch} x {cfg.seq} tokens per GPU", highlight=False)
    c = plan.chosen
    if c is not None:
        show(f"memory per GPU: {c.layout.name}", ["component", "size"], memory_rows(c))
        show("communication per step", ["what", "bytes and time"], comm_rows(plan, c))
        show("estimated step time", ["part", "time"], time_rows(c))
    limit = None if all_layouts else SHOWN
    show(f"layouts ({len(plan.fitting)} fit, {len(plan.rejected)} do not"
         + ("" if all_layouts else f"; first {SHOWN} of each, --all for every one") + ")",
         ["fits", "layout", "GiB/GPU", "step", "MFU", "why not"], layout_rows(plan, limit))
    console.print("assumptions: " + "; ".join(plan.cluster.assumptions()), highlight=False)
    for n in plan.notes + (c.memory.notes if c else []):
        console.print(f"note: {n}", highlight=False)
    style = "green" if c is not None and c.fits else "red"
    console.print(f"[{style}]{plan.verdict}[/{style}]", highlight=False)


def markdown(plan: Plan, plot_file: str | None = None) -> str:
    cfg, c = plan.config, plan.chosen
    out = [f"{cfg.gpus} GPUs, {cfg.mode}, {cfg.micro_batch} x {cfg.seq} tokens per GPU: "
           f"**{plan.verdict}**.", ""]
    if c is not None:
        out += [table([f"memory per GPU ({c.layout.name})", "size"], memory_rows(c)), "",
                table(["communication per step", "bytes and time"], comm_rows(plan, c)), "",
                table(["estimated step time", ""], time_rows(c)), ""]
    if plot_file:
        out += [f"![memory per GPU by component]({plot_file})", ""]
    out += [table(["fits", "layout", "per GPU", "step", "MFU", "why not"], layout_rows(plan)), "",
            "Assumptions: " + "; ".join(plan.cluster.assumptions()) + "."]
    out += [f"Note: {n}" for n in plan.notes]
    return "\n".join(out)


def plot(plan: Plan, path: Path) -> bool:
    """Stacked bars: memory per GPU by component for the best fitting layouts and the nearest
    misses, the GPU's memory as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = plan.fitting[:4] + sorted(plan.rejected, key=lambda c: c.memory.total)[:3]
    if not shown:
        return False
    comps: list[str] = []
    for c in shown:
        comps += [k for k in c.memory.components() if k not in comps]
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    cmap = plt.get_cmap("tab20")
    labels = [f"EP{c.layout.ep}xFSDP{c.layout.fsdp}\nrc {c.layout.recompute}\n"
              f"off {c.layout.offload}" + ("" if c.fits else "\n(no fit)") for c in shown]
    bottom = [0.0] * len(shown)
    for i, comp in enumerate(comps):
        vals = [c.memory.components().get(comp, 0.0) / GIB for c in shown]
        ax.bar(range(len(shown)), vals, bottom=bottom, label=comp, color=cmap(i % 20))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(plan.cluster.gpu_mem_gib, color="black", linestyle="--", linewidth=1)
    ax.text(len(shown) - 0.5, plan.cluster.gpu_mem_gib, f" {plan.cluster.gpu_mem_gib:g} GiB",
            va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(shown)), labels, fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{plan.model}: memory per GPU, {plan.config.gpus} GPUs, "
                 f"{plan.config.mode}, seq {plan.config.seq}", fontsize=10)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
