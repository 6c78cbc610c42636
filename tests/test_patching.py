"""Coverage, candidate generation and patching of models the code has never special-cased."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import pytest

from onboarding.backend import kernel_device
from onboarding.generate.candidates import check_candidate, kernels_for, promote, render_candidates
from onboarding.load.model import load_model
from onboarding.graph.parse import example_inputs, load_stage
from onboarding.patching.core import patch_model
from onboarding.coverage import build_coverage, reviewed_kernels

# served by our kernel: a template renders one, or it is a reviewed module in kernels/ (merged
# from a kernel PR, rendered from the same template at the same parameters)
OURS = ("template", "kernel")


def _prepare(parse_model, ref, tmp_path, families=None):
    g = parse_model(ref)
    cov = build_coverage(g)
    if families is not None:  # reviewed modules in kernels/ serve only the families asked for too
        cov.entries = [e for e in cov.entries if e.family is None or e.family in families]
    cands = [check_candidate(c, c.shapes) for c in render_candidates(cov, tmp_path)
             if families is None or c.family in families]  # checks run in the interpreter
    info = load_stage(load_model(ref, trust_remote_code=True))
    device = kernel_device()  # the GPU when there is one, else the interpreter on the CPU
    model = info.loaded.build(info.proxy_config, seed=0).eval().to(device)
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, g.seq, 1)
    return g, cov, cands, model, tuple(t.to(device) for t in inputs), kwargs


def test_coverage_statuses(parse_model):
    cov = build_coverage(parse_model("hf:qwen3_next"))
    # ours: a template renders it, or a reviewed module in kernels/ (merged from a kernel PR)
    by = {(e.kind, "ours" if e.status in OURS else e.status)
          for e in cov.entries}
    assert ("norm.rms", "ours") in by and ("conv.causal1d", "ours") in by
    assert ("attention.gated", "torch_fast") in by and ("lm_head", "torch_fast") in by
    assert ("linear_attention.gated_delta", "ours") in by
    assert ("moe.experts", "ours") in by and ("moe.router", "ours") in by
    assert all(e.module and Path(e.module).is_file() for e in cov.entries if e.status == "kernel")
    norm = next(e for e in cov.entries if e.kind == "norm.rms")
    assert norm.params["unit_offset"] is True and norm.shapes[0][-1] == 128


def test_layer_norm_is_a_fused_torch_path(parse_model):
    """The indexer's LayerNorm (one fused F.layer_norm) is served by torch, not uncovered."""
    cov = build_coverage(parse_model("hf:deepseek_v32"))
    norms = [e for e in cov.entries if e.kind == "norm.layer"]
    assert norms and {e.status for e in norms} == {"torch_fast"}
    assert "native_layer_norm" in norms[0].reason


@pytest.mark.slow  # 80-90 s each on 2 cores; tests/test_align.py aligns both models in CI
@pytest.mark.parametrize("ref,kinds", [
    # rope: the rope binding patches Qwen3-Next's rotation (partial rotary, half-split)
    ("hf:qwen3_next", {"norm.rms", "norm.rms_gated", "conv.causal1d", "moe.shared_expert",
                       "moe.experts", "moe.router", "linear_attention.gated_delta", "rope"}),
    # Kimi's output norm is gated by sigmoid: `rmsnorm/gated` with activation=sigmoid.
    ("hf:kimi_linear", {"norm.rms", "norm.rms_gated", "conv.causal1d", "moe.shared_expert",
                        "mlp.dense", "moe.experts", "moe.router", "linear_attention.kimi_delta"}),
])
def test_patched_model_matches_unpatched(parse_model, ref, kinds, tmp_path):
    g, cov, cands, model, inputs, kwargs = _prepare(parse_model, ref, tmp_path)
    assert cands and all(c.status == "passed" for c in cands), [c.error for c in cands]
    with torch.no_grad():
        expected = model(*inputs, **kwargs).logits
    with patch_model(model, g, kernels_for(cov, cands)) as patches:
        with torch.no_grad():
            got = model(*inputs, **kwargs).logits
            again = model(*inputs, **kwargs).logits  # after calibration: kernels only
        assert {r.kind for r in patches.active()} == kinds
        assert not [r for r in patches.records if r.status != "active"]
    for out in (got, again):
        assert ((out - expected).norm() / expected.norm()) < 1e-5
    with torch.no_grad():
        restored = model(*inputs, **kwargs).logits
    assert torch.equal(restored, expected)  # reversible
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.slow  # 47 s in CI (warm, idle); the GDN family's kernel tests stay in CI
def test_delta_rule_function_given_normalised_qk(parse_model, tmp_path):
    """The built-in example l2-normalises q and k (eps inside the root, so norms slightly below 1)
    before its delta-rule function, which takes no l2norm flag: the block's op graph still shows
    the normalisation, so the kernel renders with qk_l2norm on. Calibration finds that the
    function wants no l2norm of ours and binds every gated-delta block (a second normalisation
    was 4.3e-4 off and left them all on the torch path)."""
    g, cov, cands, model, inputs, kwargs = _prepare(parse_model, "onboard_hybrid", tmp_path,
                                                    families={"gated_delta"})
    assert cands and all(c.status == "passed" and c.params["qk_l2norm"] for c in cands)
    with torch.no_grad():
        expected = model(*inputs, **kwargs).logits
    with patch_model(model, g, kernels_for(cov, cands)) as patches:
        with torch.no_grad():
            model(*inputs, **kwargs)
            got = model(*inputs, **kwargs).logits  # after calibration: kernels only
        records = [r for r in patches.records if r.kind == "linear_attention.gated_delta"]
        assert records and all(r.status == "active" for r in records), [r.detail for r in records]
    assert ((got - expected).norm() / expected.norm()) < 1e-5


def test_wrong_kernel_is_rejected_not_used(parse_model, tmp_path):
    # only the norms' candidates: the experts' and router's checks in the interpreter are not
    # what this test is about
    g, cov, cands, model, inputs, kwargs = _prepare(parse_model, "hf:qwen3_moe", tmp_path,
                                                    families=("rmsnorm",))
    kernels = kernels_for(cov, cands)
    path = next(p for (p, fam) in kernels if fam == "rmsnorm")

    class Wrong:  # a "kernel" that computes something else
        @staticmethod
        def rmsnorm(x, w, eps):
            return x * 2

        rmsnorm_op = None

    kernels[(path, "rmsnorm")] = Wrong
    with torch.no_grad():
        expected = model(*inputs, **kwargs).logits
    with patch_model(model, g, kernels) as patches, torch.no_grad():
        got = model(*inputs, **kwargs).logits
        rec = next(r for r in patches.records if r.path == path)
        assert rec.status == "rejected" and "no binding matched" in rec.detail
    assert ((got - expected).norm() / expected.norm()) < 1e-5


def test_promotion_needs_a_pass_and_never_overwrites(parse_model, tmp_path):
    cov = build_coverage(parse_model("hf:mixtral"))
    cand = check_candidate(render_candidates(cov, tmp_path / "cands")[0], [[5, 128]])
    root = tmp_path / "kernels"
    dest = promote(cand, root)
    assert dest.read_text() == (tmp_path / "cands" / cand.family / dest.name).read_text()
    assert reviewed_kernels(root), "a promoted module is found by its header"
    assert build_coverage(parse_model("hf:mixtral"), root).by_status("kernel")
    dest.write_text(dest.read_text() + "# local edit\n")
    from onboarding.errors import InputError

    with pytest.raises(InputError, match="not overwriting"):
        promote(cand, root)
    cand.status = "failed"
    with pytest.raises(InputError, match="only a candidate that passed"):
        promote(cand, root)


# ---- top-k sparse attention (DSA) --------------------------------------------------------------

