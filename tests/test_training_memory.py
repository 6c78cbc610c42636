"""Activation memory of a training step: ours keeps no more for the backward than the baseline.

The tiny proxy of a Qwen3-MoE-style model in bf16, prepared as the worker prepares its roles
(`onboarding.train.worker.prepare`): the baseline (the model as it stands with PEFT's LoRA on
attention) against ours (expert-parallel experts, our LoRA), one step each; the bytes autograd
keeps (`onboarding.train.memory`), per block kind and in total.
"""

from __future__ import annotations

import copy

import pytest
import torch

from onboarding.train.config import TrainConfig

REF = "hf:qwen3_moe"


@pytest.fixture(scope="module")
def proxy():
    from fixtures.bf16_proxy import bf16_proxy

    return bf16_proxy(REF)


def _step(built, role: str, ids):
    from onboarding.train.memory import saved_for_backward
    from onboarding.train.parallel import single_layout
    from onboarding.train.worker import lm_loss, prepare

    cfg = TrainConfig(model=REF, dtype="bf16", device="cpu", kernels=False, lora_rank=8)
    b = copy.copy(built)
    b.model = copy.deepcopy(built.model)
    prepare(cfg, role, b, single_layout(), torch.device("cpu"))
    b.model.train()
    loss, saved = saved_for_backward(b.model, b.graph,
                                     lambda: lm_loss(b.model, ids, chunked=role != "baseline"))
    grads = {n: p.grad for n, p in b.model.named_parameters() if p.requires_grad}
    return loss, saved, grads


def test_ours_keeps_no_more_than_the_baseline(proxy):
    ids = torch.randint(0, proxy.model.config.vocab_size, (2, 97),
                        generator=torch.Generator().manual_seed(0))
    base_loss, base, base_grads = _step(proxy, "baseline", ids)
    loss, ours, grads = _step(proxy, "reference", ids)
    # adapters start at B = 0: the model as it stands (bf16: the routing weight is applied to
    # the experts' activation rather than their output, one rounding apart)
    assert loss.item() == pytest.approx(base_loss.item(), rel=1e-4)
    assert base.by_kind.get("moe.experts") and base.by_kind.get("attention.full")
    more = {k: (v, base.by_kind.get(k, 0)) for k, v in ours.by_kind.items()
            if v > base.by_kind.get(k, 0)}
    assert not more, f"blocks keeping more than the baseline's (ours, baseline bytes): {more}"
    assert ours.total <= base.total
    # the loss keeps the 16-bit logits (half the bytes), not their fp32 log-probabilities
    assert ours.by_kind.get("(model)", 0) < 0.6 * base.by_kind["(model)"]
    # the attention LoRA keeps the 16-bit input once, not an fp32 copy per adapter
    assert ours.by_kind["attention.full"] < base.by_kind["attention.full"]
    assert len(grads) == len(base_grads) > 0  # the same number of adapter tensors train

