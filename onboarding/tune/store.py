"""The tuner's results: `<module>.tuned.json` (write, apply, dispatch), warm-start configs, and
the report pieces (best-so-far plot, Markdown table). Re-exported by `onboarding.tune.search`."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from onboarding.errors import InputError

TUNED_SUFFIX = ".tuned.json"


@dataclass(kw_only=True)
class BucketResult:
    bucket: str
    study_name: str
    best_config: dict[str, Any] | None
    best_ms: float | None
    default_ms: float | None
    n_trials: int
    n_complete: int
    pruned: dict[str, int]  # reason stage -> count
    history: list[float | None]  # best-so-far per trial number (None before the first)
    prune_reasons: dict[str, str] = field(default_factory=dict)  # stage -> its first reason
    # the finalists re-timed after the search (config JSON -> median ms; empty: not re-timed).
    # best_ms / default_ms come from here when it holds them.
    final: dict[str, float | None] = field(default_factory=dict)
    # [best config, bucket default]: the largest spill of their kernels in bytes per thread
    # (the AOT gate's ptxas report; None: not compiled ahead of time)
    spill_bytes: list[int | None] = field(default_factory=lambda: [None, None])
    # "stopped at budget (N s) after k of n trials" when the time budget ended the search
    stopped: str | None = None
    trials_run: int | None = None  # trials this call ran (n_trials counts a resumed study's too)
    budget_s: float | None = None  # the study's time budget (None: none)
    seconds: float | None = None  # the study's wall time, search and re-timing
    # seconds its trials spent per phase, summed (`search.phase_seconds`: aot, wait, check, time)
    phase_s: dict[str, float] = field(default_factory=dict)
    # trials of `trials_run` that helpers ran (other studies' threads: `search.OpenSearches`)
    helper_trials: int = 0
    # how its GPU timings were taken (`TuneConfig.timing`): "cuda-events", "cuda-graph", or
    # events after a failed capture (and why); None where timing is not real (the interpreter)
    timing: str | None = None


def gpu_name() -> str:
    import torch

    from onboarding.backend import on_gpu

    return torch.cuda.get_device_name(0) if on_gpu() else "cpu-interpreter"


def module_meta(module: ModuleType) -> dict[str, Any]:
    from onboarding.families.render import params_hash

    fam, var = getattr(module, "FAMILY", "unknown"), getattr(module, "VARIANT", "unknown")
    params = dict(getattr(module, "PARAMS", {}))
    return {"family": fam, "variant": var, "params": params,
            "params_hash": params_hash(fam, var, getattr(module, "TEMPLATE_VERSION", 0), params)}


# ---- warm start --------------------------------------------------------------------------------

def tuned_path(module_path: Path | str) -> Path:
    p = Path(module_path)
    return p.with_name(p.stem + TUNED_SUFFIX)


def bucket_default(module: ModuleType, bucket: str) -> dict[str, Any]:
    """The config a shape bucket runs with when nothing is pinned: DEFAULT_CONFIG under the
    bucket's own values (`config_for` without the pins)."""
    b = next(x for x in module.SHAPE_BUCKETS if x["name"] == bucket)
    return {**module.DEFAULT_CONFIG, **b["config"]}


def warm_start_configs(module: ModuleType, module_path: Path | str, bucket: str,
                       search_dirs: Iterable[Path | str] = ()) -> list[dict[str, Any]]:
    """Configs to try first: the bucket's default, then neighbouring buckets' tuned bests of this
    module (nearest first), then same-family bests from other tuned.json files."""
    names = [b["name"] for b in module.SHAPE_BUCKETS]
    i = names.index(bucket)
    out = [bucket_default(module, bucket)]
    own = tuned_path(module_path)
    files = [own] + sorted(f for d in search_dirs for f in Path(d).rglob(f"*{TUNED_SUFFIX}")
                           if f.resolve() != own.resolve())
    fam = getattr(module, "FAMILY", None)
    for n, f in enumerate(files):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if data.get("family") != fam:
            continue
        same_variant = n == 0 or data.get("variant") == getattr(module, "VARIANT", None)
        ranked = sorted(data.get("buckets", {}).items(),
                        key=lambda kv: abs(names.index(kv[0]) - i) if kv[0] in names else 99)
        for name, entry in ranked:
            if n == 0 and name == bucket and not same_variant:
                continue
            out.append(dict(entry["config"]))
    seen, uniq = set(), []
    for c in out:
        if any(k not in module.TUNING_SPACE or v not in module.TUNING_SPACE[k] for k, v in c.items()):
            continue
        c = {**module.DEFAULT_CONFIG, **c}
        key = json.dumps(c, sort_keys=True)
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


def enqueue_warm_start(study, configs: list[dict[str, Any]]) -> int:
    """Enqueue configs not yet tried or queued in `study`; returns how many were enqueued."""
    before = len(study.get_trials(deepcopy=False))
    for c in configs:
        study.enqueue_trial(c, user_attrs={"warm_start": True}, skip_if_exists=True)
    return len(study.get_trials(deepcopy=False)) - before


# ---- persistence and dispatch -----------------------------------------------------------------

