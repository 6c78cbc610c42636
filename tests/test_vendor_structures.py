"""Structures from real vendor code (issue 26, item 4): experts written as a list of per-expert
MLPs stacked into the packed kernel layout and patched, for alignment and training."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from onboarding.backend import kernel_device
from onboarding.patching.core import PatchRecord
from onboarding.patching.expert_list import StackedExperts, module_list_bindings, role_candidates

FIX = Path(__file__).parent / "fixtures" / "vendor_moe.py"


def _fixture():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vendor_moe_fixture", FIX)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def swiglu_kernel(tmp_path_factory):
    from onboarding.generate.templating import load_module, render_to
    from onboarding.patching.core import entry_function

    out = tmp_path_factory.mktemp("moe_experts")
    return entry_function(load_module(render_to(out, "moe_experts", "swiglu", {})))


def _moe(seed: int = 0, d: int = 24, f: int = 20):
    torch.manual_seed(seed)
    return _fixture().SparseMoeBlock(d, n_experts=4, top_k=2, intermediate=f, shared=16).to(kernel_device())


class _OddNames(nn.Module):
    """A SwiGLU expert whose names say nothing: which linear is the gate is for the calibration."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.b = nn.Linear(d, f, bias=False)  # up
        self.a = nn.Linear(d, f, bias=False)  # gate
        self.c = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.c(self.b(x) * F.silu(self.a(x)))


def test_module_list_experts_patched_forward_backward(swiglu_kernel):
    """The members' weights stacked to gate_up [E, 2F, D] / down [E, D, F]; the block's output and
    every gradient (x, each member's weights, the router's) equal the unpatched block's; the
    routing stays the block's own (the router's gate gets its gradient through it)."""
    moe, ref = _moe(), _moe()
    x = torch.randn(2, 9, 24, device=kernel_device())
    rec = PatchRecord(path="experts", kind="moe.experts", family="moe_experts")
    undo = module_list_bindings(moe.experts, swiglu_kernel, rec, gated=True)
    assert undo is not None
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, _ = moe(xa)
    assert rec.status == "active" and "gate=gate_proj.weight, up=up_proj.weight" in rec.binding, rec
    want, _ = ref(xb)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    dy = torch.randn_like(out)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    undo()
    assert all("forward" not in m.__dict__ for m in moe.experts)


def test_stacked_weights_cached_frozen_restacked_when_changed():
    """Frozen (or no_grad): one stack, reused while no member weight changes; an in-place update
    (an optimizer step) stacks again; a trained weight is stacked per call, with its gradient."""
    moe = _moe()
    groups = role_candidates(list(moe.experts), True)[0][1]
    stacked = StackedExperts(list(moe.experts), groups)
    with torch.no_grad():
        (gu, dn), at = stacked.get(2)
        assert at == 2 and gu.shape == (4, 40, 24) and dn.shape == (4, 24, 20)
        torch.testing.assert_close(gu[2], torch.cat([moe.experts[2].gate_proj.weight,
                                                     moe.experts[2].up_proj.weight]))
        assert stacked.get(1)[0][0] is gu  # cached
        moe.experts[1].up_proj.weight.add_(1.0)
        (gu2, _), _ = stacked.get(1)
        assert gu2 is not gu
        torch.testing.assert_close(gu2[1, 20:], moe.experts[1].up_proj.weight)
    (gu3, _), at = stacked.get(3)  # trained: member 3 alone, differentiable
    assert at == 0 and gu3.shape == (1, 40, 24) and gu3.requires_grad
    gu3.sum().backward()
    assert moe.experts[3].gate_proj.weight.grad is not None and moe.experts[0].gate_proj.weight.grad is None


def test_module_list_gate_found_by_calibration_and_misfits_rejected(swiglu_kernel):
    """Names that do not say which linear is the gate: the first-call check keeps the assignment
    that reproduces the member. Members with biases fit no packed layout: rejected, nothing patched."""
    torch.manual_seed(0)
    experts = nn.ModuleList(_OddNames(24, 20) for _ in range(3)).to(kernel_device())
    x = torch.randn(7, 24, device=kernel_device())
    with torch.no_grad():
        want = [m(x) for m in experts]
    rec = PatchRecord(path="experts", kind="moe.experts", family="moe_experts")
    undo = module_list_bindings(experts, swiglu_kernel, rec, gated=True)
    with torch.no_grad():
        got = [m(x) for m in experts]
    assert rec.status == "active" and "gate=a.weight, up=b.weight, down=c.weight" in rec.binding, rec
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    undo()
    biased = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(2))
    rec = PatchRecord(path="experts", kind="moe.experts", family="moe_experts")
    assert module_list_bindings(biased, swiglu_kernel, rec, gated=None) is None
    assert rec.status == "rejected" and "does not fit" in rec.detail


