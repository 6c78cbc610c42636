"""Patch binding of `norm.layer` blocks (written in torch ops; a fused ``F.layer_norm`` is left to
torch) to the layernorm kernel: ``forward(x)`` -> ``layernorm(x, w, [b,] eps)``, weight and bias
told apart by calibration (`onboarding.patching.core.calibrated`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, calibrated, entry_function


def layer_norm_bindings(block: Block, module: nn.Module, fn: Callable, bias: bool
                         ) -> dict[str, Callable]:
    """``forward(x)`` -> ``fn(x, weight[, bias], eps)`` for a module whose own parameters are
    exactly the 1-D weight, or weight and bias when the kernel was rendered with ``bias`` (which
    is which is left to calibration: with the usual ones / zeros init the swapped binding
    outputs the bias, never the norm). An eps the classifier did not read is left to the
    kernel's rendered default."""
    names = [n for n, p in module.named_parameters(recurse=False) if p.ndim == 1]
    if len(names) != len(list(module.parameters(recurse=False))) or len(names) != 1 + bias:
        return {}
    eps = block.attrs.get("eps")
    extra = () if eps is None else (eps,)

    def bind(*order: str):
        # looked up by name at call time: FSDP2 swaps a sharded module's parameters
        return lambda x, *a, **k: fn(x, *(getattr(module, n) for n in order), *extra)

    if len(names) == 1:
        return {f"x, weight={names[0]}": bind(*names)}
    a, b = names
    return {f"x, weight={a}, bias={b}": bind(a, b), f"x, weight={b}, bias={a}": bind(b, a)}


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`): the bias when the kernel was
    rendered with ``has_bias``."""
    kmod = kernels[0]
    bias = bool(getattr(kmod, "PARAMS", {}).get("has_bias"))
    return calibrated(module, record, layer_norm_bindings(block, module, entry_function(kmod), bias))
