"""In alignment's fp64 reference, fp32 is fp64.

Models upcast for precision with ``.float()`` or ``.to(torch.float32)`` (norms, routers, the
softmax of a score) and accumulate in buffers they create as fp32 (``torch.zeros_like(h,
dtype=torch.float32)``): in a bf16 or fp32 model that is a step up or a no-op. In the fp64
reference it would be a step *down*, and the model's fp32 islands then meet fp64 weights and
tensors: Inkling 2's router (``F.linear`` of its ``hidden_states.float()`` and an fp64 weight)
and its experts (``index_add_`` of fp64 outputs into an fp32 buffer) stopped the reference run.
Inside `keep_float64` a cast of a floating tensor to fp32 gives fp64, and a call asked for
``dtype=torch.float32`` gets fp64, so the reference computes in fp64 throughout. Casts to other
dtypes (bf16, integers), and casts that also move or copy, are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type}


def _to_float32(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call only casts its floating tensor to fp32 (no device or copy option)."""
    if not (args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
        return False
    if func is torch.Tensor.float:
        return len(args) == 1 and not kwargs
    rest = [*args[1:], *kwargs.values()]
    if func is torch.Tensor.type:
        return len(rest) == 1 and rest[0] in (torch.float32, "torch.FloatTensor")
    # Tensor.to(dtype) / .to(dtype=...); .to(device, dtype) and copy/non_blocking do more
    return len(rest) == 1 and rest[0] is torch.float32


class _Float32IsFloat64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS and _to_float32(func, args, kwargs):
            return args[0].to(torch.float64)
        if kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_float64(dtype: torch.dtype) -> Iterator[None]:
    """Inside: fp32 casts and fp32 requests give fp64, when ``dtype`` (the run's) is fp64."""
    if dtype != torch.float64:
        yield
        return
    with _Float32IsFloat64():
        yield
