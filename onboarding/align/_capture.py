"""Alignment's capture: each block's calls on a forward pass (`_Recorder`), their inputs and
outputs kept as `_Call`s for the judge to replay and compare."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from onboarding.align.stats import _float_slots, _map, _split, _tensors
from onboarding.graph.opgraph import Block


@dataclass
class _Call:
    args: Any = None  # (args, kwargs) with tensors detached and cloned; requires_grad kept aside
    grad_flags: list[bool] = field(default_factory=list)  # per tensor in _tensors(args)
    inputs: list[torch.Tensor] = field(default_factory=list)  # floating inputs (all)
    discrete_in: list[torch.Tensor] = field(default_factory=list)
    taps: list[torch.Tensor | None] = field(default_factory=list)  # grads w.r.t. tapped inputs
    n_taps: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)
    discrete_out: list[torch.Tensor] = field(default_factory=list)
    out_grads: list[torch.Tensor | None] = field(default_factory=list)
    out_needs_grad: list[bool] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)  # per output: its top-level slot
    none_slots: frozenset[int] = frozenset()  # top-level output slots that were None


def _without_slots(call: _Call, drop: frozenset[int]) -> _Call:
    """A copy of ``call`` without its floating outputs (and their grads) in the slots ``drop``."""
    keep = [s not in drop for s in call.out_slots]
    pick = lambda xs: [x for x, k in zip(xs, keep) if k]  # noqa: E731
    return dataclasses.replace(call, outputs=pick(call.outputs), out_grads=pick(call.out_grads),
                               out_needs_grad=pick(call.out_needs_grad), out_slots=pick(call.out_slots))


class _Recorder:
    """Forward pre/post hooks on the blocks of one model; see the module docstring."""

    def __init__(self, model: nn.Module, blocks: list[Block]):
        self.modules = dict(model.named_modules())
        self.calls: dict[str, list[_Call]] = {b.path: [] for b in blocks}
        self.start: list[str] = []
        self.end: list[str] = []
        self.active = True
        self._stack: dict[str, list[_Call]] = {}
        self._handles = []
        for b in blocks:
            m = self.modules.get(b.path)
            if m is None:
                continue
            self._handles.append(m.register_forward_pre_hook(self._pre(b.path), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(b.path), with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, path: str):
        def hook(module, args, kwargs):
            if not self.active:
                return None
            call = _Call()
            ts = list(_tensors((args, kwargs)))
            call.grad_flags = [t.requires_grad for t in ts]
            snap = lambda t: t.detach().clone()  # noqa: E731
            call.args = _map((args, kwargs), snap, inner=snap)  # a shared mapping: as it was now
            call.inputs, call.discrete_in = _split(t.detach().clone() for t in ts)
            if not torch.is_grad_enabled():
                self._begin(path, call)
                return None

            def tap(t: torch.Tensor) -> torch.Tensor:
                # A private clone: its gradient is this block's share only (the original may
                # feed a residual too). Only top-level and tuple-nested tensors are tapped.
                if not (t.is_floating_point() and t.requires_grad):
                    return t
                k = call.n_taps
                call.n_taps += 1
                call.taps.append(None)
                c = t.clone()
                c.register_hook(lambda g, k=k: call.taps.__setitem__(k, g.detach().clone()))
                return c

            new_args, new_kwargs = _map((args, kwargs), tap)
            self._begin(path, call)
            return new_args, new_kwargs
        return hook

    def _begin(self, path: str, call: _Call) -> None:
        self._stack.setdefault(path, []).append(call)
        self.start.append(path)

    def _post(self, path: str):
        def hook(module, args, kwargs, output):
            if not self.active or not self._stack.get(path):
                return None
            call = self._stack[path].pop()
            outs = list(_tensors(output))
            floats, discrete = _split(outs)
            call.outputs = [t.detach().clone() for t in floats]
            call.out_slots, call.none_slots = _float_slots(output)
            call.discrete_out = [t.detach().clone() for t in discrete]
            call.out_grads = [None] * len(floats)
            call.out_needs_grad = [t.requires_grad for t in floats]
            for k, t in enumerate(floats):
                if t.requires_grad:
                    # an output no loss reaches gets None when it comes out of an autograd
                    # Function whose other outputs are used (a kernel's final states): as unset
                    t.register_hook(lambda g, k=k: None if g is None else
                                    call.out_grads.__setitem__(k, g.detach().clone()))
            self.calls[path].append(call)
            self.end.append(path)
            return None
        return hook
