"""Exhaustive grid vs TPE on the same space, in the same session: is the short search enough?

`compare_grid` runs two studies over one bucket's search space, beside the tuner's own study:
``<name>.grid`` (Optuna's GridSampler: every config once) and ``<name>.tpe`` (the tuner's TPE,
with its warm start, given `tpe_fraction` of the grid's trials: 15% by default, the goal being
within 3% of the grid's best time). Both are resumable: a killed comparison continues where it
stopped. The result says grid best, TPE best, their ratio, the trial fraction, the gain of each
best over the bucket's default config (always part of the space), and after how many TPE trials
it came within 3% of the grid's best.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onboarding.tune.search import (BucketResult, Timer, TuneConfig, bucket_default, create_study,
                             retime, search_space, space_size, storage_url, study_name, timing_is_real,
                             tune_module)

WITHIN = 1.03  # the goal: TPE's best within 3% of the grid's
MAX_GRID = 2000  # an exhaustive grid larger than this is a mistake, not a baseline


@dataclass(kw_only=True)
class GridComparison:
    family: str
    variant: str
    bucket: str
    size: int
    dims: dict[str, int] | None
    space: dict[str, list]
    grid_size: int  # configs in the space (the grid study may hold a few duplicate trials)
    grid: BucketResult
    tpe: BucketResult
    tpe_fraction: float
    # The grid's best, TPE's best and the default re-timed together after both searches
    # ("grid" / "tpe" / "default" -> median ms; empty when not re-timed: interpreter, rounds 0)
    final_ms: dict[str, float | None] = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """TPE best / grid best (1.0: TPE found the grid's best; < 1: timing noise), from the
        joint re-timing when there is one."""
        g, t = self.final_ms.get("grid"), self.final_ms.get("tpe")
        if g and t:
            return t / g
        if self.grid.best_ms and self.tpe.best_ms:
            return self.tpe.best_ms / self.grid.best_ms
        return None

    def best(self) -> BucketResult | None:
        """The study whose best config is faster: by the joint re-timing when there is one."""
        def ms(key: str, r: BucketResult) -> float | None:
            return self.final_ms.get(key) or r.best_ms

        timed = [(ms(k, r), r) for k, r in (("grid", self.grid), ("tpe", self.tpe)) if ms(k, r)]
        return min(timed, key=lambda x: x[0])[1] if timed else None

    @property
    def trials_fraction(self) -> float:
        return self.tpe.n_trials / max(1, self.grid_size)

    @property
    def default_ms(self) -> float | None:
        return self.final_ms.get("default") or self.grid.default_ms or self.tpe.default_ms

    def gain(self, r: BucketResult) -> float | None:
        """Default config time / best time: from the joint re-timing when there is one, else
        both as study `r` timed them."""
        best = self.final_ms.get("grid" if r is self.grid else "tpe")
        if best and self.final_ms.get("default"):
            return self.final_ms["default"] / best
        d = r.default_ms or self.default_ms
        return d / r.best_ms if d and r.best_ms else None

    @property
    def tpe_trials_to_goal(self) -> int | None:
        """First TPE trial (1-based) whose best-so-far is within 3% of the grid's best."""
        if not self.grid.best_ms:
            return None
        for i, v in enumerate(self.tpe.history):
            if v is not None and v <= WITHIN * self.grid.best_ms:
                return i + 1
        return None

    @property
    def goal_met(self) -> bool:
        return self.ratio is not None and self.ratio <= WITHIN and self.trials_fraction <= 0.15

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ratio=self.ratio, trials_fraction=self.trials_fraction,
                   default_ms=self.default_ms, gain_grid=self.gain(self.grid),
                   gain_tpe=self.gain(self.tpe), tpe_trials_to_goal=self.tpe_trials_to_goal,
                   goal_met=self.goal_met)
        return out

    def markdown(self) -> str:
        def f(v, spec=".4g"):
            return "-" if v is None else format(v, spec)

        rows = [
            "| | grid | TPE |", "|---|---|---|",
            f"| trials | {self.grid_size} | {self.tpe.n_trials} "
            f"({self.trials_fraction:.1%} of the grid) |",
            f"| complete / pruned | {self.grid.n_complete} / {sum(self.grid.pruned.values())} "
            f"| {self.tpe.n_complete} / {sum(self.tpe.pruned.values())} |",
            f"| best ms | {f(self.grid.best_ms)} | {f(self.tpe.best_ms)} |",
            f"| best config | `{json.dumps(self.grid.best_config, sort_keys=True)}` | "
            f"`{json.dumps(self.tpe.best_config, sort_keys=True)}` |",
            f"| gain over default ({f(self.default_ms)} ms) | {f(self.gain(self.grid), '.2f')}x "
            f"| {f(self.gain(self.tpe), '.2f')}x |",
        ]
        if self.final_ms:
            rows.append(f"| best re-timed together (default {f(self.final_ms.get('default'))} "
                        f"ms) | {f(self.final_ms.get('grid'))} | {f(self.final_ms.get('tpe'))} |")
        head = (f"### Grid vs TPE: {self.family}/{self.variant}, bucket {self.bucket} "
                f"(size {self.size}{', dims ' + json.dumps(self.dims) if self.dims else ''})")
        verdict = (f"TPE best / grid best = {f(self.ratio, '.4f')} with "
                   f"{self.trials_fraction:.1%} of the grid's trials; within 3% after "
                   f"{f(self.tpe_trials_to_goal, 'd')} TPE trials; goal (<= 1.03 with <= 15% "
                   f"of the trials) {'met' if self.goal_met else 'NOT met'}.")
        why = [f"- {name} pruned by {stage} ({n}x), e.g.: {r.prune_reasons.get(stage, '')[:200]}"
               for name, r in (("grid", self.grid), ("TPE", self.tpe))
               for stage, n in r.pruned.items()]
        return "\n".join([head, "", *rows, "", verdict, *([""] + why if why else [])]) + "\n"


