"""Regression check of a finished run against a golden reference in ``reference_runs/<name>/``.

`golden` reads the facts that say "the tool still works the same" out of a run directory: the
run's configuration and stages, the full-size parameter accounting, the op graph's capture,
layer pattern and block kinds, the coverage map, which candidate kernels passed their checks,
which kernels alignment patched, and the alignment's verdict and worst errors. Everything else
there (timings, paths, plots) is left out: timings are never compared, and on a CPU they are
Triton-interpreter wall clock anyway.

Categorical and integer facts must match exactly. Error metrics are floats that move with
summation order (another torch build, the GPU instead of the interpreter): each has a
`Tolerance` in `TOLERANCES`, the one place they are set. `compare` returns every difference.

The golden file, ``reference_runs/<name>/golden.json``, holds the facts plus the metadata of the
run that made it (commit, date, versions, GPU, the exact command); it is written atomically.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onboarding.errors import InputError
from onboarding.rundir import write_json

REFERENCE_DIR = Path(__file__).resolve().parents[1] / "reference_runs"
GOLDEN_FILE = "golden.json"
FORMAT = 1
# What `onboard run` leaves in a finished run directory and `golden` reads.
RUN_FILES = ("model.json", "opgraph.json", "coverage.json", "candidates.json", "alignment.json",
             "events.jsonl")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, slots=True)
class Tolerance:
    """An error metric may grow to ``max(golden * ratio, floor)``; ``drop`` instead allows a
    higher-is-better metric to fall by that much. Getting better is never a regression."""

    ratio: float = 1.0
    floor: float = 0.0
    drop: float | None = None

    def problem(self, golden: float, current: float) -> str | None:
        if self.drop is not None:
            if current >= golden - self.drop:
                return None
            return f"allowed >= {golden - self.drop:.4g} (golden - {self.drop:g})"
        bound = max(golden * self.ratio, self.floor)
        if current <= bound:
            return None
        return f"allowed <= {bound:.2e}: {self.ratio:g}x golden, at least {self.floor:.0e}"


# fp32 rounding noise against the fp64 reference moves with summation order (another torch
# build, compiled kernels instead of the interpreter) by small factors; a real bug (a lost term,
# a wrong mask) moves these errors by orders of magnitude. The floor covers goldens of exactly
# 0 (rope is exact in fp32) and is still ~10 fp32 ulps.
_REL_RMS = Tolerance(ratio=4.0, floor=1e-6)
TOLERANCES: dict[str, Tolerance] = {
    "candidates.worst_rel_rms": _REL_RMS,
    "alignment.worst_fwd_rel_rms": _REL_RMS,
    "alignment.worst_bwd_rel_rms": _REL_RMS,
    "alignment.worst_param_grad_rel_rms": _REL_RMS,
    "alignment.logits_rel_rms": _REL_RMS,
    # KL grows with the square of the logits' error: 16x is the 4x above.
    "alignment.logits_kl": Tolerance(ratio=16.0, floor=1e-12),
    # one token of the example's 64 may flip its top-1 on a near-tie
    "alignment.top1_agreement": Tolerance(drop=0.02),
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One difference: ``fact`` (and ``key`` inside a fact that is a mapping)."""

    fact: str
    key: str | None
    golden: Any
    current: Any
    message: str


# ---- reading a run -------------------------------------------------------------------------------

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: malformed JSON ({exc})") from None


def stages(run_dir: Path) -> list[str]:
    """The nodes that finished, in order, from ``events.jsonl``."""
    out = []
    for i, line in enumerate((run_dir / "events.jsonl").read_text().splitlines()):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(f"{run_dir / 'events.jsonl'}:{i + 1}: malformed JSON line") from None
        if ev.get("event") == "done":
            out.append(ev.get("node"))
    return out


def check_run_dir(run_dir: Path) -> None:
    """Raise `InputError` naming the problem unless ``run_dir`` is a finished `onboard run`."""
    if not run_dir.exists():
        raise InputError(f"RUN_DIR {run_dir}: no such directory")
    if not run_dir.is_dir():
        raise InputError(f"RUN_DIR {run_dir}: not a directory")
    missing = [f for f in RUN_FILES if not (run_dir / f).is_file()]
    if len(missing) == len(RUN_FILES):
        raise InputError(f"RUN_DIR {run_dir}: not a run directory (no {', '.join(RUN_FILES)})")
    if missing:
        raise InputError(f"RUN_DIR {run_dir}: not a finished run, missing {', '.join(missing)}")
    done = stages(run_dir)
    if "report" not in done:
        raise InputError(f"RUN_DIR {run_dir}: the run has not finished (done: "
                         f"{', '.join(done) or 'nothing'}); continue it with `onboard run "
                         f"--resume {run_dir}`")


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()) if v is not None)


