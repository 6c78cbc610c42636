"""Cross-entropy family (`fused`, training only): the mean loss over N rows and the logits'
gradient written by one kernel, against its reference, `F.cross_entropy` and the training
worker's `_ChunkedCE`; attached to the training loss by `attach_loss_kernel` (a wrong kernel is
rejected, counted and warned). CPU: the interpreter, fp32 (its bf16 maths is wrong; the kernel
loads then casts, so the bf16 contract case runs too); the bf16 bars at the proxies' shapes
need CUDA."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from kernel_cases import training_root, zero_fill_shapes

from onboarding.families import training_kernel
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck
from onboarding.testing.kernel_contract import check_aot_sm90
from onboarding.testing.tolerance import rel_rms
from onboarding.train import kernels as K
from onboarding.train import worker

CUDA = torch.cuda.is_available()
# CPU: small tiles, so V = 1000 takes four column steps (one partial) and 37 rows ten row blocks
CPU_CONFIG = {"BLOCK_V": 256, "ROWS": 4, "num_warps": 4}
KIND, REJECTED = K.LOSS_KIND, f"rejected:{K.LOSS_KIND}"
SHAPES = [(37, 1000), (5, 37), (1, 1), (64, 256)]


@pytest.fixture(scope="module")
def module(load_kernel):
    return load_kernel("cross_entropy", "fused", {}, CPU_CONFIG)


def _inputs(n: int, v: int, dtype, device, gen, *, ignore_every: int = 3, scale: float = 3.0):
    x = (scale * torch.randn(n, v, generator=gen)).to(device, dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    if ignore_every:
        t[::ignore_every] = -100
    return x, t.to(device)


def fixture(module, shape) -> KernelFixture:
    return KernelFixture(name="cross_entropy/fused", module=module,
                         make_inputs=lambda dtype, device, gen: _inputs(*shape, dtype, device, gen))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_backward_fp32(module, device, shape):
    """Loss and gradient against the reference (outputs poisoned, loads and stores bounds-checked
    in the interpreter): V not a multiple of the tile, odd N, one row, one class."""
    check_forward_backward(fixture(module, shape), torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_forward_backward_16bit(module, device, dtype):
    check_forward_backward(fixture(module, (37, 1000)), dtype, device)


def test_contract_and_opcheck(module, device):
    check_module_contract(module)
    check_opcheck(fixture(module, (5, 37)), torch.float32, device)


def test_op_autograd_per_row(module, device):
    """The custom op called directly: per-row losses (fp32, 0 on ignored rows) and its own
    autograd (the stored gradient rescaled per row, out of place) = `F.cross_entropy` with
    reduction "none"."""
    gen = torch.Generator().manual_seed(2)
    x, t = _inputs(11, 300, torch.float32, device, gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    losses, grad = module.cross_entropy_fused_fwd_op(xa, t, 0.25)
    ref = F.cross_entropy(xb, t, reduction="none")
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-6)
    (gb,) = torch.autograd.grad(ref.sum() * 0.25, xb, retain_graph=True)
    torch.testing.assert_close(grad, gb, rtol=1e-5, atol=1e-7)
    d = torch.randn(11, generator=gen).to(device)
    torch.testing.assert_close(torch.autograd.grad(losses, xa, d)[0],
                               torch.autograd.grad(ref, xb, d)[0], rtol=1e-5, atol=1e-7)


def test_op_backward_fills_no_zeros_for_the_stored_gradient(module, device):
    """The op's second output (the stored [N, V] gradient) is marked non-differentiable: its own
    autograd takes None for it (set_materialize_grads(False)), not an [N, V] tensor of zeros
    autograd fills first."""
    x, t = _inputs(11, 300, torch.float32, device, torch.Generator().manual_seed(5))
    x.requires_grad_()
    losses, _ = module.cross_entropy_fused_fwd_op(x, t, 0.25)
    fills = zero_fill_shapes((losses * torch.randn_like(losses)).sum())
    assert [11, 300] not in fills, fills
    assert x.grad is not None and x.grad.shape == (11, 300)


@pytest.mark.parametrize("n,v,ignore_every", [(37, 1000, 0), (37, 1000, 4), (9, 37, 1)],
                         ids=["none-ignored", "some-ignored", "all-ignored"])
def test_against_f_cross_entropy(module, device, n, v, ignore_every):
    """= F.cross_entropy's sum over N (its mean when nothing is ignored), gradient too, under an
    incoming gradient other than 1; all rows ignored gives 0 and a zero gradient."""
    gen = torch.Generator().manual_seed(n + v + ignore_every)
    x, t = _inputs(n, v, torch.float32, device, gen, ignore_every=ignore_every)
    x = x.requires_grad_()
    loss = module.cross_entropy_fused(x, t)
    ref = F.cross_entropy(x, t, reduction="sum") / n
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    if not ignore_every:
        torch.testing.assert_close(loss, F.cross_entropy(x, t), rtol=1e-5, atol=1e-6)
    (got,), (want,) = torch.autograd.grad(0.6 * loss, x), torch.autograd.grad(0.6 * ref, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    if ignore_every == 1:
        assert loss.item() == 0.0 and not got.any()
    elif ignore_every:
        assert not got[::ignore_every].any()


def test_against_chunked_ce_and_errors(module, device):
    """Equal to the worker's `_ChunkedCE` (loss and gradient, fp32); one [N, V] buffer in the
    logits' dtype kept for the backward, not the logits; shapes that do not fit are refused."""
    gen = torch.Generator().manual_seed(5)
    x, t = _inputs(63, 100, torch.float32, device, gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saved.append(v) or v, lambda v: v):
        la = module.cross_entropy_fused(xa, t)
    assert [(v.dtype, tuple(v.shape)) for v in saved] == [(torch.float32, (63, 100))]
    assert saved[0].untyped_storage().data_ptr() != xa.untyped_storage().data_ptr()
    lb = worker._ChunkedCE.apply(xb, t, t.numel())
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    (2 * la).backward()
    (2 * lb).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"\(4,\).*\(63, 100\)"):
        module.cross_entropy_fused(x, t[:4])
    with pytest.raises(ValueError, match="integer"):
        module.cross_entropy_fused(x, t.float())


