"""What a run directory proposes for review: the passing kernel modules, family by family, with
the rows that back them (checks, alignment, tuning, benchmarks), read only from the run's own
files. Nothing that failed a correctness check is proposed, and nothing that imports more than
torch, triton and the standard library."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onboarding.errors import InputError

ALLOWED_IMPORTS = ("torch", "triton")  # besides the standard library
GENERATED_DIR = Path("generated") / "families"  # LLM-written family folders of a run
GENERATED_LIST = Path("generated") / "pr_candidates.json"


@dataclass(kw_only=True)
class KernelModule:
    """One rendered module proposed under `kernels/<family>/<name>`."""

    family: str
    variant: str
    params: dict[str, Any]
    source: Path  # the candidate file in the run directory
    blocks: list[str]
    shapes: list[list[int]]
    checks: list[dict[str, Any]]
    tuned: Path | None = None  # <module>.tuned.json, when tuned on a GPU
    tuned_gpu: str | None = None
    entry: str = ""  # the user-facing call, "name(arg, ...)"

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def label(self) -> str:
        return f"{self.family}/{self.source.stem}"


@dataclass(kw_only=True)
class FamilyChange:
    """One commit: a family's modules, its generated folder (when the run wrote the family)."""

    family: str
    modules: list[KernelModule] = field(default_factory=list)
    folder: Path | None = None  # <run_dir>/generated/families/<family>
    tests: list[Path] = field(default_factory=list)  # tests the generated family came with


@dataclass(kw_only=True)
class Proposal:
    run_dir: Path
    model: str
    model_ref: str
    overrides: dict[str, Any]
    families: list[FamilyChange]
    left_out: list[tuple[str, str]]  # (candidate, why it is not proposed)
    environment: dict[str, Any]
    alignment: dict[str, Any] | None
    tune: dict[str, Any] | None
    bench: list[dict[str, Any]]  # benchmark rows recorded in the run directory

    @property
    def modules(self) -> list[KernelModule]:
        return [m for f in self.families for m in f.modules]


def imports_of(source: str) -> list[str]:
    """Top-level package names a module imports (anywhere in it), plus '<dynamic import>' for
    `__import__` / `importlib` calls that an AST cannot follow."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            fn = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if fn in ("__import__", "import_module"):
                names.append("<dynamic import>")
    return list(dict.fromkeys(names))


def foreign_imports(source: str) -> list[str]:
    """What a module imports besides torch, triton and the standard library (empty: it is
    self-contained)."""
    return [n for n in imports_of(source) if n != "__future__" and n not in ALLOWED_IMPORTS
            and n not in sys.stdlib_module_names]


def entry_signature(source: str) -> str:
    """`name(arg, ...)` of the module's `entry = <function>`, read from its source."""
    tree = ast.parse(source)
    target = None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "entry"
                                                  for t in node.targets)
                and isinstance(node.value, ast.Name)):
            target = node.value.id
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == (target or "entry"):
            args = [a.arg for a in node.args.args]
            args += [f"{a.arg}=..." for a in node.args.kwonlyargs]
            n_def = len(node.args.defaults)
            if n_def:
                args[len(node.args.args) - n_def:len(node.args.args)] = [
                    f"{a}={ast.unparse(d)}" for a, d in
                    zip(args[len(node.args.args) - n_def:len(node.args.args)],
                        node.args.defaults, strict=True)]
            return f"{node.name}({', '.join(args)})"
    return "entry(...)"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: unreadable ({exc})") from None


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise InputError(f"unknown RUN_DIR {run_dir}: no such directory")
    if not (run_dir / "candidates.json").is_file():
        raise InputError(f"RUN_DIR {run_dir}: not an onboard run directory with candidate "
                         "kernels (no candidates.json; `onboard run` writes one)")


def _alignment_failures(alignment: dict[str, Any] | None) -> dict[tuple[str, str], str]:
    """(block path, family) -> the failing verdict, for blocks that ran our kernel and failed."""
    from onboarding.align.core import FAILING

    if not alignment:
        return {}
    active = {(p["path"], p["family"]) for p in alignment.get("patches", [])
              if p.get("status") == "active"}
    out = {}
    for b in alignment.get("blocks", []):
        for d in ("fwd", "bwd"):
            v = (b.get(d) or {}).get("verdict")
            if v in FAILING:
                for path, fam in active:
                    if path == b["path"]:
                        out[(path, fam)] = f"{d} {v}"
    return out


def _tuned(source: Path) -> tuple[Path | None, str | None]:
    """The module's tuned.json when it was tuned on a GPU (an interpreter's timings are not
    proposed)."""
    f = source.with_name(source.stem + ".tuned.json")
    if not f.is_file():
        return None, None
    data = _json(f)
    gpus = {str(v.get("gpu")) for v in _entries(data)} or {str(data.get("gpu"))}
    gpus.discard("None")
    real = sorted(g for g in gpus if g and "cpu" not in g.lower() and "interpret" not in g.lower())
    return (f, ", ".join(real)) if real else (None, None)