def _max(values) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def golden(run_dir: Path) -> dict[str, Any]:
    """The facts of a finished run: a JSON-serialisable dict, fact name -> value (a scalar, a
    string or a mapping of entry -> scalar)."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    model, graph, cov, cands, al = (_read_json(run_dir / f) for f in RUN_FILES[:5])
    p = model["params"]
    f: dict[str, Any] = {}
    f["run.config"] = {"model": model["name"], "source": model["source"],
                       "overrides": json.dumps(model["overrides"], sort_keys=True),
                       "proxy": model["proxy"], "batch": graph["batch"], "seq": graph["seq"],
                       "seed": al["seed"], "mode": al["mode"],
                       "candidate_dtype": al["candidate_dtype"],
                       "reference_dtype": al["reference_dtype"]}
    f["run.stages"] = " ".join(stages(run_dir))

    f["params.totals"] = {k: p[k] for k in ("total", "active", "active_without_embeddings",
                                            "embedding", "lm_head", "routed_experts",
                                            "tied_embeddings")}
    f["params.by_category"] = dict(sorted(p["by_category"].items()))
    f["params.moe"] = dict(sorted(Counter(f"{m['n_experts']} experts, top-k {m['top_k']}"
                                          for m in p["moe"]).items()))
    f["params.proxy_total"] = graph["param_counts"]["proxy"]["total"]

    f["opgraph.capture"] = graph["capture"]
    f["opgraph.layer_pattern"] = graph["layer_pattern"]
    f["opgraph.block_kinds"] = dict(sorted(Counter(b["kind"] for b in graph["blocks"]).items()))
    f["opgraph.total_flops"] = graph["total_flops"]

    f["coverage.counts"] = cov["counts"]
    groups: dict[str, Counter] = {}
    for e in cov["entries"]:
        how = f" / {e['family']}/{e['variant']}" if e["family"] else ""
        groups.setdefault(f"{e['kind']} / {e['op']}{how}", Counter())[e["status"]] += 1
    f["coverage.entries"] = {k: ", ".join(f"{s} x{n}" for s, n in sorted(c.items()))
                             for k, c in sorted(groups.items())}

    status, worst = {}, {}
    for c in cands:
        key = f"{c['family']}/{c['variant']} {_params(c['params'])}".strip()
        ok = sum(bool(x.get("passed")) for x in c["checks"])
        status[key] = f"{c['status']}, {ok}/{len(c['checks'])} checks" + \
            (f" ({c['error'][:80]})" if c.get("error") else "")
        worst[key] = _max(x.get("rel_rms") for x in c["checks"])
    f["candidates.status"] = dict(sorted(status.items()))
    f["candidates.worst_rel_rms"] = dict(sorted(worst.items()))

    f.update(alignment_facts(al))
    return f


def alignment_facts(al: dict[str, Any]) -> dict[str, Any]:
    """The ``alignment.*`` facts of an ``alignment.json`` (the nightly suite keeps these too)."""
    f: dict[str, Any] = {}
    f["alignment.verdict"] = "passed" if al["passed"] else "FAILED"
    f["alignment.culprits"] = {d: " ".join(al["culprit"][d]) or "-" for d in ("fwd", "bwd")}
    verdicts = Counter()
    for b in al["blocks"]:
        verdicts[f"fwd {b['fwd']['verdict']}"] += 1
        verdicts[f"bwd {b['bwd']['verdict']}"] += 1
    f["alignment.block_verdicts"] = dict(sorted(verdicts.items()))
    patches: dict[str, Counter] = {}
    for r in al["patches"]:
        patches.setdefault(r.get("family") or "-", Counter())[r.get("status")] += 1
    f["alignment.patches"] = {k: ", ".join(f"{s} x{n}" for s, n in sorted(c.items()))
                              for k, c in sorted(patches.items())}

    def worst_of(direction: str, part: str) -> float | None:
        return _max((b[direction].get(part) or {}).get("rel_rms") for b in al["blocks"])

    f["alignment.worst_fwd_rel_rms"] = worst_of("fwd", "output")
    f["alignment.worst_bwd_rel_rms"] = worst_of("bwd", "output")
    f["alignment.worst_param_grad_rel_rms"] = worst_of("bwd", "params")
    f["alignment.logits_kl"] = al["logits"]["kl"]
    f["alignment.logits_rel_rms"] = al["logits"]["stats"]["rel_rms"]
    f["alignment.top1_agreement"] = al["logits"]["top1_agreement"]
    return f


# ---- comparing -----------------------------------------------------------------------------------

def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if 1e-3 <= abs(v) < 1e6 or v == 0 else f"{v:.2e}"
    return repr(v)


def other_model(golden: dict[str, Any], current: dict[str, Any]) -> tuple[str, str] | None:
    """(the golden's model, this run's) when the two runs are of different models (name and
    source in ``run.config``): their facts do not compare. None when they are of one model."""
    def which(facts: dict[str, Any]) -> tuple[Any, Any]:
        cfg = facts.get("run.config") or {}
        return cfg.get("model"), cfg.get("source")

    g, c = which(golden), which(current)
    if g == c or None in g:
        return None
    return tuple(f"{name} ({source})" for name, source in (g, c))  # type: ignore[return-value]


def _one(fact: str, key: str | None, g: Any, c: Any) -> Finding | None:
    name = fact if key is None else f"{fact}[{key}]"
    tol = TOLERANCES.get(fact)
    if tol is not None and _finite(g):
        if not _finite(c):
            return Finding(fact, key, g, c, f"{name}: golden {_fmt(g)}, now {_fmt(c)} "
                                            "(not a finite number)")
        why = tol.problem(g, c)
        if why is None:
            return None
        return Finding(fact, key, g, c, f"{name}: golden {_fmt(g)}, now {_fmt(c)} ({why})")
    if g == c and type(g) is type(c):
        return None
    return Finding(fact, key, g, c, f"{name}: golden {_fmt(g)}, now {_fmt(c)}")


def compare(golden: dict[str, Any], current: dict[str, Any]) -> list[Finding]:
    """Every difference between two fact dicts (from `golden`), in the golden's fact order:
    exact for categorical and integer facts, within `TOLERANCES` for error metrics."""
    out: list[Finding] = []
    for fact in [*golden, *(k for k in current if k not in golden)]:
        if fact not in current:
            out.append(Finding(fact, None, golden[fact], None,
                               f"{fact}: in the golden, missing from this run"))
            continue
        if fact not in golden:
            out.append(Finding(fact, None, None, current[fact],
                               f"{fact}: not in the golden (made by an older onboard); "
                               "re-run with --update to add it"))
            continue
        g, c = golden[fact], current[fact]
        if isinstance(g, dict) and isinstance(c, dict):
            for key in [*g, *(k for k in c if k not in g)]:
                if key not in c:
                    out.append(Finding(fact, key, g[key], None,
                                       f"{fact}[{key}]: golden {_fmt(g[key])}, now absent"))
                elif key not in g:
                    out.append(Finding(fact, key, None, c[key],
                                       f"{fact}[{key}]: new, {_fmt(c[key])} (not in the golden)"))
                elif (found := _one(fact, key, g[key], c[key])) is not None:
                    out.append(found)
        elif (found := _one(fact, None, g, c)) is not None:
            out.append(found)
    return out


def summary(value: Any, width: int = 44) -> str:
    """A table cell for a fact's value: the value if short, else how many entries."""
    if isinstance(value, dict):
        text = ", ".join(f"{k}={_fmt(v) if isinstance(v, float) else v}"
                         for k, v in value.items())
        return text if len(text) <= width else f"{len(value)} entries"
    text = _fmt(value) if isinstance(value, float) else str(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def rows(golden: dict[str, Any], current: dict[str, Any], findings: list[Finding]
         ) -> list[tuple[str, str, str, str]]:
    """(fact, golden, current, status) for every fact of either side; status is "ok",
    "changed" ("changed (n)": n entries of a mapping), or "new" (not in the golden)."""
    changed = Counter(f.fact for f in findings)
    out = []
    for fact in [*golden, *(k for k in current if k not in golden)]:
        n = changed.get(fact, 0)
        if fact not in golden:
            status = "new"
        else:
            status = "ok" if not n else ("changed" if not isinstance(golden[fact], dict)
                                         else f"changed ({n})")
        out.append((fact, summary(golden.get(fact, "-")), summary(current.get(fact, "-")),
                    status))
    return out


# ---- the golden file ------------------------------------------------------------------------------

def reference_dir(name: str, root: Path | None = None) -> Path:
    if not _NAME.match(name):
        raise InputError(f"--reference {name!r}: a name of letters, digits, '_', '.', '-'")
    return (root or REFERENCE_DIR) / name


def device() -> str:
    """This process's device as a golden's metadata names it (`metadata`'s "device"): the GPU's
    name, or the CPU's Triton interpreter. No git call, no versions: what a comparison reads."""
    import torch

    return device_name(torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def device_name(gpu: str | None) -> str:
    """A golden's "device" from the environment's "gpu" (None: no GPU)."""
    return gpu or "cpu (Triton interpreter)"


def metadata(*, command: str, run_command: str | None = None) -> dict[str, Any]:
    """Where and how the golden was made: commit (and the tracked files modified on top of it),
    date, versions, GPU, and the exact commands."""
    from onboarding.stages import environment, git_state

    checkout = git_state()  # asked once: environment's short commit is made from it too
    env = environment(checkout)
    env["commit"] = checkout.head if checkout is not None else None
    env["modified_files"] = checkout.modified if checkout is not None else []
    env["device"] = device_name(env["gpu"])
    return {**env, "command": command, "run_command": run_command}


def load_golden(path: Path) -> dict[str, Any]:
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("facts"), dict) \
            or not isinstance(data.get("metadata"), dict):
        raise InputError(f"{path}: not a golden file (no 'facts' and 'metadata')")
    return data


def write_golden(path: Path, facts: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write ``{"format", "metadata", "facts"}`` atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"format": FORMAT, "metadata": meta, "facts": facts})
    return path
