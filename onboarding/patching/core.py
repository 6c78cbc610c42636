"""Swap classified blocks of a model for kernel-backed versions, reversibly, by module path.

Nothing here knows a model class or a kernel family. A family that can patch the blocks it
serves says how in its folder (`kernel_templates/<family>/binding.py`, set as the `binding` hook
of its `FamilySpec`): which of the block's parameters and arguments go where in its kernel's
signature. `patch_model` finds, for each block, the first family (in name order) that has a
`binding` and a kernel for the block, and calls it; the binding installs the patch and returns
its undo.

The shared machinery lives here: `calibrated` (below), the packed experts weights by their
shapes (`_experts_bindings`, also what expert parallelism splits), and beside this module the
delta-rule call swap (`onboarding.patching.linear_attention`) and the top-k attention intercept
(`onboarding.patching.sparse`).

Where a binding has a choice the structure leaves open (which linear is the gate, which argument
is the gate), the patch *calibrates* on its first call: it runs the original and each candidate
binding on the same input and keeps the one that matches within tolerance. A block with no
matching binding is restored and reported, never silently wrong. A block whose own code cannot
run in the call's 16-bit dtype is calibrated against itself run in float32 (`_upcast_reference`),
and its record says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from onboarding.graph.classify import packed_orientation
from onboarding.families import families
from onboarding.formatting import clip
from onboarding.graph.opgraph import Block, OpGraph
from onboarding.testing.tolerance import compare, tolerance_for


@dataclass(kw_only=True)
class PatchRecord:
    path: str
    kind: str
    family: str
    # pending -> active | dense_by_shape | rejected, then restored. dense_by_shape: the patch is
    # installed and calibrated but a shape policy sent every call so far to the block's own
    # (dense) attention, so the kernel served none: not a kernel-patched block
    status: str = "pending"
    binding: str = ""
    detail: str = ""
    # calls served per path, for a patch that routes each call by shape (the sparse intercept):
    # {"kernel": n, "dense": m}; empty for patches that always run their kernel
    calls: dict[str, int] = field(default_factory=dict)
    # the blocks where the patch's kernel ran, when not the block's own code: a rope block makes
    # the cos/sin tables, and its kernel rotates q/k inside the attention blocks that use them;
    # alignment judges the kernel there (empty for patches that run inside their own block)
    sites: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class PatchSet:
    records: list[PatchRecord] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for r in self.records:
            if r.status in ("pending", "active", "dense_by_shape"):
                r.status = "restored"

    def __enter__(self) -> PatchSet:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def active(self) -> list[PatchRecord]:
        return [r for r in self.records if r.status == "active"]


def swap_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Set ``module.forward`` (an instance attribute, which ``module(...)`` calls) to ``forward``;
    returns the undo, which puts back the instance ``forward`` the module had (or none, so the
    class's serves again)."""
    had_own, previous = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if had_own:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)

    return undo


def run_probed(undos: list[Callable[[], None]], run: Callable[[], Any]) -> None:
    """``run`` the model once without grad with probes installed (``undos``: their undos, in
    the order installed), then take them out again, last first, whatever ``run`` raised: how a
    family's probe records what its binding would find."""
    try:
        with torch.no_grad():
            run()
    finally:
        for undo in reversed(undos):
            undo()


def entry_function(mod: ModuleType) -> Callable:
    """The user-facing function of a rendered module (its ``entry``, by the module contract)."""
    if callable(getattr(mod, "entry", None)):
        return mod.entry
    for name in dir(mod):
        if not name.startswith("_") and not name.endswith("_op") and \
                hasattr(mod, f"{name}_op") and callable(getattr(mod, name)):
            return getattr(mod, name)
    raise ValueError(f"{mod.__name__}: no entry function (f with f_op)")


def _same(out: Any, ref: Any) -> tuple[Callable[[Any], Any], str] | None:
    """The default calibration check: the binding's output is the original's, as it stands."""
    return ((lambda o: o), "") if _matches(out, ref) else None


def _matches(out: Any, ref: Any) -> bool:
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return False
    if out.shape != ref.shape:
        return False
    return compare(out.float(), ref.float(), tolerance_for(ref.dtype)).passed


def _mismatch(out: Any, ref: Any) -> str:
    """How a binding's raw output differs from the original's (the rejection's detail)."""
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return f"returned {type(out).__name__}, the original {type(ref).__name__}"
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}, the original {tuple(ref.shape)}"
    return compare(out.float(), ref.float(), tolerance_for(ref.dtype)).message


