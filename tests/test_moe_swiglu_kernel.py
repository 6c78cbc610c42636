"""Issue 34: the MoE experts' routing-weighted SwiGLU as one Triton pass each way (the swiglu
family's `weighted` variant, attached by `attach_swiglu_kernels`), and the sort-free backward of
the token-row gather feeding the experts (`_GatherPairs`).

CPU runs interpret the kernel in fp32 (tests/conftest.py sets TRITON_INTERPRET); the CUDA test at
the end checks the real proxy shape in bf16 and prints timings (skipped without a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from onboarding.train._moe_ep_ops import _gather_pairs, _SwiGLUWeighted
from onboarding.train.moe_ep import EPExperts, EPGroup
from onboarding.bench.harness import time_fn
from onboarding.families import training_kernel
from onboarding.train.kernels import (WEIGHTED_ACT_KIND, attach_swiglu_kernels, check_swiglu_kernel,
                                      load_training_variant)

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# CPU: small tiles, so F = 100 takes two column steps (one partial) and 37 rows three row blocks
CPU_CONFIG = {"BLOCK_N": 16, "BLOCK_F": 64, "num_warps": 4}


@pytest.fixture(scope="module")
def kernel_module(tmp_path_factory):
    assert training_kernel(WEIGHTED_ACT_KIND) == ("swiglu", "weighted")  # the family says it serves it
    module = load_training_variant(training_kernel(WEIGHTED_ACT_KIND), tmp_path_factory.mktemp("swiglu_w"), 0)
    if not CUDA:
        module.set_config(CPU_CONFIG)
    return module


# ---- the gather's backward ---------------------------------------------------------------------
@pytest.mark.parametrize("n,k,d", [(7, 3, 5), (5, 1, 4), (0, 2, 3)])
def test_gather_pairs_equals_indexing_without_index_backward(n, k, d, monkeypatch):
    """Same rows and the same d x as ``x[order // k]`` (fp64: exactly the same sums), through
    `_GatherPairs`'s backward, not autograd's IndexBackward0 (a sort + index_put on CUDA); its
    token blocks of 2 tokens here (the last one partial)."""
    from onboarding.train import _moe_ep_ops

    monkeypatch.setattr(_moe_ep_ops, "PAIR_BLOCK_ELEMENTS", 2 * k * d)
    gen = torch.Generator().manual_seed(n * 10 + k)
    x = torch.randn(n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    order = torch.randperm(n * k, generator=gen)
    y, ref = _gather_pairs(x, order, k), x[order // k]
    assert torch.equal(y, ref)
    assert "GatherPairs" in type(y.grad_fn).__name__ and "Index" not in type(y.grad_fn).__name__
    dy = torch.randn(y.shape, dtype=torch.float64, generator=gen)
    (got,), (want,) = torch.autograd.grad(y, [x], dy), torch.autograd.grad(ref, [x], dy)
    torch.testing.assert_close(got, want)
    w = torch.randn(n * k, dtype=torch.float64, generator=gen, requires_grad=True)  # 1-D, k = 1
    assert torch.autograd.gradcheck(lambda t: _gather_pairs(t, order), (w,))


@pytest.mark.parametrize("n,k,d", [(7, 3, 5), (5, 1, 4), (0, 2, 3)])
def test_combine_pairs_is_place_rows_then_sum(n, k, d, monkeypatch):
    """The experts' combine (`_combine_pairs`) equals placing the rows back in pair order and
    summing each token's k rows (the form it replaces: ``_place_rows(y, order).view(n, k, -1)
    .sum(1)``), forward and gradient, exactly in fp64, through `_sum_pairs`' torch path (the
    blocked gather + sum, in token blocks of 2 here), and `_GatherPairs`'s backward (the same
    `_sum_pairs`) too. Keeps only the order."""
    from onboarding.train import _moe_ep_ops

    monkeypatch.setattr(_moe_ep_ops, "PAIR_BLOCK_ELEMENTS", 2 * k * d)
    gen = torch.Generator().manual_seed(n * 10 + k)
    y = torch.randn(n * k, d, dtype=torch.float64, generator=gen, requires_grad=True)
    order = torch.randperm(n * k, generator=gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _moe_ep_ops._combine_pairs(y, order, k)
    assert all(not t.is_floating_point() for t in saved)
    ref = _moe_ep_ops._place_rows(y, order).view(n, k, d).sum(1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dy = torch.randn(n, d, dtype=torch.float64, generator=gen)
    (got,), (want,) = torch.autograd.grad(out, [y], dy), torch.autograd.grad(ref, [y], dy)
    assert torch.equal(got, want)
    x = torch.randn(n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    dp = torch.randn(n * k, d, dtype=torch.float64, generator=gen)
    (gx,), (wx,) = (torch.autograd.grad(f(x), [x], dp) for f in
                    (lambda t: _gather_pairs(t, order, k), lambda t: t[order // k]))
    torch.testing.assert_close(gx, wx, rtol=0, atol=1e-12)


def test_ep_forward_has_no_index_backward():
    """The experts' forward gathers token rows and routing weights through `_GatherPairs`: the
    autograd graph of an `EPExperts` output holds no IndexBackward0."""
    m = _experts(4, 16, 13)
    x, idx, w = _routing(9, 16, 4, 2, torch.Generator().manual_seed(0))
    y = m(x.requires_grad_(), idx, w.requires_grad_())
    names, seen, todo = set(), set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo += [f for f, _ in fn.next_functions]
    assert "IndexBackward0" not in names and any("GatherPairs" in n for n in names), names


# ---- the kernel against the torch path -----------------------------------------------------------
@pytest.mark.parametrize("rows,f", [(37, 100), (3, 1), (0, 7)], ids=["37x100", "3x1", "0rows"])
def test_weighted_kernel_matches_torch_path(kernel_module, rows, f):
    """Forward, dh and dw against `_SwiGLUWeighted` on fresh random inputs in fp32 (odd rows and
    widths, not multiples of the tiles; no rows at all)."""
    gen = torch.Generator().manual_seed(rows + f)
    h = (3 * torch.randn(rows, 2 * f, generator=gen)).to(DEV).requires_grad_()
    w = torch.rand(rows, generator=gen).to(DEV).requires_grad_()
    dy = torch.randn(rows, f, generator=gen).to(DEV)
    y, ref = kernel_module.swiglu_weighted(h, w), _SwiGLUWeighted.apply(h, w)
    assert y.shape == ref.shape == (rows, f) and y.dtype == ref.dtype
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    got, want = torch.autograd.grad(y, [h, w], dy), torch.autograd.grad(ref, [h, w], dy)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)


def test_check_passes_the_kernel_and_rejects_a_wrong_one(kernel_module):
    """`check_swiglu_kernel` accepts the kernel (fp32, and bf16 h with fp32 w, loaded then cast
    in the kernel) and names what differs for a kernel whose output or dw is off."""
    fn = kernel_module.swiglu_weighted
    assert check_swiglu_kernel(fn, 50, torch.float32, DEV, rows=21) is None
    assert check_swiglu_kernel(fn, 50, torch.bfloat16, DEV, w_dtype=torch.float32, rows=21) is None
    bad = check_swiglu_kernel(lambda h, w: _SwiGLUWeighted.apply(h, w * 1.1), 50, torch.float32,
                              DEV, rows=21)
    assert bad and bad.startswith("output") and "d w" in bad, bad


# ---- through EPExperts -------------------------------------------------------------------------
class _Packed(nn.Module):
    """transformers 5's packed experts: gate_up_proj [E, 2F, D] ([gate | up]), down_proj [E, D, F]."""

    def __init__(self, e: int, d: int, f: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, d, generator=gen) / d ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(e, d, f, generator=gen) / f ** 0.5)


