"""LoRA family (fused frozen linear + low-rank adapter): forward, grads to x, A, B (none to W)."""

from __future__ import annotations

import pytest
import torch
from conftest import case_id

from onboarding import aot, templating
from onboarding.families import lora
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck

CPU_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "dot_precision": "ieee"}
SHAPES = [((37, 24), 40, 8), ((2, 19, 40), 24, 5), ((1, 24), 16, 16)]  # (x shape, out, rank)
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
def test_forward_backward(load, device, shape, out, rank, dtype):
    check_forward_backward(fixture(load({}), shape, out, rank), dtype, device)


def test_frozen_weight_gets_no_grad(load, device):
    module = load({"scaling": 0.5})
    x = torch.randn(5, 24, device=device, requires_grad=True)
    w = torch.randn(16, 24, device=device, requires_grad=True)
    a = torch.randn(4, 24, device=device, requires_grad=True)
    b = torch.randn(16, 4, device=device, requires_grad=True)
    y = module.entry(x, w, a, b)  # default scaling from the render param
    torch.testing.assert_close(y, module.reference(x, w, a, b, 0.5))
    y.sum().backward()
    assert w.grad is None and x.grad is not None and a.grad is not None and b.grad is not None


def test_opcheck_and_contract(load, device):
    module = load({})
    check_module_contract(module)
    check_opcheck(fixture(module, (7, 24), 16, 4), torch.float32, device)


def test_shape_errors_name_shapes(load, device):
    module = load({})
    with pytest.raises(ValueError, match=r"lora_a \(4, 23\)"):
        module.entry(torch.randn(3, 24), torch.randn(16, 24), torch.randn(4, 23), torch.randn(16, 4))


def test_aot_sm90(load):
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    for path, rs in aot.compile_files([load({}).__file__], registers=False).items():
        assert rs, path
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"
            assert r.shared_bytes is not None and r.shared_bytes <= aot.H100_SHARED_BYTES