class _Calibrated:
    """Replaces ``module.forward``; picks a binding on the first call by comparing outputs."""

    def __init__(self, module: nn.Module, record: PatchRecord,
                 bindings: dict[str, Callable[..., torch.Tensor]],
                 adapt: Callable[[Any, Any], tuple[Callable[[Any], Any], str] | None] = _same):
        # adapt(out, ref) -> (convert, description) when a binding's raw output, converted,
        # reproduces the original's output ref; None when it does not
        self.module, self.record, self.bindings, self.adapt = module, record, bindings, adapt
        self.original = module.forward
        self.chosen: Callable | None = None

    def __call__(self, *args, **kwargs):
        if self.chosen is None:
            with torch.no_grad():
                upcast = ""
                try:
                    ref = self.original(*args, **kwargs)
                except RuntimeError as exc:  # e.g. the block's own code mixes float32 into bf16 maths
                    ref, upcast = _upcast_reference(self.module, self.original, args, kwargs, exc)
                for name, fn in self.bindings.items():
                    try:
                        out = fn(*args, **kwargs)
                    except (TypeError, ValueError, RuntimeError) as exc:
                        self.record.detail = clip(f"{name}: {type(exc).__name__}: {exc}", 200)
                        continue
                    fit = self.adapt(out, ref)
                    if fit is not None:
                        convert, how = fit
                        self.chosen = _converted(fn, convert)
                        self.record.binding = name + (f" -> {how}" if how else "")
                        self.record.status = "active"
                        self.record.detail = upcast
                        break
                    self.record.detail = clip(f"{name}: {_mismatch(out, ref)}", 300)
            if self.chosen is None:
                self.record.status = "rejected"
                why = self.record.detail  # the last binding's error or comparison
                self.record.detail = "no binding matched the original" + (f" ({why})" if why else "")
                self.module.forward = self.original  # give the block back, unpatched
                return self.original(*args, **kwargs)
        out = self.chosen(*args, **kwargs)
        return out


_LOW = (torch.bfloat16, torch.float16)


def _cast(obj: Any, src: torch.dtype, dst: torch.dtype) -> Any:
    """``obj`` (a pytree: tuples, lists, dicts) with its ``src`` tensors cast to ``dst``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dst) if t.dtype == src else t, obj)


def _upcast_reference(module: nn.Module, original: Callable, args: tuple, kwargs: dict,
                      exc: RuntimeError) -> tuple[Any, str]:
    """The original's output when it fails in the call's 16-bit dtype (a block whose own code
    mixes a float32 tensor into its bf16 maths cannot run in bf16 at all, while a kernel that
    replaces it can): computed again in float32, with the block's 16-bit parameters and buffers
    widened for the call and put back after (bit-exact: every 16-bit value is a float32), then
    cast back to the call's dtype for the comparison. Raises ``exc`` when the call has no one
    16-bit dtype, the parameters are distributed (DTensor), or float32 fails too."""
    low = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dtype in _LOW}
    if len(low) != 1:
        raise exc
    dtype = low.pop()
    held = [t for t in (*module.parameters(), *module.buffers()) if t.dtype == dtype]
    if any(type(t.data) is not torch.Tensor for t in held):  # DTensor shards: not widened in place
        raise exc
    saved = [t.data for t in held]
    try:
        for t, d in zip(held, saved):
            t.data = d.float()
        ref = original(*_cast(args, dtype, torch.float32), **_cast(kwargs, dtype, torch.float32))
    except RuntimeError:
        raise exc from None
    finally:
        for t, d in zip(held, saved):
            t.data = d
    return _cast(ref, torch.float32, dtype), (
        f"the block's own code fails in {str(dtype).removeprefix('torch.')} "
        f"({type(exc).__name__}: {clip(str(exc), 120)}); calibrated against it in float32")


def _converted(fn: Callable, convert: Callable[[Any], Any]) -> Callable:
    return lambda *args, **kwargs: convert(fn(*args, **kwargs))


def calibrated(module: nn.Module, record: PatchRecord, bindings: dict[str, Callable[..., Any]],
               adapt: Callable[[Any, Any], tuple[Callable[[Any], Any], str] | None] = _same
               ) -> Callable[[], None] | None:
    """Put ``bindings`` (description -> call with the forward's arguments) over ``module.forward``,
    the one that reproduces the original on the first call to be kept (`_Calibrated`; ``adapt``
    says when a binding's output, converted, is the original's). Returns the undo, or None with
    the record rejected when there is no binding: the block's structure does not fit the kernel."""
    if not bindings:
        record.status, record.detail = "rejected", "structure does not fit the kernel"
        return None
    return swap_forward(module, _Calibrated(module, record, bindings, adapt))


def _experts_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, topk_indices, topk_weights) of an experts call, in any argument order: the one integer
    tensor, and of the two float ones the wider (x [N, D] beside weights [N, K])."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    idx = [t for t in tensors if not t.is_floating_point()]
    flt = [t for t in tensors if t.is_floating_point()]
    if len(idx) != 1 or len(flt) != 2:
        raise ValueError("expected one index tensor and two float tensors")
    x, w = sorted(flt, key=lambda t: -t.shape[-1]) if flt[0].shape[-1] != \
        flt[1].shape[-1] else flt
    return x, idx[0], w


