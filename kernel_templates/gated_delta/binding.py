"""Patch binding of linear-attention blocks to the chunked delta-rule kernel: the plain function the
block hands its recurrence to is swapped for the kernel while the block runs, each reachable
candidate calibrated on its first call (`onboarding.patching.linear_attention`). The per-channel
family (`extends` this one) binds the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from torch import nn

from onboarding.patching.linear_attention import patch_linear_attention
from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, entry_function


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    return patch_linear_attention(module, entry_function(kernels[0]), record)
