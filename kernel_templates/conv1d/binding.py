"""Patch binding of `conv.causal1d` blocks to the conv1d kernel: the depthwise conv call made with
the block's weight, intercepted with a `TorchFunctionMode` while the owning block runs (the conv
is often an inline functional call, not a module call).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, entry_function, swap_forward


class _ConvIntercept(TorchFunctionMode):
    """Routes ``conv1d(x, w, b, padding=P, groups=C)`` with our weight to the kernel, P = K-1 (the
    conv pads itself, the caller keeps the first T steps) or 0 (the caller padded the sequence on
    the left, `left_pad`: the kernel's causal conv of the given input less its first K-1 steps)."""

    def __init__(self, weight: torch.Tensor, fn: Callable, record: PatchRecord):
        super().__init__()
        self.ptr, self.fn, self.record = weight.untyped_storage().data_ptr(), fn, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.conv1d, torch.conv1d):
            a = {**dict(zip(_CONV_ARGS, args)), **kwargs}
            x, w = a.get("input"), a.get("weight")
            if isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() == self.ptr \
                    and isinstance(x, torch.Tensor) and x.dim() == 3:
                k = w.shape[-1]
                pad = a.get("padding", 0)
                pad = pad[0] if isinstance(pad, (list, tuple)) else pad
                ones = all((v[0] if isinstance(v, (list, tuple)) else v) == 1
                           for v in (a.get("stride", 1), a.get("dilation", 1)))
                depthwise = ones and a.get("groups", 1) == w.shape[0]
                unpadded = pad == 0 and k > 1 and x.shape[-1] >= k
                if depthwise and (unpadded or (pad == k - 1 and x.shape[-1] >= k - 1)):
                    y = self.fn(x.transpose(1, 2), w.reshape(w.shape[0], k), a.get("bias"))
                    self.record.status = "active"
                    if unpadded:
                        # output t reads inputs t .. t + K - 1: the causal conv's output t + K - 1
                        # (its zero left pad is never read past step K - 2)
                        return y[:, k - 1:].transpose(1, 2)
                    # conv1d with padding K-1 returns T + K - 1 steps; callers keep the first T
                    # (that is what makes it causal). The K - 1 trailing steps only see the last
                    # K - 1 inputs: computed exactly here, so the patch is a true drop-in.
                    tail = func(x[..., x.shape[-1] - (k - 1):], w, a.get("bias"),
                                padding=k - 1, groups=w.shape[0])[..., k - 1:]
                    # joined time-major ([B, T + K - 1, C], a plain copy) and handed back as the
                    # [B, C, T + K - 1] view: the caller's usual slice and transpose back to
                    # [B, T, C] then read it contiguously, with no transposing copies after. The
                    # values are conv1d's; the strides are not: a caller that `.view`s the result
                    # merging the batch and channel dims would need `.reshape` (none of the
                    # mixers we know does; each slices the time axis first)
                    return torch.cat([y, tail.transpose(1, 2)], dim=1).transpose(1, 2)
        return func(*args, **kwargs)


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`): the intercept on the block's
    parent module (the conv runs inside the nearest ancestor that is a module call)."""
    weight = dict(model.named_parameters()).get(block.path + ".weight")
    if weight is None:
        record.status, record.detail = "rejected", "no weight parameter at the block path"
        return None
    owner_path = block.path.rsplit(".", 1)[0] if "." in block.path else ""
    owner = model.get_submodule(owner_path)
    original = owner.forward
    intercept = _ConvIntercept(weight, entry_function(kernels[0]), record)

    def forward(*args, **kwargs):
        # FSDP2 swaps parameters (sharded outside, unsharded inside forward): match the weight
        # the conv module holds now.
        intercept.ptr = module.weight.untyped_storage().data_ptr()
        with intercept:
            return original(*args, **kwargs)

    record.binding = (f"conv1d calls with {block.path}.weight inside {owner_path or 'model'}"
                      + (f" (unpadded, after the caller's left pad of {block.attrs['left_pad']})"
                         if block.attrs.get("left_pad") is not None else ""))
    return swap_forward(owner, forward)