def _done(name: str, url: str, space: dict, seed: int, sampler: str) -> int:
    """Trials finished in the study (grid: distinct configs). The grid's configs are all
    enqueued up front: workers pop queued trials atomically, whereas GridSampler's own draws
    repeat grid points that another worker is still running."""
    study = create_study(name, url, space, seed, sampler)  # once, before any worker
    trials = study.get_trials(deepcopy=False)
    if sampler == "grid":  # enqueue what is neither run nor queued (one query, not one per config)
        # A RUNNING trial here was left by a killed run: its config is queued again.
        seen = {json.dumps(t.params or t.system_attrs.get("fixed_params", {}), sort_keys=True)
                for t in trials if t.state.name != "RUNNING"}
        keys = list(space)
        for values in itertools.product(*(space[k] for k in keys)):
            config = dict(zip(keys, values))
            if json.dumps(config, sort_keys=True) not in seen:
                study.enqueue_trial(config, user_attrs={"grid": True})
    done = [t for t in trials if t.state.is_finished()]
    if sampler == "grid":
        return len({json.dumps(t.params, sort_keys=True) for t in done})
    return len(done)


def compare_grid(module_path: Path | str, *, size: int, shapes: list[list[int]] | None = None,
                 dims: dict[str, int] | None = None, config: TuneConfig | None = None,
                 timer: Timer | None = None, tpe_fraction: float = 0.15,
                 progress=None) -> GridComparison:
    """Run (or finish) the grid and the TPE study of `size`'s bucket; see the module doc."""
    from onboarding.generate.templating import load_module

    if not 0 < tpe_fraction <= 1:
        from onboarding.errors import InputError

        raise InputError(f"tune: the TPE trial fraction must be in (0, 1], got {tpe_fraction}")
    cfg = config or TuneConfig()
    module = load_module(module_path)
    bucket = module.shape_bucket(size)
    space = search_space(module, bucket, cfg.space, cfg.space_only)
    n_grid = space_size(space)
    if n_grid > MAX_GRID:
        from onboarding.errors import InputError

        wide = " x ".join(f"{k} {len(v)}" for k, v in space.items() if len(v) > 1)
        raise InputError(f"tune --compare-grid: the grid holds {n_grid} configs ({wide}), over "
                         f"{MAX_GRID}; narrow it: --space KEY=V1,V2 --space-only")
    n_tpe = max(1, math.floor(tpe_fraction * n_grid))  # never more than the fraction
    url = storage_url(cfg)
    base = study_name(module, bucket, cfg.dtype, space=space)
    results = {}
    for sampler, total in (("grid", n_grid), ("tpe", n_tpe)):
        for _ in range(3):  # the grid: until every config ran (duplicates leave gaps)
            left = total - _done(f"{base}.{sampler}", url, space, cfg.seed, sampler)
            if left <= 0 and sampler in results:
                break
            run_cfg = dataclasses.replace(cfg, n_trials=max(0, left), final_rounds=0,
                                          warm_start=cfg.warm_start and sampler == "tpe")
            results[sampler] = tune_module(module_path, size=size, shapes=shapes, dims=dims,
                                           config=run_cfg, timer=timer, sampler=sampler,
                                           suffix=f".{sampler}", progress=progress)
            if sampler == "tpe":
                break
    grid, tpe = results["grid"], results["tpe"]
    final_ms: dict[str, float | None] = {}
    if cfg.final_rounds and timing_is_real(timer) and grid.best_config and tpe.best_config:
        named = {"grid": grid.best_config, "tpe": tpe.best_config,
                 "default": bucket_default(module, bucket)}
        distinct = list({json.dumps(c, sort_keys=True): c for c in named.values()}.values())
        ms = dict(zip((json.dumps(c, sort_keys=True) for c in distinct),
                      retime(module_path, distinct, size=size, shapes=shapes, dims=dims,
                             config=cfg, timer=timer, progress=progress)))
        final_ms = {k: ms[json.dumps(c, sort_keys=True)] for k, c in named.items()}
    return GridComparison(family=module.FAMILY, variant=module.VARIANT, bucket=bucket, size=size,
                          dims=dims, space=space, grid_size=n_grid, grid=grid, tpe=tpe,
                          tpe_fraction=tpe_fraction, final_ms=final_ms)


def plot_comparison(cmp: GridComparison, out: Path | str) -> Path:
    """Best-so-far vs trials of both studies, the grid's best and the 3% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r, label in ((cmp.grid, "grid"), (cmp.tpe, "TPE")):
        xs = [i + 1 for i, v in enumerate(r.history) if v is not None]
        ax.step(xs, [v for v in r.history if v is not None], where="post", label=label)
    if cmp.grid.best_ms:
        ax.axhline(WITHIN * cmp.grid.best_ms, ls=":", c="grey", label="grid best + 3%")
    ax.set_xscale("log")
    ax.set_xlabel("trial")
    ax.set_ylabel("best so far (ms)")
    ax.set_title(f"{cmp.family}/{cmp.variant} {cmp.bucket}", fontsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
