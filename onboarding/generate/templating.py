"""Render kernel templates into self-contained modules, write them, and import them by path.

A family (`onboarding.families`) declares its template, a typed parameter schema, its variants,
tuning space and shape buckets as a `FamilySpec`. `render(family, variant, params)` validates
the parameters first (a bad parameter raises `InputError` naming it; nothing is written), then
renders the template in the family's folder (`kernel_templates/<family>/`, or wherever a
plug-in family lies; shared partials come from `kernel_templates/_common/`) deterministically:
the same parameters give a byte-identical module. `write_module` stores it as `kernels/<family>/<variant>.py` and
`load_module` imports such a file by path under a private name
(`onboard_kernels.<family>.<variant>_<sha>`), never as a top-level `kernels` package (that name
belongs to the Hugging Face kernel hub). Rendered source must live in a file: Triton's `@jit`
reads the function source back, so `exec()` of a string fails outside the interpreter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from onboarding.errors import InputError
from onboarding.families import FamilySpec, get_family
from onboarding.families.render import render_source

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "kernel_templates"
MODULE_PREFIX = "onboard_kernels"
_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")


def render(
    family: str | FamilySpec,
    variant: str,
    params: Mapping[str, Any] | None = None,
    *,
    template_dir: Path | None = None,
    tag: str | None = None,
) -> str:
    """Validate `params` for `family`/`variant` and return the rendered module source.

    `template_dir`: templates other than kernel_templates/ (another revision's); `tag` then
    keeps the module's custom op names apart from the tree's (they share one op registry).
    Raises InputError (naming the parameter) on a bad family, variant or parameter; raises
    RuntimeError if the template produced invalid Python (a template bug).
    """
    spec = get_family(family)
    base = get_family(spec.extends) if spec.extends else None
    return render_source(spec, variant, params, base=base, template_dir=template_dir, tag=tag)


def module_path(root: Path | str, family: str, variant: str) -> Path:
    """Where a rendered module lives: `<root>/<family>/<variant>.py`."""
    for what, name in (("family", family), ("variant", variant)):
        if not _IDENT.match(name):
            raise InputError(f"{what} {name!r} is not a lowercase identifier")
    return Path(root) / family / f"{variant}.py"


def write_module(source: str, path: Path | str, *, overwrite: bool = False) -> Path:
    """Write rendered `source` to `path` (atomically); identical existing content is a no-op.

    Refuses (InputError) to replace a file with different content unless `overwrite=True`.
    No `__init__.py` is created: rendered modules are loaded by path only.
    """
    path = Path(path)
    if path.suffix != ".py":
        raise InputError(f"rendered module path must end in .py: {path}")
    if path.exists():
        if path.read_text() == source:
            return path
        if not overwrite:
            raise InputError(f"{path} exists with different content (pass overwrite=True to replace)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


_LOADED: dict[str, ModuleType] = {}
_OP_OWNERS: dict[str, str] = {}  # custom op name -> sha of the source that registered it
_OP_NAME_LINE = re.compile(r'^OP_NAME = "([^"]+)"$', re.M)
# one load at a time: two threads loading one source at once (a run's studies start together)
# both missed the cache, and the second registration destroyed the first's custom op
_LOAD_LOCK = threading.RLock()


def load_module(path: Path | str) -> ModuleType:
    """Import a rendered module by path under `onboard_kernels.<family>.<variant>_<sha12>`.

    Modules are cached by content: loading the same source twice returns the same module (its
    custom ops can be registered only once per process).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise InputError(f"no rendered module at {path}")
    data = path.read_bytes()
    with _LOAD_LOCK:
        return _load(path, data)


def _load(path: Path, data: bytes) -> ModuleType:
    sha = hashlib.sha256(data).hexdigest()[:12]
    if sha in _LOADED:
        return _LOADED[sha]
    family = re.sub(r"\W", "_", path.parent.name) or "unknown"
    variant = re.sub(r"\W", "_", path.stem)
    name = f"{MODULE_PREFIX}.{family}.{variant}_{sha}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    text = data.decode()
    op = _OP_NAME_LINE.search(text)
    sys.modules[name] = module
    try:
        if op and _OP_OWNERS.setdefault(op.group(1), sha) != sha:
            # Another source (an edited or re-rendered module) registered this op name in this
            # process already. torch replaces a custom op defined again under its name, which
            # leaves the first module calling a destroyed op: this one gets its own name.
            text = text[:op.end(1)] + f"_{sha}" + text[op.end(1):]
            exec(compile(text, str(path), "exec"), module.__dict__)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _LOADED[sha] = module
    return module


def render_to(
    root: Path | str,
    family: str | FamilySpec,
    variant: str,
    params: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
    template_dir: Path | None = None,
    tag: str | None = None,
) -> Path:
    """Render (`render`'s arguments) and write `<root>/<family>/<variant>.py`; returns the path."""
    spec = get_family(family)
    source = render(spec, variant, params, template_dir=template_dir, tag=tag)
    return write_module(source, module_path(root, spec.name, variant), overwrite=overwrite)
