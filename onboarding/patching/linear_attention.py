"""Linear-attention blocks: swap the chunked delta-rule function a block calls for our kernel.

A `linear_attention.gated_delta` / `linear_attention.kimi_delta` block computes its projections,
conv and gates itself and hands the recurrence to one plain function: an instance attribute in
some models, a module-level function in others, a hub kernel (fla) when one is installed. Which
one is not read from names. While the block runs, every function it can reach (its instance
attributes, and the module-level functions its ``forward`` or its helpers name:
`onboarding.patching.callswap.reachable`) whose signature takes
at least five required positional arguments (q, k, v, g, beta: the delta-rule interface) is
wrapped (`onboarding.patching.callswap`: calibrated on the first call, which the kernel then
serves too). The wrapper binds the arguments by the function's own signature.

Arguments our kernel does not take (a named one that is set, or a tensor such as variable-length
offsets passed through ``**kwargs``) keep the original function. A function without a
``use_qk_l2norm_in_kernel`` argument may or may not normalise q and k itself (the block's op graph
shows a normalisation either way, often applied before the call): calibration tries the kernel
without its l2norm first, then with it, and keeps the one that agrees.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from onboarding.patching.callswap import Interface, install, min_required

KERNEL_KWARGS = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
IGNORED = ("chunk_size",)  # a render parameter of ours: it changes rounding, not the maths
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
    # function's **kwargs (sequence offsets). Flags that only ride along in **kwargs do not, nor
    # does anything in a **kwargs the function's body never reads (GLM-5-Next's layers hand
    # their chunk_kimi_delta_attention the model's input_ids that way).
    unknown = [k for k, v in named.items() if v is not None]
    if catch_all and _reads_catch_all(fn):
        unknown += [k for k, v in catch_all.items() if isinstance(v, torch.Tensor)]
    if unknown:
        raise TypeError(f"arguments the kernel does not take: {unknown}")
    if l2 is not None:
        extra.setdefault(L2_FLAG, l2)
    return kernel(*pos, **extra)


@functools.lru_cache(maxsize=256)
def _reads_catch_all(fn: Callable) -> bool:
    """Whether ``fn``'s body reads its ``**kwargs`` parameter (by its own name); True when its
    source cannot be read (what it does with them is then unknown)."""
    sig = inspect.signature(fn)
    name = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if name is None:
        return False
    body = inspect.unwrap(getattr(fn, "__func__", fn))
    # a stateless module's forward standing for a function (transformers 5.25's hub decorator:
    # `forward(self, *args, **kwargs)` with the function's signature, calling it): that function,
    # the one among its closure's whose signature it carries
    body = next((c.cell_contents for c in (getattr(body, "__closure__", None) or ())
                 if inspect.isfunction(c.cell_contents)
                 and inspect.signature(c.cell_contents) == sig), body)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(body)))
    except (OSError, TypeError, SyntaxError):
        return True
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                None)
    if func is None:
        return True
    return any(isinstance(n, ast.Name) and n.id == name for stmt in func.body
               for n in ast.walk(stmt))


def _l2_variants(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """Our l2norm off, then on, when the function takes no flag of its own."""
    given = L2_FLAG in inspect.signature(fn).parameters or L2_FLAG in kwargs
    return (None,) if given else (False, True)


# q, k, v, g, beta: at least five required positional arguments
DELTA_RULE = Interface(what="delta-rule", fits=min_required(5), call=_call_ours,
                       variants=_l2_variants)


def patch_linear_attention(module: nn.Module, kernel: Callable, record: Any
                           ) -> Callable[[], None] | None:
    """Install the swap on ``module``; returns its undo, or None (record rejected)."""
    return install(module, kernel, record, DELTA_RULE,
                   "the block calls no delta-rule-like function")
