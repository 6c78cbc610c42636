"""Host cost of the training step (issue 34): what our code launches and reads on the host per
step, counted on the CPU by `onboarding.testing.hostcost` (docs/LOG.md, helper-52)."""

import math

import pytest
import torch
from torch.nn import functional as F

from onboarding.testing.hostcost import counting
from onboarding.train.moe_ep import EPExperts, EPGroup, ExpertLoRA
from onboarding.train.parallel import clip_grads, single_layout

# expert parallelism's code: the experts module and the tensor ops it composes
EP_FILES = ("onboarding/train/moe_ep.py", "onboarding/train/_moe_ep_ops.py")


def _adapters(seed: int = 0, scale: float = 1.0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    ps = []
    for shape in ((4, 64), (96, 4), (4, 33), (7,), (3, 5, 2)):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = scale * torch.randn(shape, generator=gen)
        ps.append(p)
    return ps


def _old_norm(params) -> float:
    """The per-parameter fp64 sum of squares the step used before (one host read)."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        sq += p.grad.double().pow(2).sum()
    return float(sq.sqrt())


@pytest.mark.parametrize("max_norm", [0.0, 0.7, 1.3, 1e9], ids=["off", "clips", "clips2", "above"])
def test_clip_grads_reads_nothing_on_the_host_and_keeps_the_numbers(max_norm):
    """`clip_grads` returns the norm as a device tensor and issues no host read (its launches
    keep queueing behind the backward); the norm is the per-parameter fp64 one within 1e-12, and
    the clipped gradients are bit-equal to scaling by ``max_norm / (norm + 1e-6)`` as a Python
    float (the old code's rounding), only where the norm is above ``max_norm``."""
    dense, experts = _adapters(0)[:3], _adapters(1)[3:]
    before = [p.grad.clone() for p in (*dense, *experts)]
    with counting() as mode:
        norm = clip_grads(dense, experts, single_layout(), max_norm)
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64 and norm.dim() == 0
    assert not mode.cost.syncs, mode.cost.syncs
    want = math.sqrt(sum(g.double().pow(2).sum().item() for g in before))
    assert float(norm) == pytest.approx(want, rel=1e-12)
    assert float(norm) == pytest.approx(_old_norm([type("P", (), {"grad": g}) for g in before]),
                                        rel=1e-12)
    scale = max_norm / (float(norm) + 1e-6) if 0 < max_norm < float(norm) else None
    for p, g in zip((*dense, *experts), before):
        assert torch.equal(p.grad, g.mul(scale) if scale is not None else g)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_clip_grads_leaves_non_finite_gradients_unscaled(bad):
    """A non-finite norm is returned as it is and scales nothing (as the host check did)."""
    ps = _adapters(2)
    ps[1].grad[0, 0] = bad
    before = [p.grad.clone() for p in ps]
    norm = clip_grads(ps, [], single_layout(), 1.0)
    assert not math.isfinite(float(norm))
    for p, g in zip(ps, before):
        assert torch.equal(p.grad.isnan(), g.isnan())
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())


class _Packed(torch.nn.Module):
    def __init__(self, e, d, f):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * f, d, generator=gen) / d ** 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(e, d, f, generator=gen) / f ** 0.5)


@pytest.mark.parametrize("k,lora", [(1, False), (3, False), (3, True)],
                         ids=["k1", "k3", "k3-expert-lora"])
