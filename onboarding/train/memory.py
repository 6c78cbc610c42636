"""What a training step keeps for its backward: bytes per block kind and per autograd op.

Activation memory without an allocator: inside `torch.autograd.graph.saved_tensors_hooks`, every
tensor autograd (or a kernel's ``save_for_backward``) keeps is seen once; distinct storages are
counted once, parameters left out. Each storage is put down to the innermost module running when
it was first saved (then to the op graph's block that holds that module) and to the backward
node that keeps it. Deterministic and device-free: the CPU answers where the GPU run's peak
memory comes from, and whether our patched model keeps more than the model as it stands.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from onboarding.graph.opgraph import OpGraph
from onboarding.modpath import inside

MODEL = "(model)"  # outside every block of the graph: embedding, loss


@dataclass(kw_only=True)
class SavedBytes:
    total: int
    by_kind: dict[str, int] = field(default_factory=dict)
    by_op: dict[str, int] = field(default_factory=dict)
    # (block kind, module leaf name, op, shape, dtype) -> bytes, the largest first
    rows: list[tuple[tuple[str, str, str, tuple, str], int]] = field(default_factory=list)


def _owner(graph: OpGraph) -> Callable[[str], str]:
    blocks = sorted((b for b in graph.blocks if b.path), key=lambda b: -len(b.path))

    def kind(path: str) -> str:
        return next((b.kind for b in blocks if inside(path, b.path)),
                    MODEL)
    return kind


def _saved_by_node(root) -> dict[int, str]:
    """{storage address: name of the first backward node found keeping it} over the graph."""
    out: dict[int, str] = {}
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kept: list = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    v = getattr(node, attr)
                except RuntimeError:
                    continue
                kept += list(v) if isinstance(v, (tuple, list)) else [v]
        try:  # custom autograd Functions
            kept += list(node.saved_tensors)
        except (AttributeError, RuntimeError):
            pass
        for t in kept:
            if isinstance(t, torch.Tensor):
                out.setdefault(t.untyped_storage().data_ptr(), node.name())
        todo += [f for f, _ in node.next_functions]
    return out


def saved_for_backward(model: nn.Module, graph: OpGraph,
                       step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, SavedBytes]:
    """Run ``step()`` (the forward and loss, returning the loss) and count what its backward
    keeps; then runs the backward. Returns (loss, `SavedBytes`)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack = [""]

    def leave(module, args, out) -> None:
        stack.pop()

    hooks = []
    for name, mod in model.named_modules():
        hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
        hooks.append(mod.register_forward_hook(leave))
    first: dict[int, tuple[str, int, tuple, str]] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in first:
            first[s.data_ptr()] = (stack[-1], s.nbytes(), tuple(t.shape), str(t.dtype))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
    finally:
        for h in hooks:
            h.remove()
    ops = _saved_by_node(loss.grad_fn)
    kind = _owner(graph)
    by_kind, by_op, rows = Counter(), Counter(), Counter()
    for ptr, (path, nbytes, shape, dtype) in first.items():
        k, op = kind(path), ops.get(ptr, "?")
        by_kind[k] += nbytes
        by_op[op] += nbytes
        rows[(k, path.rpartition(".")[2], op, shape, dtype)] += nbytes
    loss.backward()
    return loss.detach(), SavedBytes(total=sum(by_kind.values()), by_kind=dict(by_kind.most_common()),
                                     by_op=dict(by_op.most_common()), rows=rows.most_common())
