"""The code's layout rules: no central module names a kernel family (everything about a family
lives in its folder), and the library's import graph has no cycles."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from onboarding.families import families
from onboarding.graph.opgraph import BLOCK_KINDS

ROOT = Path(__file__).resolve().parents[1]
CENTRAL = sorted([*(ROOT / "onboarding").rglob("*.py"), *(ROOT / "agents").rglob("*.py")])
# Literals that equal a family's name but mean something else, each with the reason.
NOT_A_FAMILY = {
    ("onboarding/graph/classify.py", "conv1d"): "the ATen op aten.conv1d, which the classifier matches",
    ("onboarding/graph/_records.py", "conv1d"): "the ATen op aten.conv1d, which the classifier matches",
    ("onboarding/cli/train.py", "lora"): "the LoRA adapters being trained (--lora-rank, "
                                            "--expert-lora, ...), not the kernel family",
    ("onboarding/train/flops.py", "lora"): "PEFT's adapter parameter names (lora_A, lora_B)",
    ("onboarding/train/lora.py", "lora"): "the --lora-targets option named in an error, not the "
                                          "kernel family",
    ("onboarding/cli/plan.py", "lora"): "the plan's training mode (--lora, --lora-rank, "
                                        "--expert-lora), not the kernel family",
    ("onboarding/plan/config.py", "lora"): "the plan's training mode, LoRA or full",
    ("onboarding/load/compat.py", "conv1d"): "the PyPI package causal-conv1d that remote code "
                                             "imports, named when it is missing",
}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def family_names_in(path: Path, names: list[str]) -> list[tuple[int, str, str]]:
    """(line, name, literal) for each string literal of `path`'s code (docstrings and comments
    aside) that names a family: the name as a whole word, not inside a dotted name (the block
    kind `linear_attention.gated_delta` is the classifier's vocabulary, not a family), and not a
    literal that is exactly a block kind (`rope`)."""
    pattern = re.compile(r"(?<![.\w])(" + "|".join(map(re.escape, names)) + r")(?![.\w])")
    source = path.read_text()
    docs = _docstring_lines(ast.parse(source))
    rel = path.relative_to(ROOT).as_posix()
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.STRING or tok.start[0] in docs:
            continue
        literal = ast.literal_eval(tok.string) if not tok.string.lstrip("rbuRBU").startswith(("f", "F")) \
            else tok.string
        if isinstance(literal, str) and literal in BLOCK_KINDS:
            continue
        for m in pattern.finditer(tok.string):
            if (rel, m.group(1)) not in NOT_A_FAMILY:
                hits.append((tok.start[0], m.group(1), tok.string))
    return hits


def test_the_scanner_finds_what_it_should(tmp_path):
    """The check below can fail: a literal naming a family is found, docstrings, comments, block
    kinds and longer identifiers are not."""
    mod = ROOT / "onboarding" / "_layout_probe_never_committed.py"
    names = ["rmsnorm", "gated_delta"]
    try:
        mod.write_text('"""rmsnorm in a docstring."""\n'
                       'A = "rmsnorm"  # rmsnorm in a comment\n'
                       'B = f"kernels/{x}/gated_delta/chunk"\n'
                       'C = "linear_attention.gated_delta"\n'
                       'D = "rmsnorm_like and my_gated_delta"\n'
                       'E = ("rope", "norm.rms")\n')
        found = [(line, name) for line, name, _ in family_names_in(mod, names)]
        assert found == [(2, "rmsnorm"), (3, "gated_delta")]
    finally:
        mod.unlink()


@pytest.mark.parametrize("path", CENTRAL, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_central_module_names_a_family(path):
    hits = family_names_in(path, sorted(families()))
    assert not hits, "\n".join(f"{path.relative_to(ROOT)}:{line}: {literal} names family {name!r} "
                               "(move that knowledge into the family's folder)"
                               for line, name, literal in hits)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root_packages=("onboarding", "agents")) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any depth in the file: lazy imports inside
    functions count too, since they are how cycles are usually hidden; imports under
    `if TYPE_CHECKING:` do not, since they never run)."""
    paths = [p for pkg in root_packages for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        tree = ast.parse(path.read_text())
        # `if TYPE_CHECKING:` imports never run: annotations are not import cycles
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                # the deepest project module the target names
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = GREY
        stack.append(n)
        for m in sorted(graph[n]):
            if color[m] == GREY:
                return stack[stack.index(m):] + [m]
            if color[m] == WHITE and (c := visit(m)):
                return c
        stack.pop()
        color[n] = BLACK
        return None

    for n in sorted(graph):
        if color[n] == WHITE and (c := visit(n)):
            return c
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_import_graph_has_no_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
