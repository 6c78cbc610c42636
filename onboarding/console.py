"""Terminal views (rich) of stage results."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from onboarding.opgraph import OpGraph
from onboarding.parse import PATTERN_LEGEND
from onboarding.report import human


def print_opgraph(g: OpGraph, console: Console) -> None:
    t = Table(title=f"{g.model}: blocks ({g.capture} capture)", show_lines=False)
    for col in ("kind", "n", "example path", "input", "evidence"):
        t.add_column(col, overflow="fold")
    counts = Counter(b.kind for b in g.blocks)
    for kind in sorted(counts):
        b = next(x for x in g.blocks if x.kind == kind)
        shape = "x".join(map(str, b.inputs[0].shape)) if b.inputs else "-"
        style = "bold red" if kind == "unknown" else None
        t.add_row(kind, str(counts[kind]), b.path, shape, "; ".join(b.evidence)[:90],
                  style=style)
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