def _entries(data: Any) -> list[dict[str, Any]]:
    """Every dict in a tuned.json (its layout is the tuner's; we only look for "gpu" keys)."""
    out, stack = [], [data]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if "gpu" in x:
                out.append(x)
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return out


def _bench_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Benchmark rows the run recorded (`bench*.json` in the run directory or its bench/)."""
    rows = []
    for f in sorted([*run_dir.glob("bench*.json"), *run_dir.glob("bench/*.json")]):
        data = _json(f)
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            ceil = data.get("ceilings") or {}
            rows += [{**r, "_ceilings": ceil, "_file": f.name} for r in data["rows"]]
    return rows


def _generated(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Family name -> its entry in generated/pr_candidates.json (when the run wrote families)."""
    f = run_dir / GENERATED_LIST
    if not f.is_file():
        return {}
    data = _json(f)
    items = data.get("candidates", data.get("families", [])) if isinstance(data, dict) else data
    out = {}
    for it in items if isinstance(items, list) else []:
        if isinstance(it, dict) and it.get("family"):
            out[it["family"]] = it
    return out


def collect(run_dir: Path, reviewed: Callable[[str], str | None] | None = None) -> Proposal:
    """What `run_dir` proposes. `reviewed(path)`: the content at a repository path in the base
    branch, or None (an identical module is not proposed again)."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    reviewed = reviewed or (lambda path: None)
    model = _json(run_dir / "model.json") if (run_dir / "model.json").is_file() else {}
    alignment = (_json(run_dir / "alignment.json")
                 if (run_dir / "alignment.json").is_file() else None)
    tune = _json(run_dir / "tune.json") if (run_dir / "tune.json").is_file() else None
    failed_blocks = _alignment_failures(alignment)
    generated = _generated(run_dir)
    fams: dict[str, FamilyChange] = {}
    left_out: list[tuple[str, str]] = []
    for c in _json(run_dir / "candidates.json"):
        src = Path(c["path"])
        if not src.is_absolute() or not src.is_file():  # a moved run dir: same relative place
            src = run_dir / "candidates" / c["family"] / Path(c["path"]).name
        label = f"{c['family']}/{src.stem}"
        if c.get("status") == "left_out":  # alignment left it out at every block it serves
            left_out.append((label, f"{c['error']} ({', '.join(c.get('blocks', [])[:3])})"))
            continue
        if c.get("status") != "passed":
            left_out.append((label, f"failed its correctness check ({c.get('status')}"
                             + (f": {c['error'][:120]}" if c.get("error") else "") + ")"))
            continue
        if c.get("left_out_at"):  # a reviewed module would serve those blocks too
            at = c["left_out_at"]
            left_out.append((label, f"left out after a failed alignment at {', '.join(at[:3])}"
                             + (f" and {len(at) - 3} more" if len(at) > 3 else "")
                             + ": a reviewed module serves every block of its family and "
                             "params, those included"))
            continue
        bad = [f"{p}: {failed_blocks[(p, c['family'])]}" for p in c.get("blocks", [])
               if (p, c["family"]) in failed_blocks]
        if bad:
            left_out.append((label, "failed alignment at " + "; ".join(bad[:3])))
            continue
        if not src.is_file():
            left_out.append((label, f"module file missing: {src}"))
            continue
        text = src.read_text()
        foreign = foreign_imports(text)
        if foreign:
            left_out.append((label, f"not self-contained: imports {', '.join(foreign)} "
                             "(a merged module imports only torch, triton and the standard "
                             "library)"))
            continue
        dest = f"kernels/{c['family']}/{src.name}"
        if reviewed(dest) == text:
            left_out.append((label, f"already reviewed: {dest} is identical"))
            continue
        tuned, gpu = _tuned(src)
        mod = KernelModule(family=c["family"], variant=c["variant"], params=c["params"],
                           source=src, blocks=list(c.get("blocks", [])),
                           shapes=c.get("shapes", []), checks=c.get("checks", []),
                           tuned=tuned, tuned_gpu=gpu, entry=entry_signature(text))
        fam = fams.setdefault(c["family"], FamilyChange(family=c["family"]))
        fam.modules.append(mod)
    for name, fam in fams.items():
        folder = run_dir / GENERATED_DIR / name
        if folder.is_dir():
            fam.folder = folder
            entry = generated.get(name, {})
            tests = entry.get("tests") or ([entry["test"]] if entry.get("test") else [])
            fam.tests = [run_dir / t if not Path(t).is_absolute() else Path(t) for t in tests
                         if (run_dir / t).is_file() or Path(t).is_file()]
    return Proposal(run_dir=run_dir, model=model.get("name") or run_dir.name,
                    model_ref=model.get("ref") or "", overrides=model.get("overrides") or {},
                    families=list(fams.values()), left_out=left_out,
                    environment=model.get("environment") or {}, alignment=alignment,
                    tune=tune, bench=_bench_rows(run_dir))