class _ExpertWeights:
    """A gated packed experts block's weights (and biases) in the kernel's layout: gate_up
    [E, 2F, D] as [gate | up] halves, down [E, D, F], gate_up_bias [E, 2F] as halves, down_bias
    [E, D].

    ``layout`` "in_out" (the block computes x @ W: gate_up [E, D, 2F], down [E, F, D]) transposes
    the last two dims; ``split`` "interleaved" (gate at even, up at odd columns) regroups them into
    halves. The kernels take contiguous weights at fixed strides, and interleaved rows are no
    strided view of halves, so a converted copy is made: for a weight that needs no gradient here
    (frozen, or under no_grad) once, cached on the parameter's data_ptr, ``_version``, shape,
    stride, dtype and device (an in-place update or a swapped tensor converts again); for one
    that does, on every call with differentiable ops, so autograd takes each gradient back to the
    original parameter's layout. Parameters are looked up by name at call time (FSDP2 swaps a
    sharded module's parameters). The same conversion runs in both cases, so the patch's
    first-call check against the block's own output covers it.
    """

    def __init__(self, module: nn.Module, names: dict[str, str], layout: str, split: str):
        self.module, self.names, self.layout, self.split = module, names, layout, split
        self._cache: dict[str, tuple[tuple, torch.Tensor]] = {}

    def _needs_conversion(self, role: str) -> bool:
        if role in ("gate_up", "down") and self.layout == "in_out":
            return True
        return role in ("gate_up", "gate_up_bias") and self.split == "interleaved"

    def _convert(self, role: str, p: torch.Tensor) -> torch.Tensor:
        if role in ("gate_up", "down") and self.layout == "in_out":
            p = p.transpose(1, 2)  # [E, in, out] -> [E, out, in]
        if role in ("gate_up", "gate_up_bias") and self.split == "interleaved":
            # rows (gate 0, up 0, gate 1, up 1, ...) -> (gate 0, gate 1, ..., up 0, up 1, ...)
            e, two_f = p.shape[0], p.shape[1]
            p = p.unflatten(1, (two_f // 2, 2)).transpose(1, 2).reshape(e, two_f, *p.shape[2:])
        return p.contiguous()

    def get(self, role: str) -> torch.Tensor:
        p = getattr(self.module, self.names[role])
        if not self._needs_conversion(role):
            return p
        if torch.is_grad_enabled() and p.requires_grad:
            return self._convert(role, p)
        key = (p.data_ptr(), p._version, tuple(p.shape), p.stride(), p.dtype, p.device)
        hit = self._cache.get(role)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, self._convert(role, p))
            self._cache[role] = hit
        return hit[1]


def _gated_experts_roles(module: nn.Module, a: torch.Tensor, b: torch.Tensor, zero: int = 0
                         ) -> tuple[str, dict[str, str]] | None:
    """(layout, {"gate_up": name, "down": name}) of two packed gated weights by their shapes
    (`classify.packed_orientation` past the expert dim): "out_in" gate_up [E, 2F, D] + down
    [E, D, F], or "in_out" gate_up [E, D, 2F] + down [E, F, D]; None when neither fits. With
    `zero` identity experts gate_up may hold E + zero experts (down: E)."""
    if a.shape[0] != b.shape[0] and not (zero and abs(a.shape[0] - b.shape[0]) == zero):
        return None
    orient = packed_orientation([list(a.shape[1:]), list(b.shape[1:])])
    if orient is None:
        return None
    layout, i = orient
    g, d = (a, b) if i == 0 else (b, a)
    if g.shape[0] not in (d.shape[0], d.shape[0] + zero):
        return None
    names = {id(p): n for n, p in module.named_parameters(recurse=False)}
    return layout, {"gate_up": names[id(g)], "down": names[id(d)]}


def _experts_bindings(module: nn.Module, fn: Callable, block: Block | None = None,
                      kernel_bias: bool = False) -> dict[str, Callable]:
    """Packed experts: ``forward(x, topk_indices, topk_weights)`` in any argument order, weights
    found by their shapes: ``[E, 2F, D]`` (gate/up) and ``[E, D, F]`` (down) for a gated block,
    or ``[E, D, 2F]`` and ``[E, F, D]`` (used as x @ W); ``[E, F, D]`` (up) and ``[E, D, F]``
    (down), each the other's transpose, for a non-gated one (the kernel then is the `mlp`
    variant's). Which of a non-gated pair is up is x's width: up ends in D. With F == D the
    shapes cannot tell, so both assignments are offered and the first-call calibration keeps the
    one that reproduces the block.

    A gated block's gate/up split and biases come from the classifier (``block.attrs``:
    ``gate_up_split``, ``gate_up_bias``, ``down_bias``; ``weight_layout`` must agree with the
    shapes); a graph classified before they were recorded means [gate | up] halves, no biases.
    An unread split, or biases the kernel was not rendered with (``kernel_bias``, the `bias`
    render parameter), give no binding. Weights in another layout are converted by
    `_ExpertWeights`."""
    packed = [p for p in module.parameters(recurse=False) if p.ndim == 3]
    if len(packed) != 2:
        return {}
    a, b = packed
    zero = int((block.attrs.get("zero_experts") or 0) if block is not None else 0)
    roles = _gated_experts_roles(module, a, b, zero)
    if roles is None:
        if a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2] and a.shape[2] == b.shape[1]:
            return _mlp_experts_bindings(module, fn, a, b)
        return {}
    layout, names = roles
    attrs = block.attrs if block is not None else {}
    split = attrs.get("gate_up_split", "halves")
    if attrs.get("weight_layout", layout) != layout or split not in ("halves", "interleaved"):
        return {}
    biases = {k: attrs.get(k) for k in ("gate_up_bias", "down_bias")}
    has_bias = all(biases.values())
    if has_bias != kernel_bias or (any(biases.values()) and not has_bias):
        return {}
    if has_bias:
        own = dict(module.named_parameters())
        if any(n not in own for n in biases.values()):
            return {}
        names.update(biases)
    weights = _ExpertWeights(module, names, layout, split)
    roles_used = ("gate_up", "down", "gate_up_bias", "down_bias") if has_bias else ("gate_up", "down")

    def call(*args, **kwargs):
        x, idx, w = _experts_args(args, kwargs)
        ws = [weights.get(r) for r in roles_used]
        if not zero:
            return fn(x, idx, w, *ws)
        # Identity ("zero") experts: slots >= E return r * x. The kernel gets the E real experts
        # (gate_up's first E) and those slots as expert 0 with weight 0 (masked_fill: no gradient
        # through the kernel's slot); their r * x is added here, with its gradient to r and x.
        e = ws[1].shape[0]
        ws = [t[:e] if t.shape[0] != e else t for t in ws]
        slot = idx >= e
        y = fn(x, idx.masked_fill(slot, 0), w.masked_fill(slot, 0), *ws)
        return y + (x * (w * slot).sum(-1, keepdim=True)).to(y.dtype)

    how = "" if (layout, split, has_bias) == ("out_in", "halves", False) else \
        f"; {names['gate_up']} {layout} {split}" + (" + biases" if has_bias else "") + " -> kernel layout"
    if zero:
        how += f"; {zero} identity (zero) experts added in torch"
    return {f"x, topk_indices, topk_weights (by dtype and width){how}": call}