def test_experts_share_one_pair_order_per_forward(k, lora):
    """One experts forward + backward makes its pair order's inverse and token rows once (the
    token gather, the weights' gather and the combine share them: one ``scatter_`` and at most
    one ``floor_divide`` in `EP_FILES`), reads nothing on the host but the counts of the per-expert
    matmul loops (the CPU's and fp32's path; CUDA bf16 runs torch._grouped_mm), once for all of
    them (two base matmuls, four more with expert LoRA), and gives the index expression's
    output and gradients (x[order // k] through the experts, placed back, summed over k; fp64, fp32
    with the fp32 expert adapters)."""
    e, d, f, n = 5, 16, 12, 9
    m = EPExperts(_Packed(e, d, f), path="layers.0.mlp.experts", layer=0, ep=EPGroup(), width=d,
                  act=F.silu, lora=ExpertLoRA(rank=2, alpha=4.0) if lora else None)
    dt, tol = (torch.float32, 1e-5) if lora else (torch.float64, 1e-12)  # fp32 adapters
    m = m.to(dt)
    if lora:  # B starts at zero: make the adapters' term count
        with torch.no_grad():
            for p in m.lora_parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(n, d, generator=gen, dtype=dt, requires_grad=True)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=gen, dtype=dt, requires_grad=True)
    cot = torch.randn(n, d, generator=gen, dtype=dt)
    with counting() as mode:
        y = m(x, idx, w)
        gx, gw = torch.autograd.grad(y, [x, w], cot)
    ours = {(line, op): c for (kind, owner, line, op), c in mode.cost.ops.items()
            if line.startswith(EP_FILES)}
    scatters = sum(c for (line, op), c in ours.items() if op == "scatter_")
    divides = sum(c for (line, op), c in ours.items() if op == "floor_divide")
    assert scatters == 1 and divides == (1 if k > 1 else 0), ours
    assert sum(mode.cost.syncs.values()) == 1, mode.cost.syncs
    assert all(line.startswith("onboarding/train/_moe_ep_ops.py:") and line.endswith("(gmm)")
               and what == "tolist" for line, what in mode.cost.syncs), mode.cost.syncs

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    ys = m._compute(xr[order // k], counts, wr.reshape(-1)[order])
    ref = torch.zeros_like(ys).index_copy(0, order, ys).view(n, k, d).sum(1)
    rx, rw = torch.autograd.grad(ref, [xr, wr], cot)
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(gx, rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw, rw, rtol=tol, atol=tol)
    assert torch.equal(m.last_counts, counts)


def test_tiny_step_our_code_reads_nothing_on_the_host(tmp_path, monkeypatch):
    """A whole training step of the tiny Qwen3-MoE proxy through the worker's `run` (as on CUDA:
    grouped GEMMs, fused AdamW): no host read from our code (onboarding/), and our own launches
    per step at most 10% above the count after issue 34's host pass (228 at 2 layers, 2 x 32
    tokens, clipping on; before it 298 and one host read, the gradient norm's); the grouped
    matmuls' offsets made once per MoE layer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    from step_host_cost import TINY, measure

    skip = ("linear_", "shared_", "head_dim")  # Qwen3-Next's keys
    sets = {**{k: v for k, v in TINY.items() if not k.startswith(skip)}, "num_hidden_layers": 2}
    res = measure("hf:qwen3_moe", sets, seq=32, batch=2, steps=3, kernels=False,
                  out=str(tmp_path), grad_clip=1.0, setattr=monkeypatch.setattr)
    cost = res["cost"]
    ours = {line: n for (line, what), n in cost.syncs.items() if line.startswith("onboarding/")}
    assert not ours, ours
    assert cost.total("launch", "onboarding") <= 1.1 * 228, cost.by_line(owner="onboarding")
    cumsums = sum(n for (kind, owner, line, op), n in cost.ops.items()
                  if op == "cumsum" and line.startswith(EP_FILES))
    assert cumsums == 2, cost.by_line(owner="onboarding")
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in res["rows"])


def test_host_cost_counts_allocations_apart_from_launches_and_views():
    """`HostCost.allocations`: tensors allocated without a fill (no device launch, but a call into
    the caching allocator on the host), counted among the view ops and by themselves."""
    with counting() as mode:
        a = torch.empty(3, 4)
        b = torch.empty_like(a)
        a.new_empty(2)
        a.view(4, 3).t()
        b.fill_(1.0)
    cost = mode.cost
    assert cost.allocations == cost.summary()["allocations"] == 3, dict(cost.ops)
    assert cost.total("launch") == 1 and cost.total("view") >= 5, dict(cost.ops)
