"""The tensor ops `moe_ep.EPExperts` composes, local to one process (no module, no collective).

- (token, k) pairs: their order by expert (`_PairOrder`), the token-row and routing-weight
  gathers (`_gather_pairs`), placement (`_place_rows`) and the combine (`_combine_pairs`), with
  sort-free, deterministic backwards; each token's k rows summed by `_sum_pairs`;
- the routing-weighted SwiGLU (`_SwiGLUWeighted`), its backward in row blocks;
- the grouped matmul over row groups by expert (`_gmm`, `_gmms`: ``torch._grouped_mm`` or the
  per-expert loop of `_grouped_mm`) and pairs per expert (`_bincount`).

Tests and fixtures patch `_gmm`, `_eager_grouped_mm`, `PAIR_BLOCK_ELEMENTS` and
`SWIGLU_BLOCK_ELEMENTS` on this module, where they are read.

Legend (as `moe_ep`'s): N tokens, K top-k, E experts (E_l local), D hidden, F expert width,
P pairs (N*K), R received rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from onboarding.train._grouped_mm import grouped_mm_loop, matmul_per_group


class _PlaceRows(torch.autograd.Function):
    """``out[index] = y`` into ``n`` zero rows; the backward gathers ``grad[index]``.

    Autograd's ``index_copy`` keeps its source (a [pairs, D] tensor per MoE layer, the size of
    the experts' output) for the backward; the gradient needs only the index. A permutation
    (``n == len(index)``) is placed by a gather through its inverse, which runs faster than the
    scattered row writes of ``index_copy``.
    """

    @staticmethod
    def forward(ctx, y, index, n):
        ctx.save_for_backward(index)
        if n == index.numel():
            inverse = torch.empty_like(index)
            inverse[index] = torch.arange(n, device=index.device, dtype=index.dtype)
            return y.index_select(0, inverse)
        return y.new_zeros(n, *y.shape[1:]).index_copy_(0, index, y)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _GatherPairs(torch.autograd.Function):
    """``x[order // k]``: the rows of ``x`` [n, ...] for the (token, k) pairs in the order of
    ``order``, a permutation of the ``n * k`` pairs; every row of ``x`` is taken ``k`` times.
    Takes ``rows = order // k`` and ``inverse = _inverse(order)`` (`_PairOrder`: made once per
    experts forward, shared by the gathers and the combine).

    Autograd's backward of that gather (``IndexBackward0``) is an ``index_put_`` with
    accumulate, which CUDA runs as a sort of the indices and a segment kernel. Here each row's
    ``k`` copies are found through the inverse permutation instead: ``dx`` is the sum over k of
    the gradient rows of each token (`_sum_pairs`: fp32 accumulation, one rounding; through
    ``kernel`` when one is attached), in a fixed order (deterministic), without a sort. Keeps
    only ``inverse`` for the backward.
    """

    @staticmethod
    def forward(ctx, x, rows, inverse, k, kernel=None):
        ctx.save_for_backward(inverse)
        ctx.k, ctx.kernel = k, kernel
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _sum_pairs(grad, inverse, ctx.k, ctx.kernel), None, None, None, None


@dataclass(frozen=True)
class _PairOrder:
    """A permutation ``order`` of the ``n * k`` (token, slot) pairs with what the gathers and
    the combine index by: ``rows = order // k`` (each pair's token row) and ``inverse`` (where
    pair ``p`` sits in ``order``, `_inverse`). Made once per experts forward: the token gather,
    the weights' gather and the combine share it (before, each made its own in the forward or
    the backward: three inverse scatters and two divisions per MoE layer and step)."""

    order: torch.Tensor
    k: int
    rows: torch.Tensor
    inverse: torch.Tensor

    @staticmethod
    def of(order: torch.Tensor, k: int) -> _PairOrder:
        return _PairOrder(order=order, k=k, rows=order // k if k > 1 else order,
                          inverse=_inverse(order))


# elements of `_sum_pairs`' gathered temporary per token block (torch path): small next to the
# [pairs, D] rows it sums
PAIR_BLOCK_ELEMENTS = 1 << 26


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """``inverse[p]``: where pair ``p`` (token ``p // k``, slot ``p % k``) sits in ``order``."""
    return torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device, dtype=order.dtype))


