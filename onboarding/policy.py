"""A run's decisions between stages, for whatever drives the stages (the agent's nodes call
these, record what they return and route on it): how much tuning and training a machine gets,
how training splits over processes, and what alignment leaves out on its next attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from onboarding.modpath import related

if TYPE_CHECKING:
    from onboarding.align.core import AlignmentResult
    from onboarding.graph.opgraph import OpGraph

DEFAULT_GPU_TUNE_TRIALS = 20
DEFAULT_GPU_TRAIN_STEPS = 20
# Seconds for the whole tune stage of a run (its studies at once on a GPU host,
# `onboarding.tune.run`). At 40 s the built-in example's studies timed their defaults and nothing
# else (a first trial costs ~45 s of compiles on an H100 host); at 120 s they ran 3-17 trials each
# and the main command took 172 s on a warm machine (docs/LOG.md, forty-fourth session). 20 trials
# per study without a budget ran past 340 s (fifteenth session).
DEFAULT_TUNE_BUDGET_S = 90.0
# what `onboarding.tune.search.gpu_name` says without a GPU (timings from the Triton interpreter)
_NO_GPU = "cpu-interpreter"


@dataclass(frozen=True, slots=True)
class Budget:
    """How much of a stage to run: ``amount`` (trials per study, optimizer steps); when it is
    not positive the stage does not run and ``skipped`` says why, for the record."""

    amount: int
    skipped: str | None = None


def tune_budget(trials: int | None, *, gpu: str) -> Budget:
    """Optuna trials per study on the device ``gpu`` (`onboarding.tune.search.gpu_name`). None: 20 on
    a GPU and none on the CPU, whose interpreter timings mean nothing; a number is taken as
    asked (the CPU tunes when asked to, each trial costing seconds)."""
    on_gpu = gpu != _NO_GPU
    n = trials if trials is not None else (DEFAULT_GPU_TUNE_TRIALS if on_gpu else 0)
    if n > 0:
        return Budget(n)
    return Budget(n, "skipped: no GPU, and Triton-interpreter timings mean nothing (set "
                     "tune_trials, `onboard run --tune-trials N`, to tune anyway)" if not on_gpu
                  else "skipped: tune_trials is 0")


def tune_seconds(budget_s: float | None) -> float | None:
    """The tune stage's time budget: None gives `DEFAULT_TUNE_BUDGET_S`; 0: no time limit
    (trials alone bound it); a positive number is taken as asked."""
    if budget_s is None:
        return DEFAULT_TUNE_BUDGET_S
    if budget_s < 0:
        raise ValueError(f"tune budget {budget_s}: expected seconds >= 0 (0: no time limit)")
    return float(budget_s) or None


def train_budget(steps: int | None, *, gpus: int) -> Budget:
    """LoRA training steps with ``gpus`` GPUs here. None: 20 on GPUs, none on the CPU (it
    trains there with gloo when asked to, seconds per step)."""
    n = steps if steps is not None else (DEFAULT_GPU_TRAIN_STEPS if gpus else 0)
    if n > 0:
        return Budget(n)
    return Budget(n, "skipped: no GPU (set train_steps, `onboard run --train-steps N`, to train "
                     "on the CPU with gloo)" if not gpus else "skipped: train_steps is 0")


def train_layout(nproc: int, n_experts: int | None) -> tuple[int, int]:
    """(ep, fsdp) for ``nproc`` processes: experts split over every rank when they divide
    evenly, else over the largest divisor of both; the rest of the world shards dense params."""
    ep = 1
    if n_experts:
        ep = max(d for d in range(1, nproc + 1) if nproc % d == 0 and n_experts % d == 0)
    return ep, nproc // ep


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """Where and how training runs: processes, the EP x FSDP split, dtype and device."""

    nproc: int
    ep: int
    fsdp: int
    dtype: str
    device: str


def train_plan(graph: OpGraph, *, gpus: int, nproc: int | None = None) -> TrainPlan:
    """``nproc`` processes (None: one per GPU, 2 on the CPU), split by `train_layout` over the
    graph's expert count (when all its MoE layers agree on one; else no expert parallelism);
    bf16 on GPUs, fp32 with gloo on the CPU."""
    n = nproc or (gpus if gpus else 2)
    experts = {b.attrs.get("n_experts") for b in graph.by_kind("moe.experts")}
    ep, fsdp = train_layout(n, next(iter(experts)) if len(experts) == 1 else None)
    return TrainPlan(nproc=n, ep=ep, fsdp=fsdp, dtype="bf16" if gpus else "fp32",
                     device="cuda" if gpus else "cpu")


class NextAlignment(NamedTuple):
    """The (block path, family) kernels to leave out on the next alignment attempt, and why
    there is no next attempt (None: retry)."""

    excluded: list[list[str]]
    stop: str | None


def next_exclusions(result: AlignmentResult, excluded: list[list[str]]) -> NextAlignment:
    """The kernels to leave out on the next attempt, and why there is none (None: retry).

    The next candidate for a culprit's op is, today, its torch path: every active kernel
    patched at a culprit, inside one, or around one is left out. A retry must change
    something: when a failed alignment blames no block that runs one of our kernels (a
    culprit on the model's own code, or a failure not pinned on a block), there is nothing
    to leave out, and the loop stops with that reason instead of running the same alignment
    again.
    """
    if result.passed:
        return NextAlignment([list(x) for x in excluded], None)
    culprits = [b.path for b in result.culprits("fwd") + result.culprits("bwd")]
    new = [list(x) for x in excluded]
    for r in result.patches:
        p = r["path"]
        if r.get("status") == "active" and [p, r["family"]] not in new and any(
                related(p, c) for c in culprits):
            new.append([p, r["family"]])
    if len(new) > len(excluded):
        return NextAlignment(new, None)
    if culprits:
        why = (f"no retry: the culprit{'s' if len(culprits) > 1 else ''} "
               f"{', '.join(culprits)} run{'s' if len(culprits) == 1 else ''} no kernel of ours "
               "(the model's own code), so there is no kernel to leave out")
    else:
        lg = result.logits
        why = ("no retry: no block is to blame (logits rel_rms "
               f"{lg['stats']['rel_rms']:.2e} over their bound {lg.get('max_rel_rms', 0):.1e}), "
               "nothing to leave out")
    return NextAlignment(new, why)
