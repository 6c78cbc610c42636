"""MoE router family (softmax / sigmoid / sqrt-softplus, group-limited, bias, renorm, scaling): outputs, counts,
gradients to x and the router weight, transformers parity, opcheck, AOT, matching real blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import case_id

from onboarding.generate import aot
from onboarding.families import family_module
moe_router = family_module("moe_router")
from onboarding.testing import check_module_contract, compare, poisoned, tolerance_for

DEEPSEEK = {"top_k": 3, "n_group": 4, "topk_group": 2, "score_bias": True, "renormalize": True,
            "routed_scaling_factor": 2.5}
CASES = [  # (variant, params, n_experts)
    ("softmax", {"top_k": 2}, 5),                       # Qwen3-MoE (no renorm), E=5
    ("softmax", {"top_k": 2, "renormalize": True}, 8),  # Mixtral
    ("sigmoid", DEEPSEEK, 8),                           # DeepSeek-V3
    ("sigmoid", {"top_k": 2, "routed_scaling_factor": 1.5}, 5),
    ("sqrtsoftplus", {"top_k": 3, "score_bias": True, "renormalize": True,  # DeepSeek-V4
                      "routed_scaling_factor": 1.5}, 8),
]
CASE_PARAMS = [pytest.param(v, p, e, id=f"{case_id(v, p)}-E{e}") for v, p, e in CASES]
CPU_CONFIG = {"BLOCK_N": 64, "num_warps": 4}


@pytest.fixture(scope="module")
def load(load_kernel):
    def load(variant, params):
        module = load_kernel("moe_router", variant, params)
        module.set_config(CPU_CONFIG)  # on a GPU too, as before: the fp32 checks use these tiles
        return module

    return load


def inputs(params, n_experts, n=37, d=24, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen).to(device).requires_grad_()
    w = (torch.randn(n_experts, d, generator=gen) / d ** 0.5).to(device).requires_grad_()
    b = (0.2 * torch.randn(n_experts, generator=gen)).to(device) if params.get("score_bias") else None
    return x, w, b


def check(module, x, w, b):
    tol = tolerance_for(torch.float32, "elementwise")
    with poisoned(module):
        logits, tw, ti, cnt = module.entry(x, w, b)
    r_logits, r_tw, r_ti, r_cnt = module.reference(x, w, b)
    assert torch.equal(ti, r_ti), (ti, r_ti)
    assert torch.equal(cnt, r_cnt) and cnt.dtype == torch.int64 and int(cnt.sum()) == ti.numel()
    results = [compare(logits, r_logits, tol, "logits"), compare(tw, r_tw, tol, "topk_weights")]
    dtw = torch.randn_like(tw)
    g = torch.autograd.grad(tw, [x, w], dtw)
    rg = torch.autograd.grad(r_tw, [x, w], dtw)
    results += [compare(g[0], rg[0], tol, "grad x"),
                compare(g[1], rg[1], tolerance_for(torch.float32, "reduction"), "grad weight")]
    failures = [r.message for r in results if not r.passed]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("variant,params,n_experts", CASE_PARAMS)
def test_forward_backward(load, device, variant, params, n_experts):
    module = load(variant, params)
    check(module, *inputs(params, n_experts, device=device))


def test_skewed_and_degenerate_rows(load, device):
    """Zipf-skewed logits (one expert takes nearly all tokens) and a single row."""
    module = load("softmax", {"top_k": 2})
    x, w, b = inputs({}, 5, device=device)
    with torch.no_grad():
        w[0] += 3.0 * x.detach().mean(0) / x.detach().mean(0).norm()  # expert 0 dominant
    check(module, x, w, b)
    check(module, *inputs({}, 5, n=1, device=device))


def test_bias_selects_only(load, device):
    """A large bias on one expert forces its selection but does not enter the weights."""
    module = load("sigmoid", DEEPSEEK)
    x, w, b = inputs(DEEPSEEK, 8, device=device)
    b = torch.zeros(8, device=device)
    b[5] = 10.0
    _, tw, ti, cnt = module.entry(x, w, b)
    assert (ti == 5).any(1).all() and cnt[5] == x.shape[0]
    check(module, x, w, b)


TOP8 = {"top_k": 8, "n_group": 8, "topk_group": 4, "score_bias": True, "renormalize": True,
        "routed_scaling_factor": 2.5}  # the DeepSeek-V3.2 tiny proxy's router: top-8 of 16


@pytest.mark.parametrize("variant,params,n_experts", [
    pytest.param("sigmoid", TOP8, 16, id="sigmoid-top8-of-16"),
    pytest.param("softmax", {"top_k": 2, "renormalize": True}, 8, id="softmax-top2")])
def test_bf16_loads_and_computes_in_fp32(load, device, variant, params, n_experts):
    """bf16 x, weight and bias: logits in bf16 (the PyTorch linear), the kernel loads them and
    scores, selects and renormalises in fp32 (the interpreter's bf16 arithmetic is never hit), so
    its fp32 weights are the reference's on the same bf16 logits to fp32 rounding, its indices
    the same; the logits' gradient is rounded to bf16 once, on store."""
    module = load(variant, params)
    x, w, b = (t.detach().bfloat16().requires_grad_(t.requires_grad) if t is not None else None
               for t in inputs(params, n_experts, seed=5, device=device))
    logits, tw, ti, cnt = module.entry(x, w, b)
    r_logits, r_tw, r_ti, r_cnt = module.reference(x, w, b)
    assert logits.dtype == torch.bfloat16 and tw.dtype == torch.float32 and ti.dtype == torch.int64
    assert torch.equal(logits, r_logits) and torch.equal(ti, r_ti) and torch.equal(cnt, r_cnt)
    fp32 = tolerance_for(torch.float32, "elementwise")
    assert compare(tw, r_tw, fp32, "topk_weights").passed  # bf16 math would be ~4e-3 off
    dtw = torch.randn_like(tw)
    g, rg = (torch.autograd.grad(o, [x, w], dtw) for o in (tw, r_tw))
    for a, r, what in zip(g, rg, ("grad x", "grad weight")):
        assert a.dtype == torch.bfloat16
        c = compare(a, r, tolerance_for(torch.bfloat16, "reduction"), what)
        assert c.passed, c.message


def assert_same_routing(ours, theirs) -> None:
    """Our (logits, weights, indices, counts) vs a transformers router's (logits, weights,
    indices), whose top-k is unsorted: the same experts per token with the same weights."""
    logits, tw, ti, _ = ours
    h_logits, h_tw, h_ti = theirs
    order = h_ti.sort(1).indices
    torch.testing.assert_close(logits, h_logits)
    torch.testing.assert_close(ti.sort(1).values, h_ti.gather(1, order))
    torch.testing.assert_close(tw.gather(1, ti.sort(1).indices), h_tw.gather(1, order))


def test_matches_transformers_routers(load, device):
    from transformers import DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = DeepseekV3Config(hidden_size=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(cfg).to(device)
    x, w, b = inputs(DEEPSEEK, 8, device=device)
    with torch.no_grad():
        hf.weight.copy_(w)
        hf.e_score_correction_bias.copy_(b)
    assert_same_routing(load("sigmoid", DEEPSEEK).entry(x, w, b), hf(x))

    hq = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=24, num_experts=5, num_experts_per_tok=2,
                                           norm_topk_prob=False)).to(device)
    x, w, _ = inputs({}, 5, device=device)
    with torch.no_grad():
        hq.weight.copy_(w)
    _, tw, ti, _ = load("softmax", {"top_k": 2}).entry(x, w, None)
    _, q_tw, q_ti = hq(x)
    assert torch.equal(ti, q_ti)
    torch.testing.assert_close(tw, q_tw)