def test_sparse_attention_proxy_patched_matches(parse_model, tmp_path):
    """DeepSeek-V3.2 proxy: every DSA block runs the absorbed-MLA gathered kernel over the model's
    own top-k (K=16 < T=24, so rows 16.. are really sparse); same logits, restorable. (The
    calibrated call runs the same intercept as later calls: one forward keeps the test short.)"""
    g = parse_model("hf:deepseek_v32")
    cov = build_coverage(g)
    cands = [check_candidate(c, c.shapes) for c in render_candidates(cov, tmp_path)
             if c.family == "sparse_attention" and c.variant == "gathered"]
    assert len(cands) == 1 and cands[0].status == "passed", cands[0].error
    info = load_stage(load_model("hf:deepseek_v32", trust_remote_code=True))
    model = info.loaded.build(info.proxy_config, seed=0).eval()
    # Layer 1's latent expansion gets a LoRA-style adapter (base + B(A(x))): the absorbed form
    # would drop the adapter's term, so that block must be refused, not silently wrong.
    adapted = "model.layers.1.self_attn"
    attn = model.get_submodule(adapted)
    attn.kv_b_proj = _Adapted(attn.kv_b_proj)
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, 24, 1)
    assert info.proxy_config.index_topk < 24
    with torch.no_grad():
        expected = model(*inputs, **kwargs).logits
    with patch_model(model, g, kernels_for(cov, cands), kinds={"sparse_attention.topk"}) as patches:
        with torch.no_grad():
            got = model(*inputs, **kwargs).logits
        recs = {r.path: r for r in patches.records}
        assert len(recs) == len(g.by_kind("sparse_attention.topk"))
        assert recs[adapted].status == "rejected" and "adapter" in recs[adapted].detail, recs[adapted]
        others = [r for p, r in recs.items() if p != adapted]
        assert all(r.status == "active" and "absorbed MLA" in r.binding for r in others), others
    assert ((got - expected).norm() / expected.norm()) < 1e-5
    with torch.no_grad():
        assert torch.equal(model(*inputs, **kwargs).logits, expected)
    assert all("forward" not in m.__dict__ for m in model.modules())


class _Adapted(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_kernels_for_keeps_every_variant_of_a_block(parse_model, tmp_path):
    """A block served by two variants of one family (DSA: gathered, then indexer) keeps the first
    under (path, family) and the other under (path, "family:variant"); nothing is overwritten."""
    g = parse_model("hf:deepseek_v32")
    cov = build_coverage(g)
    cands = [c for c in render_candidates(cov, tmp_path) if c.family == "sparse_attention"]
    for c in cands:  # plumbing only: the modules' numerics are the kernel tests' business
        c.status = "passed"
    kernels = kernels_for(cov, cands)
    for b in g.by_kind("sparse_attention.topk"):
        assert kernels[(b.path, "sparse_attention")].VARIANT == "gathered"
        assert kernels[(b.path, "sparse_attention:indexer")].VARIANT == "indexer"


class _TinyDSA(torch.nn.Module):
    """A GQA attention with a DSA-style indexer, written from scratch: relu(q_i.k_i) weighted over
    index heads, causal top-k, the selection scattered into a boolean mask, dense attention: SDPA,
    or (``eager``) q @ k^T * scale + bias -> softmax -> @ v with the diagonal always kept."""

    def __init__(self, d=32, H=4, HK=2, D=16, DI=8, HI=2, topk=6, eager=False):
        super().__init__()
        lin = torch.nn.Linear
        self.H, self.HK, self.D, self.DI, self.HI, self.topk = H, HK, D, DI, HI, topk
        self.eager = eager
        self.q, self.k, self.v, self.o = lin(d, H * D), lin(d, HK * D), lin(d, HK * D), lin(H * D, d)
        self.iq, self.ik, self.iw = lin(d, HI * DI), lin(d, DI), lin(d, HI)

    def forward(self, x):
        B, T, _ = x.shape
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        with torch.no_grad():
            s = torch.relu(torch.einsum("bthd,bsd->bths", self.iq(x).view(B, T, self.HI, self.DI), self.ik(x)))
            s = (s * self.iw(x)[..., None]).sum(2).masked_fill(~causal, float("-inf"))
            idx = s.topk(min(self.topk, T), dim=-1).indices
        keep = torch.zeros(B, T, T, dtype=torch.bool, device=x.device).scatter(-1, idx, True) & causal
        q = self.q(x).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k(x).view(B, T, self.HK, self.D).transpose(1, 2)
        v = self.v(x).view(B, T, self.HK, self.D).transpose(1, 2)
        if self.eager:
            keep = keep | torch.eye(T, dtype=torch.bool, device=x.device)  # not a top-k set any more
            bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))[:, None]
            k, v = k.repeat_interleave(self.H // self.HK, 1), v.repeat_interleave(self.H // self.HK, 1)
            probs = ((q @ k.transpose(-1, -2)).float() * self.D ** -0.5 + bias).softmax(dim=-1)
            o = probs.to(v.dtype) @ v
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None], enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(B, T, -1))


def _tiny_dsa_setup(tmp_path, eager=False):
    from types import SimpleNamespace

    from onboarding.families import family_module
    fam = family_module("sparse_attention")
    from onboarding.graph.opgraph import Block
    from onboarding.generate.templating import load_module, render_to

    block = Block(path="attn", kind="sparse_attention.topk", layer=0, class_name="Anything",
                  attrs={"topk": 6, "indexer_relu": True})
    m = fam.match(block)
    kmod = load_module(render_to(tmp_path, fam.NAME, m["variant"], m["params"], overwrite=True))
    model = torch.nn.Module()
    model.attn = _TinyDSA(eager=eager)
    return model, SimpleNamespace(blocks=[block]), kmod


@pytest.mark.parametrize("eager,source", [(False, "top-k keys"),
                                           pytest.param(True, "mask's kept keys", marks=pytest.mark.slow)],  # ~19 s
                         ids=["sdpa", "eager-diagonal-kept"])
