"""The nightly dashboard: one self-contained HTML page (plots embedded as PNG data URIs, no
script, no stylesheet or font from elsewhere) that opens offline in any browser.

Sections: the latest run's verdicts; every row over time with its noise band (the value times
1 +- K_SIGMA x the row's A/A noise) and the change points found in the history; a roofline per
family (achieved TFLOP/s against arithmetic intensity under the copy and matmul ceilings
measured in the same run; families whose cases count no FLOPs: achieved bandwidth against the
copy ceiling); a timeline of one training step (torch.profiler GPU time per kernel as bars, the
kernel launches on a time axis) and the name of its Chrome trace file, beside the page, for
Perfetto (ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

from onboarding.bench.compare import K_SIGMA
from onboarding.bench.history import series_change_points

SECTIONS = ("verdicts", "history", "roofline", "train-step")
MAX_PANELS = 24  # rows per history figure


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _img(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{html.escape(alt)}">'


def history_figures(series: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """(group, PNG) per row group: one panel per row, its values over the runs, the noise band
    and the change points (commit labels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[str]] = {}
    for key, pts in series.items():
        groups.setdefault(key.split("/")[1] if "/" in key else key, []).append(key)
    out = []
    for group, keys in groups.items():
        keys = keys[:MAX_PANELS]
        cols = min(3, len(keys))
        rows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.6 * rows), squeeze=False)
        for ax in axes.flat[len(keys):]:
            ax.set_visible(False)
        for ax, key in zip(axes.flat, keys):
            pts = [p for p in series[key] if p["value"] is not None]
            xs = list(range(len(pts)))
            vals = [p["value"] for p in pts]
            lo = [p["value"] * (1 - K_SIGMA * (p["noise"] or 0)) for p in pts]
            hi = [p["value"] * (1 + K_SIGMA * (p["noise"] or 0)) for p in pts]
            ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.18, linewidth=0,
                            label=f"±{K_SIGMA:g}σ A/A noise")
            ax.plot(xs, vals, "o-", color="tab:blue", markersize=3, linewidth=1)
            for cp in series_change_points(series[key]):
                ax.axvline(cp.index - 0.5, color="tab:red", linewidth=1.2)
                ax.annotate(f"{(cp.commit or '?')[:8]} {100 * cp.rel:+.1f}%",
                            (cp.index - 0.5, max(vals)), color="tab:red", fontsize=7,
                            rotation=90, va="top", ha="right")
            if pts:
                ax.set_xticks(xs[:: max(1, len(xs) // 6)])
                ax.set_xticklabels([(pts[i]["commit"] or "?")[:7] for i in xs[:: max(1, len(xs) // 6)]],
                                   fontsize=6, rotation=30)
            unit = series[key][-1]["unit"]
            ax.set_title("/".join(key.split("/")[2:])[:60] or key, fontsize=7)
            ax.set_ylabel(unit, fontsize=7)
            ax.tick_params(labelsize=6)
        fig.suptitle(f"{group}: rows over time (runs oldest to newest)", fontsize=9)
        fig.tight_layout()
        out.append((group, _png(fig)))
    return out


def roofline_figures(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(family, PNG) per family of the run's kernel rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copy = result["ceilings"]["copy_tb_s"]  # TB/s
    mm = result["ceilings"]["matmul_bf16_tflops"]
    fams: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        if r["part"] == "kernels" and r["value"] is not None and r.get("min_bytes"):
            fams.setdefault(r["group"], []).append(r)
    out = []
    for fam, rows in fams.items():
        fig, ax = plt.subplots(figsize=(6.2, 3.6))
        if any(r.get("flops") for r in rows):
            ais = [r["flops"] / r["min_bytes"] for r in rows if r.get("flops")]
            x = [10 ** e for e in [i / 20 for i in range(-20, 100)]]
            ax.loglog(x, [min(copy * a, mm) for a in x], "k-", linewidth=1.2,
                      label=f"ceilings: copy {copy:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s")
            for r in rows:
                if r.get("flops"):
                    ai = r["flops"] / r["min_bytes"]
                    ax.loglog([ai], [r["tflops"]], "o", label=f"{r['impl']} {r['case'][:28]}: "
                              f"{r['tflops']:.1f} TFLOP/s ({100 * r['tflops'] / min(copy * ai, mm):.0f}%)")
            ax.set_xlim(min(ais) / 10, max(ais) * 10)
            ax.set_xlabel("arithmetic intensity (FLOP / byte, fewest bytes)", fontsize=8)
            ax.set_ylabel("TFLOP/s", fontsize=8)
        else:
            names = [f"{r['impl']}\n{r['case'][:18]}" for r in rows]
            ax.bar(names, [r["gbps"] / 1e3 for r in rows], color="tab:blue")
            ax.axhline(copy, color="k", linewidth=1.2, label=f"copy ceiling {copy:.2f} TB/s")
            for i, r in enumerate(rows):
                ax.annotate(f"{100 * r['gbps'] / 1e3 / copy:.0f}%", (i, r["gbps"] / 1e3),
                            ha="center", va="bottom", fontsize=7)
            ax.set_ylabel("achieved TB/s (fewest bytes / time)", fontsize=8)
        ax.set_title(f"{fam}: roofline (ceilings measured in this run)", fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        out.append((fam, _png(fig)))
    return out


def train_figures(prof: dict[str, Any]) -> list[str]:
    """Time per kernel (bars) and the step's kernel launches on a time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [k for k in prof["kernels"]][:20]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(ks) + 1))
    ax.barh(range(len(ks)), [k["ms"] for k in ks], color="tab:green")
    ax.set_yticks(range(len(ks)))
    ax.set_yticklabels([k["kernel"][:70] for k in ks], fontsize=6)
    ax.invert_yaxis()
    for i, k in enumerate(ks):
        ax.annotate(f"{k['ms']:.2f} ms, {100 * k['share']:.0f}%, {k['calls']:.0f}x", (k["ms"], i),
                    fontsize=6, va="center")
    ax.set_xlabel("GPU ms in the profiled step", fontsize=8)
    ax.set_title(f"one training step of {prof['model']}: time per kernel", fontsize=9)
    fig.tight_layout()
    bars = _png(fig)
    top = [k["kernel"][:120] for k in ks if not k["kernel"].startswith("(")][:9]
    colors = {name: plt.cm.tab10(i) for i, name in enumerate(top)}
    fig, ax = plt.subplots(figsize=(10, 2.2))
    for name, start, dur in prof["timeline"]:
        ax.broken_barh([(start, max(dur, 1e-3))], (0, 1), color=colors.get(name, (0.6, 0.6, 0.6)))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, [n[:50] for n in colors], fontsize=5, ncol=3, loc="upper center",
              bbox_to_anchor=(0.5, -0.35))
    ax.set_yticks([])
    ax.set_xlabel("ms since the step's first kernel", fontsize=8)
    ax.set_title("kernel timeline of the step (GPU)", fontsize=9)
    fig.tight_layout()
    return [bars, _png(fig)]


_CSS = """body{font-family:sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}
.regression{background:#f8d0d0}.improvement{background:#d0f0d0}.suspicious{background:#fff0c0}
img{max-width:100%;display:block;margin:0.5em 0}h2{border-bottom:1px solid #999}"""


def _verdict_table(verdicts: list[dict[str, Any]]) -> str:
    order = {v: i for i, v in enumerate(("regression", "suspicious", "improvement", "ok"))}
    cells = []
    for v in sorted(verdicts, key=lambda v: order[v["verdict"]]):
        def f(x):
            return f"{x:.4g}" if isinstance(x, float) else html.escape(str(x))[:40]
        cells.append(f'<tr class="{v["verdict"]}"><td>{html.escape(v["key"])}</td>'
                     f'<td>{v["verdict"]}</td><td>{f(v["baseline"])}</td><td>{f(v["now"])}</td>'
                     f'<td>{html.escape(v["reason"])}</td></tr>')
    return ("<table><tr><th>row</th><th>verdict</th><th>baseline</th><th>now</th><th>why</th>"
            "</tr>" + "".join(cells) + "</table>")


def render(result: dict[str, Any], series: dict[str, list[dict[str, Any]]],
           verdicts: list[dict[str, Any]] | None = None) -> str:
    """The page: `result` the latest nightly run, `series` the history (`History.series`),
    `verdicts` the comparison with the baseline (None: no comparison ran)."""
    env = result["environment"]
    head = (f"{html.escape(str(env.get('gpu')))} · commit {html.escape(str(env.get('commit')))} · "
            f"{html.escape(str(env.get('date')))} · torch {env.get('torch')} · triton "
            f"{env.get('triton')} · transformers {env.get('transformers')} · ceilings: copy "
            f"{result['ceilings']['copy_tb_s']} TB/s, bf16 matmul "
            f"{result['ceilings']['matmul_bf16_tflops']} TFLOP/s")
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>onboard nightly</title>"
             f"<style>{_CSS}</style></head><body><h1>onboard nightly benchmark</h1><p>{head}</p>"]
    parts.append('<h2 id="verdicts">Verdicts against the baseline</h2>')
    if verdicts:
        counts = {}
        for v in verdicts:
            counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
        parts.append("<p>" + ", ".join(f"{n} {k}" for k, n in counts.items()) + "</p>")
        parts.append(_verdict_table(verdicts))
    else:
        parts.append("<p>no comparison in this run (--compare not given)</p>")
    parts.append('<h2 id="history">Every row over time</h2><p>Band: ±'
                 f'{K_SIGMA:g} x the row\'s A/A noise floor; red lines: change points in the '
                 'history, labelled with the first commit of the new level.</p>')
    figs = history_figures(series)
    parts += [f"<h3>{html.escape(g)}</h3>" + _img(uri, f"{g} over time") for g, uri in figs] \
        or ["<p>no history yet</p>"]
    parts.append('<h2 id="roofline">Roofline per family</h2>')
    parts += [_img(uri, f"{f} roofline") for f, uri in roofline_figures(result)] \
        or ["<p>no kernel rows in this run</p>"]
    parts.append('<h2 id="train-step">Timeline of one training step</h2>')
    prof = result.get("train_profile")
    if prof:
        trace = prof.get("trace_file")
        parts.append(f"<p>{html.escape(prof['model'])}: step {prof.get('step_ms') or 0:.1f} ms "
                     "(profiled, not timed). "
                     + (f"Chrome trace beside this page: <code>{html.escape(trace)}</code> (open "
                        "it in Perfetto, ui.perfetto.dev, or chrome://tracing)." if trace else "")
                     + "</p>")
        parts += [_img(uri, "training step") for uri in train_figures(prof)]
    else:
        parts.append("<p>no training step in this run</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write(path: Path, result: dict[str, Any], series: dict[str, list[dict[str, Any]]],
          verdicts: list[dict[str, Any]] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(render(result, series, verdicts))
    tmp.replace(path)
    return path