def _mlp_experts_bindings(module: nn.Module, fn: Callable, a: torch.Tensor, b: torch.Tensor
                          ) -> dict[str, Callable]:
    """Non-gated packed experts: up [E, F, D] and down [E, D, F] (see `_experts_bindings`). The
    weights are looked up by name at call time: FSDP2 swaps a sharded module's parameters."""
    names = {id(p): n for n, p in module.named_parameters(recurse=False)}
    na, nb = names[id(a)], names[id(b)]

    def bind(up_name: str | None, down_name: str | None):
        def call(*args, **kwargs):
            x, idx, w = _experts_args(args, kwargs)
            wa, wb = getattr(module, na), getattr(module, nb)
            if up_name is None:  # F != D: up is the weight whose last dim is x's width
                up, down = (wa, wb) if wa.shape[-1] == x.shape[-1] else (wb, wa)
            else:
                up, down = getattr(module, up_name), getattr(module, down_name)
            return fn(x, idx, w, up, down)
        return call

    if a.shape[1] != a.shape[2]:
        return {f"x, topk_indices, topk_weights; up/down = {na}/{nb} by x's width": bind(None, None)}
    return {f"x, topk_indices, topk_weights; up={na}, down={nb}": bind(na, nb),
            f"x, topk_indices, topk_weights; up={nb}, down={na}": bind(nb, na)}