def test_module_list_member_that_does_not_match_gives_the_list_back(swiglu_kernel):
    """A member computing something else than the first (a GELU gate) fails its own first-call
    check: the whole list is restored and the record rejected, and the output is the original's."""
    torch.manual_seed(0)
    MLP = _fixture().MLP
    experts = nn.ModuleList(MLP(24, 20) for _ in range(3)).to(kernel_device())
    experts[2].act_fn = nn.GELU()
    x = torch.randn(5, 24, device=kernel_device())
    rec = PatchRecord(path="experts", kind="moe.experts", family="moe_experts")
    module_list_bindings(experts, swiglu_kernel, rec, gated=True)
    with torch.no_grad():
        experts[0](x)
        assert rec.status == "active"
        want = F.linear(F.gelu(experts[2].gate_proj(x)) * experts[2].up_proj(x), experts[2].down_proj.weight)
        got = experts[2](x)
    assert rec.status == "rejected" and rec.detail.startswith("member 2"), rec
    torch.testing.assert_close(got, want)
    assert all("forward" not in m.__dict__ for m in experts)


@pytest.mark.slow
def test_module_list_experts_fixture_aligns_patched(tmp_path):
    """Must-show: `onboard align` on a vendor-style causal LM whose MoE routes inline and loops over
    a ModuleList of SwiGLU experts patches both experts blocks (active in alignment.json, with the
    stacked weights' binding) and passes."""
    from onboarding.cli.main import main

    out = tmp_path / "run"
    code = main(["align", f"{FIX}:ListMoECausalLM", "--dtype", "fp32", "--reference", "fp64",
                 "--out", str(out)])
    assert code == 0
    report = json.loads((out / "alignment.json").read_text())
    experts = {p["path"]: p for p in report["patches"] if p["kind"] == "moe.experts"}
    assert set(experts) == {"layers.0.mlp.experts", "layers.1.mlp.experts"}, experts
    for p in experts.values():
        assert p["status"] == "active", p
        assert "stacked to the packed layout" in p["binding"], p
    assert report["passed"] is True


@pytest.mark.slow
def test_module_list_experts_patched_for_training(parse_model, tmp_path):
    """Training patches what expert parallelism never replaces: the module_list experts get the
    stacked-weights patch (the router, tapped by expert parallelism, stays excluded); a training
    step's forward and the members' weight gradients equal the unpatched model's."""
    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.train.kernels import patch_kernels

    ref = f"{FIX}:ListMoECausalLM"
    graph = parse_model(ref)
    info = load_stage(load_model(ref))
    model = info.loaded.build(info.proxy_config, seed=0).to(kernel_device()).train()
    plain = info.loaded.build(info.proxy_config, seed=0).to(kernel_device()).train()
    patches = patch_kernels(model, graph, tmp_path / "kernels", rank=0, distributed=False)
    ids = torch.randint(0, 101, (2, 12), device=kernel_device())
    loss = model(ids).float().square().mean()
    want = plain(ids).float().square().mean()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-6)
    loss.backward()
    want.backward()
    status = {r.path: r.status for r in patches.records}
    assert status["layers.0.mlp.experts"] == status["layers.1.mlp.experts"] == "active", status
    assert not any(r.kind == "moe.router" for r in patches.records)
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if ".experts." in name:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_router_score_bias_held_as_a_buffer(parse_model, tmp_path):
    """A router's selection bias held as a buffer (DeepSeek-V3's e_score_correction_bias), in a
    model torch.export cannot trace (its sorted-token expert loop): classified `score_bias`, the
    router kernel rendered with it, and the patch reads the buffer itself (an update outside the
    optimizer moves the kernel's selection as it moves the original's)."""
    from onboarding.families import family_module
    from onboarding.generate.templating import load_module, render_to
    from onboarding.patching.core import patch_model

    graph = parse_model(f"{FIX}:BufferBiasMoECausalLM")
    assert graph.capture == "dispatch"
    routers = graph.by_kind("moe.router")
    assert [r.path for r in routers] == ["layers.0.mlp.gate", "layers.1.mlp.gate"]
    block = routers[0]
    assert block.attrs["score_bias"] is True and block.attrs["group_limited"] is True, block.attrs
    match = family_module("moe_router").match(block)
    assert match is not None and match["params"]["score_bias"] is True, match
    kmod = load_module(render_to(tmp_path, "moe_router", match["variant"], match["params"]))
    torch.manual_seed(0)
    lm = _fixture().BufferBiasMoECausalLM().to(kernel_device())
    gate = lm.layers[0].mlp.gate
    x = torch.randn(2, 7, 32, device=kernel_device())
    one = replace(graph, blocks=[block])
    with patch_model(lm, one, {(block.path, "moe_router"): kmod}) as patches, torch.no_grad():
        idx, w = gate(x)
        rec = patches.records[0]
        assert rec.status == "active", (rec.binding, rec.detail)
        gate.e_score_correction_bias[[5, 6]] += 10.0  # experts 5 and 6 (one group) now always win
        idx, w = gate(x)
        assert set(idx.flatten().tolist()) == {5, 6}
    with torch.no_grad():
        ref_idx, ref_w = gate(x)
    torch.testing.assert_close(idx.sort(-1).values, ref_idx.sort(-1).values)
    torch.testing.assert_close(w.sum(-1), ref_w.sum(-1), rtol=1e-5, atol=1e-6)


