"""The runtime half of the anti-cheat check: watch a block forward (and its backward) run.

`Monitor` is a context manager that, while active:
- counts Triton kernel launches (``JITFunction.run`` and the interpreter's
  ``InterpretedFunction.run``, patched at class level by `onboarding.testing.launches.watching`)
  and records the kernels' names;
- records every ATen op that reaches the dispatcher outside a launch (a `TorchDispatchMode`;
  a custom op is followed into its Python implementation, so work cannot hide in one) and
  flags each op that is not allocation or layout glue (`GLUE`);
- poisons fresh allocations: ``empty``-family ops return tensors filled with NaN, so an output
  element the kernel never writes shows up in the comparison;
- in Triton's interpreter, checks every load and store of a launch against the launch's tensor
  arguments (`onboarding.testing.bounds`): an access outside them raises `OutOfBounds` where a
  GPU would fault or corrupt memory, even when the numbers come out right.

`module_state(mod)` snapshots a module's mutable globals (containers and tensors); two snapshots
that differ mean the module wrote state during the calls between them (outputs kept from earlier
calls).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onboarding.testing.bounds import checked_when_interpreted
from onboarding.testing.launches import watching

# ATen ops a kernel wrapper may run in torch: allocation, layout, dtype moves, views
GLUE = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
    "new_zeros", "full", "full_like", "new_full", "fill_", "zero_", "ones", "ones_like", "new_ones",
    "arange", "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "expand_as",
    "squeeze", "unsqueeze", "select", "slice", "narrow", "as_strided", "alias", "detach", "clone",
    "contiguous", "copy_", "_to_copy", "to", "lift_fresh", "lift_fresh_copy", "unbind", "split",
    "split_with_sizes", "chunk", "cat", "stack", "flatten", "unflatten", "view_as",
    "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_same_size", "_has_compatible_shallow_copy_type", "set_", "resize_", "_reshape_alias",
    # the backward of a slice, a select or a view writes the gradient into zeros: layout too
    "slice_backward", "select_backward", "_unsafe_view_backward"})
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_AGG_NAMESPACES = ("aten", "prims", "prim")


def _base(name: str) -> str:
    return name.split("::")[-1].split(".")[0]


@dataclass(kw_only=True)
class RunRecord:
    launches: int = 0
    kernels: list[str] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)  # every ATen op seen outside launches
    forbidden: dict[str, int] = field(default_factory=dict)  # the ones that are not glue
    custom_ops: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"launches": self.launches, "kernels": sorted(set(self.kernels)), "ops": dict(self.ops),
                "forbidden": dict(self.forbidden), "custom_ops": sorted(set(self.custom_ops))}


class _Recorder(TorchDispatchMode):
    def __init__(self, monitor: Monitor):
        super().__init__()
        self.monitor = monitor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mon = self.monitor
        if mon.in_launch():
            return func(*args, **kwargs)
        name = str(func.name()) if hasattr(func, "name") else str(func)
        ns = name.split("::")[0]
        if ns not in _AGG_NAMESPACES:
            mon.record.custom_ops.append(name)
            impl = _custom_impl(func, args)
            if impl is not None:
                with self:  # follow the custom op into its Python implementation
                    return impl(*args, **kwargs)
        base = _base(name)
        mon.record.ops[base] = mon.record.ops.get(base, 0) + 1
        if base not in GLUE and ns in _AGG_NAMESPACES:
            mon.record.forbidden[base] = mon.record.forbidden.get(base, 0) + 1
        out = func(*args, **kwargs)
        if base in _EMPTY and mon.poison and isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(float("nan"))
        return out


def _custom_impl(func: Any, args: tuple) -> Any:
    """The Python implementation behind a `torch.library.custom_op` (for the device of its first
    tensor argument), or None for an op that has none."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - older torch
        return None
    qual = str(func.name()).split(".")[0] if hasattr(func, "name") else ""
    opdef = OPDEFS.get(qual)
    if opdef is None:
        return None
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    fns = getattr(opdef, "_backend_fns", {}) or {}
    return fns.get(dev) or fns.get(None) or getattr(opdef, "_init_fn", None)


class Monitor:
    """See the module docstring. ``poison``: fill ``empty`` allocations with NaN. The bounds check
    is on whenever kernels run in the interpreter."""

    def __init__(self, poison: bool = True):
        self.poison = poison
        self._bounds: Any = None
        self.record = RunRecord()
        self._local = threading.local()
        self._launches: Any = None
        self._mode: _Recorder | None = None

    def in_launch(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def _around(self, name: str, warmup: bool, call: Any) -> Any:
        """Each Triton launch (`onboarding.testing.launches.watching`): counted and named; the
        ATen ops it runs are its own (`in_launch`)."""
        self.record.launches += 1
        self.record.kernels.append(name)
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            return call()
        finally:
            self._local.depth -= 1

    def __enter__(self) -> Monitor:
        self._launches = watching(self._around)
        self._launches.__enter__()
        self._mode = _Recorder(self)
        self._mode.__enter__()
        self._bounds = checked_when_interpreted()
        self._bounds.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bounds is not None:
            self._bounds.__exit__(*exc)
            self._bounds = None
        if self._mode is not None:
            self._mode.__exit__(*exc)
        if self._launches is not None:
            self._launches.__exit__(*exc)
            self._launches = None


def _fingerprint(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), value._version, tuple(value.shape))
    if isinstance(value, dict):
        return ("dict", len(value), tuple(sorted((repr(k), _fingerprint(v)) for k, v in list(value.items())[:256])))
    if isinstance(value, (list, set, bytearray)):
        items = sorted(map(repr, value)) if isinstance(value, set) else [_fingerprint(v) for v in list(value)[:256]]
        return (type(value).__name__, len(value), tuple(items))
    return None


def module_state(mod: ModuleType, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Name -> fingerprint of each data global of `mod`: containers and tensors by content and
    version, scalars, strings and None by value (functions, classes and modules are left out:
    the Triton interpreter patches those while it runs a kernel)."""
    out: dict[str, Any] = {}
    for name, value in list(vars(mod).items()):
        if name.startswith("__") or name in skip:
            continue
        fp = _fingerprint(value)
        if fp is None and (value is None or isinstance(value, (bool, int, float, str, tuple))):
            fp = ("value", type(value).__name__, repr(value)[:200])
        if fp is None and inspect.isfunction(value) and vars(value):
            fp = ("function attributes", _fingerprint(dict(vars(value))))  # f.cache = {...}
        if fp is not None:
            out[name] = fp
    return out


def object_state(obj: Any) -> dict[str, Any]:
    """Fingerprints of an object's attributes (the block module's: a kernel that keeps outputs
    on the module it is handed)."""
    return {k: _fingerprint(v) or ("id", id(v)) for k, v in list(vars(obj).items())
            if k not in ("forward", "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                         "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")}


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Globals added, rebound or mutated between two `module_state` snapshots."""
    return sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
