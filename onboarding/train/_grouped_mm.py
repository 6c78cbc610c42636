"""``onboard::grouped_mm_loop``: the experts' per-expert matmul loop as one opaque custom op.

`_moe_ep_ops._gmm` multiplies row groups by their expert's weight. Off CUDA bf16 it loops over the
experts in Python, splitting the rows by the counts it reads on the host; traced by
``torch.compile`` (`compile = "blocks"`) that read is a graph break per call and the split sizes
are data-dependent. This op runs the same loop (the same matmuls, so the same numbers) behind a
fake implementation whose output is [R, O] whatever the counts, and a backward made of the same
two loops (dx through the transposed weights, dW per expert), so a compiled layer keeps its MoE
experts in one graph. Used only while compiling; eager runs keep `_gmm`'s own loop.

Legend: R rows (grouped by expert), I in features, O out features, E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def matmul_per_group(x: Tensor, w_t: Tensor, sizes: list[int]) -> Tensor:
    """``x`` [R, I] in row groups of ``sizes`` (host ints) times ``w_t[e]`` [I, O] per group ->
    [R, O]: one matmul per non-empty group (`_moe_ep_ops._gmm`'s eager fallback and this op's
    body)."""
    outs = [xe @ w_t[e] for e, xe in enumerate(torch.split(x, sizes)) if sizes[e]]
    return torch.cat(outs) if outs else x.new_zeros(0, w_t.shape[-1])


@torch.library.custom_op("onboard::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(x: Tensor, w_t: Tensor, counts: Tensor) -> Tensor:
    """``x`` [R, I] in row groups of sizes ``counts`` [E] (summing to R) times ``w_t`` [E, I, O]
    per group -> [R, O]."""
    if x.dim() != 2 or w_t.dim() != 3 or x.shape[1] != w_t.shape[1] or counts.numel() != w_t.shape[0]:
        raise ValueError(f"grouped_mm_loop: x {tuple(x.shape)}, w_t {tuple(w_t.shape)}, counts "
                         f"{tuple(counts.shape)}: expected [R, I], [E, I, O], [E]")
    return matmul_per_group(x, w_t, counts.tolist())


@grouped_mm_loop.register_fake
def _(x: Tensor, w_t: Tensor, counts: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w_t.shape[-1])


@torch.library.custom_op("onboard::grouped_mm_loop_wgrad", mutates_args=())
def grouped_mm_loop_wgrad(x: Tensor, dy: Tensor, counts: Tensor) -> Tensor:
    """The weights' gradient of `grouped_mm_loop`: ``x_e^T @ dy_e`` per group -> [E, I, O]
    (zero for an expert without rows)."""
    sizes = counts.tolist()
    out = x.new_zeros(len(sizes), x.shape[1], dy.shape[1])
    for e, (xe, ge) in enumerate(zip(torch.split(x, sizes), torch.split(dy, sizes))):
        if sizes[e]:
            out[e] = xe.transpose(0, 1) @ ge
    return out


@grouped_mm_loop_wgrad.register_fake
def _(x: Tensor, dy: Tensor, counts: Tensor) -> Tensor:
    return x.new_empty(counts.shape[0], x.shape[1], dy.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, w_t, counts = inputs
    ctx.save_for_backward(x if w_t.requires_grad else None, w_t, counts)


def _backward(ctx, grad: Tensor):
    x, w_t, counts = ctx.saved_tensors
    dx = grouped_mm_loop(grad, w_t.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_loop_wgrad(x, grad, counts).to(w_t.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm_loop.register_autograd(_backward, setup_context=_setup)
