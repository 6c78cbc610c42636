"""Patch binding of a `rope` block (the module that makes the cos/sin tables) to the rotary
kernel: the function the attention blocks hand q and k and those tables to is swapped for the
kernel while they run.

The rope block only makes the tables; the rotation runs where they are used: transformers'
attention modules call a module-level ``apply_rotary_pos_emb(q, k, cos, sin, ...)``,
remote-code models their own copies, some on one tensor at a time (``fn(x, cos, sin)``). Which
function, and where, is not read from names:

- the rope module's forward is wrapped to keep its outputs (the tables) of its last `KEEP` calls;
- every module under the rope module's parent (its siblings' subtrees: the layers that receive
  the tables; the parent itself too) that can reach a function with three or more required
  positional arguments (`onboarding.patching.callswap.reachable`) has those functions wrapped
  while it runs;
- a wrapped function's call is a *rotation call* of this block when two of its arguments are
  the block's outputs (the same storage: the tables or views of them) or tensors computed from
  them alone: until the first rotation call, the parent's forward runs under a
  `TorchFunctionMode` (`_Derived`) that counts an op's floating outputs as tables when every
  floating tensor it was given is one (Qwen2.5-VL's vision tower gathers its tables' rows into
  its attention windows' order, new storage, before the blocks get them; an op mixing a table
  with anything else, ``x + pos``, makes no table). The floating tensors
  among its other arguments are the rotated inputs (one, x, or two, q and k); any other tensor
  argument (a ``position_ids`` that indexes the tables) keeps the original.

What the function computes is found by probing it (`detect`), not read from its code or the
classifier: on the first rotation call it runs again, under no_grad, on known inputs of the
call's shapes (its first batch entry; random q/k and random cos/sin tables, unrelated to each
other, so every candidate computes something else), and its output is compared with each
candidate `Layout` computed in torch: the rotation's pairs (half-split (i, i + R/2), transformers'
default; interleaved (2i, 2i + 1), GLM / GPT-J; or deinterleaved: pairs (2i, 2i + 1) moved to
(i, i + R/2), then half-split, the output left so, DeepSeek-V3's, served by the half-split kernel
after the same move made by torch), the table columns each pair reads (one per
rotated element: R = the tables' width, each frequency twice as transformers makes them; one per
pair: R = twice the width, gpt-oss's tables of each frequency once; one per pair from the first
half: R = the width, GLM's function reading half of a doubled table), the head axis of the inputs
(``[B, T, H, D]`` or ``[B, H, T, D]``; a 3-D call, ``[T, H, D]`` or ``[H, T, D]``, is one batch
entry: vision towers rotate the patches of their packed images so, with tables ``[T, R]``) and
which table is cos. The kernel modules given for the
block are then tried in the layouts that matched (a module of the layout's variant; tables of a
column per pair are doubled for it) on the call itself, and the first whose outputs agree with the
original's within the layer tolerance is kept (calibration); the kernel then serves that call too
(forward and backward through the kernel's own autograd: the rendered module's backward kernel
applies the transposed rotation). No layout matching, or no kernel given agreeing, keeps the
original function, and the record is rejected with the reason. The partial rotary dim is the
kernel's own (R < D: the rest of each head passes through); a model that rotates a slice of each
head itself hands the function that slice.

The parse stage runs the same probe (`ROTARY`, the family's `probe`: `record_calls`), so the op
graph holds what this binding would find (the rotation call and its layouts, or why not), and
`refusal` (the family's `refusal` and `match`) reads it: coverage says what patching will do, and
renders the kernel of the layout found (its rotation, its rotary dim).

After calibration the swap serves every call of that function with the same argument structure
(the same table argument positions, the same non-tensor arguments, shapes the kernel takes), also
tables that are not this block's recent outputs (alignment replays a block on copies of its
inputs), but never tables another live rope patch made (a model with a second rope block for
local layers). Other calls run the original; the record's detail counts them.

The record stays at the rope block's path, and names the blocks the kernel ran in
(`PatchRecord.sites`): alignment judges the kernel there (the rope block's own outputs, the
tables, are the model's code, and no gradient flows through them).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from onboarding.formatting import clip
from onboarding.graph.opgraph import Block
from onboarding.patching.callswap import (bound_arguments, forward_function, min_required,
                                          outputs_agree, reachable, run_swapped)
from onboarding.patching.core import PatchRecord, entry_function, run_probed, swap_forward

NONE_FOUND = ("no module beside the rope block reaches a function of three or more arguments "
              "(q or k, cos, sin): the rotation runs inline")
NOT_CALLED = ("no function the blocks beside it called was handed this block's cos/sin tables: "
              "the rotation runs inline")

_FITS = min_required(3)
# the rope module's calls whose tables are recognised (one forward may call it once per layer
# type: Gemma 3 makes its sliding and full tables with one module)
KEEP = 8
_LIVE: weakref.WeakSet = weakref.WeakSet()  # the installed rope patches (tables' owners)


def _storage(t: torch.Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


class _Call:
    """One call of a wrapped function, read by structure: which arguments are tables, which are
    rotated, what else it was given."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, tables: set):
        named, extra = bound_arguments(fn, args, kwargs)
        self.values = {**named, **extra}
        self.table_names = [n for n, v in self.values.items()
                            if isinstance(v, torch.Tensor) and _storage(v) in tables]
        self.inputs = [n for n, v in self.values.items() if isinstance(v, torch.Tensor)
                       and n not in self.table_names and v.is_floating_point()]
        self.other_tensors = [n for n, v in self.values.items() if isinstance(v, torch.Tensor)
                              and n not in self.table_names and n not in self.inputs]
        self.rest = {n: v for n, v in self.values.items() if not isinstance(v, torch.Tensor)}

    def key(self) -> tuple:
        """The call's structure: what a later call must repeat to be served as the first was."""
        rest = tuple((n, v if isinstance(v, (int, float, str, bool, type(None))) else type(v))
                     for n, v in self.rest.items())
        dims = tuple(self.values[n].dim() for n in self.inputs)  # a bound 3-D call serves no 4-D one
        return tuple(self.table_names), tuple(self.inputs), rest, dims

    def problem(self) -> str | None:
        """Why the kernel cannot take this call, or None."""
        if len(self.table_names) != 2:
            return (f"handed {len(self.table_names)} of the table tensors, not cos and sin "
                    f"({self.table_names})")
        if not 1 <= len(self.inputs) <= 2:
            return f"{len(self.inputs)} tensors to rotate ({self.inputs}), not one (x) or two (q, k)"
        if self.other_tensors:
            return f"tensor arguments the kernel does not take: {self.other_tensors}"
        dims = {self.values[n].dim() for n in self.inputs}
        if len(dims) != 1 or not dims <= {3, 4}:
            return ("the rotated tensors are not all 4-D ([B, T, H, D] or [B, H, T, D]) or all 3-D "
                    "([T, H, D] or [H, T, D]: one batch entry)")
        return None

    def batch(self) -> int:
        """The rotated tensors' batch size (1 for 3-D ones: one batch entry)."""
        x = self.values[self.inputs[0]]
        return x.shape[0] if x.dim() == 4 else 1


