"""Experts written as a list of per-expert MLPs (`moe.experts`, ``layout: module_list``): each
member's 2-D weights stacked into the packed layout the experts kernels take, and the members'
calls served by the kernel.

Vendor code of this kind (Mixtral / Qwen2-MoE / DeepSeek remote code for transformers 4.x) routes
inline: the block that owns the list calls its router, picks the top-k, and then, expert by
expert, calls ``experts[e](x[rows])`` and multiplies by its own routing weights. The list itself
is never called. So the patch sits on each member's ``forward``: the routing stays the module's
own (its router call selected ``rows`` and weighs the result), and the member's call becomes one
kernel call over those rows with every row routed to expert ``e`` with weight 1
(``fn(x, [[e]], [[1]], gate_up, down)``), which is ``experts[e](x)``; a member called with the
rows' routing weights too (Mixtral's early ``expert(x, routing_weights)``, weighing inside the
expert) gets them as the kernel's weights.

The packed weights (`StackedExperts`): gated members (gate [F, D], up [F, D], down [D, F]) give
gate_up [E, 2F, D] as [gate | up] halves and down [E, D, F]; non-gated ones (up [F, D], down
[D, F]) up [E, F, D] and down [E, D, F]. A stack that needs no gradient (frozen weights, or under
no_grad) is made once and cached on every member weight's data_ptr, ``_version``, shape, stride,
dtype and device (an optimizer step or a swapped tensor stacks again); one that does (trained) is
re-stacked on every call with differentiable ops, the called member's weights as a one-expert
pack, so each gradient reaches the member's own weight. Which linear
is the gate, which up and which down is left open where the shapes cannot tell; every assignment
is offered and checked on the first call of each member against the member's own output (the
first-call calibration): the first one that matches is kept for all members, and a member that
then does not match gives the whole list back, unpatched, with the record rejected.
"""

from __future__ import annotations

from collections.abc import Callable
import torch
from torch import nn

from onboarding.formatting import clip
from onboarding.patching.core import PatchRecord, _matches, swap_forward


class StackedExperts:
    """The members' weights ``roles`` (per role, the parameter name inside a member) stacked
    over the list: ``get(e)`` -> ([E, out, in] tensors, one per role group; e's index in them). ``groups`` says which
    roles are concatenated along dim 1 (gate and up into gate_up)."""

    def __init__(self, members: list[nn.Module], groups: list[tuple[str, ...]]):
        self.members, self.groups = members, groups
        self._cache: tuple[tuple, list[torch.Tensor]] | None = None

    def _weights(self) -> list[list[torch.Tensor]]:
        names = [n for g in self.groups for n in g]
        return [[m.get_parameter(n) for n in names] for m in self.members]

    def _stack(self, per_member: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        out, i = [], 0
        for g in self.groups:
            cols = [torch.cat(ws[i:i + len(g)], 0) if len(g) > 1 else ws[i] for ws in per_member]
            out.append(torch.stack(cols, 0))
            i += len(g)
        return out

    def get(self, e: int | None = None) -> tuple[list[torch.Tensor], int]:
        """(packed weights, the index of member ``e`` in them). Frozen (or under no_grad): the
        whole list stacked once and cached, index ``e``. Trained: member ``e``'s own weights as a
        one-expert pack, stacked on every call, index 0 (each call's gradient reaches only its
        member's weights; no E-fold restack per call)."""
        per_member = self._weights()
        flat = [p for ws in per_member for p in ws]
        if torch.is_grad_enabled() and any(p.requires_grad for p in flat):
            if e is None:
                return self._stack(per_member), 0
            return self._stack([per_member[e]]), 0
        key = tuple((p.data_ptr(), p._version, tuple(p.shape), p.stride(), p.dtype, p.device)
                    for p in flat)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, self._stack(per_member))
        return self._cache[1], (e or 0)


def _member_weights(members: list[nn.Module]) -> list[tuple[str, tuple[int, ...]]] | None:
    """(name, shape) of the first member's parameters when every member has the same 2-D weights
    and nothing else; None otherwise."""
    first = [(n, tuple(p.shape)) for n, p in members[0].named_parameters()]
    if not first or any(len(s) != 2 for _, s in first):
        return None
    for m in members[1:]:
        if [(n, tuple(p.shape)) for n, p in m.named_parameters()] != first:
            return None
    return first


