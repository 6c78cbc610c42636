"""Find, import and check kernel family folders.

A family folder holds `family.py` (which builds a `FamilySpec` named `FAMILY`), its Jinja
template(s) and any helper modules it imports relatively. Folders come from, in this order:

1. the built-in `kernel_templates/` (every sub-folder with a `family.py`);
2. `--families DIR` (repeatable; `add_dirs`), then the `ONBOARD_FAMILIES` path list (os.pathsep
   separated);
3. installed packages, through the entry-point group `onboard.families`: each entry point names a
   module or package, whose folder is searched like a `--families DIR`.

A DIR is either one family folder (it has `family.py`) or a folder of family folders. The folder's
name is the family's name. A folder whose family cannot be used (a syntax or import error, no
`FAMILY`, a spec that fails its own checks, a name that is not the folder's, a name already taken,
a variant whose template does not render at its defaults — checked for folders from outside the
repo; the built-in templates are rendered by the test suite) is skipped with a `FamilyWarning`
naming its path and the reason; the rest load as usual.

Each family imports as the package `onboard_families.<name>` (its folder as `__path__`), so
`family.py` may import its sibling modules relatively and another family's through
`family_module(name)`. Nothing is imported as a top-level package of the folder's own name.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from onboarding.errors import InputError
from onboarding.families.render import render_source
from onboarding.families.spec import FamilySpec
from onboarding.modpath import inside

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "kernel_templates"
ENV_VAR = "ONBOARD_FAMILIES"
ENTRY_POINT_GROUP = "onboard.families"
PACKAGE = "onboard_families"
SPEC_FILE = "family.py"


class FamilyWarning(UserWarning):
    """A family folder that was found but skipped (its path and the reason are in the message)."""


@dataclass(frozen=True, slots=True)
class Family:
    """A loaded family: its spec, its `family.py` module, and where it came from."""

    spec: FamilySpec
    module: ModuleType
    folder: Path
    origin: str  # "built-in", "--families", "ONBOARD_FAMILIES" or "entry point <name>"


@dataclass(frozen=True, slots=True)
class Skipped:
    folder: Path
    origin: str
    reason: str


class _Broken(Exception):
    """A family folder that cannot be used (message: why)."""


_EXTRA_DIRS: list[Path] = []


def add_dirs(dirs: list[str | Path]) -> None:
    """Search these folders too (`--families DIR`); the registry reloads on next use."""
    for d in dirs:
        path = Path(d).expanduser().resolve()
        if not path.is_dir():
            raise InputError(f"--families {d}: no such folder")
        if path not in _EXTRA_DIRS:
            _EXTRA_DIRS.append(path)
    reset()


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with `ONBOARD_FAMILIES` extended by the `--families`
    folders, so a worker subprocess sees the same families as its parent."""
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get(ENV_VAR, "").split(os.pathsep) if p]
    paths += [str(d) for d in _EXTRA_DIRS if str(d) not in paths]
    if paths:
        env[ENV_VAR] = os.pathsep.join(paths)
    return env


def _family_folders(root: Path) -> list[Path]:
    if (root / SPEC_FILE).is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(("_", ".")) and (p / SPEC_FILE).is_file())


def _entry_point_dirs() -> list[tuple[Path, str]]:
    out = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        origin = f"entry point {ep.name} ({ep.value})"
        try:
            target = ep.load()
        except Exception as exc:  # a broken installed package must not stop the run
            warnings.warn(f"family entry point {ep.name!r} = {ep.value!r}: cannot load it: "
                          f"{type(exc).__name__}: {exc}", FamilyWarning, stacklevel=3)
            continue
        path = getattr(target, "__file__", None) or target
        path = Path(str(path))
        out.append((path.parent if path.is_file() else path, origin))
    return out


def _sources() -> list[tuple[Path, str]]:
    """(family folder, origin) in search order."""
    roots: list[tuple[Path, str]] = [(BUILTIN_DIR, "built-in")]
    roots += [(d, "--families") for d in _EXTRA_DIRS]
    roots += [(Path(p).expanduser().resolve(), ENV_VAR)
              for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p]
    roots += _entry_point_dirs()
    out, seen = [], set()
    for root, origin in roots:
        folders = _family_folders(root)
        if not folders and origin != "built-in":
            warnings.warn(f"{origin} {root}: no family folder there (a folder with {SPEC_FILE}, "
                          "or folders of them)", FamilyWarning, stacklevel=3)
        for folder in folders:
            if folder.resolve() not in seen:
                seen.add(folder.resolve())
                out.append((folder.resolve(), origin))
    return out


class Registry:
    """The families of this process, imported on first use."""

    def __init__(self) -> None:
        self.candidates: dict[str, tuple[Path, str]] = {}
        self.loaded: dict[str, Family] = {}
        self.skipped: list[Skipped] = []
        self._importing: list[str] = []
        for folder, origin in _sources():
            name = folder.name
            if name in self.candidates:
                first, first_origin = self.candidates[name]
                self._skip(folder, origin, f"family name {name!r} is taken by {first} ({first_origin})")
                continue
            self.candidates[name] = (folder, origin)

    def _skip(self, folder: Path, origin: str, reason: str) -> None:
        self.skipped.append(Skipped(folder, origin, reason))
        warnings.warn(f"kernel family at {folder} ({origin}) skipped: {reason}", FamilyWarning,
                      stacklevel=4)

    def load_all(self) -> dict[str, Family]:
        for name in list(self.candidates):
            self.get(name, quiet=True)
        return self.loaded

    def get(self, name: str, quiet: bool = False) -> Family | None:
        if name in self.loaded:
            return self.loaded[name]
        if name not in self.candidates or name in self._importing:
            return None
        folder, origin = self.candidates[name]
        self._importing.append(name)
        try:
            family = _import_family(name, folder, origin)
            base = None
            if family.spec.extends:
                found = self.get(family.spec.extends)
                if found is None:
                    raise _Broken(f"it extends family {family.spec.extends!r}, which is not loaded")
                base = found.spec
            if origin != "built-in":
                # the built-in templates are rendered variant by variant by the test suite
                # (tests/test_templating.py); checking them here would cost every process ~0.5 s
                _check_renders(family.spec, base)
        except _Broken as exc:
            del self.candidates[name]
            _forget(name)
            self._skip(folder, origin, str(exc))
            return None
        finally:
            self._importing.pop()
        self.loaded[name] = family
        return family