def test_module_called_twice_classified_per_call(parse_model):
    """An lm_head shared with a multi-token-prediction head runs twice per forward: both captures
    record which call ran each op, each call is classified on its own, and the block is an
    `lm_head` saying so (it was `unknown`, its two vocabulary matmuls taken for one block's)."""
    from onboarding.graph.capture import record_eager

    graph = parse_model(f"{FIX}:SharedHeadMTPCausalLM")
    kinds = {b.path: b.kind for b in graph.blocks}
    assert kinds["lm_head"] == "lm_head", kinds
    assert "unknown" not in kinds.values(), kinds
    head = next(b for b in graph.blocks if b.path == "lm_head")
    assert any("called 2 times" in e for e in head.evidence), head.evidence
    torch.manual_seed(0)
    lm = _fixture().SharedHeadMTPCausalLM()
    cap = record_eager(lm, (torch.randint(0, 101, (1, 8)),), {})
    calls = sorted({r.call for r in cap.records if r.module == "lm_head"})
    assert calls == [0, 1], calls
    assert {r.call for r in cap.records if r.module == "mtp.eh_proj"} == {0}


class _WeighingExpert(nn.Module):
    """Mixtral's early expert: called with the rows' routing weights, which it applies itself."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)

    def forward(self, hidden_states, routing_weights):
        return routing_weights * self.w2(F.silu(self.w1(hidden_states)) * self.w3(hidden_states))


def test_module_list_member_called_with_its_routing_weights(swiglu_kernel):
    """A member called as ``expert(x, routing_weights)`` gets those weights as the kernel's, with
    their gradient; another second argument is no fit (rejected, the list given back)."""
    torch.manual_seed(0)
    experts = nn.ModuleList(_WeighingExpert(24, 20) for _ in range(3)).to(kernel_device())
    x = torch.randn(6, 24, device=kernel_device())
    r = torch.rand(6, 1, device=kernel_device())
    ra, rb = r.clone().requires_grad_(), r.clone().requires_grad_()
    want = experts[1](x, rb)
    rec = PatchRecord(path="experts", kind="moe.experts", family="moe_experts")
    undo = module_list_bindings(experts, swiglu_kernel, rec, gated=True)
    got = experts[1](x, ra)
    assert rec.status == "active" and "the routing weight it is called with" in rec.binding, rec
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    dy = torch.randn_like(got)
    got.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(ra.grad, rb.grad, rtol=1e-4, atol=1e-5)
    undo()
    rec = PatchRecord(path="experts", kind="moe.experts", family="moe_experts")
    module_list_bindings(experts, swiglu_kernel, rec, gated=True)
    with torch.no_grad():
        experts[0](x, torch.rand(6, 24, device=kernel_device()))  # not one weight per row
    assert rec.status == "rejected" and "arguments" in rec.detail, rec
    assert all("forward" not in m.__dict__ for m in experts)


def test_inline_router_is_seen_and_rejected_with_its_reason(parse_model):
    """A router that is no module of its own (Mixtral-style remote code: a gate linear, softmax
    and top-k in the MoE block's forward) is the MoE block itself as `moe.router`: marked
    `inline` by structure (the block holds the experts), and the router binding rejects it
    saying why instead of trying a module patch that would replace the whole block."""
    from onboarding.families import families

    graph = parse_model(f"{FIX}:ListMoECausalLM")
    routers = {b.path: b for b in graph.by_kind("moe.router")}
    assert set(routers) == {"layers.0.mlp", "layers.1.mlp"}, set(routers)
    block = routers["layers.0.mlp"]
    assert block.attrs.get("inline") is True and "no module of its own" in block.evidence[-1]
    record = PatchRecord(path=block.path, kind=block.kind, family="moe_router")
    bind = families()["moe_router"].binding
    lm = _fixture().ListMoECausalLM()
    assert bind(block, lm.get_submodule(block.path), [None], record, lm) is None
    assert record.status == "rejected" and record.detail.startswith("inline routing"), record
    # a router module of its own (a gate module holding its weight) is not inline
    other = parse_model(f"{FIX}:BufferBiasMoECausalLM").by_kind("moe.router")
    assert other and not any(b.attrs.get("inline") for b in other)
