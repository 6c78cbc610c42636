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
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.callswap import Interface, bound_arguments, install, positional_counts
from onboarding.patching.core import PatchRecord, entry_function

# mamba_ssm's selective_scan_fn order after the five tensors; the kernel's keywords
TAIL = ("D", "z", "delta_bias", "delta_softplus", "return_last_state")


def _scan_like(fn: Any) -> bool:
    counts = positional_counts(fn)
    return counts is not None and counts[0] == 5 and counts[1] >= 5 + len(TAIL)


def _call_ours(fn: Callable, kernel: Callable, args: tuple, kwargs: dict) -> Any:
    """``kernel`` on ``fn``'s arguments (bound by ``fn``'s own signature, mapped by position)."""
    named, extra = bound_arguments(fn, args, kwargs)
    names = list(named)
    pos = [named.pop(n) for n in names[:5]]
    kw = {ours: named.pop(theirs) for ours, theirs in zip(TAIL, names[5:5 + len(TAIL)])}
    if "initial_state" in named:
        kw["initial_state"] = named.pop("initial_state")
    # the rest may only choose among torch algorithms for the same maths (flags), never add
    # inputs: a tensor, or a non-bool set value, keeps the original
    unknown = [k for k, v in {**named, **extra}.items()
               if v is not None and not isinstance(v, bool)]
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    return kernel(*pos, **kw)


SELECTIVE_SCAN = Interface(
    what="selective-scan", fits=_scan_like,
    call=lambda fn, kernel, args, kwargs, variant: _call_ours(fn, kernel, args, kwargs))


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    return install(module, entry_function(kernels[0]), record, SELECTIVE_SCAN,
                   "the mixer calls no selective-scan-like function (u, delta, A, B, C, D, z, "
                   "delta_bias, delta_softplus, return_last_state); its scan runs inline")
