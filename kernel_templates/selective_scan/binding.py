"""Patch binding of Mamba-1 mixers to the selective-scan kernel: the plain function the mixer hands
its scan core to is swapped for the kernel while the mixer runs; the projections, the conv and
any B/C/dt norms stay the model's own modules (so LoRA wraps the projections as usual).

Which function is not read from names: every plain function the mixer can reach (its instance
attributes, and the module-level functions its ``forward`` names) that takes exactly five
required positional arguments (u, delta, A, B, C: the selective-scan interface of mamba_ssm,
which transformers' torch fallback keeps, followed by D, z, delta_bias, delta_softplus,
return_last_state) is wrapped. On its first call a wrapper runs the original and the kernel on
the same tensors and keeps the swap when every output agrees within the layer tolerance of its
dtype; otherwise that function stays as it is. A mixer where no function was swapped after its
first call is reported as rejected. Arguments beyond those ten keep the original unless they
only pick between torch algorithms for the same maths (a bool that is off, or a flag).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, entry_function

# mamba_ssm's selective_scan_fn order after the five tensors; the kernel's keywords
TAIL = ("D", "z", "delta_bias", "delta_softplus", "return_last_state")


def _scan_like(fn: Any) -> bool:
    if not callable(fn) or isinstance(fn, (type, nn.Module)) or not inspect.isfunction(inspect.unwrap(fn)):
        return False
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 5 and len([p for p in params if p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 5 + len(TAIL)


def callees(module: nn.Module) -> list[tuple[str, str, Callable]]:
    """(where, name, function): the plain functions ``module`` may hand its scan to."""
    found = [("attr", n, v) for n, v in vars(module).items() if n != "forward" and _scan_like(v)]
    fwd = inspect.unwrap(type(module).forward)
    code, glob = getattr(fwd, "__code__", None), getattr(fwd, "__globals__", {})
    for name in (code.co_names if code else ()):
        if _scan_like(v := glob.get(name)):
            found.append(("global", name, v))
    return found


def _call_ours(fn: Callable, kernel: Callable, args: tuple, kwargs: dict) -> Any:
    """``kernel`` on ``fn``'s arguments (bound by ``fn``'s own signature, mapped by position)."""
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    extra: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            extra = named.pop(p.name, {})
        elif p.kind is p.VAR_POSITIONAL and named.pop(p.name, ()):
            raise TypeError("extra positional arguments")
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


def _agrees(out: Any, ref: Any) -> tuple[bool, str]:
    from onboarding.align.stats import within
    from onboarding.testing.tolerance import layer_tolerance

    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    if len(outs) != len(refs) or not all(isinstance(r, torch.Tensor) for r in refs):
        return False, "output structure differs"
    for a, b in zip(outs, refs):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False, "output shapes differ"
        ok, msg = within([a.float()], [b.float()], layer_tolerance(b.dtype), "output")
        if not ok:
            return False, msg
    return True, ""


def _like(out: Any, dtypes: tuple[torch.dtype, ...]) -> Any:
    """Ours cast to the original's output dtypes (transformers' fallback returns fp32 y)."""
    if isinstance(out, tuple):
        return tuple(o.to(d) for o, d in zip(out, dtypes))
    return out.to(dtypes[0])


class _Swap:
    """Wraps one reachable function of the mixer; calibrates on the first call."""

    def __init__(self, fn: Callable, kernel: Callable, patch: _MixerPatch, name: str):
        self.fn, self.kernel, self.patch, self.name = fn, kernel, patch, name
        self.state = "pending"  # -> bound | kept
        self.dtypes: tuple[torch.dtype, ...] = ()

    def __call__(self, *args, **kwargs):
        if self.state == "bound":
            return _like(_call_ours(self.fn, self.kernel, args, kwargs), self.dtypes)
        ref = self.fn(*args, **kwargs)
        if self.state == "pending":
            try:
                with torch.no_grad():
                    mine = _call_ours(self.fn, self.kernel, args, kwargs)
                ok, why = _agrees(mine, ref)
            except (TypeError, ValueError, RuntimeError) as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.dtypes = tuple(r.dtype for r in (ref if isinstance(ref, tuple) else (ref,)))
            self.state = "bound" if ok else "kept"
            self.patch.calibrated(self.name, ok, why)
        return ref


class _MixerPatch:
    def __init__(self, module: nn.Module, kernel: Callable, record: PatchRecord):
        self.module, self.record = module, record
        self.swaps = {(where, name): _Swap(fn, kernel, self, f"{where} {name}")
                      for where, name, fn in callees(module)}
        self.original = module.forward
        self.had_own = "forward" in module.__dict__
        self.calls = 0

    def calibrated(self, name: str, ok: bool, why: str) -> None:
        if ok:
            self.record.status = "active"
            self.record.binding = f"selective-scan call {name} -> kernel"
        elif self.record.status != "active":
            self.record.detail = f"{name}: {why}"[:200]

    def forward(self, *args, **kwargs):
        glob = inspect.unwrap(type(self.module).forward).__globals__
        saved_attr, saved_glob = {}, {}
        for (where, name), swap in self.swaps.items():
            if where == "attr":
                saved_attr[name] = self.module.__dict__[name]
                self.module.__dict__[name] = swap
            else:
                saved_glob[name] = glob[name]
                glob[name] = swap
        try:
            return self.original(*args, **kwargs)
        finally:
            self.module.__dict__.update(saved_attr)
            glob.update(saved_glob)
            self.calls += 1
            if self.calls == 1 and self.record.status == "pending":
                self.record.status = "rejected"
                self.record.detail = self.record.detail or "no selective-scan call was made"

    def undo(self) -> None:
        if self.had_own:
            self.module.forward = self.original
        else:
            self.module.__dict__.pop("forward", None)


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    patch = _MixerPatch(module, entry_function(kernels[0]), record)
    if not patch.swaps:
        record.status = "rejected"
        record.detail = ("the mixer calls no selective-scan-like function (u, delta, A, B, C, D, z, "
                         "delta_bias, delta_softplus, return_last_state); its scan runs inline")
        return None
    module.forward = patch.forward
    record.binding = "calibrating: " + ", ".join(s.name for s in patch.swaps.values())
    return patch.undo