def _sum_pairs(src: torch.Tensor, inverse: torch.Tensor, k: int,
               kernel: Callable | None = None) -> torch.Tensor:
    """``out[t] = sum_j src[inverse[t * k + j]]`` for the ``len(inverse) // k`` tokens: each
    token's ``k`` pair rows, in ``src``'s dtype after an fp32 sum (one rounding).

    ``kernel`` (``kernel(src [S, D], inverse, k) -> [n, D]``: the pair-sum family's entry that
    `onboarding.train.kernels.attach_pair_sum_kernels` attaches on CUDA) sums a 2-D ``src`` in
    one pass, each pair row read once and the sums written once. The torch path gathers the
    rows into a temporary in token blocks of about `PAIR_BLOCK_ELEMENTS` elements and sums each
    block (``torch.sum``: fp32 accumulation for 16-bit), so the temporary stays small; on the
    H200 it took 0.501 ms at 16,384 tokens x top-8 x D 2048 bf16, against 0.717 ms for one
    ``embedding_bag`` (sum), the CUDA path it replaced (docs/LOG.md, twenty-fifth session,
    call Y)."""
    if k == 1:
        return src.index_select(0, inverse)
    if kernel is not None and src.dim() == 2:
        return kernel(src, inverse, k)
    n, tail = inverse.numel() // k, src.shape[1:]
    out = src.new_empty(n, *tail)
    step = max(1, PAIR_BLOCK_ELEMENTS // max(k * math.prod(tail), 1))
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        pairs = src.index_select(0, inverse[lo * k:hi * k])
        torch.sum(pairs.view(hi - lo, k, *tail), 1, out=out[lo:hi])
    return out


class _CombinePairs(torch.autograd.Function):
    """The experts' combine: ``y_sorted`` [pairs, ...] in the order of a permutation of the
    ``n * k`` (token, slot) pairs -> [n, ...], each token's ``k`` rows summed (`_sum_pairs`
    through the permutation's ``inverse``, or ``kernel`` when one is attached). The same sum as
    placing the rows back in pair order and summing over k
    (``_place_rows(y, order).view(n, k, -1).sum(1)``), without the placed [pairs, ...] copy; the
    backward gathers each pair's token gradient (``grad[rows]``, ``rows = order // k``). Keeps
    ``rows``."""

    @staticmethod
    def forward(ctx, y_sorted, rows, inverse, k, kernel=None):
        ctx.save_for_backward(rows)
        return _sum_pairs(y_sorted, inverse, k, kernel)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None, None, None


def _pair_order(order: torch.Tensor | _PairOrder, k: int) -> _PairOrder:
    return order if isinstance(order, _PairOrder) else _PairOrder.of(order, k)


def _combine_pairs(y_sorted: torch.Tensor, order: torch.Tensor | _PairOrder, k: int,
                   kernel: Callable | None = None) -> torch.Tensor:
    """Each token's ``k`` expert rows of ``y_sorted`` (pair order ``order``, or its
    `_PairOrder`) summed (`_CombinePairs`; ``kernel``: an attached pair-sum kernel, see
    `_sum_pairs`)."""
    po = _pair_order(order, k)
    return _CombinePairs.apply(y_sorted, po.rows, po.inverse, k, kernel)


def _gather_pairs(x: torch.Tensor, order: torch.Tensor | _PairOrder, k: int = 1,
                  kernel: Callable | None = None) -> torch.Tensor:
    """``x[order // k]`` (``order`` a permutation of ``len(x) * k`` pairs, or its `_PairOrder`)
    with a sort-free, deterministic backward (`_GatherPairs`; ``kernel``: an attached pair-sum
    kernel for that backward's sums, see `_sum_pairs`). A `_PairOrder` of any k serves a
    k = 1 gather (the routing weights, one per pair): rows ``order``, the same ``inverse``."""
    if isinstance(order, _PairOrder) and order.k != k:
        if k != 1:
            raise ValueError(f"a pair order of k={order.k} gathers k={order.k} or 1, not {k}")
        order = _PairOrder(order=order.order, k=1, rows=order.order, inverse=order.inverse)
    po = _pair_order(order, k)
    return _GatherPairs.apply(x, po.rows, po.inverse, k, kernel)


# elements of `_SwiGLUWeighted`'s backward temporaries per row block. A module constant, not a
# class attribute: dynamo cannot read an autograd.Function's class attribute while it traces the
# backward (a graph break at every apply under `compile = "blocks"`)
SWIGLU_BLOCK_ELEMENTS = 1 << 26


class _SwiGLUWeighted(torch.autograd.Function):
    """``silu(gate) * up * w`` per row of ``h = [gate | up]`` [R, 2F] with ``w`` [R]; keeps
    ``h`` and ``w`` for the backward and recomputes silu there (autograd would also keep
    silu(gate) [R, F]). The backward works in ``h``'s dtype with the same roundings as
    autograd's (silu's own backward op), in row blocks so its temporaries stay small next to the
    activations still held when it runs (`SWIGLU_BLOCK_ELEMENTS`)."""

    @staticmethod
    def forward(ctx, h, w):
        g, u = h.chunk(2, dim=-1)
        ctx.save_for_backward(h, w)
        return F.silu(g) * u * w.unsqueeze(-1).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        h, w = ctx.saved_tensors
        f = h.shape[-1] // 2
        dh = torch.empty_like(h)
        dw = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        step = max(1, SWIGLU_BLOCK_ELEMENTS // max(f, 1))
        for lo in range(0, h.shape[0], step):
            hi = min(lo + step, h.shape[0])
            g, u, gr = h[lo:hi, :f], h[lo:hi, f:], grad[lo:hi]
            act = F.silu(g)
            gu = act * u
            dw[lo:hi] = (gr * gu).sum(-1, dtype=torch.float32)
            gw = gr * w[lo:hi].unsqueeze(-1).to(gr.dtype)
            dh[lo:hi, f:] = gw * act  # not mul(out=a column slice): dynamo breaks there
            dh[lo:hi, :f] = torch.ops.aten.silu_backward(gw * u, g)
        return dh, dw.to(w.dtype)


def _place_rows(y: torch.Tensor, index: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Row ``i`` of ``y`` to row ``index[i]`` of an ``n``-row result (default: ``len(y)``, a
    permutation); rows no index names are zero. Keeps only ``index`` for the backward."""
    return _PlaceRows.apply(y, index, y.shape[0] if n is None else n)


def _counts(counts: torch.Tensor | list[int], device) -> torch.Tensor:
    """Rows per expert as a device tensor (a list is copied up; a device tensor is itself)."""
    return counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=device)


def _gmm(x: torch.Tensor, w_t: torch.Tensor, counts: torch.Tensor | list[int], *,
         offs: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped ``x_e @ w_t[e]`` over row groups of sizes ``counts``: [R, I] x [E_l, I, O] -> [R, O].

    CUDA: ``torch._grouped_mm`` (one launch), its offsets from the counts on the device (no host
    round trip: the host keeps queueing work); elsewhere, or where it refuses the dtype or the
    alignment, one matmul per non-empty expert. Inside ``torch.compile`` (`compile = "blocks"`)
    the same choice without a host read: ``torch._grouped_mm`` where it takes these tensors
    (`_grouped_mm_fits`, decided from shapes and strides), else the loop as one custom op
    (`_grouped_mm.grouped_mm_loop`: the same matmuls, output [R, O] whatever the counts) instead
    of a graph break at the counts' read and data-dependent split sizes. ``offs``: the counts'
    int32 cumulative sum when the caller has it (eager ``torch._grouped_mm``).
    """
    if torch.compiler.is_compiling():
        if x.is_cuda and _grouped_mm_fits(x, w_t):
            offs = torch.cumsum(_counts(counts, x.device), 0, dtype=torch.int32)
            return torch._grouped_mm(x, w_t, offs=offs)
        return grouped_mm_loop(x, w_t, _counts(counts, x.device))
    if _eager_grouped_mm(x, w_t):
        if offs is None:
            offs = torch.cumsum(_counts(counts, x.device), 0, dtype=torch.int32)
        try:
            return torch._grouped_mm(x, w_t, offs=offs)
        except RuntimeError:
            pass
    return matmul_per_group(x, w_t, counts.tolist() if isinstance(counts, torch.Tensor) else counts)


def _eager_grouped_mm(x: torch.Tensor, w_t: torch.Tensor) -> bool:
    """Whether eager `_gmm` runs ``torch._grouped_mm`` (CUDA, both bf16), else the per-expert
    loop."""
    return x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == w_t.dtype == torch.bfloat16


def _gmms(counts: torch.Tensor | list[int]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``gmm(x, w_t)``: `_gmm` over the row groups ``counts`` for one experts compute, where the
    per-expert loops (off CUDA bf16: fp32 expert LoRA, the CPU) read the counts on the host once,
    not once per matmul (four loops per layer with expert LoRA: four host syncs on CUDA), and
    eager ``torch._grouped_mm`` takes the device counts' offsets made once (one cumsum per
    layer, not one per matmul; no host read). A compiled step calls `_gmm` as it is."""
    host: list = []
    offsets: list = []

    def gmm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        if not isinstance(counts, torch.Tensor) or torch.compiler.is_compiling():
            return _gmm(x, w_t, counts)
        if _eager_grouped_mm(x, w_t):
            if not offsets:
                offsets.append(torch.cumsum(counts, 0, dtype=torch.int32))
            return _gmm(x, w_t, counts, offs=offsets[0])
        if not host:
            host.append(counts.tolist())
        return _gmm(x, w_t, host[0])
    return gmm


def _grouped_mm_fits(x: torch.Tensor, w_t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x`` [R, I] and ``w_t`` [E, I, O] as they are: both
    bf16 (what its fake implementation accepts), and every stride but the unit one a multiple
    of 16 bytes, the output's row too (its alignment check, which the eager path catches)."""
    if not hasattr(torch, "_grouped_mm") or not x.dtype == w_t.dtype == torch.bfloat16 \
            or x.dim() != 2 or w_t.dim() != 3:
        return False
    size = x.element_size()
    return all(s == 1 or (s * size) % 16 == 0 for s in (*x.stride(), *w_t.stride())) \
        and (w_t.shape[-1] * size) % 16 == 0


def _bincount(index: torch.Tensor, n: int) -> torch.Tensor:
    """Pairs per expert, by a scatter-add (CUDA's bincount reads the largest index back to the
    host first: a synchronisation per MoE layer)."""
    return torch.zeros(n, dtype=torch.long, device=index.device).scatter_add_(
        0, index, torch.ones_like(index))
