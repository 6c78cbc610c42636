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
The mask is handed to the kernel unless it adds nothing to the reading's band (`band_mask`: its
values are 0 / True at every (query, key) the band lets through, read once per mask object and
re-read when the object, its shapes or its contents change): transformers' pure causal and
sliding-window masks are left out (on the H100 reading them cost 1.6-2.1x the band alone), a
mask with padding or any other information is kept. The band only saves work then: a band wider
than the mask's is exact, a narrower one fails the first call's check when the call is longer
than the window (any integer argument was tried before: one that is no window and larger than
the first call's length would have passed that check and cut later, longer calls).
The call's scaling and dropout arguments are read by the interface's names (``scaling`` None:
head_dim ** -0.5); a dropout that is on in training, or any other named argument set (a position
bias), keeps the original function.

The logit soft-cap, s -> c tanh(s / c) after the scaling and before the mask (Gemma 2's
attn_logit_softcapping), is read from the call too, by the interface's keyword ``softcap`` (a
named parameter of the function or one its ``**kwargs`` took; transformers' fused paths read it
there), never from the model: a positive finite number is the kernel's cap, None (or no such
argument, or 0) none. Whether the core caps its scores is structure the parse stage saw
(``unfused_core["softcap"]``: a tanh over the [.., T, T] scores), and it decides the readings
(`cap_readings`), since the first call's check cannot: tanh(s / c) is nearly linear while the
scores are small against c (a fresh proxy's), so a kernel with the cap and one without can both
agree with it. A capped core is tried only with the call's cap and is refused when the call
names none the kernel can take (`cap_problem`: a cap written into the function, a tensor, a
negative number); an uncapped one only without a cap (a ``softcap`` parameter it was handed then
counts as an argument the kernel does not take); with no graph to say (a swap installed by
hand), the call's cap first, then none.

The tests on a call's arguments (`structure_problem`, `cap_problem`, `readings`,
`unknown_arguments`) read them
as `callswap.describe` writes them, so `refusal` runs the same tests on the calls the parse stage
recorded (`callswap.record_core_calls`, the family's `probe`): coverage then says what this
binding will do with the block (the family's `refusal` and `match`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from types import ModuleType
from typing import Any

from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.callswap import (Interface, bound_arguments, describe, install,
                                          is_tensor, min_required, recorded_refusal)
from onboarding.patching.core import PatchRecord, entry_function

from .band_mask import MaskGuard


# verdicts on the masks the swaps are handed (`band_mask.MaskGuard`; keyed by the mask object,
# its version, shapes and the band, so one guard serves every bound block)
MASKS = MaskGuard()

NONE_FOUND = ("the block calls no attention-interface-like function (module, query, key, value, "
              "attention_mask, ...); its core runs inline")


def structure_problem(args: dict[str, Any]) -> str | None:
    """Why a call's bound named arguments (described, `callswap.describe`) are not the attention
    interface's (block, query, key, value, attention_mask, ...), or None."""
    names = list(args)
    if len(names) < 5:
        return "fewer than five arguments"
    if not all(is_tensor(args[n], 4) for n in names[1:4]):
        return "query, key and value are not [B, H, T, D] tensors"
    if args[names[4]] is not None and not is_tensor(args[names[4]]):
        return "the mask is not a tensor"
    return None


def _arguments(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    """(block, q, k, v, mask, named, extra): ``fn``'s arguments bound by its own signature; the
    first five positional ones, its other named parameters, and what its ``**kwargs`` took."""
    named, extra = bound_arguments(fn, args, kwargs)
    problem = structure_problem({n: describe(v) for n, v in named.items()})
    if problem:
        raise TypeError(problem)
    names = list(named)
    block, q, k, v, mask = (named.pop(n) for n in names[:5])
    return block, q, k, v, mask, named, extra


SOFTCAP = "softcap"  # the attention interface's keyword for the logit soft-cap
CAPPED_UNREAD = ("the scores pass through a tanh (a logit soft-cap) but the call names no softcap the "
                 "kernel can take")


def _call_values(args: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments past the interface's first five: its named ones, then its ``**kwargs``."""
    return {**{n: args[n] for n in list(args)[5:]}, **kwargs}


def _is_cap(val: Any) -> bool:
    return isinstance(val, (int, float)) and not isinstance(val, bool) and 0 < val < float("inf")


def _no_cap(val: Any) -> bool:
    """None, or 0 (flash-attn's softcap=0.0: no soft-cap)."""
    return val is None or (isinstance(val, (int, float)) and not isinstance(val, bool) and val == 0)


def cap_problem(values: dict[str, Any], capped: bool | None) -> str | None:
    """Why a call's soft-cap (``values``: its described arguments past the first five,
    `_call_values`) cannot be the kernel's, on a core that caps its scores or may (``capped``, the
    graph's ``unfused_core["softcap"]``; None: not known), or None."""
    val = values.get(SOFTCAP)
    if not _no_cap(val) and not _is_cap(val):
        return f"softcap {val!r}: the kernel's cap is a positive finite number c (c tanh(s / c))"
    if capped and not _is_cap(val):
        return CAPPED_UNREAD
    return None


def cap_readings(values: dict[str, Any], capped: bool | None) -> list[float]:
    """The soft-caps to try (0.0: none), in order (the module docstring): the call's own where it
    is one (`_is_cap`) and the core may cap (``capped`` True or None), then none where the core
    may be uncapped (``capped`` False or None)."""
    val = values.get(SOFTCAP)
    caps = [float(val)] if capped is not False and _is_cap(val) else []
    return caps + ([0.0] if capped is not True else [])


def readings(args: dict[str, Any], kwargs: dict[str, Any], vectors: dict[str, int],
             capped: bool | None = None) -> list[tuple[Any, bool, int, float]]:
    """(sink source, causal, window, softcap) readings to try, in order (the module docstring),
    from a call's described arguments (`callswap.describe`: ``args`` its named parameters, the
    first five the interface's, ``kwargs`` what its ``**kwargs`` took), the block's own 1-D
    parameters (``vectors``: name -> entries) and whether its core caps its scores (``capped``,
    `cap_readings`)."""
    names = list(args)
    heads = args[names[1]]["tensor"][1]
    sinks: list[Any] = [("param", n) for n, size in vectors.items() if size == heads]
    values = _call_values(args, kwargs)
    sinks += [("arg", n) for n, d in values.items() if is_tensor(d, 1) and d["tensor"][0] == heads]
    sinks.append(None)
    w = values.get("sliding_window")
    windows = [w] if isinstance(w, int) and not isinstance(w, bool) and w > 0 else []
    bands = [(True, w) for w in windows] + [(True, 0), (False, 0)]
    caps = cap_readings(values, capped)
    return [(s, c, w, cap) for cap in caps for s in sinks for c, w in bands]


def unknown_arguments(named: dict[str, Any], variant: tuple[Any, bool, int, float]) -> list[str]:
    """The function's own named arguments past the first five (described), other than scaling
    and dropout, that may change the maths under ``variant`` and that the kernel does not take:
    a tensor other than the reading's sink, a non-zero number other than its window and its
    soft-cap (``softcap``), any other set value. The swap keeps the original function when there
    are any (`_call`)."""
    source, _, window, softcap = variant

    def is_set(name: str, val: Any) -> bool:
        if val is None or val is False:
            return False
        if is_tensor(val):
            return source != ("arg", name)
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            if name == SOFTCAP and softcap and val == softcap:
                return False
            return val != 0 and not (isinstance(val, int) and val == window)
        return True

    return [n for n, val in named.items() if n not in ("scaling", "dropout") and is_set(n, val)]


def _vectors(block: Any) -> dict[str, int]:
    """The block's own 1-D parameters (name -> entries): the sink candidates."""
    if not isinstance(block, nn.Module):
        return {}
    return {n: p.numel() for n, p in block.named_parameters(recurse=False) if p.dim() == 1}


def _variants(fn: Callable, args: tuple, kwargs: dict, capped: bool | None = None
              ) -> list[tuple[Any, bool, int, float]]:
    """(sink source, causal, window, softcap) readings to try, in order (the module docstring)."""
    try:
        block = _arguments(fn, args, kwargs)[0]
        named, extra = bound_arguments(fn, args, kwargs)
    except TypeError:
        return [(None, True, 0, 0.0)]  # the call itself says why
    found = readings({n: describe(v) for n, v in named.items()},
                     {n: describe(v) for n, v in extra.items()}, _vectors(block), capped)
    return found or [(None, True, 0, 0.0)]  # no cap to read: the call says why (`cap_problem`)


def _call(fn: Callable, kernel: Callable, args: tuple, kwargs: dict, variant: Any,
          capped: bool | None = None) -> Any:
    """``kernel`` on ``fn``'s arguments under one reading ``variant``: (output [B, Tq, H, D],
    None); ``capped``: whether the core caps its scores (`cap_problem`). The soft-cap is handed to
    the kernel only when the reading has one (an entry without the argument serves the rest)."""
    block, q, k, v, mask, named, extra = _arguments(fn, args, kwargs)
    problem = cap_problem({n: describe(val) for n, val in {**named, **extra}.items()}, capped)
    if problem:
        raise TypeError(problem)
    source, causal, window, softcap = variant
    scale = named.pop("scaling", extra.pop("scaling", None))
    dropout = named.pop("dropout", extra.pop("dropout", 0.0))
    if dropout and getattr(block, "training", False):
        raise TypeError(f"attention dropout {dropout} in training: the kernel does not drop")
    unknown = unknown_arguments({n: describe(val) for n, val in named.items()}, variant)
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    sinks = None
    if source is not None:
        where, name = source
        sinks = getattr(block, name) if where == "param" else {**named, **extra}[name]
    mask = MASKS.needed(mask, q, k, causal, window)
    o = kernel(q, k, v, sinks, mask, None if scale is None else float(scale), causal, window,
               *((softcap,) if softcap else ()))
    return o.transpose(1, 2).contiguous(), None


def call_refusal(call: dict[str, Any], vectors: dict[str, int], capped: bool | None = None) -> str | None:
    """Why the swap would keep the original function at this recorded core call
    (`callswap.record_core_calls`; ``vectors``: the block's own 1-D parameters; ``capped``: whether
    the core caps its scores), by the same tests its calls run (`structure_problem`,
    `cap_problem`, `readings`, `unknown_arguments`), or None when some reading takes its arguments
    (calibration then judges the numbers). Not read here: dropout in training (the probe runs in
    eval mode) and the numbers themselves."""
    if "error" in call:
        return call["error"]
    args, kwargs = call["args"], call["kwargs"]
    problem = structure_problem(args) or cap_problem(_call_values(args, kwargs), capped)
    if problem:
        return f"TypeError: {problem}"
    rest = {n: args[n] for n in list(args)[5:]}
    first = None
    for variant in readings(args, kwargs, vectors, capped):
        unknown = unknown_arguments(rest, variant)
        if not unknown:
            return None
        first = first or unknown
    return f"TypeError: arguments the kernel does not take: {first}"


def refusal(found: dict[str, Any], vectors: dict[str, int], capped: bool | None = None) -> str | None:
    """Why `bind` would leave the block unpatched, read off what the parse stage recorded of its
    calls (``found``: `callswap.record_core_calls`'s entry for `ATTENTION_CORE`), or None when a
    call's arguments fit: `callswap.recorded_refusal` with this binding's `call_refusal` (the
    same outcomes as `install` and the swaps' first calls; ``capped`` as `bind` reads it)."""
    return recorded_refusal(found, ATTENTION_CORE, NONE_FOUND,
                            lambda call: call_refusal(call, vectors, capped))


def _judged(ref: Any) -> Any:
    """The original's (output, weights): the output is judged, the weights are not formed."""
    if isinstance(ref, tuple) and len(ref) == 2:
        return ref[0], None
    return ref


ATTENTION_CORE = Interface(what="attention-core", fits=min_required(5), call=_call, variants=_variants,
                           takes_block=True, judged=_judged)


def capped(block: Any) -> bool | None:
    """Whether the block's core caps its scores, as the parse stage saw it (``unfused_core``'s
    ``softcap``: a tanh over the [.., T, T] scores); None without a written-out core recorded."""
    core = block.attrs.get("unfused_core")
    return None if core is None else bool(core.get("softcap"))


def interface(cap: bool | None) -> Interface:
    """`ATTENTION_CORE` with its readings and calls for a core that caps its scores or not
    (``cap``, `capped`)."""
    if cap is None:
        return ATTENTION_CORE
    return replace(ATTENTION_CORE, call=partial(_call, capped=cap), variants=partial(_variants, capped=cap))


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    return install(module, entry_function(kernels[0]), record, interface(capped(block)), NONE_FOUND)