def test_sparse_attention_gqa_block_forward_backward(tmp_path, eager, source):
    """MHA/GQA layout on a hand-written DSA block (no transformers class): same output and the
    same gradients for every weight (k/v get theirs through the kernel's scatter-add). Eager: the
    q @ k^T -> softmax -> @ v chain is followed; its mask keeps the diagonal beyond the top-k, so
    only the binding that reads the mask's kept keys matches."""
    import copy

    model, graph, kmod = _tiny_dsa_setup(tmp_path, eager)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(0))
    with patch_model(model, graph, {("attn", "sparse_attention"): kmod}) as patches:
        out = model.attn(x)
        (rec,) = patches.records
        assert rec.status == "active" and source in rec.binding, rec
        out = model.attn(x)  # calibrated: the kernel path with autograd
        expected = ref.attn(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        do = torch.randn_like(out)
        out.backward(do)
        expected.backward(do)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        if p_ref.grad is None:  # the indexer's weights: the selection is not differentiated
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_sparse_attention_wrong_kernel_is_rejected(tmp_path):
    """A "gathered" kernel that attends to every causal position is caught on calibration."""
    model, graph, kmod = _tiny_dsa_setup(tmp_path)

    class Dense:
        VARIANT = "gathered"
        PARAMS = {"layout": "mha"}

        @staticmethod
        def entry(q, k, v, indices, sink=None, scale=None):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
            return o.transpose(1, 2)

    x = torch.randn(1, 13, 32, generator=torch.Generator().manual_seed(1))
    expected = model.attn(x)
    with patch_model(model, graph, {("attn", "sparse_attention"): Dense}) as patches, torch.no_grad():
        got = model.attn(x)
        (rec,) = patches.records
        assert rec.status == "rejected" and "differs" in rec.detail, rec
    torch.testing.assert_close(got, expected)


# ---- moe.router (+ moe.experts) -------------------------------------------------------------
@pytest.mark.parametrize("ref", [pytest.param("hf:qwen3_moe", marks=pytest.mark.slow),  # ~35 s; mixtral stays
                                 "hf:mixtral",
                                 pytest.param("hf:qwen3_next", marks=pytest.mark.slow),  # 45-60 s
                                 pytest.param("hf:deepseek_v32", marks=pytest.mark.slow)])  # ~29 s
def test_router_and_experts_patched_match_unpatched(parse_model, ref, tmp_path):
    g, cov, cands, model, inputs, kwargs = _prepare(parse_model, ref, tmp_path,
                                                    families={"moe_router", "moe_experts"})
    kinds = {"moe.router", "moe.experts"}
    with torch.no_grad():
        expected = model(*inputs, **kwargs).logits
    with patch_model(model, g, kernels_for(cov, cands), kinds=kinds) as patches:
        with torch.no_grad():
            got = model(*inputs, **kwargs).logits
            again = model(*inputs, **kwargs).logits  # after calibration: kernels only
        routers = [r for r in patches.records if r.kind == "moe.router"]
        assert routers and {r.kind for r in patches.active()} == kinds
        assert all(r.status == "active" for r in patches.records), [(r.path, r.detail) for r in patches.records]
        # transformers 5 routers return (logits, weights, indices): read off the original's output
        # (at top-8 DeepSeek's topk(sorted=False) lists the experts in another order than ours)
        assert all("-> (logits, topk_weights, topk_indices)" in r.binding for r in routers), \
            [r.binding for r in routers]
    for out in (got, again):
        assert ((out - expected).norm() / expected.norm()) < 1e-5
    with torch.no_grad():
        assert torch.equal(model(*inputs, **kwargs).logits, expected)  # reversible


@pytest.mark.slow  # ~35 s on 2 cores
def test_clamped_experts_patched_match_unpatched(parse_model, tmp_path):
    """DeepSeek-V4's experts clamp gate and up before a SiLU: matched from the clamp style the
    classifier reads off the op order, patched, and equal to the unpatched model."""
    pytest.importorskip("transformers.models.deepseek_v4")
    g, cov, cands, model, inputs, kwargs = _prepare(parse_model, "hf:deepseek_v4", tmp_path,
                                                    families={"moe_experts"})
    assert all(c.params.get("limit") == 10.0 for c in cands)
    with torch.no_grad():
        expected = model(*inputs, **kwargs).logits
    with patch_model(model, g, kernels_for(cov, cands), kinds={"moe.experts"}) as patches:
        with torch.no_grad():
            got = model(*inputs, **kwargs).logits
        assert patches.records and all(r.status == "active" for r in patches.records), \
            [(r.path, r.detail) for r in patches.records]
    assert ((got - expected).norm() / expected.norm()) < 1e-5


class _Router(torch.nn.Module):
    """A router that is no transformers class: sigmoid scores, a score bias buffer, renormalised
    top-k, and a configurable output structure."""

    def __init__(self, structure: str, gen: torch.Generator, e: int = 8, d: int = 16, k: int = 3):
        super().__init__()
        self.gate_proj = torch.nn.Parameter(torch.randn(e, d, generator=gen) / d ** 0.5)
        self.register_buffer("correction", 0.05 * torch.randn(e, generator=gen))
        self.structure, self.k = structure, k

    def forward(self, x):
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), self.gate_proj)
        s = logits.sigmoid()
        idx = torch.topk(s + self.correction, self.k, dim=-1, sorted=self.structure != "unsorted")[1]
        if self.structure == "reversed":  # the same experts, listed in another order
            idx = idx.flip(-1)
        w = s.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        if self.structure in ("indices_weights", "reversed", "unsorted"):
            return idx, w
        if self.structure == "dense":  # [N, E] routing scores, zeros off the selection
            return torch.zeros_like(s).scatter(1, idx, w), logits
        if self.structure == "counts":  # something the kernel cannot give in this form
            return w, idx, torch.bincount(idx.flatten(), minlength=s.shape[1]).float()
        if self.structure == "flipped":  # not a top-k of these scores
            return (logits, w, (idx + 1) % s.shape[1])
        raise ValueError(self.structure)


def _router_graph(block_attrs):
    from onboarding.graph.opgraph import Block, OpGraph

    block = Block(path="router", kind="moe.router", layer=0, class_name="_Router",
                  params={"router.gate_proj": [8, 16]}, attrs=block_attrs)
    return OpGraph(model="toy", capture="export", capture_note="", batch=1, seq=37, dtype="fp32",
                   blocks=[block], layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)


@pytest.fixture(scope="module")
def router_kernel(tmp_path_factory):
    from onboarding.families import family_module
    moe_router = family_module("moe_router")
    from onboarding.generate.templating import load_module, render_to

    attrs = {"n_experts": 8, "top_k": 3, "scoring": "sigmoid", "score_bias": True, "renormalize": True,
             "group_limited": False, "routed_scaling_factor": 1.0}
    m = moe_router.match(_router_graph(attrs).blocks[0])
    return attrs, load_module(render_to(tmp_path_factory.mktemp("k"), "moe_router", m["variant"], m["params"]))


@pytest.mark.parametrize("structure,active", [
    ("indices_weights", True), ("unsorted", True), ("reversed", True), ("dense", True),
    ("counts", False), ("flipped", False)])
def test_router_output_structure_by_calibration(router_kernel, structure, active):
    attrs, kmod = router_kernel
    gen = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    root.router = _Router(structure, gen)
    x = torch.randn(2, 37, 16, generator=gen, requires_grad=True)
    expected = root.router(x)
    with patch_model(root, _router_graph(attrs), {("router", "moe_router"): kmod}) as patches:
        got = root.router(x)
        rec = patches.records[0]
        assert (rec.status == "active") is active, (rec.status, rec.detail)
        if not active:  # restored, reported, and the original's output returned
            assert "no binding matched" in rec.detail
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
            return
        root.router.structure = "no longer runnable"  # the original would raise from now on
        again = root.router(x)  # so this is the kernel alone
        fewer = root.router(x[:, :5])  # another token count after calibration
        assert [t.shape[0] for t in fewer] == [10] * len(expected)
    assert len(again) == len(expected)
    for a, b in zip(again, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
    if structure == "dense":
        torch.testing.assert_close(again[0], expected[0])
        torch.testing.assert_close(again[1], expected[1])
    else:  # the same experts per token (order may differ), with the same weight on each
        (ia, wa), (ib, wb) = again, expected
        oa, ob = ia.argsort(-1), ib.argsort(-1)
        assert torch.equal(ia.gather(1, oa), ib.gather(1, ob))
        torch.testing.assert_close(wa.gather(1, oa), wb.gather(1, ob))
    # gradients flow to the input and the gate weight through the kernel's weights
    w_out = again[0] if structure == "dense" else again[1]
    w_out.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and root.router.gate_proj.grad.abs().sum() > 0


class _BiasArgRouter(torch.nn.Module):
    """A gate whose score-correction bias belongs to its parent and comes in as an argument
    (MiniMax-M2's gate(x, e_score_correction_bias))."""

    def __init__(self, gen: torch.Generator, e: int = 8, d: int = 16, k: int = 3):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(e, d, generator=gen) / d ** 0.5)
        self.k = k

    def logits(self, x):
        return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), self.weight)

    def forward(self, x, correction):
        logits = self.logits(x)
        s = logits.sigmoid()
        idx = torch.topk(s + correction, self.k, dim=-1)[1]
        w = s.gather(1, idx)
        return logits, w / w.sum(-1, keepdim=True), idx


@contextlib.contextmanager
def _calibrated(router, router_kernel, *args):
    """`router` patched with the router kernel and calibrated on `args`: from here on the
    kernel alone runs."""
    attrs, kmod = router_kernel
    root = torch.nn.Module()
    root.router = router
    with patch_model(root, _router_graph(attrs), {("router", "moe_router"): kmod}) as patches:
        router(*args)
        assert patches.records[0].status == "active", patches.records[0].detail
        yield router


