"""Patch binding of attention blocks whose core is written out (softmax(QK^T)V in torch ops, with
or without a sink column) to the sink-attention kernel: the plain function the block hands its
core to is swapped for the kernel while the block runs; the projections, RoPE and the output
projection stay the block's own modules (LoRA wraps the projections as usual).

transformers' attention modules hand the core to a function of the attention interface,
``fn(module, query [B, H, Tq, D], key, value [B, Hk, Tk, D], attention_mask, scaling=...,
dropout=..., **kwargs) -> (output [B, Tq, H, D], weights)``, the block itself first: the
module-level eager function their ``forward`` names when no fused path is set. Which function is
not read from names: every function the block can reach (`onboarding.patching.callswap.
reachable`) taking at least five required positional arguments is wrapped while the block runs,
and on its first call (handed the block itself) the kernel runs on the same tensors with each
reading of what the function does (`_variants`), kept when one agrees with the original's output
within the layer tolerance; the kernel then serves that call too. Ours returns None for the
attention weights (the scores are never formed), as transformers' fused paths do.

What the function does beyond q, k, v and the mask is tried, not read from names:
- the sink: each 1-D parameter of the block (its own, not its children's) with one entry per
  query head, then each such tensor among the call's arguments, then no sink;
- the band the kernel may skip to: causal with the call's ``sliding_window`` argument as the
  window when it is a positive integer (the attention interface's keyword: transformers' fused
  paths read the layer's window from it), then causal, then not causal.
The mask itself is always handed to the kernel, so the band only saves work: a band wider than
the mask's is exact, a narrower one fails the first call's check when the call is longer than
the window (any integer argument was tried before: one that is no window and larger than the
first call's length would have passed that check and cut later, longer calls).
The call's scaling and dropout arguments are read by the interface's names (``scaling`` None:
head_dim ** -0.5); a dropout that is on in training, or any other named argument set (a logit
soft-cap), keeps the original function.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.callswap import Interface, bound_arguments, install, min_required
from onboarding.patching.core import PatchRecord, entry_function


def _arguments(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    """(block, q, k, v, mask, named, extra): ``fn``'s arguments bound by its own signature; the
    first five positional ones, its other named parameters, and what its ``**kwargs`` took."""
    named, extra = bound_arguments(fn, args, kwargs)
    names = list(named)
    if len(names) < 5:
        raise TypeError("fewer than five arguments")
    block, q, k, v, mask = (named.pop(n) for n in names[:5])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        raise TypeError("query, key and value are not [B, H, T, D] tensors")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError("the mask is not a tensor")
    return block, q, k, v, mask, named, extra


def _variants(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[Any, bool, int]]:
    """(sink source, causal, window) readings to try, in order (the module docstring)."""
    try:
        block, q, _, _, _, named, extra = _arguments(fn, args, kwargs)
    except TypeError:
        return [(None, True, 0)]  # the call itself says why
    heads = q.shape[1]
    sinks: list[Any] = []
    if isinstance(block, nn.Module):
        sinks += [("param", n) for n, p in block.named_parameters(recurse=False)
                  if p.dim() == 1 and p.numel() == heads]
    values = {**named, **extra}
    sinks += [("arg", n) for n, t in values.items()
              if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == heads]
    sinks.append(None)
    w = values.get("sliding_window")
    windows = [w] if isinstance(w, int) and not isinstance(w, bool) and w > 0 else []
    bands = [(True, w) for w in windows] + [(True, 0), (False, 0)]
    return [(s, c, w) for s in sinks for c, w in bands]


def _call(fn: Callable, kernel: Callable, args: tuple, kwargs: dict, variant: Any) -> Any:
    """``kernel`` on ``fn``'s arguments under one reading ``variant``: (output [B, Tq, H, D], None)."""
    block, q, k, v, mask, named, extra = _arguments(fn, args, kwargs)
    source, causal, window = variant
    scale = named.pop("scaling", extra.pop("scaling", None))
    dropout = named.pop("dropout", extra.pop("dropout", 0.0))
    if dropout and getattr(block, "training", False):
        raise TypeError(f"attention dropout {dropout} in training: the kernel does not drop")

    def is_set(name: str, val: Any) -> bool:  # an argument that may change the maths
        if val is None or val is False:
            return False
        if isinstance(val, torch.Tensor):
            return source != ("arg", name)
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return val != 0 and not (isinstance(val, int) and val == window)
        return True

    unknown = [n for n, val in named.items() if is_set(n, val)]
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    sinks = None
    if source is not None:
        where, name = source
        sinks = getattr(block, name) if where == "param" else {**named, **extra}[name]
    o = kernel(q, k, v, sinks, mask, None if scale is None else float(scale), causal, window)
    return o.transpose(1, 2).contiguous(), None


def _judged(ref: Any) -> Any:
    """The original's (output, weights): the output is judged, the weights are not formed."""
    if isinstance(ref, tuple) and len(ref) == 2:
        return ref[0], None
    return ref


ATTENTION_CORE = Interface(what="attention-core", fits=min_required(5), call=_call, variants=_variants,
                           takes_block=True, judged=_judged)


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    return install(module, entry_function(kernels[0]), record, ATTENTION_CORE,
                   "the block calls no attention-interface-like function "
                   "(module, query, key, value, attention_mask, ...); its core runs inline")