@pytest.mark.slow  # sm_90 build, nightly: 16.8 s on CI's cold Triton cache (28th session)
def test_aot_sm90(module):
    check_aot_sm90([module.__file__], size=32000)
    check_aot_sm90([module.__file__], size=151936)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,v", [(16384, 32000), (8192, 151936), (333, 1000)],
                         ids=["16384x32000", "8192x151936", "333x1000"])
def test_bf16_bars_on_gpu(module, device, n, v):
    """bf16 logits: the loss and gradient within the bf16 bars of fp32 `F.cross_entropy` on the
    same values (rel RMS 5e-3 / 1e-2), and within the training check's bars of `_ChunkedCE` on the
    bf16 logits (`check_loss_kernel`)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = (2 * torch.randn(n, v, device=device, generator=gen)).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    t[::97] = -100
    lo, hi = x.clone().requires_grad_(), x.float().requires_grad_()
    loss = module.cross_entropy_fused(lo, t)
    ref = F.cross_entropy(hi, t, reduction="sum") / n
    assert rel_rms(loss, ref) <= 5e-3, (loss.item(), ref.item())
    loss.backward()
    ref.backward()
    assert lo.grad.dtype == torch.bfloat16 and rel_rms(lo.grad, hi.grad) <= 1e-2
    assert K.check_loss_kernel(module.entry, worker.chunked_cross_entropy, v, torch.bfloat16,
                               device) is None


# ---- the training loss: `attach_loss_kernel` -------------------------------------------------
class _TinyLM(nn.Module):
    """Embedding and LM head at vocabulary ``v``: ``model(input_ids=...).logits`` [B, T, V]."""

    def __init__(self, v: int = 37, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(v, d), nn.Linear(d, v, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.head(self.emb(input_ids)))


@pytest.fixture(scope="module")
def root(tmp_path_factory, device):
    """The kernels dir `attach_loss_kernel` renders into (`training_root`)."""
    return training_root(tmp_path_factory, device, KIND, CPU_CONFIG)


def _attach(model, root, **kw):
    return K.attach_loss_kernel(model, root, rank=0, torch_path=worker.chunked_cross_entropy,
                                ignore_index=worker.IGNORE_INDEX, **kw)


def test_attached_loss_equals_chunked_ce(root, device):
    """The attached kernel serves `lm_loss` (called, counted) and gives `_ChunkedCE`'s loss and
    gradients; logits of another vocabulary or dtype fall back to `_ChunkedCE`."""
    assert training_kernel(KIND) == ("cross_entropy", "fused")  # the family serves the loss
    model = _TinyLM().to(device)
    torch_path = copy.deepcopy(model)
    assert _attach(model, root) == {KIND: 1, REJECTED: 0}
    lk = getattr(model, K.LOSS_KERNEL_ATTR)
    assert (lk.vocab, lk.dtype) == (37, torch.float32)
    calls = []
    inner = lk.fn
    lk.fn = lambda x, t: calls.append(tuple(x.shape)) or inner(x, t)
    ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    targets = ids[:, 1:].reshape(-1).clone()
    targets[3] = worker.IGNORE_INDEX

    def loss_of(m):
        flat = m(input_ids=ids[:, :-1]).logits.reshape(-1, 37)
        return worker.chunked_cross_entropy(flat, targets,
                                            kernel=getattr(m, K.LOSS_KERNEL_ATTR, None))

    la, lb = loss_of(model), loss_of(torch_path)
    assert calls == [(18, 37)]
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    la.backward()
    lb.backward()
    for (n, p), q in zip(model.named_parameters(), torch_path.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    # lm_loss reads the attached kernel off the model
    worker.lm_loss(model, ids, chunked=True)
    assert len(calls) == 2
    zeros = torch.zeros(4, dtype=torch.long, device=device)
    worker.chunked_cross_entropy(torch.randn(4, 36, device=device), zeros, kernel=lk)
    worker.chunked_cross_entropy(torch.randn(4, 37, device=device).double(), zeros, kernel=lk)
    assert len(calls) == 2


def test_wrong_loss_kernel_rejected(root, device):
    """A kernel off by 10% (loss and gradient) or one that raises is rejected: counted, warned,
    `_ChunkedCE` kept (nothing attached); a model without an output embedding gets nothing."""
    model = _TinyLM().to(device)
    bad = lambda x, t: 1.1 * worker.chunked_cross_entropy(x, t)  # noqa: E731
    with pytest.warns(UserWarning, match="keep the torch path"):
        assert _attach(model, root, kernel=bad) == {KIND: 0, REJECTED: 1}
    assert getattr(model, K.LOSS_KERNEL_ATTR, None) is None
    why = K.check_loss_kernel(bad, worker.chunked_cross_entropy, 37, torch.float32, device, rows=9)
    assert why.startswith("output") and "d logits" in why, why

    def boom(x, t):
        raise RuntimeError("no")

    assert K.check_loss_kernel(boom, worker.chunked_cross_entropy, 37, torch.float32,
                               device) == "the kernel raised RuntimeError: no"
    assert _attach(nn.Sequential(nn.Linear(4, 4)), root) == {}