def test_lora_delta_same_numbers_as_the_plain_expression():
    from onboarding.train.lora import _LoRADelta

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g).to(torch.bfloat16).requires_grad_()
    a = (torch.randn(4, 16, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(8, 4, generator=g) * 0.3).requires_grad_()
    dy = torch.randn(3, 5, 8, generator=g)
    plain = 2.0 * torch.nn.functional.linear(torch.nn.functional.linear(x.float(), a), b)
    ref = torch.autograd.grad(plain, (x, a, b), dy)
    out = _LoRADelta.apply(x, a, b, 2.0)
    got = torch.autograd.grad(out, (x, a, b), dy)
    assert torch.equal(out, plain)
    for r, t in zip(ref, got):
        assert t.dtype == r.dtype
        torch.testing.assert_close(t, r, rtol=1e-6, atol=1e-6)


def test_place_rows_is_index_copy_keeping_only_the_index():
    from onboarding.train._moe_ep_ops import _place_rows

    g = torch.Generator().manual_seed(0)
    y = torch.randn(6, 3, generator=g, requires_grad=True)
    perm = torch.randperm(6, generator=g)
    kept = torch.tensor([4, 0, 7])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _place_rows(y, perm)
        part = _place_rows(y[:3], kept, 9)
    assert all(not t.is_floating_point() for t in saved)  # indices only
    assert torch.equal(out, torch.empty_like(y).index_copy(0, perm, y))
    assert torch.equal(part, torch.zeros(9, 3).index_copy(0, kept, y[:3]))
    dy, dp = torch.randn(6, 3, generator=g), torch.randn(9, 3, generator=g)
    (gy,) = torch.autograd.grad((out * dy).sum() + (part * dp).sum(), y)
    want = dy[perm].clone()
    want[:3] += dp[kept]
    torch.testing.assert_close(gy, want)


def test_step_breakdown_by_phase_and_block(proxy):
    """The profiled step's breakdown (`metrics.step_breakdown`, CPU: leaf ops stand for kernels)
    puts the forward's time under the graph's block kinds and the backward's under autograd
    nodes; the optimizer step is its own phase."""
    from onboarding.train import metrics as M
    from onboarding.train.worker import lm_loss

    model = copy.deepcopy(proxy.model).train()
    w = model.lm_head.weight
    w.requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.1)
    ids = torch.randint(0, model.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(1))
    phase = M.phases(True, model, proxy.graph)
    with M.profiler(torch.device("cpu")) as prof:
        with phase("forward"):
            loss = lm_loss(model, ids)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
    b = M.step_breakdown(prof, 1.0)
    assert set(b["by_phase"]) >= {"forward", "backward", "optimizer"}
    assert {"moe.experts", "attention.full", "norm.rms"} <= set(b["by_block_forward"])
    assert any(n.endswith("Backward0") for n in b["by_autograd_node"])
    assert b["kernel_ms"] > 0 and b["top_kernels"]


def test_weighted_swiglu_grads_in_row_blocks(monkeypatch):
    from onboarding.train import _moe_ep_ops
    from onboarding.train._moe_ep_ops import _SwiGLUWeighted

    monkeypatch.setattr(_moe_ep_ops, "SWIGLU_BLOCK_ELEMENTS", 24)  # 4-row blocks of F = 6
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 12, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(11, generator=g, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _SwiGLUWeighted.apply(h, w)
    assert len(saved) == 2 and saved[0] is h and saved[1] is w  # nothing [R, F] more
    gate, up = h.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up * w.unsqueeze(-1)
    torch.testing.assert_close(out, ref)
    torch.autograd.gradcheck(_SwiGLUWeighted.apply, (h, w))


def test_chunked_cross_entropy_same_loss_and_grads(monkeypatch):
    """The chunked loss gives F.cross_entropy's loss and bf16 gradient (ignored targets too, and
    a loss scaled after it), and autograd keeps one bf16 [N, V] buffer: no fp32 chunk, not the
    logits themselves."""
    from torch.nn import functional as F

    from onboarding.train import worker

    monkeypatch.setattr(worker, "CE_CHUNK_ELEMENTS", 50 * 64)  # 64-row chunks, the last short
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 50, generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 50, (300,), generator=g)
    t[::7] = -100  # ignored rows: no loss, no gradient, still counted in the mean
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saved.append(v) or v, lambda v: v):
        loss = worker.chunked_cross_entropy(x, t)
    assert not [v for v in saved if v.dtype == torch.float32 and v.shape[-1] == 50]
    assert [(v.dtype, tuple(v.shape)) for v in saved] == [(torch.bfloat16, (300, 50))]
    assert all(v.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for v in saved)
    ref = F.cross_entropy(x.float(), t, reduction="sum") / t.numel()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    (got,), (want,) = torch.autograd.grad(loss, x), torch.autograd.grad(ref, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not got[::7].any() and got[1::7].abs().amin(-1).gt(0).all()
    # a loss scaled after it (grad_out != 1): the buffer scaled in place, within a bf16 rounding
    (got3,) = torch.autograd.grad(3 * worker.chunked_cross_entropy(x, t), x)
    (want3,) = torch.autograd.grad(3 * F.cross_entropy(x.float(), t, reduction="sum") / t.numel(), x)
    torch.testing.assert_close(got3.float(), want3.float(), rtol=1e-2, atol=1e-6)
