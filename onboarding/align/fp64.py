"""In alignment's fp64 reference, fp32 is fp64.

Models upcast for precision with ``.float()`` or ``.to(torch.float32)`` (norms, routers, the
softmax of a score) and accumulate in buffers they create as fp32 (``torch.zeros_like(h,
dtype=torch.float32)``): in a bf16 or fp32 model that is a step up or a no-op. In the fp64
reference it would be a step *down*, and the model's fp32 islands then meet fp64 weights and
tensors: Inkling 2's router (``F.linear`` of its ``hidden_states.float()`` and an fp64 weight)
and its experts (``index_add_`` of fp64 outputs into an fp32 buffer) stopped the reference run.
Inside `keep_float64` every fp32 a torch function is handed (``.to(torch.float32, ...)``,
``dtype=torch.float32``) is fp64 and ``.float()`` is ``.double()``, so the reference computes in
fp64 throughout, its fp32 islands included (before, Qwen3-Next's torch gated delta rule, which
casts its inputs to fp32, ran in fp32 inside the fp64 reference). Other dtypes are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _swap(v: Any) -> Any:
    return torch.float64 if v is torch.float32 else v


class _Float32IsFloat64(TorchFunctionMode):
    """Every torch.float32 handed to a torch function (a cast's dtype, a factory's ``dtype=``)
    becomes torch.float64, and ``Tensor.float()`` is ``Tensor.double()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return torch.Tensor.to(args[0], torch.float64, **kwargs)
        args = tuple(_swap(a) for a in args)
        kwargs = {k: _swap(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_float64(dtype: torch.dtype) -> Iterator[None]:
    """Inside: fp32 is fp64 (`_Float32IsFloat64`), when ``dtype`` (the run's) is fp64."""
    if dtype != torch.float64:
        yield
        return
    with _Float32IsFloat64():
        yield
