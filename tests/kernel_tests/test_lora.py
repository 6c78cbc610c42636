"""LoRA family (fused frozen linear + low-rank adapter): forward, grads to x, A, B (none to W)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import case_id, zero_fill_shapes
from test_moe_experts import assert_bf16_mma, sm90_mma

from onboarding.generate import templating
from onboarding.families import family_module
lora = family_module("lora")
from onboarding.testing import (
    KernelFixture,
    check_aot_sm90,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
)
from onboarding.testing.tolerance import rel_rms as rel

CPU_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "dot_precision": "ieee"}
# (x shape, out, rank): rows not a multiple of the CPU tile, I/O not powers of two, r in {1, 5, 8, 16}
SHAPES = [((37, 24), 40, 8), ((2, 19, 40), 24, 5), ((1, 24), 16, 16), ((45, 70), 33, 1), ((3, 11, 36), 50, 16)]
BASES = ["torch", "triton"]
_MODULES: dict = {}


@pytest.fixture(scope="module")
def load(kernel_root):
    def load(params):
        key = tuple(sorted(params.items()))
        if key not in _MODULES:
            src = templating.render(lora.FAMILY, "linear", params)
            name = case_id("linear", params).replace("=", "_").replace("-", "_").replace(".", "p").lower()
            module = templating.load_module(templating.write_module(src, kernel_root / "lora" / f"{name}.py"))
            module.set_config(CPU_CONFIG)
            _MODULES[key] = module
        return _MODULES[key]

    return load


def fixture(module, shape, out, rank, scaling=2.0) -> KernelFixture:
    def make_inputs(dtype, device, gen):
        d = shape[-1]
        x = torch.randn(shape, generator=gen)
        w = torch.randn(out, d, generator=gen) / d ** 0.5
        a = torch.randn(rank, d, generator=gen) / d ** 0.5
        b = torch.randn(out, rank, generator=gen) / rank ** 0.5  # non-zero B: dA is not trivially 0
        return [x.to(device, dtype), w.to(device, dtype), a.to(device, dtype), b.to(device, dtype), scaling]

    # W is frozen: no_grad keeps it a plain tensor; A and B gradients are sums over rows.
    return KernelFixture(name="lora/linear", module=module, make_inputs=make_inputs, weights=(2, 3), no_grad=(1,))


@pytest.mark.parametrize("shape,out,rank", SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("base", BASES)
def test_forward_backward(load, device, base, shape, out, rank, dtype):
    check_forward_backward(fixture(load({"base": base}), shape, out, rank), dtype, device)


def test_base_param_picks_kernels(load):
    """base="torch" renders only the low-rank kernel (the base GEMMs are torch's);
    base="triton" only the fused Triton GEMM; a bad value is a clear user error."""
    from onboarding.errors import InputError

    assert load({})._lowrank_into and not hasattr(load({}), "lora_matmul_kernel")
    assert load({"base": "triton"})._mm and not hasattr(load({"base": "triton"}), "lora_lowrank_kernel")
    with pytest.raises(InputError, match="base"):
        templating.render(lora.FAMILY, "linear", {"base": "cublas"})


def test_lowrank_into_strided(load, device):
    """The low-rank kernel writes s (x u) v into y (y's old content, NaN here, ignored), takes
    transposed and sliced views, and returns x u in fp32."""
    module = load({})
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 45, generator=gen).to(device)[:, 5:]  # [70, 40], row stride 45
    a, b = torch.randn(6, 40, generator=gen).to(device), torch.randn(33, 6, generator=gen).to(device)
    y = torch.full((70, 33), float("nan"), device=device)
    xu = module._lowrank_into(x, a.t(), b.t(), y, -1.5, torch.float32)
    assert xu.dtype == torch.float32
    torch.testing.assert_close(xu, x @ a.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, -1.5 * (x @ a.t()) @ b.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", BASES)
def test_frozen_weight_gets_no_grad(load, device, base):
    module = load({"scaling": 0.5, "base": base})
    x = torch.randn(5, 24, device=device, requires_grad=True)
    w = torch.randn(16, 24, device=device, requires_grad=True)
    a = torch.randn(4, 24, device=device, requires_grad=True)
    b = torch.randn(16, 4, device=device, requires_grad=True)
    y = module.entry(x, w, a, b)  # default scaling from the render param
    torch.testing.assert_close(y, module.reference(x, w, a, b, 0.5))
    y.sum().backward()
    assert w.grad is None and x.grad is not None and a.grad is not None and b.grad is not None


@pytest.mark.parametrize("base", BASES)
def test_backward_fills_no_zeros_for_xa(load, device, base):
    """xa = x A^T, the op's second output, is saved for the backward and gets no gradient: the
    backward takes None for it (set_materialize_grads(False)), not an [N, r] fp32 tensor of zeros
    autograd fills first."""
    module = load({"base": base})
    gen = torch.Generator().manual_seed(4)
    x, w, a, b, s = fixture(module, (7, 24), 16, 5).make_inputs(torch.float32, device, gen)
    leaves = [t.requires_grad_() for t in (x, a, b)]
    y = module.entry(leaves[0], w, leaves[1], leaves[2], s)
    fills = zero_fill_shapes((y * torch.randn_like(y)).sum())
    assert [7, 5] not in fills, fills
    assert all(t.grad is not None for t in leaves)


@pytest.mark.parametrize("base", BASES)
def test_opcheck_and_contract(load, device, base):
    module = load({"base": base})
    check_module_contract(module)
    check_opcheck(fixture(module, (7, 24), 16, 4), torch.float32, device)


@pytest.mark.parametrize("base", BASES)
def test_shape_errors_name_shapes(load, device, base):
    module = load({"base": base})
    with pytest.raises(ValueError, match=r"lora_a \(4, 23\)"):
        module.entry(torch.randn(3, 24), torch.randn(16, 24), torch.randn(4, 23), torch.randn(16, 4))


@pytest.mark.slow  # sm_90 build, nightly: 21.3 s on CI's cold Triton cache (28th session)
def test_aot_sm90(load):
    check_aot_sm90([load({"base": base}).__file__ for base in BASES])


@pytest.mark.slow  # sm_90 build, nightly: 10.2 s on CI's cold Triton cache (28th session)
@pytest.mark.parametrize("base,kernel", [("torch", "lora_lowrank_kernel"), ("triton", "lora_matmul_kernel")])
def test_bf16_spec_compiles_to_bf16_mma(load, tmp_path, base, kernel):
    """The bf16 AOT specs take the 16-bit dot mode and compile to bf16 tensor-core instructions
    (the low-rank kernel's x A^T and its fp32 (x A^T) B^T operand; the fused GEMM's both forms)."""
    module = load({"base": base})
    assert {s["constexprs"]["DOT_PRECISION"] for s in module.aot_specs("bf16")} == {"bf16"}
    assert_bf16_mma(sm90_mma(module.__file__, [kernel], tmp_path), [kernel])


def test_dot_mode_keeps_fp32_operands_off_gpu(load):
    cpu = torch.device("cpu")
    module = load({})
    cfg = module.config_for(24)
    assert module._dot_mode(cfg["dot_precision"], torch.bfloat16, cpu) in ("ieee", "tf32")
    # off the GPU the low-rank kernel keeps the config's row tile (no SM count to fill) unless
    # its output tile would pass 32x128 fp32 values
    assert module._lowrank_launch({**cfg, "BLOCK_M": 128, "BLOCK_N": 32}, 8192, cpu, "ieee")["BLOCK_M"] == 128
    assert module._lowrank_launch({**cfg, "BLOCK_M": 128, "BLOCK_N": 128}, 8192, cpu, "ieee")["BLOCK_M"] == 32
    module = load({"base": "triton"})
    assert module._launch({**cfg, "BLOCK_K": 64}, "ieee")["BLOCK_K"] == 32
    assert module._launch({**cfg, "BLOCK_K": 64}, "bf16") == {**{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N")},
                                                              "BLOCK_K": 64, "DOT_PRECISION": "bf16"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 tensor-core path runs on a GPU only")
@pytest.mark.parametrize("base", BASES)
def test_bf16_tensor_core_accuracy_cuda(load, base):
    """bf16 inputs (16-bit dots, the module's GPU tiles) vs the fp32 reference on fp32 inputs at a
    real projection width: rel RMS <= 5e-3 (output), <= 1e-2 (dx, dA, dB)."""
    module = load({"base": base})
    gen = torch.Generator().manual_seed(0)
    n, i, o, r = 4096, 2048, 1024, 16
    ins = [torch.randn(n, i, generator=gen), torch.randn(o, i, generator=gen) / i ** 0.5,
           torch.randn(r, i, generator=gen) / i ** 0.5, torch.randn(o, r, generator=gen) / r]
    hi = [t.cuda().requires_grad_(j != 1) for j, t in enumerate(ins)]
    lo = [t.detach().to(torch.bfloat16).requires_grad_(j != 1) for j, t in enumerate(hi)]
    module.set_config(None)
    if base == "torch":  # one program per BLOCK_M rows: the launch fills every SM
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        bm = module._lowrank_launch(module.config_for(i), n, torch.device("cuda"), "bf16")["BLOCK_M"]
        assert bm == 16 or n // bm >= sms, bm
    try:
        y = module.entry(*lo, 2.0)
        dy = torch.randn(y.shape, device="cuda")
        y.backward(dy.to(y.dtype))
    finally:
        module.set_config(CPU_CONFIG)
    ref = module.reference(*hi, 2.0)
    ref.backward(dy)
    assert rel(y, ref) <= 5e-3
    for j in (0, 2, 3):
        assert rel(lo[j].grad, hi[j].grad) <= 1e-2, (j, rel(lo[j].grad, hi[j].grad))
