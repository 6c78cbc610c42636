"""Onboard kernels inside the training model: render, check on this device, patch by structure.

Rank 0 renders a candidate for every coverable block of the op graph into
``<out>/train/kernels/`` and checks each against its reference on the device (forward and every
gradient); the other ranks wait and load the verdicts. Only passing candidates are patched, with
the same structural patcher that alignment uses, and every patch calibrates on its first call.
Blocks that expert parallelism owns (``moe.experts``, and the router whose outputs it taps) are
left to it.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch import nn

from onboarding.opgraph import OpGraph

EP_OWNED = frozenset({"moe.experts", "moe.router"})


def patch_kernels(model: nn.Module, graph: OpGraph, root: Path, *, rank: int,
                  distributed: bool, exclude: frozenset[str] = EP_OWNED):
    """Patch passing candidates into ``model``; returns the `PatchSet`."""
    from onboarding.generate import (check_candidate, kernels_for, load_candidates,
                                     render_candidates, save_candidates)
    from onboarding.patching import PATCHABLE, patch_model
    from onboarding.registry import build_coverage

    coverage = build_coverage(graph)
    verdicts = root / "candidates.json"
    if rank == 0 and not verdicts.exists():  # a resumed run keeps the first run's verdicts
        cands = [check_candidate(c, c.shapes) for c in render_candidates(coverage, root)]
        save_candidates(cands, verdicts)
    if distributed:
        dist.barrier()
    cands = load_candidates(verdicts)
    kinds = {k for k in PATCHABLE if k not in exclude}
    return patch_model(model, graph, kernels_for(coverage, cands), kinds=kinds)


def summary(patches) -> dict[str, int]:
    """Active patches per block kind, and how many were rejected."""
    out: dict[str, int] = {}
    for r in patches.records:
        key = r.kind if r.status == "active" else f"{r.status}:{r.kind}"
        out[key] = out.get(key, 0) + 1
    return out