class _Statics(torch.nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.correction = torch.nn.Parameter(bias[None, :], requires_grad=False)  # [1, E]


class _SubmoduleBiasRouter(_BiasArgRouter):
    """The bias held by a submodule as [1, E] (Ernie 4.5's moe_statics)."""

    def __init__(self, gen: torch.Generator):
        super().__init__(gen)
        self.statics = _Statics(0.05 * torch.randn(8, generator=gen))

    def forward(self, x):
        return super().forward(x, self.statics.correction.squeeze(0))


def test_router_finds_a_score_bias_in_a_submodule(router_kernel):
    gen = torch.Generator().manual_seed(2)
    router = _SubmoduleBiasRouter(gen)
    x = torch.randn(2, 37, 16, generator=gen)
    expected = router(x)
    with _calibrated(router, router_kernel, x):
        with torch.no_grad():
            router.statics.correction[0, :3] += 50.0  # the kernel reads the live bias
        got = router(x)
    assert torch.equal(got[2].sort(-1).values, torch.tensor([0, 1, 2]).expand(74, 3))
    assert got[0].shape == expected[0].shape


class _LinearGateRouter(_BiasArgRouter):
    """The gate weight inside an nn.Linear submodule, the bias passed in (AFMoE)."""

    def __init__(self, gen: torch.Generator):
        super().__init__(gen)
        del self.weight
        self.gate = torch.nn.Linear(16, 8, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(8, 16, generator=gen) / 4)

    def logits(self, x):
        return self.gate(x.reshape(-1, 16))


@pytest.mark.parametrize("make", [_BiasArgRouter, _LinearGateRouter])
def test_router_takes_a_score_bias_passed_in(router_kernel, make):
    """The bias comes in as an argument; the gate weight is the block's own or an nn.Linear's."""
    gen = torch.Generator().manual_seed(1)
    router = make(gen)
    x = torch.randn(2, 37, 16, generator=gen)
    correction = 0.05 * torch.randn(8, generator=gen)
    expected = router(x, correction)
    with _calibrated(router, router_kernel, x, correction):
        got = router(x, correction)  # the kernel alone, the bias read from the argument
        shifted = router(x, correction + torch.linspace(0.0, 50.0, 8))  # bias decides top-k
    torch.testing.assert_close(got[0], expected[0])
    assert torch.equal(got[2].sort(-1).values, expected[2].sort(-1).values)
    assert torch.equal(shifted[2].sort(-1).values, torch.tensor([5, 6, 7]).expand(74, 3))


def test_router_structure_mismatch_is_rejected(router_kernel):
    """No gate weight of shape [n_experts, hidden]: nothing to bind, reported, block untouched."""
    attrs, kmod = router_kernel
    root = torch.nn.Module()
    root.router = _Router("indices_weights", torch.Generator().manual_seed(0), e=6)
    with patch_model(root, _router_graph(attrs), {("router", "moe_router"): kmod}) as patches:
        rec = patches.records[0]
        assert rec.status == "rejected" and "structure does not fit" in rec.detail
        assert "forward" not in root.router.__dict__


def test_router_ties_are_rejected_not_guessed(router_kernel):
    """A zero gate weight (Qwen3's router init) ties every expert: torch.topk's tie order is
    arbitrary on the CPU, the kernel takes the lowest indices, so the selections differ; the
    patch must be rejected and the original's routing kept, never a silently different one."""
    attrs, kmod = router_kernel
    root = torch.nn.Module()
    root.router = _Router("indices_weights", torch.Generator().manual_seed(0))
    with torch.no_grad():
        root.router.gate_proj.zero_()
        root.router.correction.zero_()
    x = torch.randn(37, 16)
    expected = root.router(x)
    if torch.equal(expected[0], torch.arange(3).expand(37, 3)):
        pytest.skip("this torch breaks ties by lowest index, as the kernel does")
    with patch_model(root, _router_graph(attrs), {("router", "moe_router"): kmod}) as patches:
        got = root.router(x)
        assert patches.records[0].status == "rejected"
    assert torch.equal(got[0], expected[0])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class _Fp32Router(torch.nn.Module):
    """Logits, scores and weights in fp32 whatever the module's dtype (DeepSeek-V3, Kimi); the
    top-k listed by ascending score (ours: descending)."""

    def __init__(self, gen: torch.Generator, e: int = 8, d: int = 16, k: int = 3):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(e, d, generator=gen) / d ** 0.5)
        self.register_buffer("correction", 0.05 * torch.randn(e, generator=gen))
        self.k = k

    def forward(self, x):
        s = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), self.weight.float()).sigmoid()
        idx = torch.topk(s + self.correction.float(), self.k, dim=-1)[1].flip(-1)
        w = s.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True)


def test_router_replay_compares_weights_choice_by_choice(router_kernel):
    """The kernel lists a token's experts by score; an original may list them in another order
    (transformers' DeepSeek-V3 / Kimi routers: topk(sorted=False)). Alignment's isolated replay
    compares the patched router's top-k weights with the reference's choice by choice, not slot
    by slot: at top-8 the slot-by-slot comparison failed DeepSeek-V3.2's and Kimi's bf16 routers
    at rel_rms 4-5e-2 against their own error of 2e-3 (the kernel's own error, aligned, is the
    unpatched bf16 router's)."""
    from onboarding.align.replay import _replay
    from onboarding.align.core import _Call

    attrs, kmod = router_kernel
    gen = torch.Generator().manual_seed(3)
    reference = _Fp32Router(gen)
    x = torch.randn(2, 37, 16, generator=gen)
    with torch.no_grad():
        idx, w = reference(x)
    call = _Call(args=((x,), {}), grad_flags=[True], outputs=[w], discrete_out=[idx],
                 out_grads=[torch.randn(w.shape, generator=gen)], out_needs_grad=[True])
    ref = _replay(reference, call, call, torch.float32)
    root = torch.nn.Module()
    root.router = _Fp32Router(torch.Generator().manual_seed(3)).to(torch.bfloat16)
    floor = _replay(root.router, call, None, torch.bfloat16)  # the unpatched router in bf16
    with patch_model(root, _router_graph(attrs), {("router", "moe_router"): kmod}) as patches:
        root.router(x.bfloat16())
        assert patches.records[0].status == "active", patches.records[0].detail
        ours = _replay(root.router, call, None, torch.bfloat16)
    # rows choosing other experts in bf16 (near ties) are masked by alignment; the rest are
    # listed in the reference's order and compared with it
    same = [(t.discrete[0].sort(-1).values == idx.sort(-1).values).all(-1) for t in (ours, floor)]
    same = same[0] & same[1]
    assert same.sum() >= 60
    err, own = (_rel(t.outputs[0][same], ref.outputs[0][same]) for t in (ours, floor))
    assert 0 < own < 1e-2 and err < 2 * own, (err, own)  # slot by slot, err was 0.27
    assert torch.equal(ours.discrete[0][same], idx[same])
    # the output grads were already paired by choice: x's grads match on those rows too
    gx = [t.input_grads[0].reshape(-1, 16)[same] for t in (ours, floor, ref)]
    assert _rel(gx[0], gx[2]) < 2 * _rel(gx[1], gx[2]) + 1e-3


