"""The built-in training corpus: docstring/code pairs from the Python standard library's source.

``python -m onboarding.train.corpus`` writes ``onboarding/data/stdlib_pairs.jsonl``: one JSON
object per function or method that has a docstring, ``prompt`` = the docstring, ``response`` =
the function's source without its docstring (dedented), ``source`` = ``module:qualname``. Files
are read in sorted order and the functions are chosen by a hash of their ``source`` name, so the
output depends only on the stdlib version (recorded in the companion ``.meta.json``). The text
is the CPython standard library's, under the PSF license.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sysconfig
import textwrap
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "stdlib_pairs.jsonl"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3",
             "__pycache__", "ensurepip", "turtledemo", "tkinter", "idlelib", "pydoc_data"}
MAX_BYTES = 3_000_000
DOC_CHARS = (40, 1200)
MAX_LINES = 60


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _pair(lines: list[str], node: ast.FunctionDef) -> tuple[str, str] | None:
    doc = ast.get_docstring(node, clean=True)
    if not doc or not DOC_CHARS[0] <= len(doc) <= DOC_CHARS[1] or not node.body:
        return None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    if node.end_lineno - first + 1 > MAX_LINES or len(node.body) < 2:
        return None  # over-long, or nothing but the docstring
    doc_node = node.body[0]
    body = lines[first - 1:doc_node.lineno - 1] + lines[doc_node.end_lineno:node.end_lineno]
    code = textwrap.dedent("".join(body)).strip("\n")
    return doc, code + "\n"


def extract(stdlib: Path) -> list[dict[str, str]]:
    """Every eligible pair in ``stdlib``, in sorted file and source order."""
    rows = []
    for file in sorted(stdlib.rglob("*.py")):
        rel = file.relative_to(stdlib)
        if any(part in SKIP_DIRS for part in rel.parts):
            continue
        try:
            text = file.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        lines = text.splitlines(keepends=True)
        for qualname, node in _functions(tree):
            pair = _pair(lines, node)
            if pair is not None:
                rows.append({"prompt": pair[0], "response": pair[1],
                             "source": f"{module}:{qualname}"})
    return rows


def select(rows: list[dict[str, str]], max_bytes: int = MAX_BYTES) -> list[dict[str, str]]:
    """A deterministic spread over the whole stdlib up to ``max_bytes`` of JSONL."""
    def key(r):
        return hashlib.sha256(r["source"].encode()).hexdigest()

    chosen, size = [], 0
    for r in sorted(rows, key=key):
        n = len(json.dumps(r)) + 1
        if size + n > max_bytes:
            continue
        chosen.append(r)
        size += n
    return sorted(chosen, key=lambda r: r["source"])


def write(out: Path = DEFAULT_OUT, max_bytes: int = MAX_BYTES) -> tuple[Path, int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = select(extract(stdlib), max_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    meta = {"python": platform.python_version(), "rows": len(rows), "bytes": out.stat().st_size,
            "license": "Python Software Foundation License (CPython standard library text)",
            "generator": "python -m onboarding.train.corpus"}
    out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out, len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--max-bytes", type=int, default=MAX_BYTES)
    args = ap.parse_args()
    path, n = write(args.out, args.max_bytes)
    print(f"wrote {n} pairs to {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