def _table(c: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """A table as the kernel takes it, [T, R] or [B, T, R], from what the function was handed
    (broadcastable: size-1 batch or head dims)."""
    while c.dim() > 3:
        one = [i for i in range(c.dim() - 2) if c.shape[i] == 1]
        if not one:
            raise ValueError(f"table of shape {tuple(c.shape)}")
        c = c.squeeze(one[-1])
    if c.dim() < 2:
        raise ValueError(f"table of shape {tuple(c.shape)}: no position dim")
    if c.dim() == 3 and c.shape[0] == 1 and B != 1:
        c = c[0]
    if c.shape[-2] != T:
        raise ValueError(f"table of shape {tuple(c.shape)} for {T} positions")
    return c


# "deinterleaved": pairs (2i, 2i + 1) moved to (i, i + R/2) first, then rotated half-split, the
# output left in that order (DeepSeek-V3's `rope_interleave`); the half-split kernel serves it
# after the same move, made by torch
ROTATIONS = ("half", "interleaved", "deinterleaved")
# the table columns a rotation pair reads: "each" rotated element its own column (R = the tables'
# width W), "pairs" one column per pair (R = 2W), "first pairs" one per pair from the first half
# (R = W: the function reads half of a doubled table)
COLUMNS = ("each", "pairs", "first pairs")


@dataclass(frozen=True)
class Layout:
    """What a rotation function computes, relative to the tables it is handed (`detect`)."""

    rotation: str  # "half" (pairs (i, i + R/2)), "interleaved" (pairs (2i, 2i + 1)), "deinterleaved"
    columns: str  # `COLUMNS`
    head_axis: int  # 2: inputs [B, T, H, D]; 1: [B, H, T, D] (3-D inputs: with a batch dim of 1)
    swapped: bool  # the first table argument is sin

    @property
    def variant(self) -> str:
        """The kernel variant that computes it."""
        return "half" if self.rotation == "deinterleaved" else self.rotation

    def rotary_dim(self, width: int) -> int:
        return 2 * width if self.columns == "pairs" else width

    def name(self, width: int | None = None, flat: bool = False) -> str:
        """In words; ``flat``: of a 3-D call (one batch entry, no batch dim)."""
        r = f", rotary dim {self.rotary_dim(width)}" if width else ""
        axes = "T, H, D" if self.head_axis == 2 else "H, T, D"
        tables = {"each": "", "pairs": ", tables of each frequency once (doubled)",
                  "first pairs": ", tables read by pair from their first half (doubled)"}[self.columns]
        rotation = ("deinterleaved (pairs (2i, 2i + 1) moved to (i, i + R/2)), then half"
                    if self.rotation == "deinterleaved" else self.rotation)
        return (f"{rotation}{r}, {f'[{axes}]' if flat else f'[B, {axes}]'}"
                + (", tables swapped" if self.swapped else "") + tables)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Layout:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def _layouts() -> list[Layout]:
    """The candidates, in the order preferred when several match (a table of one pair)."""
    return [Layout(rot, cols, axis, swapped) for cols in COLUMNS for rot in ROTATIONS
            for axis in (2, 1) for swapped in (False, True)]


def _kernel_name(kernel: ModuleType) -> str:
    return (f"{getattr(kernel, 'VARIANT', '?')} kernel (rotary dim "
            f"{getattr(kernel, 'ROTARY_DIM', None) or 'any'})")


def _kernel_tables(layout: Layout, cos: torch.Tensor, sin: torch.Tensor, B: int, T: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's tables as the kernel of ``layout.variant`` takes them: [T, R] or [B, T, R], a
    column per rotated element (a table of a column per pair doubled: repeated for interleaved
    pairs, concatenated for half-split ones)."""
    if layout.swapped:
        cos, sin = sin, cos
    cos, sin = _table(cos, B, T), _table(sin, B, T)
    if layout.columns == "each":
        return cos, sin
    w = cos.shape[-1]
    if layout.columns == "first pairs":
        if w % 2:
            raise ValueError(f"table of odd width {w} read by pair from its first half")
        cos, sin = cos[..., : w // 2], sin[..., : w // 2]

    def twice(t):
        return t.repeat_interleave(2, dim=-1) if layout.rotation == "interleaved" else torch.cat((t, t), dim=-1)

    return twice(cos), twice(sin)


def _rot(x: torch.Tensor, rotation: str) -> torch.Tensor:
    if rotation == "interleaved":
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _apply(layout: Layout, call: _Call, rotate: Callable) -> Any:
    """``rotate(xs [B, T, H, D], cos, sin [T, R] or [B, T, R]) -> outputs`` on a call's tensors
    under ``layout``, in the call's structure (one tensor, or a tuple of two). 3-D tensors are
    one batch entry: rotated as [1, ...], returned 3-D."""
    xs = [call.values[n] for n in call.inputs]
    flat = xs[0].dim() == 3
    xs = [x.unsqueeze(0) if flat else x for x in xs]
    cos, sin = (call.values[n] for n in call.table_names)
    xs = [x if layout.head_axis == 2 else x.transpose(1, 2) for x in xs]  # -> [B, T, H, D]
    B, T = xs[0].shape[:2]
    cos, sin = _kernel_tables(layout, cos, sin, B, T)
    if layout.rotation == "deinterleaved":
        xs = [_deinterleave(x, cos.shape[-1]) for x in xs]
    outs = [o if layout.head_axis == 2 else o.transpose(1, 2) for o in rotate(xs, cos, sin)]
    outs = [o.squeeze(0) if flat else o for o in outs]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _deinterleave(x: torch.Tensor, r: int) -> torch.Tensor:
    """``x`` with its first ``r`` dims' pairs (2i, 2i + 1) moved to (i, i + r/2) (a copy)."""
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f"rotary dim {r} for a head of {x.shape[-1]}")
    moved = x[..., :r].unflatten(-1, (r // 2, 2)).transpose(-1, -2).flatten(-2)
    return torch.cat((moved, x[..., r:]), dim=-1) if r < x.shape[-1] else moved


def _torch_rotation(rotation: str) -> Callable:
    """The rotation in fp32 torch (the candidates `detect` compares the function with)."""
    def rotate(xs, cos, sin):
        R, D = cos.shape[-1], xs[0].shape[-1]
        if R % 2 or R > D or R == 0:
            raise ValueError(f"rotary dim {R} for a head of {D}")
        c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)
        return [torch.cat((x[..., :R].float() * c + _rot(x[..., :R].float(), rotation) * s,
                           x[..., R:].float()), dim=-1) for x in xs]
    return rotate


def _kernel_rotation(kernel: ModuleType) -> Callable:
    entry = entry_function(kernel)

    def rotate(xs, cos, sin):
        if len(xs) == 2:
            return list(entry(xs[0], xs[1], cos, sin))
        return [entry(xs[0], xs[0][:, :, :0], cos, sin)[0]]  # one tensor: k an empty head slice
    return rotate


def _ours(kernel: ModuleType, layout: Layout, call: _Call) -> Any:
    """The kernel on a call's tensors under ``layout``: the rotated tensors, in the call's
    structure (one tensor, or a tuple of two)."""
    return _apply(layout, call, _kernel_rotation(kernel))


def _replaced(fn: Callable, args: tuple, kwargs: dict, new: dict[str, Any]) -> tuple[tuple, dict]:
    """``fn``'s call arguments with the named ones (bound by its signature, or taken by its
    ``**kwargs``) replaced."""
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    for n, v in new.items():
        if n in bound.arguments and n != var_kw:
            bound.arguments[n] = v
        else:
            bound.arguments[var_kw] = {**bound.arguments.get(var_kw, {}), n: v}
    return bound.args, bound.kwargs


def detect(fn: Callable, call: _Call, args: tuple, kwargs: dict) -> tuple[list[Layout], str]:
    """The layouts ``fn`` computes on this call's structure, found by probing: ``fn`` runs on
    known inputs of the call's shapes and dtypes (its first batch entry; q/k, cos and sin each
    drawn at random, so no two candidates agree by chance), and each candidate (`_layouts`) is
    computed in torch from the same inputs and compared with its output (the layer tolerance of
    its dtype). Returns (the layouts that agree, in `_layouts`'s order; why none did: the
    function's error on the probe, else the first candidate that ran and disagreed)."""
    gen = torch.Generator().manual_seed(0)
    B = call.batch()

    def known(t: torch.Tensor, batched: bool) -> torch.Tensor:
        shape = list(t.shape)
        if batched and shape and shape[0] == B:  # (B > 1 only: a 3-D call is one entry)
            shape[0] = 1  # the first batch entry: the probe's cost is one entry's
        return torch.randn(shape, generator=gen).to(device=t.device, dtype=t.dtype)

    failed = ""
    for one in ((True, False) if B > 1 else (False,)):  # one batch entry, else the call's
        probe = {n: known(call.values[n], one) for n in call.inputs}
        probe.update({n: known(call.values[n], one and call.values[n].dim() >= 3)
                      for n in call.table_names})
        try:
            p_args, p_kwargs = _replaced(fn, args, kwargs, probe)
            with torch.no_grad():
                ref = fn(*p_args, **p_kwargs)
            break
        except Exception as exc:  # the model's function on inputs it was not written for
            failed = clip(f"the function failed on the probe's inputs: {type(exc).__name__}: {exc}", 200)
    else:
        return [], failed
    probed = _Call(fn, p_args, p_kwargs, {_storage(probe[n]) for n in call.table_names})
    found, why = [], ""
    for layout in _layouts():
        try:
            with torch.no_grad():
                mine = _apply(layout, probed, _torch_rotation(layout.variant))
        except (TypeError, ValueError, RuntimeError):
            continue  # does not fit the shapes (a head axis, a rotary dim wider than the head)
        ok, msg = outputs_agree(mine, ref)
        if ok:
            found.append(layout)
        elif not why:
            why = f"{layout.name()}: {msg}"
    return found, clip(why or "no candidate layout fits the shapes", 200)


def _dtypes(ref: Any) -> tuple:
    return tuple(r.dtype for r in ref) if isinstance(ref, tuple) else (ref.dtype,)


def _cast(out: Any, dtypes: tuple) -> Any:
    """Ours in the original's output dtypes."""
    if isinstance(out, tuple):
        return tuple(o.to(d) for o, d in zip(out, dtypes))
    return out.to(dtypes[0])


class _Swap:
    """One reachable function of one consumer module, wrapped while that module runs; the state
    (pending -> bound | kept) is the patch's, shared by every consumer: one function, one
    layout, one kernel."""

    def __init__(self, patch: RopePatch, fn: Callable, name: str, site: str):
        self.patch, self.fn, self.name, self.site = patch, fn, name, site
        self.outer: list[Callable] = []  # what the name held when the consumer started (a stack)

    def _fallback(self, args: tuple, kwargs: dict) -> Any:
        return (self.outer[-1] if self.outer else self.fn)(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        p = self.patch
        try:
            call = _Call(self.fn, args, kwargs, p.tables())
        except TypeError:
            return self._fallback(args, kwargs)
        if p.state == "pending":
            if not call.table_names:
                return self._fallback(args, kwargs)  # not handed this block's tables
            problem = call.problem()
            if problem is not None:  # handed the tables, but no rotation the kernel takes
                p.passed.setdefault(f"{self.name} in {self.site}", problem)
                return self._fallback(args, kwargs)
            return p.calibrate(self, call, args, kwargs)
        if p.state == "bound" and p.fn == self.fn:  # (a hub-decorated function: bound methods)
            if not call.table_names:  # tables that are not this block's recent ones: read by place
                call = _Call(self.fn, args, kwargs, _tables_at(self.fn, args, kwargs, p.key))
                if not call.table_names or p.foreign(call):
                    return self._fallback(args, kwargs)
            if call.key() == p.key and call.problem() is None:
                try:
                    out = _ours(p.kernel, p.layout, call)
                except (TypeError, ValueError, RuntimeError) as exc:
                    p.original_call(f"{type(exc).__name__}: {exc}")
                    return self._fallback(args, kwargs)
                p.served(self.site)
                return _cast(out, p.dtypes)
            if call.table_names:
                p.original_call("a call of another structure: " + (call.problem() or str(call.key())))
        return self._fallback(args, kwargs)


def _tables_at(fn: Callable, args: tuple, kwargs: dict, key: tuple) -> set:
    """The storages of the arguments at the table places of the bound structure ``key``."""
    named, extra = bound_arguments(fn, args, kwargs)
    values = {**named, **extra}
    return {_storage(values[n]) for n in key[0] if isinstance(values.get(n), torch.Tensor)}


class _Derived(TorchFunctionMode):
    """The parent's forward until the first rotation call: an op whose floating tensor inputs
    are all tables (the block's outputs, or tensors derived so) makes tables of its floating
    outputs (`RopePatch.derived`: kept alive, so that no storage is reused by another tensor)."""

    def __init__(self, patch: RopePatch):
        super().__init__()
        self.patch = patch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        p = self.patch
        if p.state != "pending":
            return out
        given = [t for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.is_floating_point()]
        tables = p.tables()
        if given and all(_storage(t) in tables for t in given):
            made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            p.derived.extend(t for t in made if _storage(t) not in tables)
        elif any(_storage(t) in tables for t in given):
            p.read = True  # a table meets another tensor: something rotates (inline or not)
        return out


class RopePatch:
    """The swaps of one rope block: its tables' capture, the consumers' wrapped functions."""

    def __init__(self, block_path: str, module: nn.Module, consumers: dict[str, nn.Module],
                 kernels: list[ModuleType], record: PatchRecord):
        self.path, self.module, self.kernels, self.record = block_path, module, kernels, record
        self.state = "pending"  # -> bound | kept
        self.fn: Callable | None = None
        self.layout: Layout | None = None
        self.kernel: ModuleType | None = None
        self.key: tuple | None = None
        self.outputs: list[list[torch.Tensor]] = []  # the tables of its last `KEEP` calls
        self.derived: list[torch.Tensor] = []  # tensors computed from them alone (`_Derived`)
        # an op of the parent's forward was given a table beside another tensor (`_Derived`)
        self.read = False
        self.sites: dict[str, int] = {}
        self.originals: dict[str, int] = {}
        self.passed: dict[str, str] = {}  # calls handed the tables that the kernel cannot take
        self.dtypes: tuple = ()
        self.consumers = {}
        for path, m in consumers.items():
            swaps = {(where, name): _Swap(self, f, f"{where} {name}", path)
                     for where, name, f in reachable(m, _FITS)}
            if swaps:
                self.consumers[path] = (m, swaps)

    # the tables
    def tables(self) -> set:
        return {_storage(t) for t in [*(t for call in self.outputs for t in call), *self.derived]}

    def foreign(self, call: _Call) -> bool:
        """The call's tables are another live rope patch's recent outputs."""
        mine = {_storage(call.values[n]) for n in call.table_names}
        return any(other is not self and mine & other.tables() for other in list(_LIVE))

    def _capture(self, original: Callable) -> Callable:
        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            flat = out if isinstance(out, (tuple, list)) else (out,)
            self.outputs = [*self.outputs[-(KEEP - 1):], [t for t in flat if isinstance(t, torch.Tensor)]]
            return out
        return forward

    def _consumer(self, module: nn.Module, swaps: dict, original: Callable) -> Callable:
        glob = forward_function(module).__globals__

        def forward(*args, **kwargs):
            for (where, name), swap in swaps.items():  # what the swap stands in for, this call
                swap.outer.append(module.__dict__[name] if where == "attr" else glob[name])
            try:
                return run_swapped(module, original, swaps, args, kwargs)
            finally:
                for swap in swaps.values():
                    swap.outer.pop()

        return forward

    def _outermost(self, original: Callable) -> Callable:
        """The parent's forward: after its first call, a patch that met no rotation call is
        rejected (the record says so)."""
        def forward(*args, **kwargs):
            try:
                if self.state != "pending":
                    return original(*args, **kwargs)
                with _Derived(self):
                    return original(*args, **kwargs)
            finally:
                self.derived = []
                if self.state == "pending" and self.record.status == "pending":
                    seen = "; ".join(f"{n}: {w}" for n, w in self.passed.items())
                    self.record.status = "rejected"
                    self.record.detail = clip(NOT_CALLED + (f" (handed them: {seen})" if seen else ""), 300)
                    self.state = "kept"
        return forward

    def install(self, parent: nn.Module) -> Callable[[], None]:
        undos = [swap_forward(self.module, self._capture(self.module.forward))]
        for m, swaps in self.consumers.values():
            undos.append(swap_forward(m, self._consumer(m, swaps, m.forward)))
        undos.append(swap_forward(parent, self._outermost(parent.forward)))
        _LIVE.add(self)

        def undo() -> None:
            _LIVE.discard(self)
            for u in reversed(undos):
                u()

        return undo

    # calibration and serving
    def reject(self, why: str) -> None:
        self.state = "kept"
        self.record.status = "rejected"
        self.record.detail = clip(why, 400)

    def calibrate(self, swap: _Swap, call: _Call, args: tuple, kwargs: dict) -> Any:
        """The first rotation call: its layouts (`detect`), then each kernel of a layout's
        rotation on the call itself against the original's output; the first that agrees is
        bound and serves this call."""
        with torch.no_grad():
            ref = swap._fallback(args, kwargs)
        where = f"{swap.name} in {swap.site} was handed the tables, but"
        layouts, why = detect(swap.fn, call, args, kwargs)
        if not layouts:
            self.reject(f"{where} no candidate layout reproduced it (probe): {why}")
            return swap._fallback(args, kwargs) if torch.is_grad_enabled() else ref
        width = call.values[call.table_names[0]].shape[-1]
        tried: list[str] = []
        for layout in layouts:
            for kernel in self.kernels:
                if getattr(kernel, "VARIANT", "half") != layout.variant:
                    continue
                try:
                    with torch.no_grad():
                        mine = _ours(kernel, layout, call)
                    ok, msg = outputs_agree(mine, ref)
                except (TypeError, ValueError, RuntimeError) as exc:
                    ok, msg = False, f"{type(exc).__name__}: {exc}"
                if ok:
                    self.state, self.fn, self.key = "bound", swap.fn, call.key()
                    self.layout, self.kernel = layout, kernel
                    self.dtypes = _dtypes(ref)
                    self.record.status = "active"
                    self.served(swap.site)
                    return _cast(_ours(kernel, layout, call), self.dtypes)
                tried.append(clip(f"{_kernel_name(kernel)}: {msg}", 160))
        given = ", ".join(_kernel_name(k) for k in self.kernels) or "none"
        self.reject(f"{where} no kernel given reproduced its layout (calibration): "
                    f"{layouts[0].name(width)} (probe); "
                    + ("; ".join(tried) if tried else
                       f"no kernel of its rotation was given (given: {given})"))
        return swap._fallback(args, kwargs) if torch.is_grad_enabled() else ref

    def served(self, site: str) -> None:
        self.sites[site] = self.sites.get(site, 0) + 1
        if site not in self.record.sites:
            self.record.sites.append(site)
            self._describe()

    def original_call(self, why: str) -> None:
        self.originals[why] = self.originals.get(why, 0) + 1
        self.record.detail = clip("; ".join(f"{n} call{'s' if n > 1 else ''} ran the original ({w})"
                                            for w, n in self.originals.items()), 300)

    def _describe(self) -> None:
        name = next((s.name for _, swaps in self.consumers.values() for s in swaps.values()
                     if s.fn == self.fn), "?")
        sites = self.record.sites
        shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
        self.record.binding = (f"rotary call {name} in {shown or '?'} -> "
                               f"{_kernel_name(self.kernel)}, layout "
                               f"{self.layout.name(flat=self.key[3][:1] == (3,))}")


def _parent(model: nn.Module, path: str) -> tuple[str, nn.Module]:
    parent = path.rpartition(".")[0]
    return parent, (model.get_submodule(parent) if parent else model)


def _consumers(model: nn.Module, block_path: str, module: nn.Module) -> tuple[nn.Module, dict]:
    """(the rope block's parent, {path: module} of the modules under it outside the block)."""
    parent_path, parent = _parent(model, block_path)
    consumers = {}
    for name, m in parent.named_modules():
        path = ".".join(p for p in (parent_path, name) if p)
        if m is module or path == block_path or path.startswith(block_path + "."):
            continue
        consumers[path] = m
    return parent, consumers


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`): ``module`` is the rope
    block's table module; the swaps sit in the modules beside it (the module docstring)."""
    parent, consumers = _consumers(model, block.path, module)
    patch = RopePatch(block.path, module, consumers, kernels, record)
    if not patch.consumers:
        record.status, record.detail = "rejected", NONE_FOUND
        return None
    record.binding = "calibrating: the functions " + clip(", ".join(sorted(
        {s.name for _, swaps in patch.consumers.values() for s in swaps.values()})), 200) + \
        f" of {len(patch.consumers)} modules beside {block.path}"
    return patch.install(parent)


# --- what coverage predicts: the same probe at parse, the same acceptance test on its record ---

class _Probing(RopePatch):
    """A `RopePatch` that binds nothing: its first rotation call's layouts (`detect`) are
    recorded, every call runs the original."""

    def __init__(self, block_path: str, module: nn.Module, consumers: dict[str, nn.Module]):
        super().__init__(block_path, module, consumers, [],
                         PatchRecord(path=block_path, kind="rope", family="rope"))
        self.calls: list[dict[str, Any]] = []

    def calibrate(self, swap: _Swap, call: _Call, args: tuple, kwargs: dict) -> Any:
        layouts, why = detect(swap.fn, call, args, kwargs)
        width = call.values[call.table_names[0]].shape[-1]
        found: dict[str, Any] = {"function": swap.name, "site": swap.site, "width": int(width)}
        if layouts:
            found["layouts"] = [x.to_json() for x in layouts]
            found["rotary_dim"] = layouts[0].rotary_dim(int(width))
        else:
            found["why"] = why
        self.calls.append(found)
        self.state = "kept"  # the binding calibrates on this call alone
        return swap._fallback(args, kwargs)

    def found(self) -> dict[str, Any]:
        return {"reachable": sorted({s.name for _, swaps in self.consumers.values()
                                     for s in swaps.values()}),
                "calls": self.calls, "handed": dict(self.passed),
                "read": bool(self.read or self.calls or self.passed)}


class RotaryProbe:
    """The rope family's `probe` (`onboarding.patching.probe.probe_core_calls`): what `bind`
    would find for each rope block, recorded by one run of the model with `_Probing` patches
    (no kernel): ``{"reachable": [the consumers' functions], "calls": [{"function", "site",
    "width": the tables' width, "layouts": [`Layout.to_json`] and "rotary_dim", or "why"}],
    "handed": {function in site: why the kernel cannot take a call handed the tables}}``."""

    what = "rotary"

    def record_calls(self, model: nn.Module, targets: list[tuple[Block, nn.Module]],
                     run: Callable[[], Any]) -> list[dict[str, Any]]:
        probes, undos = [], []
        for block, module in targets:
            parent, consumers = _consumers(model, block.path, module)
            probe = _Probing(block.path, module, consumers)
            probes.append(probe)
            if probe.consumers:
                undos.append(probe.install(parent))
        run_probed(undos, run)
        return [p.found() for p in probes]


ROTARY = RotaryProbe()


def unread(found: dict[str, Any]) -> bool:
    """Whether the probe saw no op of the forward read the block's tables (beside another
    tensor) and no function handed them: nothing rotates (Bamba's default config, every layer a
    Mamba mixer, still makes the tables). The block is then its cos/sin table alone, which no
    kernel serves and no fallback needs to (``read`` absent: a graph probed before it was
    recorded, judged as before)."""
    return found.get("read") is False and not found.get("calls") and not found.get("handed")


def refusal(found: dict[str, Any]) -> str | None:
    """Why `bind` would leave a rope block unpatched, read off what `ROTARY` recorded for it
    (``found``), or None when its rotation call has a layout the kernel computes: the same
    outcomes as `bind` (no function reachable), the parent's first forward (no function handed
    the tables in a form the kernel takes) and `RopePatch.calibrate` (no layout reproduced it)."""
    if not found.get("reachable"):
        return NONE_FOUND
    calls = found.get("calls") or []
    if not calls:
        seen = "; ".join(f"{n}: {w}" for n, w in (found.get("handed") or {}).items())
        return clip(NOT_CALLED + (f" (handed them: {seen})" if seen else ""), 300)
    call = calls[0]
    if "why" in call:
        return clip(f"{call['function']} in {call['site']} was handed the tables, but no candidate "
                    f"layout reproduced it (probe): {call['why']}", 400)
    return None


def probed_layout(found: dict[str, Any]) -> tuple[Layout, int] | None:
    """(the first layout, the rotary dim) of the rotation call `ROTARY` recorded, or None."""
    calls = found.get("calls") or []
    if not calls or not calls[0].get("layouts"):
        return None
    return Layout.from_json(calls[0]["layouts"][0]), int(calls[0]["rotary_dim"])
