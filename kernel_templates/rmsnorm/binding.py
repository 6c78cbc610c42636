"""Patch binding of `norm.rms` and `norm.rms_gated` blocks to the rmsnorm kernel.

  - ``norm.rms``: ``forward(x)`` -> ``rmsnorm(x, w, eps)`` (``unit_offset`` rendered in), or
    ``rmsnorm(x, eps)`` for a kernel rendered without a weight, bound only to a module that has
    no parameters of its own;
  - ``norm.rms_gated``: ``forward(x, z)`` -> ``rmsnorm_gated(x, z, w, eps)``, which argument is
    the gate left to calibration (`onboarding.patching.core.calibrated`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, calibrated, entry_function


def _weight_1d(module: nn.Module) -> nn.Parameter | None:
    ps = [p for p in module.parameters(recurse=False) if p.ndim == 1]
    return ps[0] if len(ps) == 1 else None


def _takes_weight(kmod: ModuleType) -> bool:
    """Whether a rendered norm module's entry takes a weight: not `l2norm`, nor `plain` rendered
    with ``has_weight=False`` (read off its render params, not its argument names)."""
    params = getattr(kmod, "PARAMS", None) or {}
    return getattr(kmod, "VARIANT", None) != "l2norm" and bool(params.get("has_weight", True))


def norm_bindings(block: Block, module: nn.Module, fn: Callable, weighted: bool = True
                   ) -> dict[str, Callable]:
    """Bindings of a norm block to ``fn``; ``weighted``: the kernel takes the module's weight."""
    eps = block.attrs.get("eps") or 1e-6
    if not weighted:
        # A weightless kernel on a module that owns a weight would ignore it, and calibration
        # could not tell while that weight is still all ones (its usual init): refused.
        if block.kind != "norm.rms" or next(module.parameters(recurse=False), None) is not None:
            return {}
        return {"x (no weight)": lambda x, *a, **k: fn(x, eps=eps)}
    if _weight_1d(module) is None:
        return {}
    # The weight is looked up at call time: FSDP2 swaps a sharded module's parameters.
    if block.kind == "norm.rms":
        return {"x": lambda x, *a, **k: fn(x, _weight_1d(module), eps)}

    def gated(i: int, j: int):
        def call(*args, **kwargs):
            tensors = list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            return fn(tensors[i], tensors[j], _weight_1d(module), eps)
        return call

    return {"x=arg0, z=arg1": gated(0, 1), "x=arg1, z=arg0": gated(1, 0)}


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    kmod = kernels[0]
    return calibrated(module, record, norm_bindings(block, module, entry_function(kmod), _takes_weight(kmod)))
