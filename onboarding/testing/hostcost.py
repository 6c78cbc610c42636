"""Host cost of a training step: aten ops, device launches and host synchronisations per step,
put down to the code that issued them (issue 34: the GPU waits for the host 36-55 ms a step).

Device-free, as `onboarding.testing.traffic`: a `TorchDispatchMode` sees every aten op of the
step (forward, backward, optimizer) and names the innermost source line outside torch, or, for
ops autograd's engine runs in the backward, the running autograd node. Each op is one of

- ``view``: metadata only (no device launch on a GPU: views, ``detach``, ``t``, ...);
- ``launch``: anything else (a kernel, an allocation with a fill, a copy, ...);
- ``sync``: an op that makes the host wait for the device on CUDA (`SYNC_OPS`: a scalar read,
  ``nonzero``, a boolean-mask index, ``repeat_interleave`` without its output size, ...), plus the
  Python-level reads that do not dispatch (``Tensor.tolist``, ``.cpu()``, ``.numpy()``), each
  wrapped while counting. On the CPU nothing waits, so these are counted, not timed.

Triton kernels launched through the interpreter (``TRITON_INTERPRET=1``) count as one launch
each (`GridExecutor` calls); the aten ops the interpreter runs inside a launch do not count.
Our kernels' ``torch.library`` custom ops are entered, so their host code counts.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onboarding.testing.traffic import _custom_impl
from onboarding.testing.traffic import _short as _short_path

# metadata-only aten ops: no device work on a GPU
VIEW_OPS = frozenset((
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "detach", "alias", "as_strided", "split", "split_with_sizes",
    "chunk", "unbind", "narrow", "diagonal", "view_as_real", "view_as_complex", "unflatten",
    "_reshape_alias", "expand_as", "view_as", "movedim", "lift_fresh", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_neg_view", "_conj",
    "set_", "resize_", "is_same_size", "_has_compatible_shallow_copy_type", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride", "numel"))
# the "view" ops that allocate: no device launch, but each one is a call into the CUDA caching
# allocator on the host (counted by `HostCost.allocations`)
ALLOC_OPS = frozenset(("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"))
# ops that return an input (or a view of it) when nothing needs converting: a launch only when
# their output has a storage of its own
MAYBE_VIEW_OPS = frozenset(("to", "contiguous", "reshape", "flatten", "type_as"))
# aten ops that read a device value on the host on CUDA (a synchronisation)
SYNC_OPS = frozenset(("_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique",
                      "_unique", "_unique2", "unique_consecutive", "unique_dim", "nonzero_static",
                      "equal", "is_nonzero", "allclose", "_assert_async"))
# Python-level reads that need the device's values (no aten op on the CPU)
SYNC_METHODS = ("tolist", "cpu", "numpy")

_SKIP = (os.sep + "torch" + os.sep, os.sep + "contextlib.py", os.sep + "functools.py",
         os.sep + "hostcost.py", os.sep + "traffic.py")
_TRITON = os.sep + "triton" + os.sep


def _short(path: str) -> str:
    """`traffic._short`, with the families' host code (``kernel_templates/<family>/...``:
    bindings, entries) named by its repo path, which `owner_of` counts as ``kernels``."""
    marker = os.sep + "kernel_templates" + os.sep
    if marker in path:
        return "kernels/" + path.split(marker, 1)[1].replace(os.sep, "/")
    return _short_path(path)


def _is_sync(func, args, kwargs) -> bool:
    name = func._overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        return kwargs.get("output_size") is None  # the output's size is read from the repeats
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        idx = args[1] if len(args) > 1 else ()
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ())
    return False


def _aliases(out, args) -> bool:
    """Whether ``out`` (a tensor) shares its storage with a tensor argument."""
    if not isinstance(out, torch.Tensor):
        return False
    try:
        ptr = out.untyped_storage().data_ptr()
        return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
                   for a in args)
    except (RuntimeError, NotImplementedError):
        return False


def owner_of(where: str) -> str:
    """'onboarding', 'kernels' (rendered / reviewed kernels' and the families' host code:
    kernels/..., kernel_templates/... as kernels/<family>/...), 'transformers', 'peft',
    'engine' (autograd's engine: a backward node), or 'other'."""
    if where.startswith("(engine)"):
        return "engine"
    head = where.split("/", 1)[0].split(":", 1)[0]
    return head if head in ("onboarding", "kernels", "transformers", "peft") else "other"


@dataclass(kw_only=True)
class HostCost:
    """One step's counts. ``ops``: (kind, owner, source line or node, aten op) -> count, kind
    one of view / launch; ``syncs``: (source line, what) -> count; ``triton``: source line of
    the launch -> count."""

    ops: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    triton: Counter = field(default_factory=Counter)

    def total(self, kind: str | None = None, owner: str | None = None) -> int:
        return sum(n for (k, o, *_), n in self.ops.items()
                   if (kind is None or k == kind) and (owner is None or o == owner))

    @property
    def launches(self) -> int:
        """Device launches a GPU would see: non-view aten ops plus Triton kernels."""
        return self.total("launch") + sum(self.triton.values())

    @property
    def allocations(self) -> int:
        """Tensors allocated without a fill (`ALLOC_OPS`): no launch, but host time in the allocator."""
        return sum(n for (_, _, _, op), n in self.ops.items() if op in ALLOC_OPS)

    def by_owner(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, owner, *_), n in self.ops.items():
            d = out.setdefault(owner, {"launch": 0, "view": 0})
            d[kind] += n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["launch"]))

    def by_line(self, *, kind: str = "launch", owner: str | None = None, top: int = 30
                ) -> list[tuple[str, int, str]]:
        """[(source line or node, launches, its ops)] most first."""
        agg: dict[str, Counter] = {}
        for (k, o, line, op), n in self.ops.items():
            if k == kind and (owner is None or o == owner):
                agg.setdefault(line, Counter())[op] += n
        rows = [(line, sum(c.values()), ", ".join(f"{op} {n}" for op, n in c.most_common(4)))
                for line, c in agg.items()]
        return sorted(rows, key=lambda r: -r[1])[:top]

    def summary(self) -> dict:
        return {"launches": self.launches, "aten_launch_ops": self.total("launch"),
                "view_ops": self.total("view"), "allocations": self.allocations,
                "triton_launches": sum(self.triton.values()),
                "syncs": sum(self.syncs.values()), "by_owner": self.by_owner(),
                "sync_lines": {f"{line} {what}": n for (line, what), n in self.syncs.items()}}


