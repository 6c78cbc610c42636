"""Pair-sum family (`gather`, training only): each token's k gathered rows summed in fp32 and
rounded once, against an fp64 reference and expert parallelism's torch path
(`_moe_ep_ops._sum_pairs`); attached to every `EPExperts` by `attach_pair_sum_kernels` (a wrong
kernel is rejected, counted and warned). CPU: the interpreter (the kernel loads then casts to
fp32, so bf16 runs too); the proxy's shape and timings need CUDA (run with -s)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from kernel_cases import training_root

from onboarding.bench.harness import time_fn
from onboarding.families import training_kernel
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck
from onboarding.testing.kernel_contract import check_aot_sm90
from onboarding.train import kernels as K
from onboarding.train import _moe_ep_ops
from onboarding.train.moe_ep import EPExperts, EPGroup

CUDA = torch.cuda.is_available()
# CPU: small tiles, so D = 130 takes three column steps (one partial) and 37 tokens ten row blocks
CPU_CONFIG = {"BLOCK_T": 4, "BLOCK_D": 64, "num_warps": 4}
KIND, REJECTED = K.PAIR_SUM_KIND, f"rejected:{K.PAIR_SUM_KIND}"
# one bf16 rounding of an fp32 sum to nearest: half an ulp, at most 2^-8 relative (atol: the fp32
# sum's own error near cancellation)
BF16_ONE_ROUNDING = {"rtol": 2.0 ** -8, "atol": 1e-5}
# Triton's interpreter truncates fp32 -> bf16 casts (its cast passes no rounding mode) where a GPU
# rounds to nearest: on the CPU the kernel's bf16 sums are within one ulp (2^-7 relative), the
# CUDA test holds `BF16_ONE_ROUNDING`
BF16_ONE_CAST = BF16_ONE_ROUNDING if CUDA else {"rtol": 2.0 ** -7, "atol": 1e-5}


@pytest.fixture(scope="module")
def module(load_kernel):
    return load_kernel("pair_sum", "gather", {}, CPU_CONFIG)


def _inputs(n: int, k: int, d: int, dtype, device, gen, *, rows: int | None = None):
    """src [S, d] (S = n * k unless ``rows``) and index [n * k]: a permutation of the pair rows
    (the combine's case), or with ``rows`` rows drawn with repeats."""
    s = n * k if rows is None else rows
    src = (2 * torch.randn(s, d, generator=gen)).to(device, dtype)
    index = torch.randperm(s, generator=gen) if rows is None else torch.randint(0, s, (n * k,), generator=gen)
    return src, index.to(device), k


def _exact(src, index, k):
    """The sums in fp64 (exact for these magnitudes), as fp32."""
    n = index.numel() // k
    return src.double().index_select(0, index).view(n, k, src.shape[1]).sum(1).float()


FP32_CASES = [(37, 1, None), (130, 1, 50), (37, 3, None), (130, 3, None), (130, 8, None),
              (37, 8, 50), (37, 17, None)]


@pytest.mark.parametrize("d,k,rows", FP32_CASES,
                         ids=[f"D{d}-k{k}-{'repeats' if r else 'perm'}" for d, k, r in FP32_CASES])
def test_fp32_matches_exact_sums(module, device, d, k, rows):
    """Fresh random rows, D not a multiple of the tile, k from 1 to past 16, gathered through a
    permutation or with repeated rows: the fp32 sums within fp32 summation error."""
    gen = torch.Generator().manual_seed(d * 100 + k)
    src, index, k = _inputs(37, k, d, torch.float32, device, gen, rows=rows)
    out = module.pair_sum_gather(src, index, k)
    assert out.shape == (37, d) and out.dtype == torch.float32
    torch.testing.assert_close(out, _exact(src, index, k), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("d,k", [(37, 3), (130, 8)], ids=["D37-k3", "D130-k8"])
def test_bf16_is_one_rounding_of_the_fp32_sum(module, device, d, k):
    """bf16 rows: the kernel's sums are the exact sums of the bf16 values cast once to bf16
    (not rounded per add), as `_sum_pairs`' torch path's are (``torch.sum``: fp32 accumulation,
    one rounding to nearest)."""
    gen = torch.Generator().manual_seed(d + k)
    src, index, k = _inputs(37, k, d, torch.bfloat16, device, gen)
    out = module.pair_sum_gather(src, index, k)
    assert out.dtype == torch.bfloat16
    exact = _exact(src, index, k)
    torch.testing.assert_close(out.float(), exact, **BF16_ONE_CAST)
    torch.testing.assert_close(_moe_ep_ops._sum_pairs(src, index, k).float(), exact, **BF16_ONE_ROUNDING)


@pytest.mark.parametrize("shape", [(0, 4, 130, 0), (0, 4, 130, 5), (3, 2, 0, 6)],
                         ids=["no-tokens", "no-tokens-some-rows", "zero-width"])
def test_empty(module, device, shape):
    """No tokens (with or without source rows) or zero width: an empty [N, D] result, no launch."""
    n, k, d, s = shape
    src = torch.randn(s, d).to(device)
    index = torch.randint(0, max(s, 1), (n * k,)).to(device)
    out = module.pair_sum_gather(src, index, k)
    assert out.shape == (n, d) and out.dtype == src.dtype
    torch.testing.assert_close(out, module.reference(src, index, k))


def test_deterministic(module, device):
    """Two runs give bit-equal sums (a fixed slot order, no atomics), in bf16 and fp32."""
    for dtype in (torch.bfloat16, torch.float32):
        src, index, k = _inputs(17, 8, 130, dtype, device, torch.Generator().manual_seed(7))
        a, b = module.pair_sum_gather(src, index, k), module.pair_sum_gather(src, index, k)
        assert torch.equal(a, b)


def _fixture(module, n=37, k=3, d=130) -> KernelFixture:
    return KernelFixture(name="pair_sum/gather", module=module,
                         make_inputs=lambda dtype, device, gen: _inputs(n, k, d, dtype, device, gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_contract_forward_backward(module, device, dtype):
    """The contract suite: output against `reference` with the output poisoned and loads and
    stores bounds-checked in the interpreter; the op's own gradient (d src: each token's gradient
    row on each of its k source rows)."""
    check_forward_backward(_fixture(module), dtype, device)


def test_contract_and_opcheck(module, device):
    check_module_contract(module)
    check_opcheck(_fixture(module, n=5, k=3, d=37), torch.float32, device)


def test_errors_name_shapes(module, device):
    src = torch.randn(6, 4, device=device)
    with pytest.raises(ValueError, match=r"\(7,\).*k=2.*\(6, 4\)"):
        module.pair_sum_gather(src, torch.zeros(7, dtype=torch.long, device=device), 2)
    with pytest.raises(ValueError, match=r"\[S, D\].*\(6,\)"):
        module.pair_sum_gather(src[:, 0], torch.zeros(6, dtype=torch.long, device=device), 2)
    with pytest.raises(ValueError, match="integer"):
        module.pair_sum_gather(src, torch.zeros(6, device=device), 2)
    with pytest.raises(ValueError, match="float64"):
        module.pair_sum_gather(src.double(), torch.zeros(6, dtype=torch.long, device=device), 2)
    with pytest.raises(ValueError, match="k must be"):
        module.pair_sum_gather(src, torch.zeros(6, dtype=torch.long, device=device), 0)


def test_aot_sm90(module):
    check_aot_sm90([module.__file__], size=2048)  # the proxies' width, k = 8


# ---- in training: `attach_pair_sum_kernels` -----------------------------------------------------
class _Packed(nn.Module):
    """transformers 5's packed experts: gate_up_proj [E, 2F, D] ([gate | up]), down_proj [E, D, F]."""

    def __init__(self, e: int, d: int, f: int):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, d, generator=gen) / d ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(e, d, f, generator=gen) / f ** 0.5)


def _experts(device, layer: int = 0, e: int = 5, d: int = 37, f: int = 13) -> EPExperts:
    return EPExperts(_Packed(e, d, f), path=f"model.layers.{layer}.mlp.experts", layer=layer,
                     ep=EPGroup(), width=d, act=F.silu).to(device)


@pytest.fixture(scope="module")
def root(tmp_path_factory, device):
    """The kernels dir `attach_pair_sum_kernels` renders into (`training_root`)."""
    return training_root(tmp_path_factory, device, KIND, CPU_CONFIG)


def test_check_passes_the_kernel_and_rejects_wrong_ones(module, device):
    """`check_pair_sum_kernel` accepts the kernel (fp32, bf16) and names what differs, and at
    which k, for a kernel off by 10% or one that drops a slot; a kernel that raises is named."""
    fn = module.pair_sum_gather
    assert K.check_pair_sum_kernel(fn, 130, torch.float32, device, tokens=9) is None
    assert K.check_pair_sum_kernel(fn, 37, torch.bfloat16, device, tokens=9) is None
    why = K.check_pair_sum_kernel(lambda s, i, k: 1.1 * fn(s, i, k), 37, torch.float32, device,
                                  tokens=9)
    assert why.startswith("k=3: output"), why

    def drops_a_slot(src, index, k):
        return fn(src, index.view(-1, k)[:, 1:].reshape(-1), k - 1) if k == 8 else fn(src, index, k)

    assert K.check_pair_sum_kernel(drops_a_slot, 37, torch.float32, device, tokens=9).startswith("k=8")

    def boom(src, index, k):
        raise RuntimeError("no")

    assert K.check_pair_sum_kernel(boom, 37, torch.float32, device) == \
        "k=3: the kernel raised RuntimeError: no"


def test_attached_kernel_serves_combine_and_gather_backward(root, device):
    """`attach_pair_sum_kernels` renders the family's variant, checks it once per (D, dtype,
    device) and attaches it to every experts module; the experts then give the torch path's
    output and gradients (x, routing weights), with the kernel called for the combine (forward)
    and the token gather's backward."""
    mods = [_experts(device, 0), _experts(device, 1)]
    torch_path = copy.deepcopy(mods[0])
    assert training_kernel(KIND) == ("pair_sum", "gather")  # the family says it serves it
    assert K.attach_pair_sum_kernels(mods, root, rank=0) == {KIND: 2, REJECTED: 0}
    kernel = mods[0].pair_sum_kernel
    assert kernel is not None and mods[1].pair_sum_kernel is kernel
    calls = []
    mods[0].use_pair_sum_kernel(lambda s, i, k: calls.append((tuple(s.shape), k)) or kernel(s, i, k))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 37, generator=gen).to(device)
    idx = torch.stack([torch.randperm(5, generator=gen)[:3] for _ in range(11)]).to(device)
    w = torch.rand(11, 3, generator=gen).to(device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    ya, yb = mods[0](xa, idx, wa), torch_path(xb, idx, wb)
    assert calls == [((33, 37), 3)]  # the combine: 11 x 3 pair rows
    cot = torch.randn(ya.shape, generator=gen).to(device)
    (ya * cot).sum().backward()
    (yb * cot).sum().backward()
    assert calls == [((33, 37), 3)] * 2  # and the gather's backward
    for got, want in ((ya, yb), (xa.grad, xb.grad), (wa.grad, wb.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_wrong_kernel_rejected_and_counted(root, device):
    """A kernel off by 10% is rejected for every module of the failing key (one warning),
    counted, and nothing is attached; modules of another width get their own check."""
    mods = [_experts(device, 0), _experts(device, 1), _experts(device, 2, d=40)]
    bad = lambda s, i, k: 1.1 * _moe_ep_ops._sum_pairs(s, i, k)  # noqa: E731
    with pytest.warns(UserWarning, match="keep the torch path") as seen:
        assert K.attach_pair_sum_kernels(mods, root, rank=0, kernel=bad) == {KIND: 0, REJECTED: 3}
    assert len([w for w in seen if "pair-sum" in str(w.message)]) == 2  # D 37 and D 40
    assert all(m.pair_sum_kernel is None for m in mods)
    assert K.attach_pair_sum_kernels([], root, rank=0) == {}


# ---- CUDA: the proxy's shape, bf16 ---------------------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_proxy_shape_bf16_and_timing(module, device):
    """The proxy's combine and gather-backward shape (16,384 tokens x top-8 of D = 2048, bf16):
    the kernel's sums are the fp32 sums rounded once, bit-equal run to run and within the
    training check's bars; its time printed beside the torch path it replaces (gather + sum) and
    ``embedding_bag`` (sum), the path before that (run with -s)."""
    n, k, d = 16384, 8, 2048
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(n * k, d, device=device, generator=gen).to(torch.bfloat16)
    order = torch.argsort(torch.randint(0, 64, (n * k,), device=device, generator=gen), stable=True)
    inverse = _moe_ep_ops._inverse(order)
    fn = module.pair_sum_gather
    out = fn(src, inverse, k)
    ref = src.float().index_select(0, inverse).view(n, k, d).sum(1)
    torch.testing.assert_close(out.float(), ref, **BF16_ONE_ROUNDING)
    assert torch.equal(out, fn(src, inverse, k))
    plain = _moe_ep_ops._sum_pairs(src, inverse, k)
    off = (out != plain).float().mean().item()
    assert off < 1e-3, off
    assert K.check_pair_sum_kernel(fn, d, torch.bfloat16, device) is None

    bag_index = inverse.view(n, k)
    ours = time_fn(lambda _: fn(src, inverse, k)).median_ms
    torch_ms = time_fn(lambda _: _moe_ep_ops._sum_pairs(src, inverse, k)).median_ms
    bag = time_fn(lambda _: F.embedding_bag(bag_index, src, mode="sum")).median_ms
    moved = (n * k + n) * d * 2
    print(f"\npair sums {n}x{k} rows of {d} bf16: kernel {ours:.3f} ms "
          f"({moved / ours / 1e9:.2f} TB/s of {moved / 1e6:.0f} MB), gather + sum {torch_ms:.3f} ms "
          f"({torch_ms / ours:.2f}x), embedding_bag {bag:.3f} ms ({bag / ours:.2f}x); elements "
          f"differing from gather + sum {off:.2e}")
