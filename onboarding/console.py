"""Terminal views (rich) of stage results."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from onboarding.opgraph import OpGraph
from onboarding.parse import PATTERN_LEGEND
from onboarding.report import human


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
