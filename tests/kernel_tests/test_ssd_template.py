"""The ssd template's layout: ssd.py.j2 includes its partials (`_ssd_*.py.j2`, each under the
project's file-size habit), and a render is the template's text with every include expanded in
place. Checked by the top-level functions and classes: those of the rendered module, in order,
are those of the template's text once its includes are expanded (recursively, found as the
renderer finds them), so no partial is left out, repeated or moved; every partial in the family's
folder is reached from ssd.py.j2 and gives the render at least one of its definitions; and the
render compiles. On the CPU, no kernel runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from onboarding.families import get_family
from onboarding.families.render import search_path
from onboarding.generate import templating

SPEC = get_family("ssd")
INCLUDE = re.compile(r'^\{% include "([\w.]+)" %\}$')
DEFINITION = re.compile(r"^(?:def|class) (\w+)")


def _find(name: str) -> Path:
    """`name` as the renderer's loader finds it (the family's folder, then the shared partials)."""
    return next(p / name for p in search_path(SPEC, None, None) if (p / name).is_file())


def _expanded(name: str, seen: list[Path]) -> list[str]:
    """Top-level definitions of template `name`'s text with its includes expanded in place;
    `seen` collects the files read."""
    path = _find(name)
    seen.append(path)
    names: list[str] = []
    for line in path.read_text().splitlines():
        if m := INCLUDE.match(line.strip()):
            names += _expanded(m.group(1), seen)
        elif m := DEFINITION.match(line):
            names.append(m.group(1))
    return names


def _rendered(chunk_size: int) -> list[str]:
    source = templating.render(SPEC.name, "scan", {"chunk_size": chunk_size})
    tree = ast.parse(compile(source, "<ssd>", "exec", ast.PyCF_ONLY_AST))
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


def test_partials_are_under_the_size_habit():
    for path in [SPEC.folder / SPEC.template, *sorted(SPEC.folder.glob("_*.py.j2"))]:
        assert len(path.read_text().splitlines()) <= 800, path.name


@pytest.mark.parametrize("chunk_size", [8, 64, 256])
def test_render_is_the_template_with_its_includes_expanded(chunk_size):
    seen: list[Path] = []
    expected = _expanded(SPEC.template, seen)
    assert _rendered(chunk_size) == expected
    partials = sorted(SPEC.folder.glob("_*.py.j2"))
    own_files = {p for p in seen if p.parent == SPEC.folder}
    assert partials and own_files == {SPEC.folder / SPEC.template, *partials}
    assert len(seen) == len(set(seen)), "a partial is included twice"
    for p in partials:
        own = [m.group(1) for line in p.read_text().splitlines() if (m := DEFINITION.match(line))]
        assert own and set(own) <= set(expected), p.name
