"""Rendering of an `AlignmentResult`: the run report's Markdown section and the error plot.

Private module: use `AlignmentResult.to_markdown()` / `.plot()`, or `render_markdown` /
`plot_errors` from `onboarding.align.core`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onboarding.align.core import AlignmentResult


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.1e}" if x else "0"


def render_markdown(result: AlignmentResult, *, only_failing: bool = False) -> str:
    """The run report's alignment section: a header line, culprits, one row per block."""
    from onboarding.align.verdicts import markdown_lines

    r = result
    what = r.checked()
    verdict = ("**FAIL** (--strict)" if r.strict_failed else "**PASS**" if r.passed
               else "**FAIL**") + (f" — {what}" if what else "")
    lines = [f"**Alignment** ({r.mode}): candidate {r.candidate_dtype} vs reference "
             f"{r.reference_dtype}, inputs {r.input_shapes}, seed {r.seed}: "
             f"{verdict}. {len(r.blocks)} blocks. Logits rel RMS "
             f"{r.logits['stats']['rel_rms']:.2e}, KL {r.logits['kl']:.2e} "
             f"(max {r.logits['kl_max']:.2e}), top-1 agreement {r.logits['top1_agreement']:.3f} "
             f"over {r.logits['tokens']} tokens.", ""]
    for key, name in (("fwd", "forward"), ("bwd", "backward")):
        for b in r.culprits(key):
            lines.append(f"- culprit ({name}): `{b.path}` ({b.kind}): {getattr(b, key).message}")
    if r.patches:
        active = sum(p["status"] == "active" for p in r.patches)
        dense = sum(p["status"] == "dense_by_shape" for p in r.patches)
        lines.append(f"- patched blocks: {active} active of {len(r.patches)}" + (
            f"; {dense} dense by shape (calibrated, but every call ran the block's own attention)"
            if dense else ""))
    lines += markdown_lines(r)
    lines += [f"- note: {n}" for n in r.notes]
    bit = r.mode == "bitwise"
    # pipes in a cell are escaped: a bare one splits the cell and breaks the whole table
    head = ["#", "block", "kind", "fwd rel RMS", r"fwd p99 \|err\|", r"fwd max \|err\|", "cos",
            "fwd", "bwd rel RMS", "param-grad rel RMS", r"bwd max \|err\|", "bwd"]
    if bit:
        head[7:7] = ["exact", "max ulp"]
    rank = {p: i for i, p in enumerate(r.forward_order)}
    no_bwd = {x["path"] for x in r.backward_not_checked}
    blocks = sorted(r.blocks, key=lambda b: rank.get(b.path, len(rank)))
    if only_failing:  # a long table: the failing blocks, and the worst block of every kind
        bad = {"fail", "nonfinite", "amplified"}
        failing = [b for b in blocks if b.fwd.verdict in bad or b.bwd.verdict in bad]
        worst: dict[str, object] = {}
        for b in blocks:
            e = b.fwd.output.rel_rms if b.fwd.output else -1.0
            w = worst.get(b.kind)
            if w is None or e > (w.fwd.output.rel_rms if w.fwd.output else -1.0):
                worst[b.kind] = b
        shown = {b.path for b in failing} | {b.path for b in worst.values()}
        lines += ["", f"{len(blocks)} blocks, {len(failing)} failing; the table lists the "
                  f"failing blocks and the block with the largest forward error of each kind "
                  f"({len(blocks) - len(shown)} more blocks are in `alignment.json`)."]
        blocks = [b for b in blocks if b.path in shown]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in blocks:
        f, g = b.fwd, b.bwd
        o, go = f.output, g.output
        row = [str(rank.get(b.path, "—")), f"`{b.path}`", b.kind,
               _fmt(o and o.rel_rms), _fmt(o and o.p99), _fmt(o and o.max_abs),
               f"{o.cosine:.6f}" if o else "—", _mark(f.verdict),
               _fmt(go and go.rel_rms), _fmt(g.params and g.params.rel_rms),
               _fmt(go and go.max_abs),
               _mark(g.verdict) + (" (backward not checked)" if b.path in no_bwd else "")]
        if bit:
            row[7:7] = [f"{o.exact_fraction:.4f}" if o and o.exact_fraction is not None else "—",
                        str(o.max_ulp) if o and o.max_ulp is not None else "—"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _mark(verdict: str) -> str:
    return {"fail": "**FAIL**", "nonfinite": "**NaN/Inf**",
            "amplified": "**AMPLIFIED**"}.get(verdict, verdict)


def plot_errors(result: AlignmentResult, path: Path) -> Path:
    """PNG: relative RMS error per block in execution order, forward and backward, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.22 * len(result.blocks)), 7.5))
    colors = {"pass": "tab:green", "propagated": "tab:orange", "fail": "tab:red",
              "nonfinite": "tab:red", "amplified": "tab:red"}
    by_path = {b.path: b for b in result.blocks}
    for ax, key, order, title in ((axes[0], "fwd", result.forward_order, "forward: block output"),
                                  (axes[1], "bwd", result.backward_order,
                                   "backward: gradient w.r.t. block input (params if none)")):
        xs, ys, cs, labels = [], [], [], []
        for p in order:
            b = by_path.get(p)
            if b is None:
                continue
            d = getattr(b, key)
            st = d.output if (d.output and d.output.numel) else d.params
            if st is None:
                continue
            y = st.rel_rms if math.isfinite(st.rel_rms) else 1e3
            xs.append(len(xs))
            ys.append(max(y, 1e-17))
            cs.append(colors.get(d.verdict, "tab:gray"))
            labels.append(f"{b.layer if b.layer is not None else '-'}:{p.rsplit('.', 1)[-1]}")
        ax.scatter(xs, ys, c=cs, s=18, zorder=3)
        ax.plot(xs, ys, color="0.75", lw=0.8, zorder=2)
        tols = [by_path[p].tolerance["max_rel_rms"] for p in order if p in by_path]
        if tols and result.mode == "percentile":
            ax.axhline(max(tols), color="tab:red", ls="--", lw=0.8, label="max_rel_rms")
            ax.legend(loc="upper left", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(xs, labels, rotation=90, fontsize=6)
        ax.set_ylabel("||a-b|| / ||b||")
        ax.set_title(f"{title} ({result.candidate_dtype} vs {result.reference_dtype})", fontsize=9)
        ax.grid(True, which="major", axis="y", alpha=0.3)
    n = len(result.not_checked)
    unchecked = f", {n} coverable block{'s' if n != 1 else ''} not checked" if n else ""
    fig.suptitle(f"{result.model}: layer-wise alignment "
                 f"({'PASS' if result.verdict_passed else 'FAIL'}{unchecked})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