def test_router_calls_compared_in_the_reference_order():
    """End to end, a router's recorded outputs and output grads, and the experts' recorded inputs
    (indices next to weights) and input grads, follow the reference's slot order for comparing;
    rows choosing other experts, tensors of other shapes and the recorded call stay as they are."""
    from onboarding.align.replay import _calls_in_reference_order
    from onboarding.align.core import _Call

    gen = torch.Generator().manual_seed(4)
    ref_idx = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(5)])
    perm = torch.stack([torch.randperm(8, generator=gen) for _ in range(5)])
    idx = ref_idx.gather(1, perm)  # the same choices, listed in another order
    idx[4] = (ref_idx[4] + 1) % 16  # row 4: other experts (a flip: left to _selection_flips)
    w, g, logits = torch.rand(5, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(5, 16)
    router = _Call(outputs=[logits, w], out_grads=[None, g], discrete_out=[idx])
    experts = _Call(inputs=[torch.randn(5, 4), w], taps=[None, g], discrete_in=[idx])
    ref = _Call(discrete_out=[ref_idx], discrete_in=[ref_idx])
    r, e = _calls_in_reference_order([router, experts], [ref, ref])
    for sel in (r.discrete_out[0], e.discrete_in[0]):
        assert torch.equal(sel[:4], ref_idx[:4]) and torch.equal(sel[4], idx[4])
    assert r.outputs[0] is logits and e.inputs[0] is experts.inputs[0]  # not slot-aligned
    for sel, ws, gs in ((r.discrete_out[0], r.outputs[1], r.out_grads[1]),
                        (e.discrete_in[0], e.inputs[1], e.taps[1])):
        for row in range(5):  # each weight and grad still goes with its expert
            assert dict(zip(sel[row].tolist(), ws[row].tolist())) == dict(zip(idx[row].tolist(), w[row].tolist()))
            assert dict(zip(sel[row].tolist(), gs[row].tolist())) == dict(zip(idx[row].tolist(), g[row].tolist()))
    assert r.out_grads[0] is None and e.taps[0] is None
    assert router.outputs[1] is w and torch.equal(router.discrete_out[0], idx)  # recorded: as it was


# ---- non-gated routed experts (moe_experts variant mlp) ---------------------------------------
def test_non_gated_experts_proxy_classified_patched_and_aligned(parse_model, tmp_path):
    """transformers' nemotron_h proxy: its routed experts (up [E, F, D] -> relu(x)^2 -> down
    [E, D, F], no gate) are classified non-gated, matched to `moe_experts/mlp`, checked against
    the eager reference, patched (the binding checked on the first call), and align block by
    block, forward and backward, with an fp64 eager reference (as tests/test_align.py)."""
    g = parse_model("hf:nemotron_h")
    experts = g.by_kind("moe.experts")
    assert experts and all(b.attrs["gated"] is False and b.attrs["activation"] == "relu2" for b in experts)
    cov = build_coverage(g)
    entries = [e for e in cov.entries if e.kind == "moe.experts"]
    assert entries and {(e.status in OURS, e.family, e.variant, e.params["activation"])
                        for e in entries} == {(True, "moe_experts", "mlp", "relu2")}
    _experts_align(g, cov, "hf:nemotron_h", tmp_path, "up/down = up_proj/down_proj by x's width")


def _experts_align(g, cov, ref: str, tmp_path, binding: str, prepare=lambda model: None) -> None:
    """Render and check the experts candidates of `cov`, build `ref`'s proxy (`prepare` edits it),
    patch its experts only (each binding naming `binding`) and align them, fp32 kernels against
    the fp64 eager model, forward and backward."""
    from onboarding.align.core import align, build_pair

    cands = [check_candidate(c, c.shapes) for c in render_candidates(cov, tmp_path) if c.family == "moe_experts"]
    assert cands and all(c.status == "passed" for c in cands), [c.error for c in cands]
    info = load_stage(load_model(ref, trust_remote_code=True))
    model = info.loaded.build(info.proxy_config, seed=0)
    prepare(model)
    reference, candidate = build_pair(model, reference_dtype="fp64", candidate_dtype="fp32")
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, 16, 0)
    with patch_model(candidate, g, kernels_for(cov, cands), kinds={"moe.experts"}) as patches:
        result = align(reference, candidate, g, inputs, kwargs, patches=patches)
        recs = patches.records
        assert recs and all(r.status == "active" for r in recs), [(r.path, r.detail) for r in recs]
        assert all(binding in r.binding for r in recs), recs
    assert result.passed, result.summary()
    for b in g.by_kind("moe.experts"):
        blk = result.block(b.path)
        assert blk.fwd.verdict == "pass" and blk.fwd.output.rel_rms < 1e-5, blk.fwd
        assert blk.bwd.verdict == "pass" and blk.bwd.output.rel_rms < 1e-5, blk.bwd
    assert result.logits["top1_agreement"] == 1.0
    assert all("forward" not in m.__dict__ for m in candidate.modules())  # restored


_MLP_LIST_MODEL = '''
import torch
from torch import nn
from torch.nn import functional as F


class Expert(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.fc_in = nn.Linear(d, f, bias=False)
        self.fc_out = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.fc_out(F.relu(self.fc_in(x)).square())


class MoE(nn.Module):
    def __init__(self, d, n_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, 48) for _ in range(n_experts))

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        w, idx = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * w[rows, slot, None])
        return out.reshape(b, t, d)


class ListMoELM(nn.Module):
    def __init__(self, vocab=97, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.moe = MoE(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.moe(x))
'''


@pytest.mark.parametrize("act_src,act", [("F.relu(self.fc_in(x)).square()", "relu2"),
                                         ('F.gelu(self.fc_in(x), approximate="tanh")', "gelu_tanh"),
                                         ("F.gelu(self.fc_in(x))", "gelu")])
def test_non_gated_module_list_experts_classified(parse_model, tmp_path, act_src, act):
    """A plain nn.Module MoE whose experts are a list of non-gated MLPs (no transformers class):
    one `module_list` experts block, non-gated from its per-expert weights [F, D] / [D, F], the
    activation read off the ops (relu then square; gelu and its `approximate` keyword), matched
    to `moe_experts/mlp`."""
    from onboarding.families import family_module
    moe_experts = family_module("moe_experts")

    path = tmp_path / "list_moe.py"
    path.write_text(_MLP_LIST_MODEL.replace("F.relu(self.fc_in(x)).square()", act_src))
    g = parse_model(f"{path}:ListMoELM")
    experts = g.by_kind("moe.experts")
    assert len(experts) == 1, [(b.path, b.kind) for b in g.blocks]
    attrs = experts[0].attrs
    assert (attrs["layout"], attrs["gated"], attrs["activation"]) == ("module_list", False, act), attrs
    assert moe_experts.match(experts[0]) == {
        "variant": "mlp", "params": moe_experts.FAMILY.resolve("mlp", {"activation": act})}


class _PackedMLPExperts(torch.nn.Module):
    """Packed non-gated experts under names no rule knows, eager per-expert loop; ``act`` is the
    activation it really applies."""

    def __init__(self, gen, e=4, d=24, f=20, act=torch.nn.functional.gelu):
        super().__init__()
        self.w_a = torch.nn.Parameter(torch.randn(e, d, f, generator=gen) / f ** 0.5)  # down first
        self.w_b = torch.nn.Parameter(torch.randn(e, f, d, generator=gen) / d ** 0.5)
        self.act = act

    def forward(self, weights, hidden, indices):  # another argument order than transformers'
        out = torch.zeros_like(hidden)
        for e in range(self.w_a.shape[0]):
            rows, slot = torch.where(indices == e)
            h = self.act(hidden[rows] @ self.w_b[e].T) @ self.w_a[e].T
            out.index_add_(0, rows, h * weights[rows, slot, None])
        return out


def _experts_graph(d, f, activation):
    from onboarding.graph.opgraph import Block, OpGraph

    block = Block(path="experts", kind="moe.experts", layer=0, class_name="_PackedMLPExperts",
                  params={"w_a": [4, d, f], "w_b": [4, f, d]},
                  attrs={"n_experts": 4, "layout": "packed_3d", "gated": False, "activation": activation,
                         "clamp": None})
    return OpGraph(model="toy", capture="export", capture_note="", batch=1, seq=37, dtype="fp32",
                   blocks=[block], layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)


@pytest.mark.parametrize("d,f,act,kernel_act,active", [
    (24, 20, "gelu", "gelu", True),
    (24, 24, "gelu", "gelu", True),  # F == D: both up/down assignments tried, the right one kept
    # a kernel with the wrong activation (exact gelu for the tanh form, relu for relu^2) is refused
    # by the first-call check against the block's own output, never used
    (24, 20, "gelu_tanh", "gelu", False),
    (24, 20, "relu2", "relu", False),
])
def test_non_gated_experts_binding_by_shape(tmp_path, d, f, act, kernel_act, active):
    from onboarding.families import family_module
    moe_experts = family_module("moe_experts")
    from onboarding.generate.templating import load_module, render_to

    torch_act = {"gelu": torch.nn.functional.gelu,
                 "gelu_tanh": lambda u: torch.nn.functional.gelu(u, approximate="tanh"),
                 "relu2": lambda u: torch.relu(u).square()}[act]
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()  # the block under a parent, at path "experts"
    model.experts = _PackedMLPExperts(gen, d=d, f=f, act=torch_act)
    model = model.to(kernel_device())
    graph = _experts_graph(d, f, act)
    m = moe_experts.match(graph.blocks[0])
    assert m is not None and m["variant"] == "mlp"
    mod = load_module(render_to(tmp_path, "moe_experts", "mlp", {"activation": kernel_act}))
    x = torch.randn(37, d, generator=gen).to(kernel_device())
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(37)]).to(x.device)
    w = torch.rand(37, 2, generator=gen).to(x.device)
    with torch.no_grad():
        expected = model.experts(w, x, idx)
    with patch_model(model, graph, {("experts", "moe_experts"): mod}) as patches, torch.no_grad():
        got = model.experts(w, x, idx)
        again = model.experts(w, x, idx)
        rec = patches.records[0]
        assert rec.status == ("active" if active else "rejected"), (rec.binding, rec.detail)
        if active and d == f:
            assert rec.binding.endswith("up=w_b, down=w_a"), rec.binding
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, expected, rtol=1e-4, atol=1e-5)


