"""The gate an answer must pass, in order, the first failure ending it with its reason:

1. the folder: the answer written as a family folder, its spec loads (`FamilySpec` checks), its
   name is not a registered family's;
2. it renders (Jinja, every variant at its defaults, into a Python module that compiles);
3. the static anti-cheat check of the rendered module (`static.check_source`);
4. it compiles ahead of time for sm_90 (`onboarding.generate.aot.compile_files`);
5. in a subprocess with a timeout (`worker`): the block's eager forward and every gradient
   against ``block_forward`` at the block's captured size and at odd sizes, on fresh inputs
   redrawn between calls, outputs poisoned, Triton launches counted, torch ops recorded, module
   state compared; and the answer's reference against the block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    stage: str  # folder | render | static | aot | numerics | timeout | passed
    reason: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_sizes(batch: int, seq: int) -> list[list[int]]:
    """The sizes a candidate is checked at: the block's own, then an odd sequence length (not a
    power of two) at batch 1, and batch 3 at a short odd length."""
    odd = max(3, (seq * 5) // 8 | 1)
    sizes = [[batch, seq], [1, odd], [3, 7 if seq > 7 else max(1, seq - 1 | 1)]]
    return [s for i, s in enumerate(sizes) if s not in sizes[:i]]


def gate(answer: Answer, task: Any, *, spec: Any, out_dir: Path, timeout_s: float = 600.0,
         sizes: list[list[int]] | None = None, seed: int = 0) -> GateVerdict:
    """Run the gate on `answer` for `task` (the proxy rebuilt from ModelSpec `spec`); files go
    under `out_dir` (``family/<name>/``, ``rendered/<name>/<variant>.py``, ``worker.json``)."""
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
        from onboarding.generate.aot import compile_files

        aot = compile_files(paths)
    except Exception as exc:
        return done(False, "aot", f"sm_90 compile failed: {type(exc).__name__}: {str(exc)[:300]}", static=static)
    aot_rows = [r.as_dict() for rs in aot.values() for r in rs]
    bad = [r for r in aot_rows if not r["ok"]]
    if bad or not aot_rows:
        why = f"{bad[0]['kernel']}: {bad[0]['error'][:300]}" if bad else "no kernel compiled"
        return done(False, "aot", f"sm_90 compile failed: {why}", static=static, aot=aot_rows)
    req = {"module": str(paths[0]), "reference": str(folder / "reference.py"), "path": task.path,
           "spec": {f: getattr(spec, f) for f in ("ref", "overrides", "trust_remote_code", "proxy",
                                                   "impl", "part") if hasattr(spec, f)},
           "sizes": sizes or check_sizes(task.batch or 1, task.seq or 16), "seed": seed}
    result = run_worker(req, timeout_s)
    (Path(out_dir) / "worker.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if not result.get("ok"):
        reason = result.get("reason") or "the check failed"
        stage = "timeout" if result.get("stage") == "timeout" else \
            "runtime" if reason.startswith("anti-cheat") else "numerics"
        return done(False, stage, reason, static=static, aot=aot_rows, worker=result)
    return done(True, "passed", "", static=static, aot=aot_rows, worker=result)


def run_worker(req: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """`worker.check(req)` in a subprocess (the families' folders and the backend as here);
    a timeout or a crash is a verdict, not an exception."""
    from onboarding.families import subprocess_env

    root = str(Path(__file__).resolve().parents[3])
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        run = subprocess.run([sys.executable, "-m", "onboarding.generate.llm.worker"],
                             input=json.dumps(req), capture_output=True, text=True, env=env,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "stage": "timeout", "reason": f"timeout after {timeout_s:g} s"}
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"ok": False, "stage": "error", "reason": f"the check process died (rc={run.returncode}): {tail}"}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"ok": False, "stage": "error", "reason": f"the check process printed no verdict: {lines[-1][:200]}"}
