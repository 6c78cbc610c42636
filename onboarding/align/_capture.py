"""Alignment's capture: each block's calls on a forward pass (`_Recorder`), their inputs and
outputs kept as `_Call`s for the judge to replay and compare."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from onboarding.align.stats import (_at, _containers, _float_slots, _items, _map, _put,
                                    _readable, _same_containers, _split, _tensors)
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
    # the floating tensors the block wrote into a container it was handed (`WRITTEN`), each
    # (container path in `args` as `_at` follows it, key, index among the value's floats);
    # they are the last outputs, slot `WRITTEN`, in this order
    written: list[tuple[tuple, Any, int]] = field(default_factory=list)
    # per tensor in the entries of the mappings it was handed (`stats._readable`, in its order):
    # floating and requiring grad. Those are inputs too: their floats follow `_tensors`'s in
    # ``inputs``, their gradients follow in ``taps``, and the replay makes them leaves
    read_flags: list[bool] = field(default_factory=list)


# The out_slot of a tensor the block wrote into a list, dict or other mutable mapping it was
# handed (Gemma-3n's KV-store attention puts its keys and values into the ``KVSharingDict`` that
# later layers read): an output of the block like the ones it returns. Its forward is compared
# with the reference's, and its gradient (what the later readers send back) is recorded and
# backpropagated in the replay with the returned outputs' (`replay._replay`): without it no
# replay could reproduce the block's real parameter and input gradients.
WRITTEN = -1


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
        self._views: dict[int, list] = {}  # id(call) -> the containers it was handed
        self._reads: dict[int, list] = {}  # id(call) -> the mapping entries it tapped
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

            def note(t: torch.Tensor) -> torch.Tensor:
                call.read_flags.append(t.is_floating_point() and t.requires_grad)
                if t.is_floating_point():
                    call.inputs.append(t.detach().clone())
                return t

            for _, _, _, value in _readable((args, kwargs)):
                _map(value, note)
            if not torch.is_grad_enabled():
                self._views[id(call)] = [(p, c, c, _items(c))
                                         for p, c in _containers((args, kwargs))]
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

            # containers tapping left unchanged stay the model's own (a block writes into them)
            new = _same_containers((args, kwargs), _map((args, kwargs), tap))
            # a mapping's entries (what the block may read, `_readable`): tapped in place, the
            # model's own entries put back after the call (`_post`) where the block left them
            reads = []
            for _, mapping, key, value in _readable(new):
                tapped = _map(value, tap)
                if any(a is not b for a, b in zip(_tensors(tapped), _tensors(value))):
                    mapping[key] = tapped
                    reads.append((mapping, key, value, tapped))
            self._reads[id(call)] = reads
            # (path, the container the block sees, the model's, its entries now): `_written`
            self._views[id(call)] = [(p, c, _at((args, kwargs), p), _items(c))
                                     for p, c in _containers(new)]
            self._begin(path, call)
            return new
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
            self._written(call, self._views.pop(id(call), []))
            for mapping, key, value, tapped in self._reads.pop(id(call), []):
                if key in mapping and mapping[key] is tapped:  # the block did not replace it
                    mapping[key] = value
            self.calls[path].append(call)
            self.end.append(path)
            return None
        return hook

    def _written(self, call: _Call, views: list) -> None:
        """The floating tensors ``call``'s block wrote into the containers it was handed (entries
        new or replaced since its call), appended to its outputs (`WRITTEN`). Each one that
        requires grad is put back as a private clone whose gradient is recorded: later blocks
        read the clone, so its gradient is their share only, apart from the block's own use of
        the tensor. A container the tap had copied (it held a tapped tensor) gets the entry
        written through to the model's own."""
        for path, view, orig, before in views:
            for key, value in _items(view).items():
                if key in before and before[key] is value:
                    continue
                j = 0

                def out(t: torch.Tensor) -> torch.Tensor:
                    nonlocal j
                    if not t.is_floating_point():
                        return t
                    k = len(call.outputs)
                    call.outputs.append(t.detach().clone())
                    call.out_slots.append(WRITTEN)
                    call.out_grads.append(None)
                    call.out_needs_grad.append(t.requires_grad)
                    call.written.append((path, key, j))
                    j += 1
                    if not (t.requires_grad and torch.is_grad_enabled()):
                        return t
                    c = t.clone()
                    c.register_hook(lambda g, k=k: None if g is None else
                                    call.out_grads.__setitem__(k, g.detach().clone()))
                    return c

                new = _map(value, out)
                if any(a is not b for a, b in zip(_tensors(new), _tensors(value))):
                    _put(view, key, new)
                if orig is not view:
                    _put(orig, key, new)