def patch_model(model: nn.Module, graph: OpGraph,
                kernels: dict[tuple[str, str], ModuleType],
                kinds: set[str] | None = None) -> PatchSet:
    """Patch every block of ``graph`` (of ``kinds``, when given) that a family with a `binding`
    has a module for in ``kernels``.

    ``kernels`` maps (block path, family) to a loaded rendered module, and a block's further
    variants of one family to (block path, "family:variant") (see
    `onboarding.generate.candidates.kernels_for`). Per block, the first family in name order with a
    ``binding`` and a module under (path, family) is called as
    ``binding(block, module, kernels, record, model) -> undo | None``: ``module`` the model's
    module at the block's path, ``kernels`` that family's modules for the block (the one under
    (path, family) first), ``record`` the block's `PatchRecord` (pending; the binding sets
    ``binding``, and ``status``/``detail`` when it rejects the block or its patch calibrates),
    ``model`` the whole model (a patch may sit on an ancestor). It returns the patch's undo, or
    None with the record rejected. Returns a `PatchSet`; ``restore()`` undoes everything.
    """
    modules = dict(model.named_modules())
    binders = {name: spec.binding for name, spec in families().items() if spec.binding is not None}
    variants: dict[tuple[str, str], list[ModuleType]] = {}
    for (path, key), kmod in kernels.items():
        family, _, variant = key.partition(":")
        if variant:
            variants.setdefault((path, family), []).append(kmod)
    patches = PatchSet()
    for block in graph.blocks:
        if kinds and block.kind not in kinds:
            continue
        family = next((f for f in binders if (block.path, f) in kernels), None)
        if family is None:
            continue
        record = PatchRecord(path=block.path, kind=block.kind, family=family)
        patches.records.append(record)
        module = modules.get(block.path)
        if module is None:
            record.status, record.detail = "rejected", "no module at this path"
            continue
        mods = [kernels[(block.path, family)], *variants.get((block.path, family), ())]
        undo = binders[family](block, module, mods, record, model)
        if undo is not None:
            patches._undo.append(undo)
    return patches


@dataclass(kw_only=True)
class BlockSwap:
    """A whole block's forward replaced by a function made from its module: the Inductor fallback
    (``label`` "inductor") or an accepted LLM-written family's forward ("generated"). ``make``
    gets the module and returns the new forward. The replacement was gated by the block check
    (`onboarding.generate.blockcheck`) on the block's own code, so `run_align` leaves out the
    family patches at or inside a swapped block (what runs is what was checked); there is no
    first-call calibration, and alignment compares the block as usual. ``module``: the module
    whose forward is replaced when not the block's own (its weightless core module,
    `onboarding.generate.tasks.core_path`); the record stays the block's."""

    path: str
    module: str = ""
    kind: str = ""
    label: str
    make: Callable[[nn.Module], Callable]
    detail: str = ""


def swap_blocks(model: nn.Module, swaps: list[BlockSwap], patches: PatchSet | None = None
                ) -> PatchSet:
    """Install ``swaps`` on ``model`` (after any family patches: see `BlockSwap`), recorded in
    ``patches`` (a new `PatchSet` when None) with ``family`` = the swap's label; a record turns
    ``active`` on the block's first call. ``restore()`` undoes them with the rest."""
    patches = patches if patches is not None else PatchSet()
    modules = dict(model.named_modules())
    for s in swaps:
        record = PatchRecord(path=s.path, kind=s.kind, family=s.label, binding=s.label,
                             detail=s.detail)
        patches.records.append(record)
        module = modules.get(s.module or s.path)
        if module is None:
            record.status, record.detail = "rejected", f"no module at {s.module or 'this path'}"
            continue
        try:
            fn = s.make(module)
        except Exception as exc:  # a replacement that cannot be made leaves the block as is
            record.status, record.detail = "rejected", clip(f"{type(exc).__name__}: {exc}", 200)
            continue

        def forward(*args, _fn=fn, _record=record, **kwargs):
            _record.status = "active"
            return _fn(*args, **kwargs)

        patches._undo.append(swap_forward(module, forward))
    return patches
