"""Patch binding of Mamba-2 mixer cores to the chunked SSD kernel: the plain function the mixer
hands its chunked scan to is swapped for the kernel while the mixer runs.

A Mamba-2 mixer computes its projections, causal conv, gate and norm itself (they stay torch
modules: LoRA-able, and the conv may be served by the conv1d family) and hands the selective
scan to one plain function with the chunked-scan interface (x [B, T, H, P], dt [B, T, H], A [H],
B and C [B, T, G, N], then chunk size, D, dt bias, softplus, dt limits, initial states): a
module-level function in transformers' models, the same name bound to a hub or package kernel
when one is installed. Which function is not read from names: every function the mixer's
``forward`` or its helpers name, and its instance attributes (`onboarding.patching.callswap.
reachable`), taking at least five required positional arguments is wrapped while the mixer
runs (a helper handed the mixer itself passes through); on its first call a wrapper binds the
arguments by the function's own signature, runs our kernel on the same tensors, and keeps the
swap only when the outputs agree with the original's within the layer tolerance of the inputs'
dtype (and then serves that first call too, so a single patched forward and backward runs the
kernel).
Arguments the kernel does not take (a gate ``z``, sequence indices or offsets for packed
sequences) keep the original function. The output is returned in the dtype the original
returned (transformers' torch path computes and returns fp32).
`refusal` runs the same tests (`unknown_arguments`) on the calls the parse stage recorded
(`callswap.record_core_calls`, the family's `probe`), so coverage says what this binding will do.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.callswap import (Interface, bound_arguments, install, min_required,
                                          recorded_refusal)
from onboarding.patching.core import PatchRecord, entry_function

# the chunked-scan interface's keywords -> ours (None: accepted and dropped: it changes rounding only)
KWARGS = {"D": "D", "dt_bias": "dt_bias", "dt_softplus": "dt_softplus", "dt_limit": "dt_limit",
          "initial_states": "initial_state", "initial_state": "initial_state", "chunk_size": None,
          "return_final_states": "return_final_state", "return_final_state": "return_final_state"}


NONE_FOUND = "the mixer calls no chunked-scan-like function"


def unknown_arguments(named: dict[str, Any], catch_all: dict[str, Any]) -> list[str]:
    """The arguments a call passed beyond the first five (``named``: its named parameters as
    passed, in order, defaults not applied; ``catch_all``: what its ``**kwargs`` took) that the
    kernel does not take: any set one (not None, not False) outside `KWARGS` (a gate, sequence
    indices, offsets: maths the kernel does not do). Reads live values and described ones
    (`callswap.describe` keeps None and False) alike."""
    return [k for k, v in [*list(named.items())[5:], *catch_all.items()]
            if k not in KWARGS and v is not None and v is not False]


def _call_ours(fn: Callable, kernel: Callable, args: tuple, kwargs: dict) -> Any:
    """``kernel`` on ``fn``'s arguments (the first five positional ones are x, dt, A, B, C)."""
    named, catch_all = bound_arguments(fn, args, kwargs, defaults=False)
    if len(named) < 5:
        raise TypeError("fewer than five arguments")
    unknown = unknown_arguments(named, catch_all)
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    pos = [named.pop(n) for n in list(named)[:5]]
    ours: dict[str, Any] = {}
    for k, v in [*named.items(), *catch_all.items()]:
        if k in KWARGS and KWARGS[k] is not None and v is not None:
            ours[KWARGS[k]] = v
    if "dt_limit" in ours:
        ours["dt_limit"] = tuple(float(v) for v in ours["dt_limit"])
    return kernel(*pos, **ours)


def call_refusal(call: dict[str, Any]) -> str | None:
    """Why the swap would keep the original function at one recorded core call
    (`callswap.record_core_calls`: its described arguments, those left at their defaults
    dropped, as the swap binds them), by the swap's own tests (`_call_ours`: five arguments,
    `unknown_arguments`), or None when the kernel takes them (calibration then judges the
    numbers; the kernel's own shape checks are not read here)."""
    defaulted = set(call.get("defaulted") or ())
    named = {n: v for n, v in call["args"].items() if n not in defaulted}
    if len(named) < 5:
        return "TypeError: fewer than five arguments"
    unknown = unknown_arguments(named, call["kwargs"])
    return f"TypeError: arguments the kernel does not take: {unknown}" if unknown else None


def refusal(found: dict[str, Any]) -> str | None:
    """Why `bind` would leave the mixer unpatched, read off what the parse stage recorded of its
    calls (``found``: `callswap.record_core_calls`'s entry for `CHUNKED_SCAN`), or None when a
    call's arguments fit: the outcomes `install` and the swaps' first calls give
    (`callswap.recorded_refusal`)."""
    return recorded_refusal(found, CHUNKED_SCAN, NONE_FOUND, call_refusal)


def _scan_call(fn: Callable, kernel: Callable, args: tuple, kwargs: dict, variant: Any) -> Any:
    return _call_ours(fn, kernel, args, kwargs)


# judged at the inputs' dtype: transformers' torch path computes and returns fp32
CHUNKED_SCAN = Interface(what="chunked-scan", fits=min_required(5), call=_scan_call,
                         input_dtype_tolerance=True)


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    return install(module, entry_function(kernels[0]), record, CHUNKED_SCAN, NONE_FOUND)
