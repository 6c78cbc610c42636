"""Block-level tuning: a family whose rendered module exports ``block_forward(module, *args,
**kwargs)`` (the LLM path's binding contract, `onboarding.generate.llm`) is tuned on the block
it serves, not on entry arguments it never declared.

Such a family says nothing about how its bucketed dimension is read off a block (no
``problem_dims``, no ``sample_inputs``/``timing_inputs``), and its kernels take the block module
itself. So `tune_block` rebuilds the run's seeded proxy, captures the block's inputs during a
forward of it (`onboarding.generate.blockcheck.capture_block_inputs`), and learns which shape
buckets the block uses by watching the module's own ``shape_bucket`` during one call of
``block_forward``. Every config of the declared ``TUNING_SPACE`` (the bucket default first; a
seeded sample when the space holds more than ``n_trials``) is pinned with ``set_config`` and
then:

1. checked: ``block_forward``'s outputs and every gradient (inputs and parameters) against the
   block's own forward, at the run's (batch, seq) and at an odd sequence length, through the
   block check's comparisons (`blockcheck.judge_once`: the "layer" row; in bf16 against the fp32
   block, with the bf16 block's own error as a floor where it runs). A config that fails is
   pruned with its reason;
2. timed: forward + backward of ``block_forward`` on the block's inputs at the run's size, CUDA
   events on a GPU (`onboarding.bench.harness.time_fn`), not `TuneConfig.timing`'s graph replay
   that kernel jobs use: the block's step runs in this process, not in a worker subprocess, so a
   capture that fails (a whole block's host syncs) would not be isolated; on the CPU
   interpreter one call's wall time (meaningless, as the kernel worker's there) unless a
   ``timer`` is injected (tests).

The best config is written to ``<module>.tuned.json`` for every bucket the block used (the
alignment stage's `kernels_for` loads it with `load_tuned`), with the default's time beside it.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onboarding.tune.store import BucketResult, bucket_default


def has_block_forward(module: Any) -> bool:
    return callable(getattr(module, "block_forward", None))


def _buckets_used(kmod: Any, fn: Callable[[], Any]) -> list[str]:
    """The shape buckets ``kmod`` looks up (its ``config_for`` -> ``shape_bucket``) while
    ``fn`` runs, in order of first use."""
    seen: list[str] = []
    real = kmod.shape_bucket

    def spy(size: int) -> str:
        name = real(size)
        if name not in seen:
            seen.append(name)
        return name

    kmod.shape_bucket = spy
    try:
        fn()
    finally:
        kmod.shape_bucket = real
    return seen


def _configs(space: dict[str, list], default: dict[str, Any], n: int, seed: int
             ) -> list[dict[str, Any]]:
    """The default, then the rest of the grid (a seeded sample of n - 1 when it is larger)."""
    keys = sorted(space)
    grid = [dict(zip(keys, vals)) for vals in itertools.product(*(space[k] for k in keys))]
    base = {k: default[k] for k in keys}
    rest = [c for c in grid if c != base]
    if len(rest) > n - 1:
        rest = random.Random(seed).sample(rest, max(0, n - 1))
    return [base, *rest]


def tune_block(module_path: Path | str, spec: Any, path: str, *, batch: int = 1,
               seq: int = 64, dtype: str = "bf16", kind: str = "", n_trials: int = 64,
               space: dict[str, list] | None = None, seed: int = 0,
               timer: Callable[[dict[str, Any]], float] | None = None,
               budget_s: float | None = None,
               check_sizes: list[tuple[int, int]] | None = None) -> list[BucketResult]:
    """Tune the rendered module at ``module_path`` on the block at ``path`` of ``spec``'s proxy
    (module docstring). ``space``: a sub-space of TUNING_SPACE (default: all of it);
    ``timer(config) -> ms`` replaces the GPU timing (tests). Returns one `BucketResult` per
    bucket the block used (the same configs serve them all: one call uses them together)."""
    from onboarding.align.core import as_dtype
    from onboarding.backend import kernel_device
    from onboarding.bench.harness import time_fn
    from onboarding.generate.blockcheck import (_backward, _clone, _forward, capture_block_inputs,
                                                default_sizes, judge_once)
    from onboarding.generate.templating import load_module
    from onboarding.graph.parse import load_shipped_weights, load_stage

    t0 = time.perf_counter()
    kmod = load_module(module_path)
    if not has_block_forward(kmod):
        raise ValueError(f"{module_path}: no block_forward(module, ...) to tune on a block")
    device = kernel_device()
    on_gpu = device.type == "cuda"
    check_dt = dtype if on_gpu else "fp32"  # the interpreter computes no bf16
    info = load_stage(spec.load(), spec.proxy)
    base = info.loaded.build(info.proxy_config, seed=seed).eval()
    load_shipped_weights(base, info)
    model = copy.deepcopy(base).to(device=device, dtype=as_dtype(check_dt)).eval()
    module = model.get_submodule(path)
    names = list(inspect.signature(module.forward).parameters)
    ref_module = module if check_dt == "fp32" else copy.deepcopy(module).float()
    kmod.set_config(None)

    def candidate(m: Any) -> Callable:
        return lambda *a, **k: kmod.block_forward(m, *a, **k)

    # per check size: its inputs and whether the block's own 16-bit forward runs (then it is
    # the floor of each trial's check, as in the block check)
    refs = []
    for draw, (b, t) in enumerate(check_sizes or default_sizes(batch, seq)[1::2]):
        args, kw = capture_block_inputs(model, info.proxy_config, path, b, t, seed + 11 + draw)
        floor = ref_module is not module
        if floor:
            try:
                with torch.no_grad():
                    module(*_clone(args), **_clone(kw))
            except Exception:  # the block's own 16-bit code may not run (xLSTM's chunkwise
                floor = False  # path): the bf16 row alone, as in the block check
        refs.append((b, t, draw, args, kw, floor))

    tmodel = model if check_dt == dtype else \
        copy.deepcopy(base).to(device=device, dtype=as_dtype(dtype)).eval()
    tmod = tmodel.get_submodule(path)
    targs, tkw = capture_block_inputs(tmodel, info.proxy_config, path, batch, seq, seed + 7)
    run = candidate(tmod)

    def step(i: int = 0) -> None:  # one training call: forward and every gradient
        _backward(_forward(run, targs, tkw, names), tmod, 0)

    def forward() -> None:
        with torch.no_grad():
            run(*targs, **tkw)

    buckets = _buckets_used(kmod, forward)
    if not buckets:
        raise ValueError(f"{module_path}: block_forward looked up no shape bucket (config_for): "
                         "nothing to tune")
    default = bucket_default(kmod, buckets[0])
    full = {k: list(v) for k, v in kmod.TUNING_SPACE.items()}
    if space:
        full.update({k: [v for v in full[k] if v in space[k] or v == default[k]]
                     for k in space})
    configs = _configs(full, default, n_trials, seed)
    trials: list[dict[str, Any]] = []
    stopped = None
    try:
        for i, config in enumerate(configs):
            if budget_s is not None and time.perf_counter() - t0 > budget_s and trials:
                stopped = f"stopped at budget ({budget_s:g} s) after {i} of {len(configs)} trials"
                break
            kmod.set_config(config)
            trial: dict[str, Any] = {"config": config, "ms": None, "reason": ""}
            trials.append(trial)
            try:
                for b, t, draw, args, kw, floor in refs:
                    errors = judge_once(candidate(module), module, ref_module, args, kw, names,
                                        draw, check_dt, kind, floor=floor)
                    bad = [e for e in errors if not e.passed]
                    if bad:
                        trial["reason"] = f"{bad[0].message} (batch {b}, seq {t}, {check_dt})"
                        break
            except Exception as exc:
                trial["reason"] = f"raised {type(exc).__name__}: {str(exc)[:200]}"
            if trial["reason"]:
                continue
            if timer is not None:
                trial["ms"] = float(timer(config))
            elif on_gpu:
                trial["ms"] = time_fn(step, warmup=3, repeats=20, n_sets=1).median_ms
            else:  # the interpreter's wall time, as the kernel worker's: meaningless, kept short
                w0 = time.perf_counter()
                step()
                trial["ms"] = (time.perf_counter() - w0) * 1e3
    finally:
        kmod.set_config(None)
    timed = [t for t in trials if t["ms"] is not None]
    best = min(timed, key=lambda t: t["ms"]) if timed else None
    base_ms = trials[0]["ms"] if trials and trials[0]["config"] == configs[0] else None
    hist, so_far = [], None
    for t in trials:
        if t["ms"] is not None:
            so_far = t["ms"] if so_far is None else min(so_far, t["ms"])
        hist.append(so_far)
    pruned = [t for t in trials if t["reason"]]
    name = f"block:{kmod.FAMILY}/{kmod.VARIANT}@{path}"
    seconds = round(time.perf_counter() - t0, 1)
    return [BucketResult(bucket=bk, study_name=name,
                         best_config={**kmod.DEFAULT_CONFIG, **best["config"]} if best else None,
                         best_ms=best["ms"] if best else None, default_ms=base_ms,
                         n_trials=len(trials), n_complete=len(timed),
                         pruned={"correctness": len(pruned)} if pruned else {}, history=hist,
                         prune_reasons={"correctness": pruned[0]["reason"]} if pruned else {},
                         stopped=stopped, trials_run=len(trials), budget_s=budget_s,
                         seconds=seconds)
            for bk in buckets]
