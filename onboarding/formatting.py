"""Text helpers shared by the run report and the stages that write its sections: human-readable
counts and Markdown tables."""

from __future__ import annotations

from typing import Any


def human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def count(n: Any, one: str, many: str | None = None) -> str:
    """``n`` and the noun in its number: "1 study", "11 studies", "- trials" (None: unknown)."""
    return f"{'-' if n is None else n} {one if n == 1 else (many or one + 's')}"


def or_dash(v: Any, fmt: str) -> str:
    """``v`` formatted with ``fmt``, or an em dash for a value that was not measured (None)."""
    return "\u2014" if v is None else format(v, fmt)


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with "…" where it was
    cut: a recorded reason (a rejected patch's error) stays short without ending mid-word. A
    text with no space in its last part is cut where the limit falls."""
    if len(text) <= limit:
        return text
    head = text[:limit - 1]
    space = head.rstrip().rfind(" ")
    if space >= limit // 2:
        head = head[:space]
    return head.rstrip(" ,;:") + "…"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