def write_tuned(module_path: Path | str, results: Iterable[BucketResult], *, dtype: str = "bf16",
                gpu: str | None = None, timing: str | None = None) -> Path:
    """Merge the best config of each result into `<module>.tuned.json` (other buckets kept)."""
    import torch
    import triton

    from onboarding.generate.templating import load_module

    module = load_module(module_path)
    path = tuned_path(module_path)
    data = json.loads(path.read_text()) if path.exists() else {}
    meta = module_meta(module)
    data.update({k: meta[k] for k in ("family", "variant", "params", "params_hash")})
    data["module_sha256"] = hashlib.sha256(Path(module_path).read_bytes()).hexdigest()[:12]
    buckets = data.setdefault("buckets", {})
    for r in results:
        if r.best_config is None:
            continue
        buckets[r.bucket] = {
            "config": r.best_config, "best_ms": r.best_ms, "default_ms": r.default_ms,
            "trials": r.n_trials, "complete": r.n_complete, "pruned": r.pruned,
            "study": r.study_name, "dtype": dtype, "gpu": gpu or gpu_name(),
            "spill_bytes": r.spill_bytes[0],
            "timing": timing or r.timing or ("cuda-events" if gpu_name() != "cpu-interpreter"
                                             else "cpu-wallclock (meaningless)"),
            "torch": torch.__version__, "triton": triton.__version__,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def apply_tuned(module: ModuleType, path: Path | str | None = None) -> dict[str, dict[str, Any]]:
    """Pin every bucket's tuned config of `path` with `module.set_config(config, bucket)`;
    returns what was applied. Buckets tuned on another GPU are skipped. A missing file applies
    nothing; a file for other parameters, or a config outside TUNING_SPACE, raises InputError.

    Pass `path`: `load_module` caches by content, so two identical module files share one module
    object whose `__file__` names the first one loaded (the default is beside that file)."""
    path = Path(path) if path else tuned_path(module.__file__)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    meta = module_meta(module)
    if data.get("params_hash") not in (None, meta["params_hash"]):
        raise InputError(f"{path}: tuned for params hash {data.get('params_hash')}, the module "
                         f"has {meta['params_hash']}")
    applied, here = {}, gpu_name()
    for bucket, entry in data.get("buckets", {}).items():
        if entry.get("gpu", here) != here:  # tiles tuned for another GPU: keep the defaults
            continue
        try:
            module.set_config(entry["config"], bucket)
        except ValueError as e:
            raise InputError(f"{path}: bucket {bucket}: {e}") from e
        applied[bucket] = dict(entry["config"])
    return applied


# ---- report ------------------------------------------------------------------------------------

def load_tuned(module_path: Path | str) -> ModuleType:
    """Load a rendered module and apply the tuned.json beside that path (if any)."""
    from onboarding.generate.templating import load_module

    module = load_module(module_path)
    apply_tuned(module, tuned_path(module_path))
    return module


def plot_history(results: Iterable[BucketResult], out: Path | str) -> Path:
    """Best-so-far vs trial number, one line per bucket (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        xs = [i + 1 for i, v in enumerate(r.history) if v is not None]
        ax.step(xs, [v for v in r.history if v is not None], where="post", label=r.bucket)
    ax.set_xlabel("trial")
    ax.set_ylabel("best so far (ms)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


def markdown_table(results: Iterable[BucketResult]) -> str:
    results = list(results)
    rows = ["| bucket | trials | complete | pruned | best config | best ms | default ms | gain "
            "| spills best / default (B) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        gain = (f"{r.default_ms / r.best_ms:.2f}x" if r.best_ms and r.default_ms else "-")
        pr = ", ".join(f"{k} {v}" for k, v in sorted(r.pruned.items())) or "0"
        fmt = (lambda v: f"{v:.4g}" if v is not None else "-")
        spills = " / ".join("-" if v is None else str(v) for v in r.spill_bytes)
        rows.append(f"| {r.bucket} | {r.n_trials} | {r.n_complete} | {pr} | "
                    f"`{json.dumps(r.best_config, sort_keys=True)}` | {fmt(r.best_ms)} | "
                    f"{fmt(r.default_ms)} | {gain} | {spills} |")
    notes = [f"- `{r.bucket}`: {r.stopped}" for r in results if r.stopped]
    notes += [f"- `{r.bucket}`: {r.helper_trials} of its trials run by helpers (other studies' "
              f"threads)" for r in results if r.helper_trials]
    notes += [f"- `{r.bucket}`: timed by {r.timing}" for r in results
              if r.timing and r.timing != "cuda-graph"]
    for r in results:  # where the study's time went (`search.phase_seconds`)
        if r.phase_s:
            notes.append(f"- `{r.bucket}`, trials' seconds by phase: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in r.phase_s.items()))
    for r in results:
        timed = sorted((ms, c) for c, ms in r.final.items() if ms is not None)
        if timed:  # best and default ms above come from these
            notes.append(f"- `{r.bucket}`, finalists re-timed in interleaved rounds (medians): "
                         + "; ".join(f"{ms:.4g} ms `{c}`" for ms, c in timed))
    return "\n".join(rows) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def result_dict(r: BucketResult) -> dict[str, Any]:
    return asdict(r)


def result_from_dict(d: dict[str, Any]) -> BucketResult:
    return BucketResult(**{k: d[k] for k in BucketResult.__dataclass_fields__ if k in d})