def role_candidates(members: list[nn.Module], gated: bool | None
                    ) -> list[tuple[str, list[tuple[str, ...]]]]:
    """(description, groups) for every assignment of the members' weights the shapes allow:
    gated [(gate, up), (down,)] with gate/up [F, D] and down [D, F]; non-gated [(up,), (down,)]
    with up [F, D] and down [D, F]. Empty when the weights fit neither."""
    weights = _member_weights(members)
    if weights is None:
        return []
    names = [n for n, _ in weights]
    shapes = dict(weights)
    out = []
    if gated is not False and len(names) == 3:
        for down in names:
            gu = [n for n in names if n != down]
            f, d = shapes[gu[0]]
            if shapes[gu[1]] != (f, d) or shapes[down] != (d, f):
                continue
            for gate, up in (gu, gu[::-1]):
                out.append((f"gate={gate}, up={up}, down={down}", [(gate, up), (down,)]))
    if gated is not True and len(names) == 2:
        for up, down in (names, names[::-1]):
            f, d = shapes[up]
            if shapes[down] == (d, f):
                out.append((f"up={up}, down={down}", [(up,), (down,)]))
    return out


def _call(fn: Callable, weights: StackedExperts, e: int) -> Callable:
    def call(x: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        packed, at = weights.get(e)
        idx = torch.full((rows.shape[0], 1), at, dtype=torch.long, device=x.device)
        w = torch.ones(rows.shape[0], 1, dtype=x.dtype, device=x.device) if r is None else \
            r.reshape(rows.shape[0], 1)
        return fn(rows, idx, w, *packed).reshape(*x.shape[:-1], -1)
    return call


def _member_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(hidden states, routing weight or None) of a member's call: the hidden states alone, or
    with the token's routing weight (one float per row: Mixtral's early
    ``expert(x, routing_weights)``, which weighs inside the expert); None for anything else."""
    vals = [*args, *kwargs.values()]
    if not vals or len(vals) > 2 or not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    x = vals[0]
    if len(vals) == 1:
        return x, None
    r = vals[1]
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    if not r.is_floating_point() or r.numel() != rows:
        return None
    return x, r


class _ListPatch:
    """The patch over every member's forward, with the shared first-call calibration."""

    def __init__(self, members: list[nn.Module], record: PatchRecord, fn: Callable,
                 candidates: list[tuple[str, list[tuple[str, ...]]]]):
        self.members, self.record = members, record
        self.stacks = {how: StackedExperts(members, groups) for how, groups in candidates}
        self.fn = fn
        self.chosen: str | None = None
        self.checked: set[int] = set()
        self.originals = [m.forward for m in members]
        self._undo = [swap_forward(m, self._forward(e)) for e, m in enumerate(members)]

    def undo(self) -> None:
        for undo in self._undo:
            undo()

    def _reject(self, detail: str) -> None:
        self.record.status, self.record.detail = "rejected", clip(detail, 200)
        self.undo()  # every member back, unpatched

    def _forward(self, e: int) -> Callable:
        def forward(*args, **kwargs):
            original = self.originals[e]
            found = _member_args(args, kwargs)
            if found is None:
                self._reject(f"member {e} called with {len(args) + len(kwargs)} arguments; the "
                             "kernel takes the hidden states (and a routing weight per row)")
                return original(*args, **kwargs)
            x, r = found
            if e not in self.checked:
                if x.numel() == 0:  # no rows routed here: nothing to check yet
                    return original(*args, **kwargs)
                with torch.no_grad():
                    ref = original(*args, **kwargs)
                    names = [self.chosen] if self.chosen else list(self.stacks)
                    fit = None
                    for how in names:
                        try:
                            out = _call(self.fn, self.stacks[how], e)(x, r)
                        except (TypeError, ValueError, RuntimeError) as exc:
                            self.record.detail = clip(f"{how}: {type(exc).__name__}: {exc}", 200)
                            continue
                        if _matches(out, ref):
                            fit = how
                            break
                if fit is None:
                    self._reject(f"member {e}: " + (f"{self.chosen} does not reproduce it" if self.chosen
                                                    else self.record.detail or "no binding matched"))
                    return original(*args, **kwargs)
                if self.chosen is None:
                    self.chosen = fit
                    self.record.status, self.record.detail = "active", ""
                    weight = "weight 1" if r is None else "the routing weight it is called with"
                    self.record.binding = (f"per member: its routed rows, expert index, {weight}; "
                                           f"{fit} stacked to the packed layout")
                self.checked.add(e)
            return _call(self.fn, self.stacks[self.chosen], e)(x, r)
        return forward


def module_list_bindings(module: nn.Module, fn: Callable, record: PatchRecord,
                         gated: bool | None) -> Callable[[], None] | None:
    """Patch the members of the expert list ``module`` with the experts kernel ``fn(x, idx, w,
    *packed)``; the undo, or None with the record rejected when the members' weights fit no
    packed layout."""
    members = list(module.children())
    if len(members) < 2 or not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        record.status, record.detail = "rejected", "not a list of expert modules"
        return None
    candidates = role_candidates(members, gated)
    if not candidates:
        record.status, record.detail = "rejected", (
            "structure does not fit the kernel: members need the same 2-D gate/up [F, D] and down "
            "[D, F] weights (or up and down) and no other parameters")
        return None
    patch = _ListPatch(members, record, fn, candidates)
    return patch.undo


__all__ = ["StackedExperts", "role_candidates", "module_list_bindings"]
