"""Patch binding of Mamba-2 mixer cores to the chunked SSD kernel: the plain function the mixer
hands its chunked scan to is swapped for the kernel while the mixer runs.

A Mamba-2 mixer computes its projections, causal conv, gate and norm itself (they stay torch
modules: LoRA-able, and the conv may be served by the conv1d family) and hands the selective
scan to one plain function with the chunked-scan interface (x [B, T, H, P], dt [B, T, H], A [H],
B and C [B, T, G, N], then chunk size, D, dt bias, softplus, dt limits, initial states): a
module-level function in transformers' models, the same name bound to a hub or package kernel
when one is installed. Which function is not read from names: every plain function the mixer's
``forward`` names (and its instance attributes) taking at least five required positional
arguments is wrapped while the mixer runs; on its first call a wrapper binds the arguments by
the function's own signature, runs our kernel on the same tensors, and keeps the swap only when
the outputs agree with the original's within the layer tolerance of the inputs' dtype (and
then serves that first call too, so a single patched forward and backward runs the kernel).
Arguments the kernel does not take (a gate ``z``, sequence indices or offsets for packed
sequences) keep the original function. The output is returned in the dtype the original
returned (transformers' torch path computes and returns fp32).
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
from onboarding.patching.linear_attention import callees

# the chunked-scan interface's keywords -> ours (None: accepted and dropped: it changes rounding only)
KWARGS = {"D": "D", "dt_bias": "dt_bias", "dt_softplus": "dt_softplus", "dt_limit": "dt_limit",
          "initial_states": "initial_state", "initial_state": "initial_state", "chunk_size": None,
          "return_final_states": "return_final_state", "return_final_state": "return_final_state"}


def _call_ours(fn: Callable, kernel: Callable, args: tuple, kwargs: dict) -> Any:
    """``kernel`` on ``fn``'s arguments (the first five positional ones are x, dt, A, B, C)."""
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    named = dict(bound.arguments)
    catch_all: dict = {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            catch_all = named.pop(p.name, {}) or {}
        elif p.kind is p.VAR_POSITIONAL and named.pop(p.name, ()):
            raise TypeError("extra positional arguments")
    if len(named) < 5:
        raise TypeError("fewer than five arguments")
    pos = [named.pop(n) for n in list(named)[:5]]
    ours: dict[str, Any] = {}
    unknown = []
    for k, v in [*named.items(), *catch_all.items()]:
        if k in KWARGS:
            if KWARGS[k] is not None and v is not None:
                ours[KWARGS[k]] = v
        elif v is not None and v is not False:
            unknown.append(k)  # a gate, sequence indices, offsets: maths the kernel does not do
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    if "dt_limit" in ours:
        ours["dt_limit"] = tuple(float(v) for v in ours["dt_limit"])
    return kernel(*pos, **ours)


def _agrees(out: Any, ref: Any, dtype: torch.dtype) -> tuple[bool, str]:
    from onboarding.align.stats import within
    from onboarding.testing.tolerance import layer_tolerance

    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    if len(outs) != len(refs) or not all(isinstance(r, torch.Tensor) for r in refs):
        return False, "output structure differs"
    for a, b in zip(outs, refs):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False, "output shapes differ"
        ok, msg = within([a.float()], [b.float()], layer_tolerance(dtype), "output")
        if not ok:
            return False, msg
    return True, ""


def _cast_like(out: Any, dtypes: tuple) -> Any:
    if isinstance(out, tuple):
        return tuple(o.to(d) for o, d in zip(out, dtypes))
    return out.to(dtypes[0])


class _Swap:
    """Wraps one reachable function of the mixer; calibrates on the first call."""

    def __init__(self, fn: Callable, kernel: Callable, patch: SSDPatch, name: str):
        self.fn, self.kernel, self.patch, self.name = fn, kernel, patch, name
        self.state = "pending"  # -> bound | kept
        self.dtypes: tuple = ()

    def __call__(self, *args, **kwargs):
        if self.state == "bound":
            return _cast_like(_call_ours(self.fn, self.kernel, args, kwargs), self.dtypes)
        ref = self.fn(*args, **kwargs)
        if self.state == "pending":
            ok, why = False, ""
            try:
                with torch.no_grad():
                    mine = _call_ours(self.fn, self.kernel, args, kwargs)
                x = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                ok, why = _agrees(mine, ref, x.dtype)
            except (TypeError, ValueError, RuntimeError, StopIteration) as exc:
                why = f"{type(exc).__name__}: {exc}"
            if ok:
                self.dtypes = tuple(r.dtype for r in (ref if isinstance(ref, tuple) else (ref,)))
            self.state = "bound" if ok else "kept"
            self.patch.calibrated(self.name, ok, why)
            if ok:  # the kernel serves the first call too (with autograd): what runs is what is judged
                return _cast_like(_call_ours(self.fn, self.kernel, args, kwargs), self.dtypes)
        return ref


class SSDPatch:
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
            self.record.binding = f"chunked-scan call {name} -> kernel"
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
                self.record.detail = self.record.detail or "no chunked-scan call matched"

    def undo(self) -> None:
        if self.had_own:
            self.module.forward = self.original
        else:
            self.module.__dict__.pop("forward", None)


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    patch = SSDPatch(module, entry_function(kernels[0]), record)
    if not patch.swaps:
        record.status, record.detail = "rejected", "the mixer calls no chunked-scan-like function"
        return None
    module.forward = patch.forward
    record.binding = "calibrating: " + ", ".join(s.name for s in patch.swaps.values())
    return patch.undo
