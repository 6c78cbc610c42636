"""Linear-attention blocks: swap the chunked delta-rule function a block calls for our kernel.

A `linear_attention.gated_delta` / `linear_attention.kimi_delta` block computes its projections,
conv and gates itself and hands the recurrence to one plain function: an instance attribute in
some models, a module-level function in others, a hub kernel (fla) when one is installed. Which
one is not read from names. While the block runs, every plain function it can reach (its
instance attributes, and the module-level functions its ``forward`` names) whose signature takes
at least five required positional arguments (q, k, v, g, beta: the delta-rule interface) is
wrapped. On the first call a wrapper binds the arguments by the function's own signature, runs
our kernel on the same tensors and keeps the swap when the output agrees with the original's
within the layer tolerance of its dtype; otherwise that function stays as it is. A swap that
agrees serves that first call as well (its output, with its autograd graph, is the kernel's), so
an alignment that runs the model once judges the kernel forward and backward. A block where no
function was swapped after its first call is reported as rejected.

Arguments our kernel does not take (a named one that is set, or a tensor such as variable-length
offsets passed through ``**kwargs``) keep the original function. A function without a
``use_qk_l2norm_in_kernel`` argument may or may not normalise q and k itself (the block's op graph
shows a normalisation either way, often applied before the call): calibration tries the kernel
without its l2norm first, then with it, and keeps the one that agrees.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

KERNEL_KWARGS = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
IGNORED = ("chunk_size",)  # a render parameter of ours: it changes rounding, not the maths


def _delta_rule_like(fn: Any) -> bool:
    if not inspect.isfunction(inspect.unwrap(fn)) and not inspect.isfunction(fn):
        return False
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) >= 5


def _forward_function(module: nn.Module) -> Callable:
    """The class's own forward, under any decorating wrappers (its globals are the model's)."""
    return inspect.unwrap(type(module).forward)


def callees(module: nn.Module) -> list[tuple[str, str, Callable]]:
    """(where, name, function): the plain functions ``module`` may hand its recurrence to."""
    found = [("attr", n, v) for n, v in vars(module).items()
             if n != "forward" and callable(v) and not isinstance(v, nn.Module)
             and _delta_rule_like(v)]
    fwd = _forward_function(module)
    code, glob = getattr(fwd, "__code__", None), getattr(fwd, "__globals__", {})
    for name in (code.co_names if code else ()):
        v = glob.get(name)
        if callable(v) and not isinstance(v, type) and _delta_rule_like(v):
            found.append(("global", name, v))
    return found


L2_FLAG = "use_qk_l2norm_in_kernel"


def _call_ours(fn: Callable, kernel: Callable, args: tuple, kwargs: dict, l2: bool | None = None) -> Any:
    """``kernel`` on ``fn``'s arguments; ``l2`` sets our l2norm flag when ``fn`` was not given one."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    catch_all = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            catch_all = named.pop(p.name, {})
    pos = [named.pop(n) for n in list(named)[:5]]
    extra = {k: named.pop(k) for k in KERNEL_KWARGS if k in named}
    extra.update({k: catch_all.pop(k) for k in KERNEL_KWARGS if k in catch_all})
    for k in IGNORED:
        named.pop(k, None)
    # A named argument we do not take changes the maths; so does a tensor passed through the
    # function's **kwargs (sequence offsets). Flags that only ride along in **kwargs do not.
    unknown = [k for k, v in named.items() if v is not None]
    unknown += [k for k, v in catch_all.items() if isinstance(v, torch.Tensor)]
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    if l2 is not None:
        extra.setdefault(L2_FLAG, l2)
    return kernel(*pos, **extra)


def _agrees(out: Any, ref: Any) -> tuple[bool, str]:
    from onboarding.align.stats import within
    from onboarding.testing.tolerance import layer_tolerance

    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    pairs = [(a, b) for a, b in zip(outs, refs) if isinstance(b, torch.Tensor)]
    if not pairs or len(outs) != len(refs):
        return False, "output structure differs"
    for a, b in pairs:
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False, "output shapes differ"
        ok, msg = within([a.float()], [b.float()], layer_tolerance(b.dtype), "output")
        if not ok:
            return False, msg
    return True, ""


class _Swap:
    """Wraps one reachable function of the block; calibrates on the first call."""

    def __init__(self, fn: Callable, kernel: Callable, patch: LinearAttentionPatch, name: str):
        self.fn, self.kernel, self.patch, self.name = fn, kernel, patch, name
        self.state = "pending"  # -> bound | kept
        self.l2: bool | None = None  # our l2norm flag, when the function takes none

    def __call__(self, *args, **kwargs):
        if self.state == "bound":
            return _call_ours(self.fn, self.kernel, args, kwargs, self.l2)
        ref = self.fn(*args, **kwargs)
        if self.state == "pending":
            given = L2_FLAG in inspect.signature(self.fn).parameters or L2_FLAG in kwargs
            ok, why = False, ""
            for l2 in (None,) if given else (False, True):
                try:
                    with torch.no_grad():
                        mine = _call_ours(self.fn, self.kernel, args, kwargs, l2)
                    ok, msg = _agrees(mine, ref)
                except (TypeError, ValueError, RuntimeError) as exc:
                    ok, msg = False, f"{type(exc).__name__}: {exc}"
                if ok:
                    self.l2 = l2
                    break
                why = why or msg  # the first attempt's reason (no l2norm of ours)
            self.state = "bound" if ok else "kept"
            self.patch.calibrated(self.name, ok, why)
            if ok:  # the kernel serves the first call too: a single-pass alignment judges it
                return _call_ours(self.fn, self.kernel, args, kwargs, self.l2)
        return ref


class LinearAttentionPatch:
    def __init__(self, module: nn.Module, kernel: Callable, record: Any):
        self.module, self.kernel, self.record = module, kernel, record
        self.swaps = {(where, name): _Swap(fn, kernel, self, f"{where} {name}")
                      for where, name, fn in callees(module)}
        self.original = module.forward
        self.had_own = "forward" in module.__dict__
        self.calls = 0

    def calibrated(self, name: str, ok: bool, why: str) -> None:
        if ok:
            self.record.status = "active"
            self.record.binding = f"delta-rule call {name} -> kernel"
        elif self.record.status != "active":
            self.record.detail = f"{name}: {why}"[:200]

    def forward(self, *args, **kwargs):
        glob = _forward_function(self.module).__globals__
        saved_attr, saved_glob = {}, {}
        for (where, name), swap in self.swaps.items():
            if where == "attr":
                saved_attr[name] = self.module.__dict__[name]
                self.module.__dict__[name] = swap
            else:
                saved_glob[name] = glob[name]
                glob[name] = swap
        try:
            return self.original(*args, **kwargs)
        finally:
            self.module.__dict__.update(saved_attr)
            glob.update(saved_glob)
            self.calls += 1
            if self.calls == 1 and self.record.status == "pending":
                self.record.status = "rejected"
                self.record.detail = self.record.detail or "no delta-rule call matched"

    def undo(self) -> None:
        if self.had_own:
            self.module.forward = self.original
        else:
            self.module.__dict__.pop("forward", None)


def patch_linear_attention(module: nn.Module, kernel: Callable, record: Any
                           ) -> Callable[[], None] | None:
    """Install the swap on ``module``; returns its undo, or None (record rejected)."""
    patch = LinearAttentionPatch(module, kernel, record)
    if not patch.swaps:
        record.status, record.detail = "rejected", "the block calls no delta-rule-like function"
        return None
    module.forward = patch.forward
    record.binding = "calibrating: " + ", ".join(s.name for s in patch.swaps.values())
    return patch.undo
