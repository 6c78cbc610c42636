"""RoPE family (half, interleaved; full and partial rotary): forward and every gradient."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, case_id

from onboarding.generate import aot
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck

CASES = [("half", {}), ("interleaved", {})]
# (B, T, H, Hk, D, R, cos has a batch dim, q given in transformers' [B, H, T, D] layout)
SHAPES = [
    (2, 63, 3, 1, 36, 36, False, False),
    (2, 17, 4, 2, 40, 20, True, True),
    (1, 5, 2, 2, 64, 48, False, False),
]
CPU_CONFIG = {"BLOCK_T": 16, "BLOCK_H": 8, "num_warps": 4}
CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in CASES]


def shape_id(s) -> str:
    B, T, H, Hk, D, R, cos3, hf = s
    return f"B{B}T{T}H{H}Hk{Hk}D{D}R{R}" + ("-cosBT" if cos3 else "") + ("-BHTD" if hf else "")


def fixture(module, shape, table_grad: bool = True) -> KernelFixture:
    B, T, H, Hk, D, R, cos3, hf = shape

    def make_inputs(dtype, device, gen):
        if hf:  # a [B, H, T, D] tensor seen as [B, T, H, D]: non-contiguous, unit last stride
            q = torch.randn(B, H, T, D, generator=gen).to(device, dtype).transpose(1, 2)
        else:
            q = torch.randn(B, T, H, D, generator=gen).to(device, dtype)
        k = torch.randn(B, T, Hk, D, generator=gen).to(device, dtype)
        table = (B, T, R) if cos3 else (T, R)
        theta = 10 * torch.rand(table, generator=gen)
        return [q, k, theta.cos().to(device), theta.sin().to(device)]

    return KernelFixture(
        name=f"rope/{module.VARIANT}", module=module, make_inputs=make_inputs,
        no_grad=() if table_grad else (2, 3),
    )


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_forward_backward(load_kernel, device, variant, params, dtype, shape):
    module = load_kernel("rope", variant, params, CPU_CONFIG)
    check_forward_backward(fixture(module, shape), dtype, device)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_forward_backward_constant_tables(load_kernel, device, variant, params):
    """cos/sin without grad (the usual case): only q/k gradients, nothing extra saved."""
    module = load_kernel("rope", variant, params, CPU_CONFIG)
    check_forward_backward(fixture(module, SHAPES[1], table_grad=False), torch.float32, device)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_opcheck_and_contract(load_kernel, device, variant, params):
    module = load_kernel("rope", variant, params, CPU_CONFIG)
    check_module_contract(module)
    check_opcheck(fixture(module, (1, 3, 2, 1, 16, 8, True, True), table_grad=False), torch.float32, device)


def test_half_matches_transformers_formula(load_kernel, device):
    """rotate_half with cos/sin built as transformers does (cat(freqs, freqs))."""
    module = load_kernel("rope", "half", {}, CPU_CONFIG)
    B, H, T, D = 1, 2, 9, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    q = torch.randn(B, H, T, D, device=device)
    k = torch.randn(B, H, T, D, device=device)

    def rotate_half(x):
        return torch.cat((-x[..., D // 2:], x[..., : D // 2]), dim=-1)

    q_ref = q * cos + rotate_half(q) * sin
    q_out, _ = module.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out.transpose(1, 2), q_ref, rtol=1e-5, atol=1e-5)


def test_shape_errors_name_shapes(load_kernel, device):
    module = load_kernel("rope", "half", {}, CPU_CONFIG)
    q = torch.randn(1, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match=r"cos \(4, 10\)"):
        module.rope(q, q, torch.randn(4, 10, device=device), torch.randn(4, 10, device=device))


def test_pinned_rotary_dim(load_kernel, device):
    module = load_kernel("rope", "half", {"head_dim": 8, "rotary_dim": 4}, CPU_CONFIG)
    q = torch.randn(1, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match="rotary_dim=4"):
        module.rope(q, q, torch.randn(4, 8, device=device), torch.randn(4, 8, device=device))


def test_aot_sm90(load_kernel):
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    paths = [load_kernel("rope", v, p).__file__ for v, p in CASES]
    for path, rs in aot.compile_files(paths, registers=False).items():
        assert len(rs) == 2, path  # forward and backward specialisations
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"