def _experts(e: int, d: int, f: int, **attrs) -> EPExperts:
    return EPExperts(_Packed(e, d, f), path="model.layers.0.mlp.experts", layer=0, ep=EPGroup(),
                     width=d, act=F.silu, attrs=attrs).to(DEV)


def _routing(n: int, d: int, e: int, k: int, gen: torch.Generator):
    x = torch.randn(n, d, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    return x.to(DEV), idx.to(DEV), torch.rand(n, k, generator=gen).to(DEV)


def test_ep_experts_with_the_kernel_attached_match_the_torch_path(kernel_module, tmp_path,
                                                                   monkeypatch):
    """`attach_swiglu_kernels` renders the `weighted` variant, checks it and attaches it to plain
    SwiGLU experts only; those then agree with a copy on the torch path (output, d x and the
    routing weights' gradient), with the kernel really called. A failed check keeps the torch
    path with a warning."""
    import onboarding.train.kernels as S

    plain, clamped = _experts(5, 16, 13), _experts(5, 16, 13, clamp=7.0, up_offset=1.0)
    torch_path = copy.deepcopy(plain)
    assert not clamped.plain
    # rendered here, into tmp_path (the CPU tiles pinned afterwards, as the fixture's module)
    counts = attach_swiglu_kernels([plain, clamped], tmp_path, rank=0)
    assert counts == {WEIGHTED_ACT_KIND: 1, f"rejected:{WEIGHTED_ACT_KIND}": 0}
    assert plain.swiglu_kernel is not None and clamped.swiglu_kernel is None
    assert (tmp_path / "rank0" / "swiglu").is_dir()
    calls = []

    def counted(h, w):
        calls.append(tuple(h.shape))
        return kernel_module.swiglu_weighted(h, w)

    plain.use_swiglu_kernel(counted)
    gen = torch.Generator().manual_seed(3)
    x, idx, w = _routing(11, 16, 5, 3, gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    ya, yb = plain(xa, idx, wa), torch_path(xb, idx, wb)
    assert calls == [(33, 26)]  # all 11 x 3 pairs, [gate | up] of F = 13
    cot = torch.randn(ya.shape, generator=gen).to(DEV)
    (ya * cot).sum().backward()
    (yb * cot).sum().backward()
    for got, want in ((ya, yb), (xa.grad, xb.grad), (wa.grad, wb.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    plain.use_swiglu_kernel(None)
    monkeypatch.setattr(S, "check_swiglu_kernel", lambda *a, **kw: "output 3.0e-01")
    with pytest.warns(UserWarning, match="keep the torch path"):
        assert attach_swiglu_kernels([plain], tmp_path, rank=0)[f"rejected:{WEIGHTED_ACT_KIND}"] == 1
    assert plain.swiglu_kernel is None
    assert attach_swiglu_kernels([clamped], tmp_path, rank=0) == {}
    plain.kernel = lambda *a: None  # the grouped expert LoRA kernel applies w itself
    assert attach_swiglu_kernels([plain], tmp_path, rank=0) == {} and plain.swiglu_kernel is None


# ---- CUDA: the proxy's shape, bf16 ---------------------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_weighted_kernel_proxy_shape_bf16_and_timing(kernel_module):
    """The H200 profile's shape (R = 131072 rows, F = 768, bf16): the kernel within the check's
    bars of the torch path, and each path's forward + backward time printed (run with -s)."""
    r, f = 131072, 768
    assert check_swiglu_kernel(kernel_module.swiglu_weighted, f, torch.bfloat16, DEV,
                               rows=r) is None
    gen = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(r, 2 * f, device=DEV, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.rand(r, device=DEV, generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(r, f, device=DEV, generator=gen).to(torch.bfloat16)

    ours, torch_ms = (time_fn(lambda _, fn=fn: torch.autograd.grad(fn(h, w), [h, w], dy)).median_ms
                      for fn in (kernel_module.swiglu_weighted, _SwiGLUWeighted.apply))
    print(f"\nweighted SwiGLU fwd+bwd R={r} F={f} bf16: kernel {ours:.3f} ms, "
          f"torch path {torch_ms:.3f} ms ({torch_ms / ours:.2f}x)")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_gather_pairs_backward_proxy_shape_and_timing():
    """The H200 profile's gather (16,384 tokens x top-8 of D = 2048, bf16): `_GatherPairs`'s d x
    is the fp32 sum of each token's 8 bf16 gradient rows rounded once (against the fp32 path's),
    and each backward's time, and autograd's ``x[order // k]``'s, printed (run with -s)."""
    n, k, d = 16384, 8, 2048
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(n, d, device=DEV, generator=gen).to(torch.bfloat16).requires_grad_()
    e = torch.randint(0, 64, (n * k,), device=DEV, generator=gen)
    order = torch.argsort(e, stable=True)
    dy = torch.randn(n * k, d, device=DEV, generator=gen).to(torch.bfloat16)
    ours, = torch.autograd.grad(_gather_pairs(x, order, k), [x], dy)
    x32 = x.detach().float().requires_grad_()
    ref, = torch.autograd.grad(x32[order // k], [x32], dy.float())
    torch.testing.assert_close(ours.float(), ref, rtol=4e-3, atol=1e-5)  # one bf16 rounding

    a, b = (time_fn(lambda _, fn=fn: torch.autograd.grad(fn(), [x], dy)).median_ms
            for fn in (lambda: _gather_pairs(x, order, k), lambda: x[order // k]))
    print(f"\ngather fwd+bwd {n}x{k} rows of {d} bf16: _GatherPairs {a:.3f} ms, "
          f"x[order // k] {b:.3f} ms ({b / a:.2f}x)")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_pair_sums_by_embedding_bag_proxy_shape_and_timing():
    """The proxy's combine and gather backward shape (16,384 tokens x top-8 of D = 2048, bf16):
    `_sum_pairs`' torch path (the blocked gather + sum, CUDA's path when no pair-sum kernel is
    attached) against ``embedding_bag`` (sum), the CUDA path it replaced (an anchor here), each
    one fp32 sum rounded once: equal but for the order of fp32 adds (1 bf16 ulp at most, on few
    elements); each one's time printed (run with -s). The pair-sum kernel's own timing is in
    tests/kernel_tests/test_pair_sum.py."""
    from onboarding.train import _moe_ep_ops

    n, k, d = 16384, 8, 2048
    gen = torch.Generator(device=DEV).manual_seed(0)
    src = torch.randn(n * k, d, device=DEV, generator=gen).to(torch.bfloat16)
    order = torch.argsort(torch.randint(0, 64, (n * k,), device=DEV, generator=gen), stable=True)
    inverse = _moe_ep_ops._inverse(order)
    bag_index = inverse.view(n, k)
    bag = F.embedding_bag(bag_index, src, mode="sum")
    plain = _moe_ep_ops._sum_pairs(src, inverse, k)
    ref = src.float().index_select(0, inverse).view(n, k, d).sum(1)
    off = (bag != plain).float().mean().item()
    assert off < 1e-3, off
    torch.testing.assert_close(bag.float(), ref, rtol=4e-3, atol=1e-5)
    torch.testing.assert_close(plain.float(), ref, rtol=4e-3, atol=1e-5)

    b = time_fn(lambda _: _moe_ep_ops._sum_pairs(src, inverse, k)).median_ms
    a = time_fn(lambda _: F.embedding_bag(bag_index, src, mode="sum")).median_ms
    print(f"\npair sums {n}x{k} rows of {d} bf16: embedding_bag {a:.3f} ms, gather + sum "
          f"{b:.3f} ms ({b / a:.2f}x); elements differing {off:.2e}")
