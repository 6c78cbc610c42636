"""Terminal views (rich) of stage results."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from onboarding.generate.candidates import Candidate
from onboarding.graph.opgraph import OpGraph
from onboarding.graph.parse import PATTERN_LEGEND
from onboarding.coverage import Coverage
from onboarding.formatting import human


def print_opgraph(g: OpGraph, console: Console) -> None:
    wide = console.width >= 120
    t = Table(title=f"{g.model}: blocks ({g.capture} capture)")
    t.add_column("kind", no_wrap=True, min_width=28)
    t.add_column("n", justify="right", no_wrap=True)
    t.add_column("input", no_wrap=True)
    t.add_column("example path", overflow="fold")
    if wide:
        t.add_column("main evidence", overflow="ellipsis", no_wrap=True, max_width=50)
    counts = Counter(b.kind for b in g.blocks)
    for kind in sorted(counts):
        b = next(x for x in g.blocks if x.kind == kind)
        shape = "x".join(map(str, b.inputs[0].shape)) if b.inputs else "-"
        row = [kind, str(counts[kind]), shape, b.path]
        if wide:
            row.append(b.evidence[0] if b.evidence else "")
        t.add_row(*row, style="bold red" if kind == "unknown" else None)
    console.print(t)
    console.print(f"layer pattern: [bold]{g.layer_pattern}[/bold]  [dim]({PATTERN_LEGEND})[/dim]")
    full = g.param_counts["full"]
    console.print(
        f"full-size parameters: [bold]{human(full['total'])}[/bold] total, "
        f"{human(full['active'])} active per token "
        f"({human(full['active_without_embeddings'])} without embeddings/lm_head); "
        f"proxy {human(g.param_counts['proxy']['total'])}")
    if g.capture != "export":
        console.print(f"[yellow]{g.capture_note}[/yellow]")


def print_coverage(cov: Coverage, console: Console) -> None:
    t = Table(title=f"{cov.model}: coverage")
    t.add_column("kind", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("n", justify="right", no_wrap=True)
    t.add_column("shape", no_wrap=True)
    t.add_column("op: how", overflow="fold", min_width=24)
    groups: dict[tuple, list] = {}
    for e in cov.entries:
        groups.setdefault((e.kind, e.status, e.op, e.variant), []).append(e)
    colors = {"kernel": "green", "template": "cyan", "generated": "magenta",
              "inductor": "yellow", "torch_fast": "blue", "uncovered": "red"}
    for (kind, status, op, variant), es in sorted(groups.items()):
        how = f"{es[0].family}/{variant}" if es[0].family else es[0].reason
        shape = "x".join(map(str, es[0].shapes[0])) if es[0].shapes else "-"
        t.add_row(kind, f"[{colors[status]}]{status}[/]", str(len(es)), shape, f"{op}: {how}")
    console.print(t)
    counts = {s: n for s in colors  # the decision loop's statuses where they occur
              if (n := len(cov.by_status(s))) or s not in ("generated", "inductor")}
    console.print("  ".join(f"[{colors[s]}]{s}[/] {n}" for s, n in counts.items()))


def print_candidates(cands: list[Candidate], console: Console) -> None:
    t = Table(title="generated candidates (forward + all gradients vs reference)")
    t.add_column("family/variant", no_wrap=True)
    t.add_column("params", overflow="fold")
    t.add_column("blocks", justify="right")
    t.add_column("status", overflow="fold")
    t.add_column("worst rel. RMS", no_wrap=True)
    for c in cands:
        worst = max((x.get("rel_rms") or 0.0 for x in c.checks), default=float("nan"))
        status = "[green]passed[/]" if c.status == "passed" else f"[red]{c.status}[/] {c.error}"
        params = " ".join(f"{k}={v}" for k, v in sorted(c.params.items()) if v is not None)
        t.add_row(f"{c.family}/{c.variant}", params, str(len(c.blocks)), status, f"{worst:.1e}")
    console.print(t)


def print_regression(rows: list[tuple[str, str, str, str]], console: Console, *,
                     title: str) -> None:
    """The facts `onboard regress` checked: golden value, this run's, ok or changed."""
    t = Table(title=title)
    t.add_column("fact", no_wrap=True)
    t.add_column("golden", overflow="fold")
    t.add_column("this run", overflow="fold")
    t.add_column("", no_wrap=True)
    for fact, gold, cur, status in rows:
        color = {"ok": "green", "new": "yellow"}.get(status, "red")
        t.add_row(fact, gold, cur, f"[{color}]{status}[/]")
    console.print(t)
