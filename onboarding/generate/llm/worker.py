"""The runtime anti-cheat check, as the replacement `onboarding.generate.blockcheck` calls.

`make(module, kernel=PATH)` (the blockcheck `Replacement` target) loads the rendered kernel
module and returns a `Watched` forward: each call runs ``block_forward(module, ...)`` under the
`Monitor` (fresh allocations poisoned, Triton launches counted, ATen ops recorded; the block
module's attributes compared before and after) and hands back its outputs through an autograd Function whose backward runs the kernel's own backward,
also under the `Monitor`, so both directions are watched and nothing else is. A call that runs
torch ops which do the work, launches no Triton kernel, or changes the kernel module's data
globals raises `CheatError` at once. On its first call it also compares the answer's
``reference`` with the block's own forward (forward only, unwatched). ``finish()`` returns the
record (blockcheck keeps it in the verdict's artifacts).

Blockcheck does the rest: the block's eager forward and every gradient against this forward, at
the captured size with two draws and at odd sizes, in a subprocess with a timeout.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from onboarding.generate.llm.folder import flat_tensors
from onboarding.generate.llm.runtime import Monitor, module_state, object_state, state_changes


class CheatError(RuntimeError):
    """The runtime check saw the answer do what it may not (the message says what)."""


def _violation(watched: Watched) -> str:
    rec = watched.monitor.record
    changed = state_changes(watched.before, module_state(watched.kmod))
    if changed:
        return f"anti-cheat (runtime): module-level state written during calls: {', '.join(changed)} " \
            "(outputs kept from earlier calls)"
    if rec.forbidden:
        ops = ", ".join(f"aten.{k} x{v}" for k, v in sorted(rec.forbidden.items()))
        return f"anti-cheat (runtime): torch ops do the work outside Triton kernels: {ops}"
    return ""


class _Guarded(torch.autograd.Function):
    """Outputs of block_forward, with the kernel's backward run under the monitor."""

    @staticmethod
    def forward(ctx, watched, spec, n_in, *flat):
        inputs, params = list(flat[:n_in]), list(flat[n_in:])
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                      and t.is_floating_point() else t for t in inputs]
            args, kwargs = tree_unflatten(leaves, spec)
            launches = watched.monitor.record.launches
            pre = object_state(watched.module)  # the eager forward may keep its own caches between calls
            with watched.monitor:
                out = watched.fn(watched.module, *args, **kwargs)
            kept = state_changes(pre, object_state(watched.module))
            if kept:
                raise CheatError(f"anti-cheat (runtime): block_forward wrote attribute(s) {', '.join(kept)} "
                                 "of the block module (outputs kept from earlier calls)")
            if watched.monitor.record.launches == launches:
                raise CheatError("anti-cheat (runtime): block_forward launched no Triton kernel")
        outs, ospec = tree_flatten(out)
        ctx.watched, ctx.ospec = watched, ospec
        ctx.leaves = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        ctx.slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        ctx.params, ctx.n_in = params, n_in
        ctx.outs = outs
        ctx.diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        watched.ospec, watched.last = ospec, outs
        res = tuple(o.detach() if isinstance(o, torch.Tensor) else torch.empty(0) for o in outs)
        ctx.mark_non_differentiable(*[r for i, r in enumerate(res) if i not in ctx.diff])
        return res

    @staticmethod
    def backward(ctx, *gouts):
        watched = ctx.watched
        targets = [ctx.outs[i] for i in ctx.diff]
        cots = [torch.zeros_like(ctx.outs[i]) if gouts[i] is None else gouts[i] for i in ctx.diff]
        wrt = ctx.leaves + [p for p in ctx.params if p.requires_grad]
        grads: list[Any] = [None] * len(wrt)
        if targets and wrt:
            launches = watched.monitor.record.launches
            with watched.monitor:
                grads = list(torch.autograd.grad(targets, wrt, cots, allow_unused=True))
            if watched.monitor.record.launches == launches:
                raise CheatError("anti-cheat (runtime): the backward launched no Triton kernel")
        why = _violation(watched)
        if why:
            raise CheatError(why)
        out: list[Any] = [None] * (ctx.n_in + len(ctx.params))
        for slot, g in zip(ctx.slots, grads[:len(ctx.leaves)]):
            out[slot] = g
        pgrads = iter(grads[len(ctx.leaves):])
        for j, p in enumerate(ctx.params):
            if p.requires_grad:
                out[ctx.n_in + j] = next(pgrads)
        return (None, None, None, *out)


