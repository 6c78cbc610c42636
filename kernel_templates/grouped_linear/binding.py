"""Patch binding of split-by-size per-expert linears (`moe.experts` blocks with `layout:
"split_linear"`) to the `grouped_linear` kernel.

The block's forward takes rows sorted by expert and the per-expert sizes, in any argument order
and as a Python list of ints (transformers' JetMoeParallelExperts: ``forward(inputs,
expert_size)``), a tuple, or an integer tensor. The binding finds the one floating tensor (x) and
the sizes, turns a list into an int64 tensor on x's device (the kernel reads the counts on the
device), and calls ``grouped_linear(x, counts, weight)`` with the block's weight looked up by name
at call time (FSDP2 swaps a sharded module's parameters). Like every patch it calibrates on its
first call against the block's own output (`onboarding.patching.core.calibrated`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, calibrated, entry_function


def _is_sizes(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dim() == 1 and not v.is_floating_point() and not v.is_complex()
    return isinstance(v, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) for s in v)


def split_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | list[int]]:
    """(x, sizes) of a split-linear call: the one floating tensor and the one list/tuple of ints
    or 1-D integer tensor among the arguments; ValueError otherwise (the binding then fails
    calibration and the block stays unpatched)."""
    values = [*args, *kwargs.values()]
    xs = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    sizes = [v for v in values if _is_sizes(v)]
    if len(xs) != 1 or len(sizes) != 1:
        raise ValueError(f"expected one float tensor and one list of sizes; got {len(xs)} and {len(sizes)}")
    return xs[0], sizes[0]


def grouped_linear_bindings(block: Block, module: nn.Module, fn: Callable) -> dict[str, Callable]:
    """{description: call} for the block, empty when its weight is not the one 3-D parameter
    [n_experts, out_features, in_features] the classifier recorded."""
    name = block.attrs.get("weight")
    own = dict(module.named_parameters(recurse=False))
    w = own.get(name) if name else None
    want = [block.attrs.get("n_experts"), block.attrs.get("out_features"), block.attrs.get("in_features")]
    if w is None or len(own) != 1 or list(w.shape) != want:
        return {}

    def call(*args, **kwargs):
        x, sizes = split_args(args, kwargs)
        if x.dim() != 2:
            raise ValueError(f"expected rows x [S, K], got {tuple(x.shape)}")
        counts = sizes.to(x.device) if isinstance(sizes, torch.Tensor) else \
            torch.as_tensor(sizes, dtype=torch.int64, device=x.device)
        return fn(x, counts, getattr(module, name))

    return {f"x, sizes -> counts [E] on x's device; {name} [E, N, K]": call}


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    return calibrated(module, record, grouped_linear_bindings(block, module, entry_function(kernels[0])))
