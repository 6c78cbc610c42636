"""Data movement of a training step: bytes and launches of copy, cast, cat, gather, fill, sum and
add ops, put down to the source line that issued them.

Device-free and deterministic, as `onboarding.train.memory`: a `TorchDispatchMode` sees every
aten op of the step (forward and backward) with its real shapes and dtypes, so the CPU says which
lines of the model, of our training code and of the kernels' host code move bytes that a GPU
step pays for in ``direct_copy_kernel``, ``CatArrayBatchedCopy``, ``vectorized_gather_kernel``,
``reduce_kernel`` and bf16 adds. Bytes are what such ops cost on a GPU (they are memory-bound),
so each op counts the bytes it reads and writes: every tensor argument once (an expanded view at
most its storage), plus each output that is not one of its arguments.

Custom ops (our kernels' ``torch.library`` ops) are entered, so the host code around a kernel
launch (a ``.contiguous()``, a cast) counts; what Triton's interpreter does inside a launch on
the CPU (its argument copies) does not, nor do the kernels themselves. In the backward, ops that
autograd's engine runs (no Python frame of ours) are put down to the running autograd node and
the forward line that created it (anomaly mode's traceback).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# aten op -> category. Views, GEMMs, attention and elementwise maths are not counted.
_CATEGORY = {
    "copy": ("copy_", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize",
             "slice_backward", "select_backward", "as_strided_scatter", "slice_scatter",
             "select_scatter", "diagonal_backward", "unfold_backward", "_unsafe_view_copy",
             "split_with_sizes_copy", "constant_pad_nd"),
    "cat": ("cat", "stack", "_cat"),
    "gather": ("index_select", "index", "gather", "index_put", "index_put_", "_index_put_impl_",
               "index_copy", "index_copy_", "index_add", "index_add_", "scatter", "scatter_",
               "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
               "embedding", "embedding_dense_backward", "take", "masked_select",
               "masked_scatter", "masked_scatter_", "index_reduce", "index_reduce_",
               "repeat_interleave", "repeat", "embedding_bag", "_embedding_bag",
               "_embedding_bag_forward_only"),
    "fill": ("zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like",
             "new_full", "ones", "ones_like", "new_ones"),
    "sum": ("sum", "mean"),
    "add": ("add", "add_"),
}
CATEGORY = {name: cat for cat, names in _CATEGORY.items() for name in names}
MOVES = ("copy", "cat", "gather")  # pure data movement (the profile's copy / cast and gather rows)

_SKIP_DIRS = (os.sep + "torch" + os.sep, os.sep + "contextlib.py", os.sep + "functools.py",
              os.sep + "traffic.py")
_TRITON = os.sep + "triton" + os.sep


@dataclass(kw_only=True)
class Traffic:
    """What one step moved. ``rows``: (phase, category, op, source line, autograd node) ->
    [launches, bytes]."""

    rows: dict[tuple[str, str, str, str, str], list[int]] = field(default_factory=dict)

    def total(self, categories=None, phase: str | None = None) -> tuple[int, int]:
        """(launches, bytes) over ``categories`` (default all) and ``phase`` (default both)."""
        n = b = 0
        for (ph, cat, *_), (k, nb) in self.rows.items():
            if (categories is None or cat in categories) and (phase is None or ph == phase):
                n, b = n + k, b + nb
        return n, b

    def by(self, *fields: str, categories=None) -> list[tuple[tuple, int, int]]:
        """[(key over ``fields`` of phase/category/op/line/node, launches, bytes)], bytes first."""
        idx = {"phase": 0, "category": 1, "op": 2, "line": 3, "node": 4}
        agg: dict[tuple, list[int]] = {}
        for key, (k, nb) in self.rows.items():
            if categories is not None and key[1] not in categories:
                continue
            sub = tuple(key[idx[f]] for f in fields)
            a = agg.setdefault(sub, [0, 0])
            a[0] += k
            a[1] += nb
        return sorted(((k, n, b) for k, (n, b) in agg.items()), key=lambda r: -r[2])


def _nbytes(t: torch.Tensor) -> int:
    view = t.numel() * t.element_size()
    try:
        return min(view, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return view


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _short(path: str) -> str:
    for marker in ("site-packages" + os.sep, os.sep + "onboarding" + os.sep,
                   os.sep + "kernels" + os.sep, os.sep + "tests" + os.sep):
        if marker in path:
            head = path.split(marker, 1)[1]
            return head if marker.startswith("site") else marker.strip(os.sep) + os.sep + head
    return os.path.basename(path)


def _frame_line(frame, stop=None) -> tuple[str | None, bool]:
    """(innermost frame outside torch below ``stop`` as 'file:line (function)', whether
    Triton's interpreter is on the stack)."""
    where = None
    f = frame
    while f is not None and f is not stop:
        fn = f.f_code.co_filename
        if _TRITON in fn:
            return None, True
        if where is None and not any(s in fn for s in _SKIP_DIRS):
            where = f"{_short(fn)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return where, False


def _traceback_line(tb) -> str | None:
    """The innermost frame outside torch of an anomaly-mode traceback (a string, or a list of
    formatted frames)."""
    last = None
    lines = "".join(tb).splitlines() if isinstance(tb, (list, tuple)) else str(tb).splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith('File "'):
            fn = s[6:s.index('"', 6)]
            if any(x in fn for x in _SKIP_DIRS):
                continue
            lineno = s.split(", line ", 1)[1].split(",", 1)[0]
            func = s.rsplit(" in ", 1)[-1]
            last = f"{_short(fn)}:{lineno} ({func})"
    return last


class TrafficMode(TorchDispatchMode):
    """Counts the step's data-movement ops into ``self.traffic``; ``self.phase`` labels them."""

    def __init__(self):
        super().__init__()
        self.traffic = Traffic()
        self.phase = "forward"
        self._stop = None  # the frame that called the backward: not a source line of it

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, its ops counted as the backward's."""
        self.phase = "backward"
        self._stop = sys._getframe()
        try:
            loss.backward()
        finally:
            self._stop = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns not in ("aten", "prim", "prims"):
            impl = _custom_impl(func)
            if impl is not None:  # our kernels' host code counts too
                with self:
                    return impl(*args, **kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        cat = CATEGORY.get(func._overloadpacket.__name__)
        if cat is None:
            return out
        where, interp = _frame_line(sys._getframe(1), self._stop)
        if interp:
            return out
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        node_name = node.name() if node is not None else ""
        if where is None or where.startswith("onboarding/testing/traffic"):
            tb = node.metadata.get("traceback_") if node is not None else None
            where = (_traceback_line(tb) if tb else None) or "(autograd engine)"
            where = f"{where} <- {node_name}" if node_name and tb else where
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        ptrs = {t.data_ptr() for t in ins}
        nbytes = sum(_nbytes(t) for t in ins)
        nbytes += sum(_nbytes(t) for t in _tensors(out) if t.data_ptr() not in ptrs)
        row = self.traffic.rows.setdefault(
            (self.phase, cat, func._overloadpacket.__name__, where, node_name), [0, 0])
        row[0] += 1
        row[1] += nbytes
        return out


def _custom_impl(func):
    """The Python body of a ``torch.library.custom_op`` (None for other ops)."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:  # pragma: no cover - older torch
        return None
    opdef = _maybe_get_opdef(func._name if hasattr(func, "_name") else str(func))
    return getattr(opdef, "_init_fn", None) if opdef is not None else None


@contextlib.contextmanager
def counting():
    """``with counting() as mode:`` run the forward, then ``mode.backward(loss)``;
    ``mode.traffic`` holds the counts. Anomaly mode (no NaN checks) gives the backward's
    engine-run ops the forward line that created their node."""
    mode = TrafficMode()
    with torch.autograd.set_detect_anomaly(True, check_nan=False), mode:
        yield mode


def format_table(traffic: Traffic, *, top: int = 30, categories=None) -> str:
    """The largest source lines by bytes, one row each (phase, category, launches, MiB)."""
    lines = [f"{'phase':8s} {'cat':6s} {'op':22s} {'n':>5s} {'MiB':>9s}  line [node]"]
    for (ph, cat, op, line, node), n, b in traffic.by(
            "phase", "category", "op", "line", "node", categories=categories)[:top]:
        lines.append(f"{ph:8s} {cat:6s} {op[:22]:22s} {n:5d} {b / 2**20:9.2f}  {line}"
                     + (f" [{node}]" if node and node not in line else ""))
    return "\n".join(lines)


def summary(traffic: Traffic) -> dict[str, tuple[int, int]]:
    """{category: (launches, bytes)} over the step, and ``moves`` (copy + cat + gather)."""
    out = {c: traffic.total((c,)) for c in _CATEGORY}
    out["moves"] = traffic.total(MOVES)
    return out


__all__ = ["CATEGORY", "MOVES", "Traffic", "TrafficMode", "counting", "format_table", "summary"]