class Watched:
    """The forward blockcheck calls; see the module docstring."""

    def __init__(self, module: torch.nn.Module, kernel: str, reference: str | None = None):
        from onboarding.generate.templating import load_module

        self.kmod = load_module(kernel)
        fn = getattr(self.kmod, "block_forward", None)
        if not callable(fn):
            raise CheatError("the rendered module has no block_forward(module, *args, **kwargs)")
        self.fn, self.module, self.reference = fn, module, reference
        self.monitor = Monitor(poison=True)
        self.before = module_state(self.kmod)
        self.calls = 0
        self.ospec, self.last = None, []
        self.reference_check: dict[str, Any] = {"checked": False}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.calls == 0 and self.reference:
            self.reference_check = _check_reference(self.reference, self.module, args, kwargs)
        self.calls += 1
        flat, spec = tree_flatten((args, kwargs))
        params = [p for p in self.module.parameters()]
        outs = _Guarded.apply(self, spec, len(flat), *flat, *params)
        why = _violation(self)
        if why:
            raise CheatError(why)
        outs = [new if isinstance(old, torch.Tensor) else old for new, old in zip(outs, self.last)]
        return tree_unflatten(outs, self.ospec)

    def finish(self) -> dict[str, Any]:
        return {"calls": self.calls, **self.monitor.record.as_dict(),
                "state_changes": state_changes(self.before, module_state(self.kmod)),
                "reference": self.reference_check}


def make(module: torch.nn.Module, kernel: str, reference: str | None = None) -> Watched:
    """The blockcheck `Replacement` target: see the module docstring."""
    return Watched(module, kernel, reference)


def _clone(x: Any) -> Any:
    flat, spec = tree_flatten(x)
    return tree_unflatten([t.detach().clone() if isinstance(t, torch.Tensor) else t for t in flat], spec)


def _check_reference(path: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The answer's reference against the block on these inputs, forward only."""
    from onboarding.testing.tolerance import compare_scaled, tolerance_for

    spec = importlib.util.spec_from_file_location("onboard_llm_reference", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        with torch.no_grad():
            got = flat_tensors(mod.reference(module, *_clone(args), **_clone(kwargs)))
            want = flat_tensors(type(module).forward(module, *_clone(args), **_clone(kwargs)))
    except Exception as exc:
        return {"checked": True, "reason": f"reference raised {type(exc).__name__}: "
                f"{(str(exc).strip().splitlines() or [''])[-1][:200]}"}
    if len(got) != len(want):
        return {"checked": True, "reason": f"reference returns {len(got)} tensors, the block {len(want)}"}
    rows = []
    for i, (a, b) in enumerate(zip(got, want)):
        if not b.is_floating_point():  # indices (a router's selected experts): exactly equal
            same = a.shape == b.shape and torch.equal(a.to(b.dtype), b)
            rows.append({"name": f"output {i}", "passed": same, "message": "" if same else
                         f"output {i}: integer values differ"})
            if not same:
                return {"checked": True, "checks": rows,
                        "reason": f"reference does not match the block: output {i}: integer "
                        "values differ"}
            continue
        c = compare_scaled(a.float(), b.float(), tolerance_for(b.dtype, "layer"), f"output {i}")
        rows.append(c.as_dict())
        if not c.passed:
            return {"checked": True, "checks": rows, "reason": f"reference does not match the block: {c.message}"}
    return {"checked": True, "checks": rows, "reason": ""}
