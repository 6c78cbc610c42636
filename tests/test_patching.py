"""Coverage, candidate generation and patching of models the code has never special-cased."""

from __future__ import annotations

import torch
import pytest

from onboarding.backend import kernel_device
from onboarding.generate import check_candidate, kernels_for, promote, render_candidates
from onboarding.loading import load_model
from onboarding.parse import example_inputs, load_stage
from onboarding.patching import patch_model
from onboarding.registry import build_coverage, reviewed_kernels


def _prepare(parse_model, ref, tmp_path):
    g = parse_model(ref)
    cov = build_coverage(g)
    cands = [check_candidate(c, c.shapes) for c in render_candidates(cov, tmp_path)]
    info = load_stage(load_model(ref, trust_remote_code=True))
    device = kernel_device()  # the GPU when there is one, else the interpreter on the CPU
    model = info.loaded.build(info.proxy_config, seed=0).eval().to(device)
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, g.seq, 1)
    return g, cov, cands, model, tuple(t.to(device) for t in inputs), kwargs


def test_coverage_statuses(parse_model):
    cov = build_coverage(parse_model("hf:qwen3_next"))
    by = {(e.kind, e.status) for e in cov.entries}
    assert ("norm.rms", "template") in by and ("conv.causal1d", "template") in by
    assert ("attention.gated", "torch_fast") in by and ("lm_head", "torch_fast") in by
    assert ("linear_attention.gated_delta", "template") in by
    assert ("moe.experts", "template") in by and ("moe.router", "template") in by
    norm = next(e for e in cov.entries if e.kind == "norm.rms")
    assert norm.params["unit_offset"] is True and norm.shapes[0][-1] == 128


@pytest.mark.parametrize("ref,kinds", [
    ("hf:qwen3_next", {"norm.rms", "norm.rms_gated", "conv.causal1d", "moe.shared_expert",
                       "moe.experts"}),
    # Kimi's output norm is gated by sigmoid: no family serves it, so it stays unpatched.
    ("hf:kimi_linear", {"norm.rms", "conv.causal1d", "moe.shared_expert", "mlp.dense",
                        "moe.experts"}),
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


def test_wrong_kernel_is_rejected_not_used(parse_model, tmp_path):
    g, cov, cands, model, inputs, kwargs = _prepare(parse_model, "hf:qwen3_moe", tmp_path)
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
