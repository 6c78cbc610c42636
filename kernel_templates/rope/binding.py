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
  the block's outputs (the same storage: the tables or views of them). The floating tensors
  among its other arguments are the rotated inputs (one, x, or two, q and k); any other tensor
  argument (a ``position_ids`` that indexes the tables) keeps the original.

On the first rotation call the kernel runs on the same tensors under each reading (`_readings`:
the kernel modules given for the block, i.e. its variants (half-split / interleaved pairs), whether
the tables hold each frequency twice (transformers' default) or once (gpt-oss: doubled for the
kernel), the head axis of the inputs (``[B, T, H, D]`` or ``[B, H, T, D]``) and which table is
cos), under no_grad; the first reading whose outputs agree with the original's within the layer
tolerance is kept and the kernel then serves that call too (forward and backward through the kernel's own
autograd: the rendered module's backward kernel applies the transposed rotation). No reading
agreeing keeps the original function, and the record is rejected with the first reading's
reason. The partial rotary dim is the kernel's own (R = cos.shape[-1] < D: the rest of each head
passes through); a model that rotates a slice of each head itself hands the function that slice.

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

import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.callswap import (bound_arguments, forward_function, min_required,
                                          outputs_agree, reachable, run_swapped)
from onboarding.patching.core import PatchRecord, entry_function, swap_forward

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
        return tuple(self.table_names), tuple(self.inputs), rest

    def problem(self) -> str | None:
        """Why the kernel cannot take this call, or None."""
        if len(self.table_names) != 2:
            return (f"handed {len(self.table_names)} of the table tensors, not cos and sin "
                    f"({self.table_names})")
        if not 1 <= len(self.inputs) <= 2:
            return f"{len(self.inputs)} tensors to rotate ({self.inputs}), not one (x) or two (q, k)"
        if self.other_tensors:
            return f"tensor arguments the kernel does not take: {self.other_tensors}"
        if any(self.values[n].dim() != 4 for n in self.inputs):
            return "the rotated tensors are not 4-D ([B, T, H, D] or [B, H, T, D])"
        return None


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


def _readings(kernels: list[ModuleType]) -> list[tuple[int, int, bool, bool]]:
    """(kernel index, head axis of the rotated tensors, tables swapped, tables hold each
    frequency once) in the order tried."""
    return [(i, axis, swapped, once) for i in range(len(kernels)) for once in (False, True)
            for axis in (2, 1) for swapped in (False, True)]


def _reading_name(kernels: list[ModuleType], reading: tuple[int, int, bool, bool]) -> str:
    i, axis, swapped, once = reading
    layout = "[B, T, H, D]" if axis == 2 else "[B, H, T, D]"
    return (f"{getattr(kernels[i], 'VARIANT', '?')} (rotary dim "
            f"{getattr(kernels[i], 'ROTARY_DIM', None) or 'any'}), {layout}"
            + (", tables swapped" if swapped else "")
            + (", tables of each frequency once (doubled)" if once else ""))


def _twice(t: torch.Tensor, variant: str) -> torch.Tensor:
    """A table of each frequency once ([.., R/2]: gpt-oss) as the kernel takes it, each twice."""
    return t.repeat_interleave(2, dim=-1) if variant == "interleaved" else torch.cat((t, t), dim=-1)


