"""Planted errors: make one block of a model wrong in a known way, to show that a check fails.

A check that has never been seen to fail proves nothing. These wrap a module's ``forward``
(the kernel-backed module a patch put there, or any block) so that it is wrong the way a buggy
kernel is wrong, while keeping shapes, dtypes and plausible values:

- ``scale``: the forward output, or (``direction="bwd"``) the gradient flowing back into the
  block, is scaled by ``1 + amount`` (a uniform error of ``amount``, e.g. 0.02);
- ``sign``: the gradient w.r.t. the block's first floating input has the wrong sign (backward);
- ``row``: one row of the forward output (the last token, where boundary bugs live) holds the
  row before it (an off-by-one).

`plant` returns a function that takes the plant out again. The first floating tensor of the
output is the one made wrong (attention blocks return (output, weights)).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["KINDS", "plant"]

KINDS = ("scale", "sign", "row")


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.factor, None


def _first_float(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, bool]:
    """``obj`` with ``fn`` applied to its first floating tensor (depth-first), and whether one was
    found."""
    if isinstance(obj, torch.Tensor):
        return (fn(obj), True) if obj.is_floating_point() else (obj, False)
    if isinstance(obj, (tuple, list)):
        out, done = [], False
        for o in obj:
            if not done:
                o, done = _first_float(o, fn)
            out.append(o)
        return (tuple(out) if isinstance(obj, tuple) else out), done
    if isinstance(obj, dict):  # also transformers' ModelOutput
        for k, v in obj.items():
            new, done = _first_float(v, fn)
            if done:
                obj[k] = new
                return obj, True
    return obj, False


def _row_off(y: torch.Tensor) -> torch.Tensor:
    if y.dim() < 2 or y.shape[-2] < 2:
        raise ValueError(f"a 'row' plant needs an output with >= 2 rows, got {tuple(y.shape)}")
    rows = torch.arange(y.shape[-2], device=y.device)
    rows[-1] = rows[-2]
    return y.index_select(-2, rows)


def plant(module: nn.Module, kind: str, amount: float = 0.0, direction: str = "fwd"
          ) -> Callable[[], None]:
    """Make ``module`` wrong by ``kind`` (see the module docstring); returns the undo."""
    if kind not in KINDS:
        raise ValueError(f"plant kind {kind!r}: expected one of {KINDS}")
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"plant direction {direction!r}: expected 'fwd' or 'bwd'")
    if kind == "sign" and direction != "bwd" or kind == "row" and direction != "fwd":
        raise ValueError(f"a {kind!r} plant is {'backward' if kind == 'sign' else 'forward'} only")
    original = module.forward

    def forward(*args, **kwargs):
        if kind == "sign":
            args, found = _first_float(args, lambda x: _ScaleGrad.apply(x, -1.0))
            if not found:
                kwargs, found = _first_float(kwargs, lambda x: _ScaleGrad.apply(x, -1.0))
            if not found:
                raise ValueError("a 'sign' plant needs a floating input")
            return original(*args, **kwargs)
        out = original(*args, **kwargs)
        if kind == "row":
            fn = _row_off
        elif direction == "fwd":
            def fn(y):
                return y * (1 + amount)
        else:
            def fn(y):
                return _ScaleGrad.apply(y, 1 + amount)
        out, found = _first_float(out, fn)
        if not found:
            raise ValueError(f"{type(module).__name__} returned no floating tensor to plant in")
        return out

    from onboarding.patching.core import swap_forward

    return swap_forward(module, forward)