def _proxy_experts(parse_model, ref: str):
    """`ref`'s op graph, its built proxy, the first experts block's path and that module's type
    (to show afterwards that nothing was replaced)."""
    g = parse_model(ref)
    info = load_stage(load_model(ref, trust_remote_code=True))
    model = info.loaded.build(info.proxy_config, seed=0)
    path = g.by_kind("moe.experts")[0].path
    return g, model, path, type(model.get_submodule(path))


def test_non_gated_experts_expert_parallel_with_lora(parse_model):
    """Training: expert parallelism and expert LoRA serve non-gated experts (nemotron_h: up
    [E, F, D] -> relu(x)^2 -> down [E, D, F]). One process (ep=1) with LoRA B non-zero equals
    transformers' module with W + s B A merged into both weights, forward and d x."""
    import copy

    from onboarding.train.moe_ep import EPExperts, EPGroup, ExpertLoRA, apply_expert_parallel

    g, model, path, _ = _proxy_experts(parse_model, "hf:nemotron_h")
    merged = copy.deepcopy(model.get_submodule(path))
    (ep,) = [m for m in apply_expert_parallel(model, g, EPGroup(), lora=ExpertLoRA(rank=4, alpha=8.0))
             if m.path == path]
    assert isinstance(model.get_submodule(path), EPExperts) and not ep.gated
    assert (ep.gate_up_name, ep.down_name) == ("up_proj", "down_proj")  # up ends in D (by shape)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ep.lora_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        merged.up_proj += ep.scaling * ep.lora_B_gate_up @ ep.lora_A_gate_up
        merged.down_proj += ep.scaling * ep.lora_B_down @ ep.lora_A_down
    e, _, d = merged.up_proj.shape
    _same_experts(ep, merged, e, d, gen)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ep.lora_parameters())