def _where(frame) -> tuple[str | None, bool]:
    """(innermost frame outside torch as 'file:line (function)', whether Triton's interpreter
    is on the stack)."""
    where = None
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if _TRITON in fn:
            return None, True
        if where is None and f.f_code.co_name == "_engine_run_backward":
            where = ""  # run by autograd's engine, not by a Python backward of ours
        if where is None and not any(s in fn for s in _SKIP) and not _passthrough(f):
            where = f"{_short(fn)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return where or None, False


def _passthrough(frame) -> bool:
    """A `TorchFunctionMode` handing a call it does not serve back to torch (a patch binding's
    intercept while its block runs, `kernel_templates/conv1d/binding.py`): the op is the
    caller's, not the mode's."""
    if frame.f_code.co_name != "__torch_function__":
        return False
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip().startswith(
        "return func(*args")


class HostCostMode(TorchDispatchMode):
    """Counts every aten op into ``self.cost`` (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.cost = HostCost()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "prim", "prims"):
            impl = _custom_impl(func)
            if impl is not None:  # our kernels' host code counts too
                with self:
                    return impl(*args, **kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        where, interp = _where(sys._getframe(1))
        if interp:
            return out
        if where is None:
            node = torch._C._current_autograd_node()
            where = f"(engine) {node.name()}" if node is not None else "(engine)"
        name = func._overloadpacket.__name__
        kind = "view" if name in VIEW_OPS or (name in MAYBE_VIEW_OPS and _aliases(out, args)) \
            else "launch"
        self.cost.ops[(kind, owner_of(where), where, name)] += 1
        if _is_sync(func, args, kwargs):
            self.cost.syncs[(where, name)] += 1
        return out


@contextlib.contextmanager
def counting():
    """``with counting() as mode:`` run a step; ``mode.cost`` holds its counts."""
    mode = HostCostMode()
    saved = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}

    def wrap(name, fn):
        def method(self, *a, **k):
            where, interp = _where(sys._getframe(1))
            if not interp:  # on a CPU tensor too: device-agnostic code reads a GPU value here
                mode.cost.syncs[(where or "(engine)", name)] += 1
            return fn(self, *a, **k)
        return method

    restore_triton = _count_triton(mode.cost)
    try:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, wrap(m, fn))
        with mode:
            yield mode
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)
        restore_triton()


def _count_triton(cost: HostCost):
    """Count interpreted Triton launches by the source line that launched them; returns the
    undo."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:  # pragma: no cover - Triton absent
        return lambda: None
    call = GridExecutor.__call__

    def counted(self, *args, **kwargs):
        where, _ = _where_outside_triton(sys._getframe(1))
        cost.triton[where] += 1
        return call(self, *args, **kwargs)

    GridExecutor.__call__ = counted

    def undo():
        GridExecutor.__call__ = call
    return undo


def _where_outside_triton(frame) -> tuple[str, bool]:
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if _TRITON not in fn and not any(s in fn for s in _SKIP):
            return f"{_short(fn)}:{f.f_lineno} ({f.f_code.co_name})", False
        f = f.f_back
    return "(unknown)", False


__all__ = ["HostCost", "HostCostMode", "SYNC_OPS", "VIEW_OPS", "counting", "owner_of"]
