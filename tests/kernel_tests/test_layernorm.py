"""LayerNorm family (weight, with and without bias): forward and every gradient vs reference, vs
torch.nn.functional.layer_norm and vs Cohere 2's LayerNorm formula, matching and patching."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_cases import DTYPES, case_id, check_match, check_sample_inputs_fit
from torch.nn import functional as F

from onboarding.families import family_module
family = family_module("layernorm")
from onboarding.graph.opgraph import Block
from onboarding.patching.core import patch_model
from onboarding.testing import (
    KernelFixture,
    check_aot_sm90,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
)

CASES = [("plain", {}), ("plain", {"has_bias": True})]
SHAPES = [(37, 100), (3, 7, 33), (1, 1)]
CPU_CONFIG = {"BLOCK_N": 16, "num_warps": 4}
CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in CASES]
EPS = 1e-5


def _draw(shape: tuple[int, ...], has_bias: bool, gen: torch.Generator) -> list[torch.Tensor]:
    """x off-centre (so the mean subtraction matters), weight near 1, bias near 0; never constant."""
    x = torch.randn(shape, generator=gen) + 0.75
    args = [x, 0.5 * torch.randn(shape[-1], generator=gen) + 1.0]
    if has_bias:
        args.append(0.5 * torch.randn(shape[-1], generator=gen))
    return args


def fixture(module, params: dict, shape: tuple[int, ...]) -> KernelFixture:
    has_bias = params.get("has_bias", False)

    def make_inputs(dtype, device, gen):
        return [*(a.to(device, dtype) for a in _draw(shape, has_bias, gen)), EPS]

    return KernelFixture(name=f"layernorm/{case_id('plain', params)}", module=module,
                         make_inputs=make_inputs, weights=(1, 2) if has_bias else (1,))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_forward_backward(load_kernel, device, variant, params, dtype, shape):
    module = load_kernel("layernorm", variant, params, CPU_CONFIG)
    check_forward_backward(fixture(module, params, shape), dtype, device)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_opcheck_and_contract(load_kernel, device, variant, params):
    module = load_kernel("layernorm", variant, params, CPU_CONFIG)
    check_module_contract(module)
    check_opcheck(fixture(module, params, (7, 33)), torch.float32, device)


def test_shape_errors_name_shapes(load_kernel, device):
    module = load_kernel("layernorm", "plain", {"has_bias": True}, CPU_CONFIG)
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"weight \(7,\).*\(4, 8\)"):
        module.layernorm(x, torch.randn(7, device=device), torch.randn(8, device=device))
    with pytest.raises(ValueError, match=r"bias \(9,\).*\(4, 8\)"):
        module.layernorm(x, torch.randn(8, device=device), torch.randn(9, device=device))


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_grid_stride_backward(load_kernel, device, variant, params):
    """More row blocks than programs: the backward's grid-stride loop and partial dW / dB sums."""
    module = load_kernel("layernorm", variant, params, CPU_CONFIG)
    old = module._num_programs
    module._num_programs = lambda n, dev, per_sm=4: max(1, min(n, 2))
    try:
        check_forward_backward(fixture(module, params, (71, 40)), torch.float32, device)
    finally:
        module._num_programs = old


def test_aot_sm90(load_kernel):
    check_aot_sm90([load_kernel("layernorm", v, p).__file__ for v, p in CASES])


# ---- against torch's own LayerNorm and the module it serves -----------------------------------
# Written out here, not taken from the rendered module's `reference` (rendered from the same
# template flags as the kernel), so a wrong flag in the template shows up.


def _cohere(x, weight, eps):
    """Cohere2MoeLayerNorm.forward (transformers 5.24), with its casts."""
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + eps)
    return (weight.to(torch.float32) * h).to(x.dtype)


def _torch_layer_norm(x, weight, bias=None, eps=EPS):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("against", ["layer_norm", "layer_norm_bias", "cohere"])
def test_matches_module_formulas(load_kernel, device, against, shape):
    has_bias = against == "layer_norm_bias"
    module = load_kernel("layernorm", "plain", {"has_bias": has_bias}, CPU_CONFIG)
    formula = _cohere if against == "cohere" else _torch_layer_norm
    gen = torch.Generator().manual_seed(sum(shape) + len(against))
    args = _draw(shape, has_bias, gen)
    ours = [a.to(device).requires_grad_() for a in args]
    theirs = [a.to(device).requires_grad_() for a in args]
    dy = torch.randn(shape, generator=gen).to(device)
    y, y_ref = module.entry(*ours, EPS), formula(*theirs, eps=EPS)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(y, ours, dy)
    ref_grads = torch.autograd.grad(y_ref, theirs, dy)
    for name, g, r in zip(("x", "weight", "bias"), grads, ref_grads, strict=False):
        # the weight and bias gradients are sums over up to 37 rows: a reduction's tolerance
        tol = 1e-5 if name == "x" else 1e-4
        torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=lambda m, n=name: f"grad {n}: {m}")


def _block(**attrs) -> Block:
    return Block(path="norm", kind="norm.layer", layer=0, class_name="AnyNorm", params={"weight": [32]},
                 attrs={"dim": 32, "eps": 1e-6, "unit_offset": False, **attrs})


