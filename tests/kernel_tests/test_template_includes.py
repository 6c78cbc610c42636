"""The layout of the templates split into Jinja includes (ssd, gated_delta, kimi_delta,
moe_experts): each family's template includes its partials (`_*.py.j2` in its folder, each under
the project's file-size habit), and a render is the template's text with every include expanded
in place. Checked by the top-level functions and classes: those of a rendered module, in order,
are those of the template's text once its includes are expanded (recursively, found as the
renderer finds them), leaving out only ones under a Jinja block (`{% if %}`, `{% macro %}`) that
the render's parameters skip, so no partial is left out, repeated or moved; every partial in the
family's folder is reached from its template, once, and holds at least one top-level
definition; every definition of the expanded text has its name in one of the renders below (no
partial is dead text); and the render compiles. A name with a Jinja expression in it
(`def {{ P }}_kernel`) matches any identifier there. On the CPU, no kernel runs."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from onboarding.families import get_family
from onboarding.families.render import search_path
from onboarding.generate import templating

INCLUDE = re.compile(r'^\{% include "([\w.]+)" %\}$')
DEFINITION = re.compile(r"^(?:def|class) ((?:\w|\{\{[^}]*\}\})+)")
JINJA_EXPR = re.compile(r"\{\{[^}]*\}\}")
BLOCK_TAG = re.compile(r"\{%-?\s*(\w+)")
OPENS = {"if", "for", "macro", "call", "filter", "with", "block"}

# The renders checked per family, as (variant, params): between them, every Jinja branch that
# holds a top-level definition (ssd: none; gated_delta.py.j2's KDA blocks: kimi_delta's renders;
# moe_experts: gated or not, LoRA or not).
RENDERS = {
    "ssd": [("scan", {"chunk_size": cs}) for cs in (8, 64, 256)],
    "gated_delta": [("chunk", {"chunk_size": 16}), ("chunk", {"chunk_size": 64, "qk_l2norm": True})],
    "kimi_delta": [("chunk", {"chunk_size": 16}), ("chunk", {"chunk_size": 64, "recompute": True})],
    "moe_experts": [("swiglu", {}), ("swiglu", {"bias": True, "limit": 7.0}), ("swiglu_lora", {}),
                    ("mlp", {"activation": "gelu_tanh"})],
}
FAMILIES = sorted(RENDERS)
CASES = [pytest.param(fam, v, p, id=f"{fam}-{v}-{i}")
         for fam in FAMILIES for i, (v, p) in enumerate(RENDERS[fam])]


@dataclass(frozen=True)
class Definition:
    """One top-level `def`/`class` line of a template file, and whether a Jinja block encloses it
    (in its file or around the include that reached it)."""

    path: Path
    line: int
    pattern: re.Pattern
    conditional: bool


def _find(spec, name: str) -> Path:
    """`name` as the renderer's loader finds it (the family's folder, the one it extends, then the
    shared partials)."""
    base = get_family(spec.extends) if spec.extends else None
    return next(p / name for p in search_path(spec, base, None) if (p / name).is_file())


def _expanded(spec, name: str, seen: list[Path], outer: int = 0) -> list[Definition]:
    """Top-level definitions of template `name`'s text with its includes expanded in place;
    `seen` collects the files read, `outer` the Jinja blocks open around the include."""
    path = _find(spec, name)
    seen.append(path)
    defs: list[Definition] = []
    depth = outer
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if m := INCLUDE.match(line.strip()):
            defs += _expanded(spec, m.group(1), seen, depth)
            continue
        if m := DEFINITION.match(line):
            name_re = r"\w+".join(re.escape(s) for s in JINJA_EXPR.split(m.group(1)))
            defs.append(Definition(path, i, re.compile(name_re), depth > 0))
        for tag in BLOCK_TAG.findall(line):
            depth += tag in OPENS
            depth -= tag.startswith("end")
    return defs


@cache
def _rendered(family: str, variant: str, params: tuple) -> list[str]:
    source = templating.render(family, variant, dict(params))
    tree = ast.parse(compile(source, f"<{family}>", "exec", ast.PyCF_ONLY_AST))
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


def _matched(expected: list[Definition], rendered: list[str]) -> list[Definition]:
    """The entries of `expected` that `rendered` takes, in order: every unconditional one, in
    place; a conditional one only where the render has it. Fails where the render's definitions
    are not such a selection of the expanded text's."""
    taken: list[Definition] = []
    names = iter(rendered)
    name = next(names, None)
    for d in expected:
        if name is not None and d.pattern.fullmatch(name):
            taken.append(d)
            name = next(names, None)
        else:
            assert d.conditional, f"{d.path.name}:{d.line} ({d.pattern.pattern}) missing from the render at {name!r}"
    assert name is None, f"{name!r} rendered but not where the expanded template has it"
    return taken


@pytest.mark.parametrize("family", FAMILIES)
def test_partials_are_under_the_size_habit(family):
    spec = get_family(family)
    for path in [spec.folder / spec.template, *sorted(spec.folder.glob("_*.py.j2"))]:
        assert len(path.read_text().splitlines()) <= 800, path.name


@pytest.mark.parametrize("family, variant, params", CASES)
def test_render_is_the_template_with_its_includes_expanded(family, variant, params):
    spec = get_family(family)
    seen: list[Path] = []
    expected = _expanded(spec, spec.template, seen)
    _matched(expected, _rendered(family, variant, tuple(sorted(params.items()))))
    partials = sorted(spec.folder.glob("_*.py.j2"))
    own_files = {p for p in seen if p.parent == spec.folder}
    assert partials and own_files == {spec.folder / spec.template, *partials}
    assert len(seen) == len(set(seen)), "a partial is included twice"
    for p in partials:
        assert any(d.path == p for d in expected), p.name


def test_every_definition_is_rendered():
    """Every top-level definition of the expanded templates (conditional ones included) has its
    name in a render of one of the families whose template reaches its file (gated_delta.py.j2's
    KDA blocks: kimi_delta's): no partial, or branch of one, holds text that no render reaches.
    By name: a render does not say which of two same-named branches it took."""
    names: dict[Path, set[str]] = {}
    defs: set[Definition] = set()
    for family in FAMILIES:
        spec = get_family(family)
        seen: list[Path] = []
        defs |= set(_expanded(spec, spec.template, seen))
        rendered = {n for v, p in RENDERS[family] for n in _rendered(family, v, tuple(sorted(p.items())))}
        for path in seen:
            names.setdefault(path, set()).update(rendered)
    missing = sorted(f"{d.path.parent.name}/{d.path.name}:{d.line}" for d in defs
                     if not any(d.pattern.fullmatch(n) for n in names[d.path]))
    assert not missing, missing