def test_matches_the_deepseek_v4_router(load, device):
    """sqrt(softplus) scores, a selection-only bias, renormalised and scaled: as transformers'
    DeepseekV4TopKRouter, with large logits of both signs (softplus's two regimes)."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    params = CASES[-1][1]
    cfg = DeepseekV4Config(hidden_size=24, num_local_experts=8, num_experts_per_tok=3,
                           routed_scaling_factor=1.5, scoring_func="sqrtsoftplus")
    hf = modeling.DeepseekV4TopKRouter(cfg).to(device)
    x, w, b = inputs(params, 8, device=device)
    with torch.no_grad():
        w.mul_(torch.linspace(-8.0, 8.0, 8, device=device)[:, None])
        hf.weight.copy_(w)
        hf.e_score_correction_bias.copy_(b)
    assert_same_routing(load("sqrtsoftplus", params).entry(x, w, b), hf(x))


def test_matches_the_gpt_oss_router(load, device):
    """A bias on the logits' linear, the top-k of the logits, a softmax over those k: our
    renormalised softmax with `gate_bias`; the gradient reaches the bias too."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    hf = modeling.GptOssTopKRouter(GptOssConfig(hidden_size=24, num_local_experts=8,
                                                num_experts_per_tok=2)).to(device)
    x, w, _ = inputs({}, 8, device=device)
    gb = (0.5 * torch.randn(8, generator=torch.Generator().manual_seed(3))).to(device).requires_grad_()
    with torch.no_grad():
        hf.weight.copy_(w)
        hf.bias.copy_(gb)
    ours = load("softmax", {"top_k": 2, "renormalize": True}).entry(x, w, None, gb)
    assert_same_routing(ours, hf(x))
    ref = load("softmax", {"top_k": 2, "renormalize": True}).reference(x, w, None, gb)
    dw = torch.randn_like(ours[1])
    g, rg = (torch.autograd.grad(o[1], gb, dw)[0] for o in (ours, ref))
    torch.testing.assert_close(g, rg)
    assert g.abs().sum() > 0


