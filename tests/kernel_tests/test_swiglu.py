"""SwiGLU family (split, fused halves/interleaved, clamped pre/post activation): fwd + grads."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, case_id

from onboarding.generate import aot
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck

GPT_OSS = {"layout": "interleaved", "limit": 2.0, "clamp_style": "pre_act", "alpha": 1.702, "up_offset": 1.0}
CASES = [
    ("split", {}),
    ("fused", {}),
    ("fused", GPT_OSS),
    ("split", {"limit": 0.5, "clamp_style": "post_act"}),
    ("split", {"limit": 1.5, "alpha": 1.702}),
]
SHAPES = [(63, 100), (2, 3, 64), (1, 1)]
CPU_CONFIG = {"BLOCK_N": 16, "BLOCK_F": 128, "num_warps": 4}
CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in CASES]
# `weighted` (MoE experts: the fused activation times a per-row routing weight, dw reduced in the
# backward kernel); its CPU tiles make F = 100 two column steps, one partial
WEIGHTED_CASES = [("weighted", {}), ("weighted", GPT_OSS),
                  ("weighted", {"limit": 0.5, "clamp_style": "post_act"})]
WEIGHTED_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in WEIGHTED_CASES]
WEIGHTED_CPU_CONFIG = {"BLOCK_N": 16, "BLOCK_F": 64, "num_warps": 4}


def fixture(module, variant: str, shape: tuple[int, ...]) -> KernelFixture:
    def make_inputs(dtype, device, gen):
        # scale 3 so clamped cases have elements on both sides of the limits
        if variant == "fused":
            return [(3 * torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)).to(device, dtype)]
        if variant == "weighted":
            return [(3 * torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)).to(device, dtype),
                    torch.rand(shape[:-1], generator=gen).to(device, dtype)]
        return [(3 * torch.randn(shape, generator=gen)).to(device, dtype) for _ in range(2)]

    # the weight's gradient is a sum over the row: the reduction tolerance
    return KernelFixture(name=f"swiglu/{variant}", module=module, make_inputs=make_inputs,
                         weights=(1,) if variant == "weighted" else ())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_forward_backward(load_kernel, device, variant, params, dtype, shape):
    module = load_kernel("swiglu", variant, params, CPU_CONFIG)
    check_forward_backward(fixture(module, variant, shape), dtype, device)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_opcheck_and_contract(load_kernel, device, variant, params):
    module = load_kernel("swiglu", variant, params, CPU_CONFIG)
    check_module_contract(module)
    check_opcheck(fixture(module, variant, (5, 24)), torch.float32, device)


@pytest.mark.parametrize("shape", [(37, 100), (2, 3, 64)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,params", WEIGHTED_PARAMS)
def test_weighted_forward_backward(load_kernel, device, variant, params, dtype, shape):
    module = load_kernel("swiglu", variant, params, WEIGHTED_CPU_CONFIG)
    check_forward_backward(fixture(module, variant, shape), dtype, device)


@pytest.mark.parametrize("variant,params", WEIGHTED_PARAMS)
def test_weighted_opcheck_and_contract(load_kernel, device, variant, params):
    module = load_kernel("swiglu", variant, params, WEIGHTED_CPU_CONFIG)
    check_module_contract(module)
    check_opcheck(fixture(module, variant, (5, 24)), torch.float32, device)


def test_weighted_is_fused_times_w_and_keeps_w_dtype(load_kernel, device):
    """`weighted` = `fused` x w per row (fp32 here: one rounding each); no rows gives empty
    results; dw comes back in w's dtype; a w that is not one per row is refused."""
    weighted = load_kernel("swiglu", "weighted", {}, WEIGHTED_CPU_CONFIG)
    fused = load_kernel("swiglu", "fused", {}, CPU_CONFIG)
    gate_up, w = 3 * torch.randn(9, 2 * 70, device=device), torch.rand(9, device=device)
    torch.testing.assert_close(weighted.swiglu_weighted(gate_up, w),
                               fused.swiglu_fused(gate_up) * w[:, None], rtol=1e-6, atol=1e-6)
    empty = torch.zeros(0, 2 * 70, device=device, requires_grad=True)
    w0 = torch.zeros(0, device=device, dtype=torch.float64, requires_grad=True)
    y = weighted.swiglu_weighted(empty, w0)
    assert y.shape == (0, 70)
    dh, dw = torch.autograd.grad(y, [empty, w0], torch.zeros(0, 70, device=device))
    assert dh.shape == (0, 140) and dw.shape == (0,) and dw.dtype == torch.float64
    with pytest.raises(ValueError, match=r"\(8,\)"):
        weighted.swiglu_weighted(gate_up, w[:8])


def test_gpt_oss_formula(load_kernel, device):
    """The fused interleaved variant reproduces transformers' gpt-oss `_apply_gate` literally."""
    module = load_kernel("swiglu", "fused", GPT_OSS, CPU_CONFIG)
    gate_up = 3 * torch.randn(4, 2 * 40, device=device)
    gate, up = gate_up[..., ::2].clamp(max=2.0), gate_up[..., 1::2].clamp(min=-2.0, max=2.0)
    expected = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    torch.testing.assert_close(module.swiglu_fused(gate_up), expected, rtol=1e-5, atol=1e-5)


def test_shape_errors_name_shapes(load_kernel, device):
    module = load_kernel("swiglu", "split", {}, CPU_CONFIG)
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(4, 9\)"):
        module.swiglu(torch.randn(4, 8, device=device), torch.randn(4, 9, device=device))


@pytest.mark.slow  # sm_90 build, nightly: 14.3 s on CI's cold Triton cache (28th session)
def test_aot_sm90(load_kernel):
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    paths = [load_kernel("swiglu", v, p).__file__ for v, p in CASES + WEIGHTED_CASES]
    for path, rs in aot.compile_files(paths, registers=False).items():
        assert rs, path
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"
