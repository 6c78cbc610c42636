"""`onboard tune MODEL`: tune every kernel a run uses, at the shapes seen in its op graph.

A run directory holds `opgraph.json`, `coverage.json` and `candidates.json` (parse, map,
generate). `plan_jobs` turns them into one job per (candidate module, shape bucket): the
bucketed dimension (`ShapeBucket.dim`) and the real problem dims for timing are read off each
block by structure (input shapes, weight shapes, attrs); the first block of a bucket gives its
shapes. `tune_run` runs one study per job (key: family, variant, params, bucket, dtype, GPU),
writes `<variant>.tuned.json` beside each candidate module, `tune.json` (every result, for the
report) and `tune_best.png`. Reviewed kernels (`kernels/`) are not tuned here: their tuned
configs are reviewed like their code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from onboarding.errors import InputError
from onboarding.rundir import write_json
from onboarding.tune import (BucketResult, Timer, TuneConfig, plot_history, progress_bar,
                             result_dict, tune_module, write_tuned)

RESULTS_FILE = "tune.json"
PLOT_FILE = "tune_best.png"
RUN_ARTIFACTS = ("opgraph.json", "coverage.json", "candidates.json")


@dataclass(kw_only=True)
class TuneJob:
    family: str
    variant: str
    module: str  # the candidate module's path
    bucket: str
    size: int  # the bucketed dimension's value
    size_source: str  # how `size` was read off the block
    shapes: list[list[int]]  # the block's input shapes (for the correctness sample)
    dims: dict[str, int] | None  # real problem dims for timing (None: sample shapes)
    blocks: list[str] = field(default_factory=list)


def _numel(shape: list[int]) -> int:
    return math.prod(shape) if shape else 0


def _delta_dims(block) -> dict[str, int] | None:
    """Heads and head dims of a delta-rule block from its weights: value heads from the per-head
    decay parameter, V from the value projection; K is taken equal to V when the query
    projection divides by it (true of Qwen3-Next and Kimi-Linear), else from the norm weight."""
    p = block.params
    hv = next((s[0] for n, s in p.items() if len(s) == 1 and n.split(".")[-1].startswith("A")),
              None)
    v_out = next((s[0] for n, s in p.items() if n.endswith("v_proj.weight") and len(s) == 2),
                 None)
    q_out = next((s[0] for n, s in p.items() if n.endswith("q_proj.weight") and len(s) == 2),
                 None)
    if not (hv and v_out and q_out) or v_out % hv:
        return None
    vd = v_out // hv
    kd = vd if q_out % vd == 0 else next((s[0] for n, s in p.items()
                                          if n.endswith("norm.weight") and len(s) == 1), None)
    if not kd or q_out % kd:
        return None
    return {"HV": hv, "V": vd, "K": kd, "HK": q_out // kd}


def block_dims(family: str, entry, block) -> dict[str, int] | None:
    """The real problem dims of one block for `_tune_worker.timing_inputs` (None: unknown)."""
    shapes = entry.shapes
    if not shapes or not shapes[0]:
        return None
    x = shapes[0]
    if family == "moe_experts" and block is not None and len(shapes) >= 2:
        # down by shape: [E, D, F], the expert weight whose output side is x's width D (gate_up
        # [E, 2F, D] and up [E, F, D] take D in); [E, F, D] for weights stored [E, in, out]
        # (`weight_layout` "in_out", gpt-oss). When F == D or 2F == D: the one that is not D x D.
        e, d = block.attrs.get("n_experts"), x[-1]
        out_dim, f_dim = (2, 1) if block.attrs.get("weight_layout") == "in_out" else (1, 2)
        downs = [s for s in block.params.values() if len(s) == 3 and s[0] == e and s[out_dim] == d]
        if e and downs:
            f = next((s[f_dim] for s in downs if s[f_dim] != d), d)
            return {"N": _numel(x[:-1]), "D": d, "E": e, "TOPK": shapes[1][-1], "F": f}
    if family == "grouped_linear" and block is not None and len(x) == 2:
        # x [S, K] (sorted rows) and the weight [E, N, K] the classifier named
        n, k, e = (block.attrs.get(a) for a in ("out_features", "in_features", "n_experts"))
        return {"S": x[0], "K": k, "N": n, "E": e} if n and k and e and x[1] == k else None
    if family in ("gated_delta", "kimi_delta") and block is not None and len(x) == 3:
        d = _delta_dims(block)
        return {"B": x[0], "T": x[1], **d} if d else None
    if family in ("rmsnorm", "layernorm"):
        return {"N": _numel(x[:-1]), "D": x[-1]}
    if family == "swiglu":
        fused = entry.variant == "fused"
        return {"N": _numel(x[:-1]), "F": x[-1] // 2 if fused else x[-1]}
    return None


def bucket_size(spec, entry, block, dims: dict[str, int] | None) -> tuple[int | None, str]:
    """The value of the family's bucketed dimension for one block, and where it came from."""
    dim = spec.shape_buckets[0].dim
    if dims and dim in dims:
        return int(dims[dim]), f"{dim} from the block's shapes"
    p, attrs = entry.params, (block.attrs if block is not None else {})
    if entry.family == "rope":
        d = p.get("head_dim") or p.get("rotary_dim")
        return (int(d), f"{dim} from the rope parameters") if d else (None, "")
    if dim == "C" and attrs.get("channels"):
        return int(attrs["channels"]), "C from the block's channels"
    if dim == "E" and attrs.get("n_experts"):
        return int(attrs["n_experts"]), "E from the block's n_experts"
    if dim in ("D", "F", "I") and entry.shapes and entry.shapes[0]:
        return int(entry.shapes[0][-1]), f"{dim}: the block input's last dim"
    if dim == "D_QK" and len(entry.shapes) >= 2 and entry.shapes[1]:
        return int(entry.shapes[1][-1]), "D_QK: the head dim of the rotary table"
    return None, ""


