"""Patch binding of `moe.router` blocks to the router kernel, by structure, matching the
original's output structure by calibration.

The binding finds the gate weight by its shape ([n_experts, hidden], the only such 2-D
parameter of the block or its submodules) and, when the kernel was rendered with a score-correction bias, the one
parameter or buffer of n_experts values (the block's or a submodule's, [E] or [1, E]), or else
the one 1-D such tensor among the call's arguments (a bias the parent block owns and passes
in). A bias of the logits' linear itself (gpt-oss) is the parameter the classifier named.
Scoring, top-k, groups, renormalisation and scaling are rendered into the kernel from the
block's attrs; the binding only checks that the kernel's top-k is the block's. Two bindings differ in the dtype of the logits: the input's dtype (Qwen3,
Mixtral) or fp32 (DeepSeek-V3 and Kimi compute the router in fp32 whatever the model dtype).

Routers return different things: (logits, weights, indices) in transformers 5, (indices,
weights) elsewhere, dense [N, E] routing scores in older code. `router_adapt` reads the structure
off the original's output on the first call: the one integer [N, k] tensor is the indices, a
float [N, k] tensor the top-k weights, a float [N, E] tensor the logits or the dense scores
(whichever matches); each in the original's dtype. The selection is compared as a set per token
(a `topk(sorted=False)` original may list the same experts in another order; every consumer sums
over the k slots); weights are compared after aligning the slots. Anything else (a count vector,
a flipped selection, a tuple of another arity) is no match: the block is restored and reported.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, calibrated, entry_function
from onboarding.testing.tolerance import compare, tolerance_for


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return out.shape == ref.shape and compare(out.float(), ref.float(), tolerance_for(ref.dtype)).passed


def router_bindings(block: Block, module: nn.Module, fn: Callable, kmod: ModuleType
                    ) -> dict[str, Callable]:
    """Candidate calls of the router kernel for this block; empty when the structure does not fit."""
    n_experts = block.attrs.get("n_experts")
    params = dict(module.named_parameters())  # its own, or a gate nn.Linear inside (AFMoE)
    mats = [p for p in params.values() if p.ndim == 2 and n_experts in (None, p.shape[0])]
    if len(mats) != 1:
        return {}
    weight = mats[0]
    E = weight.shape[0]
    top_k = getattr(kmod, "TOP_K", None)
    if block.attrs.get("top_k") not in (None, top_k):
        return {}
    # the logits' own linear bias (gpt-oss), named by the classifier
    gate_bias = None
    if block.attrs.get("gate_bias"):
        own = dict(module.named_parameters())
        name = block.attrs["gate_bias"]
        gate_bias = next((p for n, p in own.items() if name == n or name.endswith("." + n)), None)
        if gate_bias is None or gate_bias.shape != (E,):
            return {}
    bias, bias_arg = None, False
    if getattr(kmod, "PARAMS", {}).get("score_bias"):
        # its own or a submodule's (Ernie 4.5's moe_statics holds a [1, E] one)
        vecs = [t for t in (*module.parameters(), *module.buffers()) if t is not gate_bias
                and t.numel() == E and t.squeeze().dim() == 1 and t.is_floating_point()]
        if len(vecs) > 1:
            return {}
        # none at all: the owner passes it in (MiniMax-M2's gate(x, e_score_correction_bias))
        bias, bias_arg = (vecs[0].reshape(E), False) if vecs else (None, True)

    def bind(fp32: bool) -> Callable:
        def call(*args, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
                       and t.is_floating_point()]
            xs = [t for t in tensors if t.dim() >= 2 and t.shape[-1] == weight.shape[1]]
            if len(xs) != 1:
                raise ValueError(f"expected one input of width {weight.shape[1]}, got {len(xs)}")
            b = bias
            if bias_arg:
                vecs = [t for t in tensors if t.dim() == 1 and t.shape[0] == E]
                if len(vecs) != 1:
                    raise ValueError(f"expected one score-bias argument of length {E}, got {len(vecs)}")
                b = vecs[0]
            x, w = (xs[0].float(), weight.float()) if fp32 else (xs[0], weight)
            gb = gate_bias.float() if fp32 and gate_bias is not None else gate_bias
            return fn(x, w, b, gb)
        return call

    return {"x, gate weight (logits in the input dtype)": bind(False),
            "x, gate weight (logits in fp32)": bind(True)}


def _slot_alignment(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor | None:
    """pos [N, k] with ours.gather(1, pos) == ref, or None when a row selects other experts."""
    if ours.shape != ref.shape or ours.dim() != 2:
        return None
    if not torch.equal(ours.sort(-1).values, ref.long().sort(-1).values):
        return None
    return (ref.long()[:, :, None] == ours[:, None, :]).int().argmax(-1)


def router_adapt(out: Any, ref: Any) -> tuple[Callable[[Any], Any], str] | None:
    """Map the kernel's (logits, topk_weights, topk_indices, counts) onto the original's output."""
    if not isinstance(out, tuple) or len(out) < 3:
        return None
    logits, weights, indices = out[:3]
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    if not all(isinstance(r, torch.Tensor) for r in refs):
        return None
    N, E = logits.shape
    k = indices.shape[1]
    ints = [r for r in refs if not r.is_floating_point()]
    if len(ints) > 1 or (ints and ints[0].numel() != N * k):
        return None
    # without indices in the output (dense scores only), top-k weights are compared as listed
    pos = _slot_alignment(indices, ints[0].reshape(N, k)) if ints else \
        torch.arange(k, device=indices.device).expand(N, k)
    if pos is None:
        return None

    def dense(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(idx.shape[0], E, dtype=w.dtype, device=w.device).scatter(1, idx, w)

    candidates = {
        "logits": lambda lg, w, idx: lg,
        "topk_weights": lambda lg, w, idx: w,
        "topk_indices": lambda lg, w, idx: idx,
        "dense_weights": lambda lg, w, idx: dense(w, idx),
    }
    layout: list[tuple[str, torch.dtype]] = []
    for r in refs:
        if r.dim() != 2 or r.shape[0] != N:  # routers flatten tokens; other layouts: no match
            names = []
        elif not r.is_floating_point():
            names = ["topk_indices"]
        elif r.shape[1] == k:
            names = ["topk_weights"] if _close(weights.gather(1, pos).to(r.dtype), r) else []
        elif r.shape[1] == E:
            names = [n for n in ("logits", "dense_weights")
                     if _close(candidates[n](logits, weights, indices).to(r.dtype), r)][:1]
        else:
            names = []
        if not names:
            return None
        layout.append((names[0], r.dtype))

    def convert(o: tuple) -> Any:
        lg, w, idx = o[:3]
        res = tuple(candidates[n](lg, w, idx).to(dt) for n, dt in layout)
        return res if isinstance(ref, (tuple, list)) else res[0]

    order = "" if not ints or torch.equal(indices, ints[0].reshape(N, k).long()) else \
        "; the original lists the same experts in another order"
    return convert, "(" + ", ".join(n for n, _ in layout) + ")" + order


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    if block.attrs.get("inline"):
        # the routing runs in the MoE block's own forward around its experts: swapping that
        # module's forward for the router kernel would drop the experts (a graph rewrite of the
        # block's forward could replace the linear -> scores -> top-k ops; not done)
        record.status, record.detail = "rejected", (
            "inline routing: the router runs in the MoE block's own forward, not in a module of "
            "its own, so no module patch can replace it")
        return None
    kmod = kernels[0]
    return calibrated(module, record, router_bindings(block, module, entry_function(kmod), kmod),
                      router_adapt)