def _package(name: str, folder: Path) -> None:
    if PACKAGE not in sys.modules:
        root = ModuleType(PACKAGE)
        root.__path__ = []  # a namespace for the family packages; nothing imports from it
        sys.modules[PACKAGE] = root
    pkg = ModuleType(f"{PACKAGE}.{name}")
    pkg.__path__ = [str(folder)]
    pkg.__package__ = pkg.__name__
    sys.modules[pkg.__name__] = pkg


def _forget(name: str) -> None:
    prefix = f"{PACKAGE}.{name}"
    for key in [k for k in sys.modules if inside(k, prefix)]:
        del sys.modules[key]


def _import_family(name: str, folder: Path, origin: str) -> Family:
    _package(name, folder)
    where = folder / SPEC_FILE
    try:
        module = importlib.import_module(f"{PACKAGE}.{name}.family")
    except SyntaxError as exc:
        raise _Broken(f"{exc.filename or where}:{exc.lineno}: syntax error: {exc.msg}") from exc
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise _Broken(f"importing {where} failed at {frame.filename}:{frame.lineno}: "
                      f"{type(exc).__name__}: {exc}") from exc
    spec = getattr(module, "FAMILY", None)
    if not isinstance(spec, FamilySpec):
        raise _Broken(f"{where} defines no FAMILY = FamilySpec(...) "
                      f"(found {type(spec).__name__})")
    if spec.name != name:
        raise _Broken(f"{where}: FAMILY.name is {spec.name!r}, but the folder is named {name!r} "
                      "(a family's folder carries its name)")
    if spec.folder is None or Path(spec.folder).resolve() != folder.resolve():
        raise _Broken(f"{where}: FAMILY.folder must be the family's own folder "
                      "(folder=Path(__file__).parent)")
    if not (folder / spec.template).is_file():
        raise _Broken(f"{where}: template {spec.template!r} is not in {folder}")
    return Family(spec, module, folder, origin)


def _check_renders(spec: FamilySpec, base: FamilySpec | None) -> None:
    for variant in spec.variants:
        try:
            defaults = spec.resolve(variant)
        except InputError:
            continue  # a variant that needs explicit params: rendered when a block asks for it
        try:
            render_source(spec, variant, defaults, base=base)
        except Exception as exc:
            raise _Broken(f"template {spec.template!r} does not render variant {variant!r} at its "
                          f"default parameters: {type(exc).__name__}: {exc}") from exc


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """This process's registry, built (and every family imported) on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
        _REGISTRY.load_all()
    return _REGISTRY


def reset() -> None:
    """Forget the loaded families (after `add_dirs`, or a test's change of ONBOARD_FAMILIES)."""
    global _REGISTRY
    if _REGISTRY is not None:
        for name in _REGISTRY.loaded:
            _forget(name)
    _REGISTRY = None


def families() -> dict[str, FamilySpec]:
    """Every usable family by name, in name order."""
    return {name: f.spec for name, f in sorted(registry().loaded.items())}


def get_family(family: str | FamilySpec) -> FamilySpec:
    if isinstance(family, FamilySpec):
        return family
    return _loaded(family).spec


def family_module(name: str) -> ModuleType:
    """The `family.py` module of family `name` (its reference, sample inputs and helpers)."""
    return _loaded(name).module


def skipped() -> list[Skipped]:
    """Family folders found but not usable, with the reason (also issued as FamilyWarning)."""
    return list(registry().skipped)


def _loaded(name: str) -> Family:
    found = registry().get(name)
    if found is None:
        raise InputError(f"unknown kernel family {name!r}; known: {sorted(registry().loaded)}")
    return found


def training_kernel(kind: str) -> tuple[str, str] | None:
    """(family, variant) of the first family, in name order, whose `training_variants` serve
    `kind` (what the training stage attaches itself); None when no family does."""
    for name, spec in families().items():
        if kind in spec.training_variants:
            return name, spec.training_variants[kind]
    return None


def refused_by(block: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every family whose `refusal` says its binding would leave ``block`` unpatched, as (family
    name, {"serves": the part or None for the block's core, "reason"}); such a family's `match`
    does not accept the block."""
    out = []
    for name, spec in families().items():
        if spec.refusal is not None and (r := spec.refusal(block)) is not None:
            out.append((name, {"serves": r.get("serves"), "reason": str(r.get("reason", ""))}))
    return out


def match_block(block: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every family whose `match` accepts `block`, as (family name, {"variant", "params"})."""
    out = []
    for name, spec in families().items():
        if spec.match is not None and (m := spec.match(block)) is not None:
            # a block may need several variants of one family (sparse attention: the indexer
            # and the gathered attention); the extra ones come under "also"
            for one in (m, *m.get("also", ())):
                # "note": what the family adds to coverage's reason (a choice it makes by shape)
                # "serves": the part of the block it serves, when not the whole block (an
                # attention core written out inside a block whose projections stay GEMMs)
                out.append((name, {"variant": one["variant"], "params": one["params"],
                                   **{k: one[k] for k in ("note", "serves") if one.get(k)}}))
    return out