@pytest.mark.parametrize("variant,params,n_experts", CASE_PARAMS)
def test_opcheck_and_contract(load, device, variant, params, n_experts):
    module = load(variant, params)
    check_module_contract(module)
    x, w, b = inputs(params, n_experts, n=7, device=device)
    for op, args in module.op_samples(x, w, b):
        torch.library.opcheck(op, args)


def test_shape_errors_name_shapes(load, device):
    module = load("sigmoid", DEEPSEEK)
    x, w, _ = inputs(DEEPSEEK, 8, device=device)
    with pytest.raises(ValueError, match=r"bias must be \[E\]=\(8,\), got \(7,\)"):
        module.entry(x, w, torch.zeros(7, device=device))
    with pytest.raises(ValueError, match=r"E=6 must split into 4 groups"):
        module.entry(x, w[:6], torch.zeros(6, device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the Triton interpreter's launches on CPU tensors; "
                    "on a GPU test_no_host_sync_cuda checks the same under CUDA's sync debug mode")
@pytest.mark.parametrize("variant,params,n_experts", CASE_PARAMS)
def test_forward_backward_read_nothing_on_the_host(load, variant, params, n_experts):
    """The op's forward (top-k weights, indices, and the counts [E] int64, added up by the forward
    kernel's atomics: no bincount) and backward, counted by `onboarding.testing.hostcost`: no op
    that reads a device value on the host on CUDA (bincount, nonzero, .item(), .tolist(), ...)
    in the module's host code; the counts equal bincount's (the reference keeps bincount)."""
    from onboarding.testing.hostcost import counting

    module = load(variant, params)
    x, w, b = inputs(params, n_experts)
    with counting() as mode:
        _, tw, ti, cnt = module.entry(x, w, b)
        tw.backward(torch.ones_like(tw))
    assert not mode.cost.syncs, dict(mode.cost.syncs)
    assert sum(mode.cost.triton.values()) == 2, dict(mode.cost.triton)  # forward and backward kernels
    want = torch.bincount(ti.flatten(), minlength=n_experts)
    assert cnt.dtype == want.dtype == torch.int64 and torch.equal(cnt, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode runs on a GPU only")
@pytest.mark.parametrize("variant,params,n_experts", [CASE_PARAMS[1], CASE_PARAMS[2]])
def test_no_host_sync_cuda(load, variant, params, n_experts):
    """bf16 router forward + backward (counts included) with the module's GPU config under
    torch.cuda.set_sync_debug_mode("error"): any op that waits for the device raises. One warm-up
    run first (Triton compiles)."""
    module = load(variant, params)
    x, w, b = inputs(params, n_experts, n=1000, d=256, device="cuda")
    x, w = x.detach().to(torch.bfloat16), w.detach().to(torch.bfloat16)

    def run():
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        _, tw, ti, cnt = module.entry(xl, wl, b)
        tw.backward(torch.ones_like(tw))
        return ti, cnt, xl.grad, wl.grad

    module.set_config(None)  # the GPU config
    try:
        warm = run()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ti, cnt, gx, gw = run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        module.set_config(CPU_CONFIG)
    assert torch.equal(ti, warm[0]) and torch.equal(cnt, torch.bincount(ti.flatten(), minlength=n_experts))
    assert torch.isfinite(gx.float()).all() and torch.isfinite(gw.float()).all()


@pytest.mark.slow  # sm_90 build, nightly: 17.2 s on CI's cold Triton cache (28th session)
def test_aot_sm90(load):
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    paths = [load(v, p).__file__ for v, p, _ in CASES]
    for path, rs in aot.compile_files(paths, registers=False).items():
        assert rs, path
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"


def _routers(graph):
    return [b for b in graph.blocks if b.kind == "moe.router"]


def test_match_parsed_blocks(parse_model):
    qwen = _routers(parse_model("hf:qwen3_moe"))[0]
    assert moe_router.match(qwen) == {"variant": "softmax", "params": moe_router.FAMILY.resolve(
        "softmax", {"top_k": qwen.attrs["top_k"]})}
    mixtral = _routers(parse_model("hf:mixtral"))[0]
    assert moe_router.match(mixtral)["params"]["renormalize"] is True
    ds = _routers(parse_model("hf:deepseek_v32"))[0]
    # the classifier reads group counts and the scaling factor off the router's ops
    m = moe_router.match(ds)
    assert m["variant"] == "sigmoid" and m["params"]["score_bias"]
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage

    cfg = load_stage(load_model("hf:deepseek_v32")).proxy_config  # the tiny proxy's
    assert (m["params"]["n_group"], m["params"]["topk_group"]) == (cfg.n_group, cfg.topk_group)
    assert m["params"]["top_k"] == cfg.num_experts_per_tok
    assert m["params"]["routed_scaling_factor"] == 2.5
    # without them a group-limited router stays uncovered rather than guessed
    bare = {k: v for k, v in ds.attrs.items() if k not in ("n_group", "topk_group")}
    assert moe_router.match(dataclasses.replace(ds, attrs=bare)) is None
    dense = [b for b in parse_model("hf:qwen3_moe").blocks if b.kind == "moe.experts"][0]
    assert moe_router.match(dense) is None


def test_match_sqrt_softplus_router(parse_model):
    """DeepSeek-V4's learned router (softplus then sqrt among its ops) takes the sqrtsoftplus
    variant; its hash routers (a token-id lookup, no top-k) are no router block."""
    pytest.importorskip("transformers.models.deepseek_v4")
    blocks = _routers(parse_model("hf:deepseek_v4"))
    learned = [b for b in blocks if b.attrs.get("scoring") == "sqrtsoftplus"]
    assert learned
    m = moe_router.match(learned[0])
    assert m["variant"] == "sqrtsoftplus"
    assert m["params"]["score_bias"] and m["params"]["renormalize"]
    assert m["params"]["routed_scaling_factor"] == 1.5


def test_softmax_after_top_k_is_a_renormalised_softmax(parse_model):
    """Cohere2-MoE takes the top-k of the logits, then a softmax over those k: the same experts
    and weights as a softmax over all experts renormalised over the selection."""
    router = _routers(parse_model("hf:cohere2_moe"))[0]
    m = moe_router.match(router)
    assert m["variant"] == "softmax" and m["params"]["renormalize"] is True
    qwen = _routers(parse_model("hf:qwen3_moe"))[0]  # softmax, then top-k, not renormalised
    assert moe_router.match(qwen)["params"]["renormalize"] is False
    assert "gate_bias" not in qwen.attrs
    gpt = _routers(parse_model("hf:gpt_oss"))[0]  # the same, after a linear with a bias
    assert moe_router.match(gpt)["params"]["renormalize"] is True
    assert gpt.attrs["gate_bias"].endswith("router.bias")