def _same_experts(mod_a, mod_b, e: int, d: int, gen: torch.Generator, n: int = 19) -> None:
    """Two experts modules on the same n tokens routed top-2 among e experts: outputs and d x
    agree (within 1e-6 of their largest magnitude: fp32 sums in another order, grouped against
    per expert)."""
    x = torch.randn(n, d, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(n)])
    w = torch.rand(n, 2, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = mod_a(xa, idx, w), mod_b(xb, idx, w)
    cot = torch.randn(ya.shape, generator=gen)
    (ya * cot).sum().backward()
    (yb * cot).sum().backward()
    for got, want in ((ya, yb), (xa.grad, xb.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=max(1e-5, 1e-6 * want.abs().max().item()))


@pytest.mark.slow  # 20-32 s in CI; test_training_dist's EP tests stay
def test_expert_lora_kernel_attaches_to_ep_experts(parse_model, tmp_path, monkeypatch):
    """Training: `attach_expert_kernels` gives plain SwiGLU EP experts with expert LoRA the
    grouped expert LoRA kernel (pre-sorted rows) after checking it against the module's torch
    path; the experts then agree with a copy on the torch path, forward, d x and every adapter
    gradient. Frozen experts (no expert LoRA) keep torch; a failed check keeps the torch path."""
    import copy

    from onboarding.families import training_kernel
    from onboarding.train import kernels as K
    from onboarding.train.moe_ep import EPGroup, ExpertLoRA, _is_silu, apply_expert_parallel

    # the experts family offers its LoRA variant for moe.experts; no family one for norms
    assert training_kernel("moe.experts") == ("moe_experts", "swiglu_lora") and training_kernel("norm.rms") is None
    g, model, path, _ = _proxy_experts(parse_model, "hf:qwen3_moe")
    mods = apply_expert_parallel(model, g, EPGroup(), lora=ExpertLoRA(rank=4, alpha=8.0))
    assert mods and all(m.plain for m in mods)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in mods:
            for p in m.lora_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    torch_path = copy.deepcopy(mods[0])
    assert K.attach_expert_kernels(mods, tmp_path, rank=0) == {"moe.experts": len(mods), "rejected:moe.experts": 0}
    assert all(m.kernel is not None for m in mods) and torch_path.kernel is None
    e, _, d = getattr(mods[0], mods[0].gate_up_name).shape
    _same_experts(mods[0], torch_path, e, d, gen)
    for a, b in zip(mods[0].lora_parameters(), torch_path.lora_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6 * b.grad.abs().max().item())

    for m in mods:
        m.use_kernel(None)
    monkeypatch.setattr(K, "check_experts_kernel", lambda m, k: "output 3.0e-01")
    with pytest.warns(UserWarning, match="keep the torch path"):
        assert K.attach_expert_kernels(mods, tmp_path, rank=0)["rejected:moe.experts"] == len(mods)
    assert all(m.kernel is None for m in mods)
    _, frozen_model, _, _ = _proxy_experts(parse_model, "hf:qwen3_moe")
    frozen = apply_expert_parallel(frozen_model, g, EPGroup())
    assert K.attach_expert_kernels(frozen, tmp_path, rank=0) == {} and all(m.kernel is None for m in frozen)
    assert _is_silu(torch.nn.SiLU()) and not _is_silu(torch.nn.functional.gelu)


def test_expert_parallel_refuses_square_non_gated_experts():
    """Non-gated experts with F == D: up and down have the same shape, so which is which cannot be
    read from them; expert parallelism says so instead of guessing."""
    from onboarding.errors import InputError
    from onboarding.train.moe_ep import _packed_weights

    class Square(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_a = torch.nn.Parameter(torch.randn(4, 8, 8))
            self.w_b = torch.nn.Parameter(torch.randn(4, 8, 8))

    with pytest.raises(InputError, match=r"blk: non-gated experts with F == D \(8\).*cannot be told by shape"):
        _packed_weights(Square(), 8, {}, "blk")


# ---- gpt-oss-style experts (x @ W weights, interleaved gate/up, per-expert biases) -----------
def test_gpt_oss_experts_proxy_classified_patched_and_aligned(parse_model, tmp_path):
    """transformers' gpt_oss proxy: its experts (gate_up [E, D, 2F] used as x @ W with gate/up
    interleaved, down [E, F, D], biases [E, 2F] / [E, D], clamped sigmoid GLU) are classified
    with that layout read off their shapes and ops, matched to `moe_experts/swiglu` with `bias`,
    checked against the eager reference, patched through the layout conversion (checked on the
    first call), and align block by block, forward and backward, with an fp64 eager reference.
    The proxy's biases start at zero: they are drawn at random first, so they count."""
    pytest.importorskip("transformers.models.gpt_oss")
    g = parse_model("hf:gpt_oss")
    experts = g.by_kind("moe.experts")
    assert experts
    for b in experts:
        a = b.attrs
        assert (a["gated"], a["activation"], a["weight_layout"], a["gate_up_split"]) == \
            (True, "silu", "in_out", "interleaved"), a
        (e, d, two_f), = [s for s in b.params.values() if len(s) == 3 and s[2] % 2 == 0 and
                           [s[0], s[2] // 2, s[1]] in b.params.values()]  # gate_up [E, D, 2F] beside down [E, F, D]
        assert (b.params[a["gate_up_bias"]], b.params[a["down_bias"]]) == ([e, two_f], [e, d]), (a, b.params)
    cov = build_coverage(g)
    entries = [e for e in cov.entries if e.kind == "moe.experts"]
    assert entries and {(e.status in OURS, e.family, e.variant, e.params["bias"], e.params["limit"],
                         e.params["alpha"], e.params["up_offset"]) for e in entries} == \
        {(True, "moe_experts", "swiglu", True, 7.0, 1.702, 1.0)}

    def random_biases(model):  # the proxy initialises them to zero: nothing would show
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for b in experts:
                mod = model.get_submodule(b.path)
                for name in (b.attrs["gate_up_bias"], b.attrs["down_bias"]):
                    p = getattr(mod, name)
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    _experts_align(g, cov, "hf:gpt_oss", tmp_path, "in_out interleaved + biases -> kernel layout", random_biases)


_SPLIT_MOE_MODEL = '''
import torch
from torch import nn
from torch.nn import functional as F

SPLIT = {split!r}


class Experts(nn.Module):
    """gate_up [E, D, 2F] used as x @ W, gate/up split by SPLIT; names nobody's rule knows."""

    def __init__(self, d, f, e):
        super().__init__()
        self.w_a = nn.Parameter(torch.randn(e, d, 2 * f) / d ** 0.5)
        self.w_b = nn.Parameter(torch.randn(e, f, d) / f ** 0.5)
        # even / odd columns, held as index tensors: the same interleaving, unreadable from ops
        self.register_buffer("cols_g", torch.arange(0, 2 * f, 2))
        self.register_buffer("cols_u", torch.arange(1, 2 * f, 2))

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for e in range(self.w_a.shape[0]):
            rows, slot = torch.where(idx == e)
            gu = x[rows] @ self.w_a[e]
            if SPLIT == "strided":
                g, u = gu[..., ::2], gu[..., 1::2]
            else:
                g, u = gu.index_select(-1, self.cols_g), gu.index_select(-1, self.cols_u)
            out.index_add_(0, rows, (F.silu(g) * u) @ self.w_b[e] * w[rows, slot, None])
        return out


class SplitMoELM(nn.Module):
    def __init__(self, vocab=97, d=32, f=24, e=4, k=2):
        super().__init__()
        self.k = k
        self.embed = nn.Embedding(vocab, d)
        self.router = nn.Linear(d, e, bias=False)
        self.experts = Experts(d, f, e)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        b, t, d = x.shape
        h = x.reshape(-1, d)
        w, idx = self.router(h).softmax(-1).topk(self.k, dim=-1)
        return self.head(x + self.experts(h, idx, w).reshape(b, t, d))
'''


@pytest.mark.parametrize("split", ["strided", "index_select"])
def test_gate_up_split_read_off_the_ops(parse_model, tmp_path, split):
    """A plain MoE (no transformers class) with x @ W experts: gate/up taken by step-2 slices is
    classified "interleaved", matched and patched equal to the model; the same interleaving taken
    with index tensors cannot be read off the ops, so the block stays uncovered (never guessed)."""
    from onboarding.families import family_module
    moe_experts = family_module("moe_experts")

    path = tmp_path / f"split_moe_{split}.py"
    path.write_text(_SPLIT_MOE_MODEL.format(split=split))
    g = parse_model(f"{path}:SplitMoELM")
    experts = g.by_kind("moe.experts")
    assert len(experts) == 1, [(b.path, b.kind) for b in g.blocks]
    attrs = experts[0].attrs
    assert (attrs["gated"], attrs["weight_layout"], attrs["activation"]) == (True, "in_out", "silu"), attrs
    entry = next(e for e in build_coverage(g).entries if e.path == experts[0].path)
    if split == "index_select":
        assert attrs["gate_up_split"] is None, attrs
        assert moe_experts.match(experts[0]) is None
        assert entry.status == "uncovered", entry
        return
    assert attrs["gate_up_split"] == "interleaved", attrs
    assert moe_experts.match(experts[0]) == {"variant": "swiglu", "params": moe_experts.FAMILY.resolve("swiglu", {})}
    assert (entry.status in OURS, entry.family, entry.variant) == (True, "moe_experts", "swiglu")
    cov = build_coverage(g)
    cands = [check_candidate(c, c.shapes) for c in render_candidates(cov, tmp_path) if c.family == "moe_experts"]
    assert cands and all(c.status == "passed" for c in cands), [c.error for c in cands]
    info = load_stage(load_model(f"{path}:SplitMoELM", trust_remote_code=True))
    model = info.loaded.build(info.proxy_config, seed=0).eval()
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
    with patch_model(model, g, kernels_for(cov, cands), kinds={"moe.experts"}) as patches, torch.no_grad():
        got = model(ids)
        again = model(ids)
        rec = patches.records[0]
        assert rec.status == "active" and "w_a in_out interleaved -> kernel layout" in rec.binding, rec
    for out in (got, again):
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_gpt_oss_experts_expert_parallel(parse_model):
    """Training: expert parallelism serves gpt-oss's experts (x @ W weights, interleaved gate/up,
    per-expert biases, clamped g * sigmoid(1.702 g) * (up + 1)) from the classifier's reading of
    the proxy: one process (ep=1) equals transformers' module, forward and d x, with random
    biases. Expert LoRA needs the [E, out, in] halves layout: refused before any block is
    replaced, naming the weights."""
    import copy

    from onboarding.errors import InputError
    from onboarding.train.moe_ep import EPExperts, EPGroup, ExpertLoRA, apply_expert_parallel

    pytest.importorskip("transformers.models.gpt_oss")
    g, model, path, before = _proxy_experts(parse_model, "hf:gpt_oss")
    with pytest.raises(InputError, match=r"expert_lora=true, but the expert weights \['down_proj', "
                                         r"'gate_up_proj', 'gate_up_proj_bias'\] are not in the \[E, out, in\]"):
        apply_expert_parallel(model, g, EPGroup(), lora=ExpertLoRA(rank=4, alpha=8.0))
    assert type(model.get_submodule(path)) is before
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.get_submodule(path).parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)  # gate/up std ~3.4: some clamp at 7
    src = copy.deepcopy(model.get_submodule(path))
    apply_expert_parallel(model, g, EPGroup())
    ep = model.get_submodule(path)
    assert isinstance(ep, EPExperts) and ep.gated and ep.limit == 7.0 and ep.up_offset == 1.0
    e, d, _ = src.gate_up_proj.shape
    _same_experts(ep, src, e, d, gen, n=23)


# ---- identity ("zero") experts (LongCat-Flash) -----------------------------------------------
# Where the identity slots live is read off the experts module's weights, not the version: up to
# transformers 5.24 the experts module holds them (gate_up over E + Z slots, down over the E real
# ones: onboard classifies `zero_experts` Z and its binding adds those slots in torch); from 5.25
# the experts module holds the E real experts only, and the MoE block around it adds r * x for
# the zero slots itself and hands them to the experts as real slots of weight 0 (masked_fill:
# no gradient through them).
def _zero_expert_router_bias(model, e: int, bias: float = 2e-3) -> None:
    """The tiny longcat_flash proxy routes among 8 real and 256 zero experts: with its zero
    score-correction bias no slot of a 16-token input picks a real expert, so the kernel would
    never run. A small bias on the real experts' selection (not on the weights) mixes both kinds
    of slot (14 of 32 slots real, 7 of 8 experts, at seed 0)."""
    for m in model.modules():
        b = getattr(m, "e_score_correction_bias", None)
        if isinstance(b, torch.Tensor):
            with torch.no_grad():
                b.zero_()
                b[:e] = bias


def _zero_slots_in_experts(module) -> bool:
    """Whether an experts module holds identity slots itself: 3-D weights over two expert counts
    (gate_up [E + Z, 2F, D], down [E, D, F]); else they are over the E real experts only."""
    return len({p.shape[0] for p in module.parameters(recurse=False) if p.ndim == 3}) == 2


@pytest.mark.slow  # 21-30 s in CI; test_zero_expert_slots_forward_and_gradients stays
def test_zero_experts_proxy_classified_patched_and_aligned(parse_model, tmp_path):
    """transformers' longcat_flash proxy, whose router scores E real and Z = 256 identity
    ("zero") experts (a zero slot adds the token times its routing weight). Where its experts
    module holds gate_up [E + Z, 2F, D] and down [E, D, F] (up to transformers 5.24): classified
    by those shapes and that op order as packed experts over the E real ones with `zero_experts`
    Z, patched with real slots through the kernel and zero slots in torch. Where it holds the E
    real experts only (5.25: the MoE block adds the zero slots): plain packed experts over E,
    patched as such. Either way matched to `moe_experts/swiglu` and aligned forward and backward
    against the fp64 eager model with both kinds of slot in the routing."""
    pytest.importorskip("transformers.models.longcat_flash")
    g, model, path, _ = _proxy_experts(parse_model, "hf:longcat_flash")
    experts = g.by_kind("moe.experts")
    assert experts and not g.by_kind("moe.shared_expert")
    # the proxy keeps top-k, so its real expert count follows it (2 x top-k at least)
    real = load_stage(load_model("hf:longcat_flash")).proxy_config.n_routed_experts
    routers = g.by_kind("moe.router")
    assert routers and {b.attrs["n_experts"] for b in routers} == {real + 256}
    inside = _zero_slots_in_experts(model.get_submodule(path))
    for b in experts:
        a = b.attrs
        assert (a["n_experts"], a.get("zero_experts"), a["gated"], a["activation"], a["weight_layout"],
                a["gate_up_split"]) == (real, 256 if inside else None, True, "silu", "out_in", "halves"), a
    cov = build_coverage(g)
    entries = [e for e in cov.entries if e.kind == "moe.experts"]
    assert entries and {(e.status in OURS, e.family, e.variant) for e in entries} == \
        {(True, "moe_experts", "swiglu")}
    binding = "256 identity (zero) experts added in torch" if inside else "x, topk_indices, topk_weights"
    _experts_align(g, cov, "hf:longcat_flash", tmp_path, binding,
                   lambda model: _zero_expert_router_bias(model, real))


def test_zero_experts_refuse_expert_parallelism_early(parse_model):
    """Expert parallelism dispatches to real experts only. Where the experts module holds
    identity (zero) slots (up to transformers 5.24) it fails before any block is replaced,
    naming them, when the module is needed (ep > 1, expert LoRA or a capacity); with ep=1, no
    expert LoRA and dropless routing the model keeps its own experts module, with a warning
    naming why. Where the MoE block adds the zero slots around experts that hold the real ones
    only (5.25), expert parallelism serves that module: with expert LoRA (B = 0) and dropless
    routing over both kinds of slot the model's logits are unchanged."""
    import copy

    from onboarding.errors import InputError
    from onboarding.train.moe_ep import EPExperts, EPGroup, ExpertLoRA, apply_expert_parallel

    pytest.importorskip("transformers.models.longcat_flash")
    g, model, path, before = _proxy_experts(parse_model, "hf:longcat_flash")
    if _zero_slots_in_experts(model.get_submodule(path)):
        for kw in ({"lora": ExpertLoRA(rank=4, alpha=8.0)}, {"capacity_factor": 1.0}):
            with pytest.raises(InputError, match=r"zero_experts=256 \(identity experts\)"):
                apply_expert_parallel(model, g, EPGroup(), **kw)
            assert type(model.get_submodule(path)) is before
        with pytest.warns(UserWarning, match=r"zero_experts=256.*keeps the model's own experts module"):
            assert apply_expert_parallel(model, g, EPGroup()) == []
        assert type(model.get_submodule(path)) is before
        return
    assert not any(b.attrs.get("zero_experts") for b in g.by_kind("moe.experts"))
    real = model.get_submodule(path).down_proj.shape[0]
    _zero_expert_router_bias(model, real)
    eager = copy.deepcopy(model)
    assert apply_expert_parallel(copy.deepcopy(model), g, EPGroup(), capacity_factor=1.0)
    mods = apply_expert_parallel(model, g, EPGroup(), lora=ExpertLoRA(rank=4, alpha=8.0))
    assert mods and isinstance(model.get_submodule(path), EPExperts)
    info = load_stage(load_model("hf:longcat_flash"))
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, 16, 0)
    with torch.no_grad():
        want, got = eager(*inputs, **kwargs).logits, model(*inputs, **kwargs).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _routing(n: int, real: int, total: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] slots: two real (< real) and one zero expert per token, distinct, in random order."""
    return torch.stack([torch.cat([torch.randperm(real, generator=gen)[:2],
                                   real + torch.randperm(total - real, generator=gen)[:1]])
                        [torch.randperm(k, generator=gen)] for _ in range(n)])


def test_zero_expert_slots_forward_and_gradients(parse_model, tmp_path):
    """Routing drawn at random over real and zero slots, through the patched experts: output and
    every gradient (x, topk_weights, gate_up, down) match the eager model's code; a zero slot's
    weight gradient is <dy, x>, never the kernel's output for the slot it is handed to. Where
    the experts module holds the zero slots (up to transformers 5.24) that is its own binding,
    called with the routing; where the MoE block adds them (5.25), the MoE block, its router
    giving that routing, around the experts' plain binding."""
    pytest.importorskip("transformers.models.longcat_flash")
    g = parse_model("hf:longcat_flash")
    cov = build_coverage(g)
    cands = [check_candidate(c, c.shapes) for c in render_candidates(cov, tmp_path) if c.family == "moe_experts"]
    assert cands and all(c.status == "passed" for c in cands), [c.error for c in cands]
    g, model, path, _ = _proxy_experts(parse_model, "hf:longcat_flash")
    module = model.get_submodule(path)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (module.gate_up_proj, module.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    n, d, k = 29, module.down_proj.shape[1], 3
    real = module.down_proj.shape[0]  # down is [E, D, F] over the real experts only
    inside = _zero_slots_in_experts(module)
    if inside:
        total, run_on = module.gate_up_proj.shape[0], module
    else:  # the MoE block around the experts, its router's slots over real and zero experts
        (router,) = [b for b in g.by_kind("moe.router") if b.path.startswith(path.rpartition(".")[0] + ".")]
        total, run_on = router.attrs["n_experts"], model.get_submodule(path.rpartition(".")[0])
    assert total - real == 256
    x = torch.randn(n, d, generator=gen)
    idx = _routing(n, real, total, k, gen)
    w = torch.rand(n, k, generator=gen)
    dy = torch.randn(n, d, generator=gen)
    if not inside:  # where the router's output holds the slots (integer) and their weights
        router_mod = model.get_submodule(router.path)
        with torch.no_grad():
            own = tuple(router_mod(x))
        ints = [i for i, t in enumerate(own) if not t.is_floating_point()]
        assert len(ints) == 1, [t.shape for t in own]
        wts = [i for i, t in enumerate(own) if t.is_floating_point() and t.shape == own[ints[0]].shape]
        assert len(wts) == 1, [t.shape for t in own]

    def run():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        model.zero_grad()
        if inside:
            y = module(xs, idx, ws)
        else:
            out = list(own)
            out[ints[0]], out[wts[0]] = idx, ws
            router_mod.forward = lambda *a, **kw: tuple(out)
            try:
                y = run_on(xs)
            finally:
                del router_mod.forward
        (y * dy).sum().backward()
        return y.detach(), xs.grad, ws.grad, module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()

    expected = run()
    with patch_model(model, g, kernels_for(cov, cands), kinds={"moe.experts"}) as patches:
        got = run()
        rec = next(r for r in patches.records if r.path == path)
        assert rec.status == "active", (rec.binding, rec.detail)
        assert ("identity (zero) experts" in rec.binding) is inside, rec.binding
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    zero = idx >= real
    assert torch.allclose(got[2][zero], (dy[:, None, :] * x[:, None, :]).sum(-1).expand(n, k)[zero], atol=1e-4)


def test_swap_forward_undo_puts_back_what_the_module_had():
    """`swap_forward`'s undo restores the module's own instance ``forward`` when it had one (a
    patch over another patch, recompute's wrapper) and the class's otherwise; twice is harmless."""
    from torch import nn

    from onboarding.patching.core import swap_forward

    m = nn.Identity()
    undo = swap_forward(m, lambda x: x + 1)
    assert m(torch.zeros(1)).item() == 1.0
    undo()
    undo()
    assert "forward" not in m.__dict__ and m(torch.zeros(1)).item() == 0.0
    m.forward = lambda x: x * 3  # an instance forward already there
    outer = swap_forward(m, lambda x: x - 5)
    assert m(torch.ones(1)).item() == -4.0
    outer()
    assert m(torch.ones(1)).item() == 3.0
