"""Patch binding of Mamba-1 mixers to the selective-scan kernel: the plain function the mixer hands
its scan core to is swapped for the kernel while the mixer runs; the projections, the conv and
any B/C/dt norms stay the model's own modules (so LoRA wraps the projections as usual).

Which function is not read from names: every plain function the mixer can reach (its instance
attributes, and the module-level functions its ``forward`` or the helpers it calls name:
`onboarding.patching.callswap.reachable`) that takes exactly five
required positional arguments (u, delta, A, B, C: the selective-scan interface of mamba_ssm,
which transformers' torch fallback keeps, followed by D, z, delta_bias, delta_softplus,
return_last_state) is wrapped. On its first call a wrapper runs the original and the kernel on
the same tensors and keeps the swap when every output agrees within the layer tolerance of its
dtype; otherwise that function stays as it is. A mixer where no function was swapped after its
first call is reported as rejected. The mechanism is `onboarding.patching.callswap`'s (the kernel
serves the first call too). Arguments beyond those ten keep the original unless they
only pick between torch algorithms for the same maths (a bool that is off, or a flag).
`refusal` runs the same test (`unknown_arguments`) on the calls the parse stage recorded
(`callswap.record_core_calls`, the family's `probe`), so coverage says what this binding will do.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.callswap import (Interface, bound_arguments, install, positional_counts,
                                          recorded_refusal)
from onboarding.patching.core import PatchRecord, entry_function

# mamba_ssm's selective_scan_fn order after the five tensors; the kernel's keywords
TAIL = ("D", "z", "delta_bias", "delta_softplus", "return_last_state")


def _scan_like(fn: Any) -> bool:
    counts = positional_counts(fn)
    return counts is not None and counts[0] == 5 and counts[1] >= 5 + len(TAIL)


NONE_FOUND = ("the mixer calls no selective-scan-like function (u, delta, A, B, C, D, z, "
              "delta_bias, delta_softplus, return_last_state); its scan runs inline")


def unknown_arguments(named: dict[str, Any], extra: dict[str, Any]) -> list[str]:
    """The arguments of a call (``named``: its named parameters bound by the function's own
    signature, defaults applied, in order; ``extra``: what its ``**kwargs`` took) past the five
    tensors, the `TAIL` and ``initial_state`` that may add inputs: a set value that is not a bool
    (a tensor, a number, a string). The rest may only choose among torch algorithms for the same
    maths (flags). Reads live values and described ones (`callswap.describe` keeps None and
    bools) alike."""
    names = list(named)
    taken = {*names[:5 + len(TAIL)], "initial_state"}
    rest = {**{n: named[n] for n in names if n not in taken}, **extra}
    return [k for k, v in rest.items() if v is not None and not isinstance(v, bool)]


def _call_ours(fn: Callable, kernel: Callable, args: tuple, kwargs: dict) -> Any:
    """``kernel`` on ``fn``'s arguments (bound by ``fn``'s own signature, mapped by position)."""
    named, extra = bound_arguments(fn, args, kwargs)
    # the rest may only choose among torch algorithms for the same maths (flags), never add
    # inputs: a tensor, or a non-bool set value, keeps the original
    unknown = unknown_arguments(named, extra)
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    names = list(named)
    pos = [named.pop(n) for n in names[:5]]
    kw = {ours: named.pop(theirs) for ours, theirs in zip(TAIL, names[5:5 + len(TAIL)])}
    if "initial_state" in named:
        kw["initial_state"] = named.pop("initial_state")
    return kernel(*pos, **kw)


def call_refusal(call: dict[str, Any]) -> str | None:
    """Why the swap would keep the original function at one recorded core call
    (`callswap.record_core_calls`: its described arguments, defaults applied, as the swap binds
    them), by the swap's own test (`unknown_arguments`), or None when the kernel takes them
    (calibration then judges the numbers)."""
    unknown = unknown_arguments(call["args"], call["kwargs"])
    return f"TypeError: arguments the kernel does not take: {unknown}" if unknown else None


def refusal(found: dict[str, Any]) -> str | None:
    """Why `bind` would leave the mixer unpatched, read off what the parse stage recorded of its
    calls (``found``: `callswap.record_core_calls`'s entry for `SELECTIVE_SCAN`), or None when a
    call's arguments fit: the outcomes `install` and the swaps' first calls give
    (`callswap.recorded_refusal`)."""
    return recorded_refusal(found, SELECTIVE_SCAN, NONE_FOUND, call_refusal)


SELECTIVE_SCAN = Interface(
    what="selective-scan", fits=_scan_like,
    call=lambda fn, kernel, args, kwargs, variant: _call_ours(fn, kernel, args, kwargs))


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    return install(module, entry_function(kernels[0]), record, SELECTIVE_SCAN, NONE_FOUND)