def plan_jobs(run_dir: Path, families: list[str] | None = None
              ) -> tuple[list[TuneJob], list[str]]:
    """Jobs for every passing candidate of the run, one per shape bucket; and notes on what
    is not tuned (reviewed kernels, failed candidates, blocks whose size is unknown)."""
    from onboarding.generate import load_candidates
    from onboarding.opgraph import OpGraph
    from onboarding.registry import Coverage
    from onboarding.families import get_family
    from onboarding.templating import load_module

    missing = [a for a in RUN_ARTIFACTS if not (run_dir / a).is_file()]
    if missing:
        raise InputError(f"{run_dir}: not a generated run directory (missing {missing}); "
                         "run `onboard generate MODEL --out DIR` or give MODEL")
    graph = OpGraph.load(run_dir / "opgraph.json")
    blocks = {b.path: b for b in graph.blocks}
    coverage = Coverage.load(run_dir / "coverage.json")
    cands = load_candidates(run_dir / "candidates.json")
    jobs: dict[tuple[str, str], TuneJob] = {}
    notes = [f"reviewed kernel {e.family} at {e.path}: not tuned here" for e in coverage.entries
             if e.status == "kernel" and (families is None or e.family in families)]
    for c in cands:
        if families is not None and c.family not in families:
            continue
        if c.status != "passed":
            notes.append(f"{c.family}/{c.variant}: candidate {c.status}, not tuned")
            continue
        # candidates.json may name another copy of this run directory: prefer the module here
        local = run_dir / "candidates" / c.family / Path(c.path).name
        path = str(local) if local.is_file() else c.path
        spec, module = get_family(c.family), load_module(path)
        for e in coverage.entries:
            if (e.family, e.variant, e.params) != (c.family, c.variant, c.params):
                continue
            block = blocks.get(e.path)
            dims = block_dims(c.family, e, block)
            size, source = bucket_size(spec, e, block, dims)
            if size is None:
                notes.append(f"{c.family}/{c.variant} at {e.path}: bucketed dimension "
                             f"{spec.shape_buckets[0].dim} unknown, not tuned")
                continue
            bucket = module.shape_bucket(size)
            job = jobs.setdefault((path, bucket), TuneJob(
                family=c.family, variant=c.variant, module=path, bucket=bucket, size=size,
                size_source=source, shapes=e.shapes, dims=dims))
            job.blocks.append(e.path)
    return list(jobs.values()), notes


def tune_run(run_dir: Path, config: TuneConfig, *, families: list[str] | None = None,
             timer: Timer | None = None, on_step: Callable[[str], None] | None = None,
             progress: bool = False) -> dict[str, Any]:
    """Tune every job of `run_dir`; writes tuned.json files, `tune.json` and `tune_best.png`.

    Studies live in `config.storage` or, by default, `run_dir/tune.db` (a resumed run continues
    them). Returns the `tune.json` content."""
    import optuna

    from onboarding.tune import gpu_name

    run_dir = Path(run_dir)
    if config.storage is None and config.storage_dir is None:
        config = replace(config, storage_dir=run_dir)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    jobs, notes = plan_jobs(run_dir, families)
    prog = progress_bar() if progress else None
    results: list[tuple[TuneJob, BucketResult]] = []
    if prog:
        prog.start()
    try:
        for i, job in enumerate(jobs):
            if on_step:
                on_step(f"{job.family}/{job.variant} {job.bucket} ({i + 1}/{len(jobs)})")
            r = tune_module(job.module, size=job.size, shapes=job.shapes, dims=job.dims,
                            config=replace(config, progress=False), timer=timer, progress=prog)
            if r.best_config is not None:
                write_tuned(job.module, [r], dtype=config.dtype,
                            timing="injected timer" if timer else None)
            results.append((job, r))
    finally:
        if prog:
            prog.stop()
    data = {"gpu": gpu_name(), "dtype": config.dtype, "trials_per_study": config.n_trials,
            "notes": notes,
            "studies": [{**asdict(job), "module": _relative(job.module, run_dir),
                         "result": result_dict(r)} for job, r in results]}
    write_json(run_dir / RESULTS_FILE, data)
    if results:  # one line per study, labelled family/variant bucket
        plot_history([replace(r, bucket=f"{j.family}/{j.variant} {j.bucket}")
                      for j, r in results], run_dir / PLOT_FILE)
    return data


def _relative(path: str, run_dir: Path) -> str:
    p, root = Path(path).resolve(), run_dir.resolve()
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


def load_results(run_dir: Path) -> dict[str, Any] | None:
    f = Path(run_dir) / RESULTS_FILE
    if not f.is_file():
        return None
    return json.loads(f.read_text())
