"""Patch binding of `moe.experts` blocks with packed 3-D weights to the experts kernel:
``forward(x, indices, weights)`` -> the grouped-GEMM experts kernel, with the weights found by
their shapes and converted to the kernel's layout where the classifier read another
(`onboarding.patching.core._experts_bindings`, which expert parallelism uses too); identity ("zero")
expert slots go to the kernel with weight 0 and their r * x is added in torch.

A `module_list` block (a list of per-expert MLPs the owner calls expert by expert, routing
inline) is served member by member with the members' weights stacked into the packed layout
(`onboarding.patching.expert_list`): the owner's own routing picks each member's rows and weighs
its output.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import (
    PatchRecord,
    _experts_bindings,
    calibrated,
    entry_function,
)
from onboarding.patching.expert_list import module_list_bindings


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`): biases only to a kernel rendered
    with ``bias``."""
    kmod = kernels[0]
    if block.attrs.get("layout") == "module_list":
        return module_list_bindings(module, entry_function(kmod), record, block.attrs.get("gated"))
    bias = bool(getattr(kmod, "PARAMS", {}).get("bias"))
    return calibrated(module, record, _experts_bindings(module, entry_function(kmod), block, bias))
