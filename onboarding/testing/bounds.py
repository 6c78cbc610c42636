"""Memory safety of Triton kernels run in the interpreter (``TRITON_INTERPRET=1``).

On a GPU, an unmasked load or store outside the memory a kernel was handed is an illegal memory
access at best and silent corruption at worst. The interpreter runs it without complaint: it reads
whatever host memory holds there, or writes over it. `bounds_checked()` patches the interpreter
for its duration so that every address a load or store touches (masked-off lanes excluded: they
are never accessed) must lie, with all its bytes, inside the storage of one of that launch's tensor
arguments (tuples of tensors and tensor descriptors' bases included). The first access that does
not raises `OutOfBounds`, naming the kernel, the access, how many addresses and how far the first
one lies from the nearest argument.

The unit is the storage, not the view: a kernel that reads past a view's last element but inside
its storage is not flagged (that memory is allocated). Tensor-descriptor (TMA) loads and stores
are checked as the interpreter lowers them (masked to the descriptor's shape, as the hardware
pads out-of-range boxes). Compiled GPU launches are untouched: this is the CPU's way to catch,
before a GPU run, what the GPU would fault on.

Atomics (``create_atomic_rmw``, ``create_atomic_cas``: tl.atomic_add and the rest) are checked as
loads and stores are (masked-off lanes excluded).

The patch is written against the interpreter of triton 3.9 (the CPU machines'):
``GridExecutor._init_args_hst`` and ``__call__``, the builder's ``create_masked_load`` /
``create_masked_store``, ``create_atomic_rmw`` and ``create_atomic_cas``. `available()` says whether
this triton has them, and `bounds_checked()`
raises `RuntimeError` when it does not rather than check nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

_STATE = threading.local()
_LOCK = threading.Lock()
_DEPTH = 0
_SAVED: list[tuple[Any, str, Any]] = []


class OutOfBounds(RuntimeError):
    """A kernel touched memory outside its tensor arguments (the message says where)."""


def _interp() -> Any:
    import triton.runtime.interpreter as interp

    return interp


def available() -> tuple[bool, str]:
    """(whether this triton's interpreter can be bounds-checked, why not)."""
    try:
        interp = _interp()
    except Exception as exc:  # noqa: BLE001 - any import failure means no interpreter
        return False, f"triton's interpreter does not import: {type(exc).__name__}: {exc}"
    missing = [f"{cls}.{name}" for cls, name in (("GridExecutor", "_init_args_hst"),
                                                 ("InterpreterBuilder", "create_masked_load"),
                                                 ("InterpreterBuilder", "create_masked_store"),
                                                 ("InterpreterBuilder", "create_atomic_rmw"),
                                                 ("InterpreterBuilder", "create_atomic_cas"))
               if not hasattr(getattr(interp, cls, None), name)]
    if not hasattr(interp, "_get_np_dtype"):
        missing.append("_get_np_dtype")
    if missing:
        return False, f"triton's interpreter lacks {', '.join(missing)}"
    return True, ""


def _storages(arg: Any, out: dict[int, int]) -> None:
    """Start address -> end address of the storages behind `arg` (a tensor, a tuple of them, a
    tensor descriptor)."""
    if isinstance(arg, (tuple, list)):
        for a in arg:
            _storages(a, out)
        return
    base = getattr(arg, "base", None)
    if base is not None and hasattr(base, "untyped_storage"):  # a tensor descriptor
        _storages(base, out)
        return
    if hasattr(arg, "untyped_storage"):
        storage = arg.untyped_storage()
        start = storage.data_ptr()
        out[start] = max(out.get(start, start), start + storage.nbytes())


def _check(ptrs: Any, mask: Any, kind: str, width: int) -> None:
    """Raise `OutOfBounds` unless every unmasked address of `ptrs` (elements of `width` bytes) lies in
    one of the current launch's argument storages."""
    launch = getattr(_STATE, "launch", None)
    if launch is None:  # a load outside a checked launch (not ours to judge)
        return
    name, starts, ends = launch
    addr = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addr = addr[np.asarray(mask.data, dtype=bool)]
    if addr.size == 0:
        return
    if starts.size == 0:
        raise OutOfBounds(f"out-of-bounds {kind} in Triton kernel {name}: {addr.size} unmasked addresses and "
                          "no tensor arguments")
    # storages never overlap: the candidate for each address is the last one starting at or before
    # it. Fast path: the lowest and the highest address in one storage put all of them in it.
    lo, hi = addr.min(), addr.max()
    j = int(np.searchsorted(starts, lo, side="right")) - 1
    if j >= 0 and hi + np.uint64(width) <= ends[j]:
        return
    idx = np.searchsorted(starts, addr, side="right") - 1
    inside = (idx >= 0) & (addr + np.uint64(width) <= ends[np.maximum(idx, 0)])
    if inside.all():
        return
    bad = addr[~inside]
    first = int(bad[0])
    j = int(np.searchsorted(starts, first, side="right")) - 1  # the storage starting at or before it
    if j >= 0:
        where = (f"the first ends {first + width - int(ends[j])} bytes past an argument's storage "
                 f"({int(ends[j]) - int(starts[j])} bytes)")
    else:
        where = f"the first lies {int(starts[0]) - first} bytes before the lowest argument's storage"
    raise OutOfBounds(f"out-of-bounds {kind} in Triton kernel {name}: {bad.size} of {addr.size} unmasked "
                      f"addresses lie outside the launch's tensor arguments; {where}")


def _patch() -> None:
    interp = _interp()
    ge, builder = interp.GridExecutor, interp.InterpreterBuilder
    init, call, load, store = ge._init_args_hst, ge.__call__, builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
    np_dtype = interp._get_np_dtype

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        spans: dict[int, int] = {}
        _storages(list(args_hst) + list(kwargs_hst.values()), spans)
        starts = np.array(sorted(spans), dtype=np.uint64)
        ends = np.array([spans[s] for s in sorted(spans)], dtype=np.uint64)
        _STATE.launch = (getattr(self.fn, "__name__", "?"), starts, ends)
        return args_hst, kwargs_hst

    def launch(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        except Exception as exc:  # the interpreter wraps what a kernel raises in InterpreterError
            if isinstance(exc.__cause__, OutOfBounds):
                raise OutOfBounds(str(exc.__cause__)) from None
            raise

    def width(ptrs) -> int:
        return np.dtype(np_dtype(ptrs.get_element_ty())).itemsize

    def masked_load(self, ptrs, mask, other, *rest, **kwargs):
        _check(ptrs, mask, "load", width(ptrs))
        return load(self, ptrs, mask, other, *rest, **kwargs)

    def masked_store(self, ptrs, value, mask, *rest, **kwargs):
        _check(ptrs, mask, "store", width(ptrs))
        return store(self, ptrs, value, mask, *rest, **kwargs)

    def atomic_rmw(self, op, ptrs, value, mask, *rest, **kwargs):
        _check(ptrs, mask, "atomic", width(ptrs))
        return rmw(self, op, ptrs, value, mask, *rest, **kwargs)

    def atomic_cas(self, ptrs, *rest, **kwargs):
        _check(ptrs, None, "atomic", width(ptrs))
        return cas(self, ptrs, *rest, **kwargs)

    _SAVED[:] = [(ge, "_init_args_hst", init), (ge, "__call__", call), (builder, "create_masked_load", load),
                 (builder, "create_masked_store", store), (builder, "create_atomic_rmw", rmw),
                 (builder, "create_atomic_cas", cas)]
    ge._init_args_hst = init_args
    ge.__call__ = launch
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    builder.create_atomic_cas = atomic_cas


@contextlib.contextmanager
def bounds_checked() -> Iterator[None]:
    """Check every interpreted launch inside the block (see the module docstring); nests."""
    global _DEPTH
    ok, why = available()
    if not ok:
        raise RuntimeError(f"bounds_checked: {why}")
    with _LOCK:
        if _DEPTH == 0:
            _patch()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                for owner, name, original in reversed(_SAVED):
                    setattr(owner, name, original)
                _SAVED.clear()
                _STATE.launch = None


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter here (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def checked_when_interpreted() -> contextlib.AbstractContextManager:
    """`bounds_checked()` when kernels run in the interpreter, else nothing."""
    return bounds_checked() if interpreting() else contextlib.nullcontext()