MATCHES = [
    # (block, (variant, expected params over the defaults)) or None: the family refuses it
    (_block(has_weight=True, has_bias=False), ("plain", {"eps": 1e-6})),
    (_block(has_weight=True, has_bias=True), ("plain", {"eps": 1e-6, "has_bias": True})),
    (_block(has_weight=True, has_bias=False, eps=None), ("plain", {})),
    (_block(has_weight=False, has_bias=False), None),
    (Block(path="norm", kind="norm.layer", layer=0, class_name="AnyNorm", attrs={}), None),
    (_block(has_weight=True, unit_offset=True), None),
    # a per-head weight [H, D] (Cohere's QK norm): the kernel takes a weight [D]
    (Block(path="norm", kind="norm.layer", layer=0, class_name="AnyNorm", params={"weight": [4, 32]},
           attrs={"dim": 32, "eps": 1e-6, "unit_offset": False, "has_weight": True}), None),
    # a fused F.layer_norm stays torch's (registry: torch_fast)
    (Block(path="norm", kind="norm.layer", layer=0, class_name="LayerNorm", attrs={},
           op_histogram={"native_layer_norm": 1}), None),
    (Block(path="norm", kind="norm.layer", layer=0, class_name="LayerNorm", attrs={},
           op_histogram={"layer_norm": 1}), None),
    (Block(path="norm", kind="norm.rms", layer=0, class_name="AnyNorm",
           attrs={"dim": 32, "eps": 1e-6, "has_weight": True}), None),
]


@pytest.mark.parametrize("block,expected", MATCHES, ids=[f"{b.kind}-{i}" for i, (b, _) in enumerate(MATCHES)])
def test_match(block, expected):
    check_match(family, block, expected)


class _CohereNorm(torch.nn.Module):
    """Cohere2MoeLayerNorm's structure: one weight [D], no bias."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(0.5 * torch.randn(d) + 1.0)

    def forward(self, hidden_states):
        return _cohere(hidden_states, self.weight, EPS)


class _BiasNorm(torch.nn.Module):
    """A written-out LayerNorm with a bias, its bias registered first (calibration orders them)."""

    def __init__(self, d: int, init_ones_zeros: bool = False):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(d) if init_ones_zeros else 0.5 * torch.randn(d))
        self.weight = torch.nn.Parameter(torch.ones(d) if init_ones_zeros else 0.5 * torch.randn(d) + 1.0)

    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return (h * self.weight + self.bias).to(hidden_states.dtype)


@pytest.mark.parametrize("norm,params,status", [
    (_CohereNorm, {}, "active"),
    (_BiasNorm, {"has_bias": True}, "active"),
    (lambda d: _BiasNorm(d, init_ones_zeros=True), {"has_bias": True}, "active"),
    (_BiasNorm, {}, "rejected"),
    (_CohereNorm, {"has_bias": True}, "rejected"),
], ids=["cohere", "bias", "bias_at_init", "biasless_kernel_on_biased_module", "bias_kernel_on_biasless_module"])
def test_patched_module_end_to_end(load_kernel, device, norm, params, status):
    """Through `patch_model`: the binding is found, and output and gradients equal the module's."""
    d = 33
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.norm = norm(d)
    model.to(device)
    kmod = load_kernel("layernorm", "plain", params, CPU_CONFIG)
    block = Block(path="norm", kind="norm.layer", layer=0, class_name="AnyNorm",
                  attrs={"dim": d, "eps": EPS, "has_weight": True, "has_bias": bool(params)})
    x = (torch.randn(5, 7, d, generator=torch.Generator().manual_seed(3)) + 0.75).to(device)
    xr = x.clone().requires_grad_()
    expected = model.norm(xr)
    ref_grads = torch.autograd.grad(expected, [xr, *model.parameters()], torch.ones_like(expected))
    with patch_model(model, SimpleNamespace(blocks=[block]), {("norm", "layernorm"): kmod}) as patches:
        model.norm(x)  # calibration
        (rec,) = patches.records
        assert rec.status == status, rec
        if status != "active":
            return
        assert rec.binding.endswith("bias=bias") if params else rec.binding == "x, weight=weight"
        xk = x.clone().requires_grad_()
        out = model.norm(xk)
        grads = torch.autograd.grad(out, [xk, *model.parameters()], torch.ones_like(out))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_sample_inputs_fit_the_entry(load_kernel, variant, params):
    check_sample_inputs_fit(load_kernel("layernorm", variant, params, CPU_CONFIG), family, variant, params, [2, 5, 33])


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_timing_inputs_fit_the_entry(load_kernel, variant, params):
    """`onboard tune` times `entry(*timing_inputs(...))` at the block's real N x D."""
    from onboarding.tune.worker import timing_inputs

    module = load_kernel("layernorm", variant, params, CPU_CONFIG)
    resolved = family.FAMILY.resolve(variant, params)
    args = timing_inputs("layernorm", variant, resolved, {"N": 9, "D": 40}, torch.float32, "cpu",
                         torch.Generator().manual_seed(0))
    assert len(args) == (4 if params else 3) and args[0].shape == (9, 40)
    torch.testing.assert_close(module.entry(*args), module.reference(*args), rtol=1e-5, atol=1e-5)
