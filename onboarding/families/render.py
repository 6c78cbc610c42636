"""Rendering a family's Jinja template into module source: the search path (the family's folder,
the one it extends, the shared partials in `kernel_templates/_common/`), the render context, and
the deterministic literals it uses. Writing and importing rendered modules is
`onboarding.generate.templating`'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onboarding.families.spec import FamilySpec

COMMON_DIR = Path(__file__).resolve().parents[2] / "kernel_templates" / "_common"


def py_literal(value: Any) -> str:
    """Deterministic Python literal (dict keys sorted, floats by repr)."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite float {value!r} cannot be rendered")
        return repr(value)
    if isinstance(value, Mapping):
        items = ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in sorted(value.items()))
        return "{" + items + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py_literal(v) for v in value)
        if isinstance(value, tuple):
            return "(" + inner + ("," if len(value) == 1 else "") + ")"
        return "[" + inner + "]"
    raise TypeError(f"cannot render {type(value).__name__} as a literal")


def params_hash(family: str, variant: str, version: int, params: Mapping[str, Any],
                tag: str | None = None) -> str:
    parts = [family, variant, version, dict(params)] + ([tag] if tag is not None else [])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:8]


def search_path(spec: FamilySpec, base: FamilySpec | None, template_dir: Path | None
                ) -> tuple[Path, ...]:
    """Folders the family's templates are looked up in, first match wins.

    The family's own folder, then the one of the family it `extends`, then the shared partials.
    With `template_dir` (another revision's `kernel_templates/`) only that tree is searched, in
    the per-family layout or the flat one older revisions had; its missing `_common.py.j2`
    (a string inside this module before the per-family layout) comes from this tree.
    """
    if template_dir is None:
        return tuple(p for p in (spec.folder, base.folder if base else None, COMMON_DIR) if p)
    root = Path(template_dir)
    names = [spec.name] + ([base.name] if base else [])
    return (*(root / n for n in names), root, root / "_common", COMMON_DIR)


@functools.lru_cache(maxsize=64)
def _environment(search: tuple[Path, ...]):
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(p) for p in search]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["py"] = py_literal
    return env


def render_source(spec: FamilySpec, variant: str, params: Mapping[str, Any] | None = None, *,
                  base: FamilySpec | None = None, template_dir: Path | None = None,
                  tag: str | None = None) -> str:
    """`spec`'s template rendered for `variant` with `params` (validated first); `base` is the
    family `spec` extends. See `onboarding.generate.templating.render`."""
    resolved = spec.resolve(variant, params)
    digest = params_hash(spec.name, variant, spec.template_version, resolved, tag)
    context = {
        "family": spec.name,
        "variant": variant,
        "template": f"{spec.name}/{spec.template}",
        "template_version": spec.template_version,
        "params": resolved,
        "params_json": json.dumps(resolved, sort_keys=True),
        "op_name": f"{spec.name}_{variant}_{digest}",
        "tuning_space": {k: list(v) for k, v in spec.tuning_space.items()},
        "default_config": dict(spec.default_config),
        "shape_buckets": [b.as_dict() for b in spec.shape_buckets],
        **resolved,
    }
    env = _environment(search_path(spec, base, Path(template_dir) if template_dir else None))
    source = env.get_template(spec.template).render(**context)
    try:
        compile(source, f"<{spec.name}/{variant}>", "exec")
    except SyntaxError as e:
        raise RuntimeError(f"template {spec.template} rendered invalid Python: {e}") from e
    return source
