"""Patch binding: a gate-first norm module's ``forward(x, z)`` -> ``rmsnorm_gate_first(x, z, w, eps)``.

Which of the two inputs is the gate is not in the op graph: both orders are offered, and the
library's first-call calibration (`onboarding.patching.core.calibrated`) keeps the one whose output
matches the module's own, or leaves the block unpatched and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, calibrated, entry_function


def _weight(module: nn.Module) -> nn.Parameter | None:
    ps = [p for p in module.parameters(recurse=False) if p.ndim == 1]
    return ps[0] if len(ps) == 1 else None


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook: see `onboarding.patching.core.patch_model`."""
    if _weight(module) is None:
        return calibrated(module, record, {})  # rejected: the structure does not fit the kernel
    fn, eps = entry_function(kernels[0]), block.attrs.get("eps") or 1e-6

    def call(i: int, j: int) -> Callable:
        def run(*args, **kwargs):
            tensors = list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            # the weight is looked up at call time: FSDP2 swaps a sharded module's parameters
            return fn(tensors[i], tensors[j], _weight(module), eps)
        return run

    return calibrated(module, record, {"x=arg0, z=arg1": call(0, 1), "x=arg1, z=arg0": call(1, 0)})