def _ours(kernels: list[ModuleType], reading: tuple[int, int, bool, bool], call: _Call) -> Any:
    """The kernel on a call's tensors under ``reading``: the rotated tensors, in the call's
    structure (one tensor, or a tuple of two)."""
    i, axis, swapped, once = reading
    kernel = entry_function(kernels[i])
    xs = [call.values[n] for n in call.inputs]
    cos, sin = (call.values[n] for n in call.table_names)
    if swapped:
        cos, sin = sin, cos
    xs = [x if axis == 2 else x.transpose(1, 2) for x in xs]  # -> [B, T, H, D]
    B, T = xs[0].shape[:2]
    cos, sin = _table(cos, B, T), _table(sin, B, T)
    if once:
        variant = getattr(kernels[i], "VARIANT", "half")
        cos, sin = _twice(cos, variant), _twice(sin, variant)
    if len(xs) == 2:
        q, k = kernel(xs[0], xs[1], cos, sin)
        outs = [q, k]
    else:  # one tensor: k is an empty head slice of it (the kernel skips it)
        outs = [kernel(xs[0], xs[0][:, :, :0], cos, sin)[0]]
    outs = [o if axis == 2 else o.transpose(1, 2) for o in outs]
    return outs[0] if len(outs) == 1 else tuple(outs)


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
    reading."""

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
                    out = _ours(p.kernels, p.reading, call)
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


class RopePatch:
    """The swaps of one rope block: its tables' capture, the consumers' wrapped functions."""

    def __init__(self, block_path: str, module: nn.Module, consumers: dict[str, nn.Module],
                 kernels: list[ModuleType], record: PatchRecord):
        self.path, self.module, self.kernels, self.record = block_path, module, kernels, record
        self.state = "pending"  # -> bound | kept
        self.fn: Callable | None = None
        self.reading: tuple[int, int, bool, bool] | None = None
        self.key: tuple | None = None
        self.outputs: list[list[torch.Tensor]] = []  # the tables of its last `KEEP` calls
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
        return {_storage(t) for call in self.outputs for t in call}

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
                return original(*args, **kwargs)
            finally:
                if self.state == "pending" and self.record.status == "pending":
                    seen = "; ".join(f"{n}: {w}" for n, w in self.passed.items())
                    self.record.status = "rejected"
                    self.record.detail = (NOT_CALLED + (f" (handed them: {seen})" if seen else ""))[:300]
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
    def calibrate(self, swap: _Swap, call: _Call, args: tuple, kwargs: dict) -> Any:
        with torch.no_grad():
            ref = swap._fallback(args, kwargs)
        whys: list[tuple[bool, str]] = []  # (the kernel ran, why it disagreed) per reading
        for reading in _readings(self.kernels):
            ran = False
            try:
                with torch.no_grad():
                    mine = _ours(self.kernels, reading, call)
                ran = True
                ok, msg = outputs_agree(mine, ref)
            except (TypeError, ValueError, RuntimeError) as exc:
                ok, msg = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.state, self.fn, self.reading, self.key = "bound", swap.fn, reading, call.key()
                self.dtypes = _dtypes(ref)
                self.record.status = "active"
                self.served(swap.site)
                return _cast(_ours(self.kernels, reading, call), self.dtypes)
            whys.append((ran, f"{_reading_name(self.kernels, reading)}: {msg}"))
        # the first reading the kernel ran on (a wrong head axis does not fit the tables), and
        # the first the kernel refused for another reason (a rotary dim it was rendered for)
        why = next((w for ran, w in whys if ran), whys[0][1] if whys else "no kernel")[:120]
        refused = next((w for ran, w in whys if not ran and "table of shape" not in w), None)
        if refused:
            why += f"; {refused}"
        self.state = "kept"
        self.record.status = "rejected"
        self.record.detail = (f"{swap.name} in {swap.site} was handed the tables, but no reading "
                              f"of the kernel reproduced it (calibration): {why}")[:400]
        return swap._fallback(args, kwargs) if torch.is_grad_enabled() else ref

    def served(self, site: str) -> None:
        self.sites[site] = self.sites.get(site, 0) + 1
        if site not in self.record.sites:
            self.record.sites.append(site)
            self._describe()

    def original_call(self, why: str) -> None:
        self.originals[why] = self.originals.get(why, 0) + 1
        self.record.detail = "; ".join(f"{n} call{'s' if n > 1 else ''} ran the original ({w})"
                                       for w, n in self.originals.items())[:300]

    def _describe(self) -> None:
        name = next((s.name for _, swaps in self.consumers.values() for s in swaps.values()
                     if s.fn == self.fn), "?")
        sites = self.record.sites
        shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
        self.record.binding = (f"rotary call {name} in {shown or '?'} -> kernel "
                               f"{_reading_name(self.kernels, self.reading)}")


def _parent(model: nn.Module, path: str) -> tuple[str, nn.Module]:
    parent = path.rpartition(".")[0]
    return parent, (model.get_submodule(parent) if parent else model)


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`): ``module`` is the rope
    block's table module; the swaps sit in the modules beside it (the module docstring)."""
    parent_path, parent = _parent(model, block.path)
    consumers = {}
    for name, m in parent.named_modules():
        path = ".".join(p for p in (parent_path, name) if p)
        if m is module or path == block.path or path.startswith(block.path + "."):
            continue
        consumers[path] = m
    patch = RopePatch(block.path, module, consumers, kernels, record)
    if not patch.consumers:
        record.status, record.detail = "rejected", NONE_FOUND
        return None
    record.binding = "calibrating: the functions " + ", ".join(sorted(
        {s.name for _, swaps in patch.consumers.values() for s in swaps.values()}))[:200] + \
        f" of {len(patch.consumers)} modules beside {block.path}"
    return patch.install(parent)
