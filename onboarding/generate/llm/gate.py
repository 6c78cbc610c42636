"""The gate an answer must pass, in order, the first failure ending it with its reason:

1. the folder: the answer written as a family folder, its spec loads (`FamilySpec` checks), its
   name is not a registered family's;
2. it renders (Jinja, every variant at its defaults, into a Python module that compiles);
3. the static anti-cheat check of the rendered module (`static.check_source`);
4. it compiles ahead of time for sm_90 (`onboarding.generate.aot.compile_files`);
5. `onboarding.generate.blockcheck` in a subprocess with a timeout: the block's eager forward
   and every gradient against ``block_forward`` at the block's captured size (two draws: inputs
   redrawn between calls) and at odd sizes, the replacement being `worker.Watched` (the runtime
   anti-cheat check: fresh allocations poisoned, Triton launches counted in both directions,
   torch ops recorded, the kernel module's data globals compared, in the interpreter every load
   and store inside the launch's tensor arguments); and the answer's reference against the block.
"""

from __future__ import annotations

import ast
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onboarding.generate.llm.contract import Answer
from onboarding.generate.llm.folder import load_spec, write_folder
from onboarding.generate.llm.static import check_source


@dataclass(kw_only=True)
class GateVerdict:
    ok: bool
    stage: str  # folder | render | static | aot | runtime | numerics | timeout | reference | passed
    reason: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def gate(answer: Answer, task: Any, *, spec: Any, out_dir: Path, timeout_s: float = 600.0,
         sizes: list[list[int]] | None = None, seed: int = 0, in_process: bool = False) -> GateVerdict:
    """Run the gate on `answer` for `task` (the proxy rebuilt from ModelSpec `spec`; `sizes`:
    (batch, seq) pairs, default blockcheck's); files go under `out_dir` (``family/<name>/``,
    ``rendered/<name>/<variant>.py``, ``blockcheck.json``). ``in_process`` runs the block check
    here, without its subprocess and timeout (tests: the subprocess costs an import of the model
    code per answer)."""
    t0 = time.perf_counter()

    def done(ok: bool, stage: str, reason: str = "", **details: Any) -> GateVerdict:
        return GateVerdict(ok=ok, stage=stage, reason=reason, details=details,
                           seconds=round(time.perf_counter() - t0, 2))

    from onboarding.families import families
    from onboarding.families.render import render_source
    from onboarding.generate.templating import write_module

    if answer.family in families():
        return done(False, "folder", f"family name {answer.family!r} is taken by a registered family")
    try:
        folder = write_folder(answer, task, Path(out_dir) / "family")
        fspec = load_spec(folder)
    except Exception as exc:
        return done(False, "folder", f"the spec does not load: {type(exc).__name__}: {exc}")
    paths = []
    for variant in fspec.variants:
        try:
            source = render_source(fspec, variant, fspec.resolve(variant))
        except Exception as exc:
            msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            return done(False, "render", f"variant {variant!r} does not render: {type(exc).__name__}: {msg}")
        path = Path(out_dir) / "rendered" / fspec.name / f"{variant}.py"
        write_module(source, path, overwrite=True)
        paths.append(path)
        report = check_source(source, str(path))
        if not report.ok:
            return done(False, "static", f"anti-cheat (static): {report.reason}", static=asdict(report))
    static = asdict(report)
    try:
        aot_rows = compile_sm90(paths)
    except Exception as exc:
        return done(False, "aot", f"sm_90 compile failed: {type(exc).__name__}: {str(exc)[:300]}", static=static)
    bad = [r for r in aot_rows if not r["ok"]]
    if bad or not aot_rows:
        why = f"{bad[0]['kernel']}: {bad[0]['error'][:300]}" if bad else "no kernel compiled"
        return done(False, "aot", f"sm_90 compile failed: {why}", static=static, aot=aot_rows)
    from onboarding.generate.blockcheck import Replacement, check_block

    repl = Replacement(target="onboarding.generate.llm.worker:make", label=f"{fspec.name} (LLM)",
                       kwargs={"kernel": str(paths[0]), "reference": str(folder / "reference.py")})
    verdict = check_block(spec, task.path, repl, batch=task.batch or 1, seq=task.seq or 16,
                          sizes=[tuple(s) for s in sizes] if sizes else None, seed=seed,
                          kind=task.kind, timeout_s=timeout_s, in_process=in_process)
    result = verdict.to_dict()
    (Path(out_dir) / "blockcheck.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    watched = [a for a in verdict.artifacts.values() if isinstance(a, dict)]
    cheat = next((w for w in (_cheat(a) for a in watched) if w), "")
    if not cheat and "anti-cheat" in verdict.reason:
        cheat = verdict.reason[verdict.reason.index("anti-cheat"):]
    if not cheat and "out-of-bounds" in verdict.reason:  # the interpreter's bounds check (runtime.Monitor)
        cheat = f"memory safety (runtime): {verdict.reason}"
    if cheat:
        return done(False, "runtime", cheat + (f" ({verdict.reason})" if verdict.reason and
                    "anti-cheat" not in verdict.reason else ""), static=static, aot=aot_rows, check=result)
    if not verdict.passed:
        stage = "timeout" if verdict.reason.startswith("timeout") else "numerics"
        return done(False, stage, verdict.reason or "the block check failed", static=static,
                    aot=aot_rows, check=result)
    ref = next((a.get("reference", {}) for a in watched), {})
    if ref.get("reason"):
        return done(False, "reference", ref["reason"], static=static, aot=aot_rows, check=result)
    return done(True, "passed", "", static=static, aot=aot_rows, check=result,
                summary=verdict.summary())


def _cheat(record: dict[str, Any]) -> str:
    """The runtime anti-cheat reason a `worker.Watched.finish()` record shows, or ""."""
    if record.get("state_changes"):
        return "anti-cheat (runtime): module-level state written during calls: " \
            f"{', '.join(record['state_changes'])} (outputs kept from earlier calls)"
    if record.get("forbidden"):
        ops = ", ".join(f"aten.{k} x{v}" for k, v in sorted(record["forbidden"].items()))
        return f"anti-cheat (runtime): torch ops do the work outside Triton kernels: {ops}"
    if record.get("calls") and not record.get("launches"):
        return "anti-cheat (runtime): block_forward launched no Triton kernel"
    return ""


_AOT_DONE: dict[str, list[dict[str, Any]]] = {}


def aot_key(source: str) -> str:
    """A digest of what the sm_90 compile of a rendered module depends on: its ``@triton.jit``
    functions, ``aot_specs`` and every module-level function these reach, the module-level
    assignments and imports of names they use, and the Triton version. Answers that differ only in Python glue
    (a retry that fixes the wrapper) compile once per process."""
    import triton

    tree = ast.parse(source)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    todo = [n for n, d in defs.items() if n == "aot_specs" or (
        isinstance(d, ast.FunctionDef) and any("jit" in ast.unparse(x) for x in d.decorator_list))]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [x.id for x in ast.walk(defs[name]) if isinstance(x, ast.Name) and x.id in defs]
    used = {x.id for n in seen for x in ast.walk(defs[n]) if isinstance(x, ast.Name)}
    glob = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom))
            and ({x.id for x in ast.walk(n) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}
                 | {a.asname or a.name.split(".")[0] for a in getattr(n, "names", [])}) & used]
    parts = [triton.__version__] + [ast.unparse(defs[n]) for n in sorted(seen)] + [ast.unparse(n) for n in glob]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def compile_sm90(paths: list[Path]) -> list[dict[str, Any]]:
    """`onboarding.generate.aot.compile_files` rows for the rendered modules, memoised by
    `aot_key` within the process."""
    from onboarding.generate.aot import compile_files

    rows: list[dict[str, Any]] = []
    for path in paths:
        key = aot_key(Path(path).read_text())
        if key not in _AOT_DONE:
            _AOT_DONE[key] = [r.as_dict() for rs in compile_files([path]).values() for r in rs]
        rows += _AOT_DONE[key]
    return rows
