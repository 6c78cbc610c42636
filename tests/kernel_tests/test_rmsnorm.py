"""RMSNorm family (plain, unit-offset, weightless, silu/sigmoid gated, l2norm): forward and every
gradient vs reference, vs hand-written formulas of the modules they serve, matching and patching."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_cases import DTYPES, case_id, check_match, check_sample_inputs_fit

from onboarding.families import family_module
family = family_module("rmsnorm")
from onboarding.graph.opgraph import Block
from onboarding.patching.core import patch_model
from onboarding.testing import (
    KernelFixture,
    check_aot_sm90,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
)

CASES = [
    ("plain", {}),
    ("plain", {"unit_offset": True}),
    ("gated", {}),
    ("gated", {"unit_offset": True}),
    ("gated", {"activation": "sigmoid"}),
    ("gated", {"activation": "sigmoid", "unit_offset": True}),
    ("plain", {"has_weight": False}),
    ("l2norm", {}),
]
SHAPES = [(63, 100), (2, 5, 128), (1, 1)]
CPU_CONFIG = {"BLOCK_N": 16, "num_warps": 4}
CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in CASES]


def fixture(module, variant: str, params: dict, shape: tuple[int, ...]) -> KernelFixture:
    def make_inputs(dtype, device, gen):
        x = torch.randn(shape, generator=gen).to(device, dtype)
        args = [x]
        if variant == "gated":
            args.append(torch.randn(shape, generator=gen).to(device, dtype))
        if variant != "l2norm" and params.get("has_weight", True):
            # unit-offset weights sit near 0, plain ones near 1; never all ones or zeros
            w = 0.5 * torch.randn(shape[-1], generator=gen) + (0.0 if params.get("unit_offset") else 1.0)
            args.append(w.to(device, dtype))
        return [*args, 1e-5]

    weights = {"plain": (1,) if params.get("has_weight", True) else (), "gated": (2,), "l2norm": ()}[variant]
    return KernelFixture(name=f"rmsnorm/{variant}", module=module, make_inputs=make_inputs, weights=weights)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_forward_backward(load_kernel, device, variant, params, dtype, shape):
    module = load_kernel("rmsnorm", variant, params, CPU_CONFIG)
    check_forward_backward(fixture(module, variant, params, shape), dtype, device)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_opcheck_and_contract(load_kernel, device, variant, params):
    module = load_kernel("rmsnorm", variant, params, CPU_CONFIG)
    check_module_contract(module)
    check_opcheck(fixture(module, variant, params, (7, 33)), torch.float32, device)


def test_shape_errors_name_shapes(load_kernel, device):
    module = load_kernel("rmsnorm", "plain", {}, CPU_CONFIG)
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"weight \(7,\).*\(4, 8\)"):
        module.rmsnorm(x, torch.randn(7, device=device))


def test_grid_stride_backward(load_kernel, device):
    """More row blocks than programs: the backward's grid-stride loop and partial dW sums."""
    module = load_kernel("rmsnorm", "gated", {}, CPU_CONFIG)
    old = module._num_programs
    module._num_programs = lambda n, dev, per_sm=4: max(1, min(n, 2))
    try:
        check_forward_backward(fixture(module, "gated", {}, (70, 40)), torch.float32, device)
    finally:
        module._num_programs = old


def test_aot_sm90(load_kernel):
    check_aot_sm90([load_kernel("rmsnorm", v, p).__file__ for v, p in CASES])


# ---- the sigmoid gate and the weightless norm against the modules they serve ------------------
# Written out here, not taken from the rendered module's `reference` (rendered from the same
# template flags as the kernel), so a wrong flag in the template shows up.


def _bailing_gated(x, gate, weight, eps):
    """BailingHybridRMSNormGated: rmsnorm(x) * weight * sigmoid(gate), in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)


def _gemma4_unscaled(x, eps):
    """Gemma4RMSNorm(with_scale=False): x * (mean(x^2) + eps) ** -0.5, in fp32."""
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


@pytest.mark.parametrize("shape", [(63, 100), (3, 7, 33), (1, 1)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("which", ["sigmoid_gated", "weightless"])
def test_new_paths_match_module_formulas(load_kernel, device, which, shape):
    gen = torch.Generator().manual_seed(sum(shape) + len(which))
    eps = 1e-5
    x = torch.randn(shape, generator=gen)
    if which == "sigmoid_gated":
        module = load_kernel("rmsnorm", "gated", {"activation": "sigmoid"}, CPU_CONFIG)
        args = [x, 2.0 * torch.randn(shape, generator=gen), 0.5 * torch.randn(shape[-1], generator=gen) + 1.0]
        formula = _bailing_gated
    else:
        module = load_kernel("rmsnorm", "plain", {"has_weight": False}, CPU_CONFIG)
        args = [x]
        formula = _gemma4_unscaled
    ours = [a.to(device).requires_grad_() for a in args]
    theirs = [a.to(device).requires_grad_() for a in args]
    dy = torch.randn(shape, generator=gen).to(device)
    y, y_ref = module.entry(*ours, eps), formula(*theirs, eps)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(y, ours, dy)
    ref_grads = torch.autograd.grad(y_ref, theirs, dy)
    names = ("x", "gate", "weight") if which == "sigmoid_gated" else ("x",)
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        # the weight gradient is a sum over up to 63 rows: a reduction's tolerance
        tol = 1e-4 if name == "weight" else 1e-5
        torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=lambda m, n=name: f"grad {n}: {m}")


def test_grid_stride_backward_sigmoid(load_kernel, device):
    """The sigmoid gate's backward through the grid-stride loop and partial dW sums."""
    params = {"activation": "sigmoid"}
    module = load_kernel("rmsnorm", "gated", params, CPU_CONFIG)
    old = module._num_programs
    module._num_programs = lambda n, dev, per_sm=4: max(1, min(n, 2))
    try:
        check_forward_backward(fixture(module, "gated", params, (71, 40)), torch.float32, device)
    finally:
        module._num_programs = old


def _block(kind: str, **attrs) -> Block:
    return Block(path="norm", kind=kind, layer=0, class_name="AnyNorm", attrs={"dim": 32, "eps": 1e-6, **attrs})


MATCHES = [
    # (block, expected variant, expected non-default params) or None: the family refuses it
    (_block("norm.rms_gated", has_weight=True, activation="sigmoid", gate_activation="sigmoid"),
     ("gated", {"activation": "sigmoid"})),
    (_block("norm.rms_gated", has_weight=True, gate_activation="sigmoid", unit_offset=True),
     ("gated", {"activation": "sigmoid", "unit_offset": True})),
    (_block("norm.rms_gated", has_weight=True, activation="silu"), ("gated", {})),
    (_block("norm.rms_gated", has_weight=True), ("gated", {})),
    (_block("norm.rms_gated", has_weight=True, activation="gelu"), None),
    (_block("norm.rms_gated", has_weight=True, activation="sigmoid", gate_activation="silu"), None),
    (_block("norm.rms_gated", has_weight=True, activation="sigmoid", norm_before_gate=False), None),
    (_block("norm.rms_gated", has_weight=False, activation="sigmoid"), None),
    (_block("norm.rms", has_weight=False, unit_offset=False), ("plain", {"has_weight": False})),
    (_block("norm.rms", has_weight=False, reduction="mean"), ("plain", {"has_weight": False})),
    (_block("norm.rms", has_weight=False, reduction="sum"), ("l2norm", {})),
    (_block("norm.rms", has_weight=False, reduction="max"), None),
    (_block("norm.rms", has_weight=True), ("plain", {})),
    (_block("norm.rms", has_weight=True, reduction="sum"), None),
]


@pytest.mark.parametrize("block,expected", MATCHES, ids=[f"{b.kind}-{i}" for i, (b, _) in enumerate(MATCHES)])
def test_match(block, expected):
    check_match(family, block, expected)


class _GatedNorm(torch.nn.Module):
    """BailingHybridRMSNormGated's structure: forward(hidden_states, gate=None)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(0.5 * torch.randn(d) + 1.0)

    def forward(self, hidden_states, gate=None):
        return _bailing_gated(hidden_states, gate, self.weight, 1e-6)


class _UnscaledNorm(torch.nn.Module):
    """Gemma4RMSNorm(with_scale=False): no parameters at all."""

    def forward(self, hidden_states):
        return _gemma4_unscaled(hidden_states, 1e-6)


class _OnesNorm(torch.nn.Module):
    """A scaled norm whose weight still holds its ones init: the weightless kernel agrees with it
    today but would not after one training step, so it must not be bound."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, hidden_states):
        return _gemma4_unscaled(hidden_states, 1e-6) * self.weight


@pytest.mark.parametrize("kind,norm,params,status", [
    ("norm.rms_gated", _GatedNorm, {"activation": "sigmoid"}, "active"),
    ("norm.rms", _UnscaledNorm, {"has_weight": False}, "active"),
    ("norm.rms", _OnesNorm, {"has_weight": False}, "rejected"),
], ids=["sigmoid_gated", "weightless", "weightless_kernel_on_weighted_module"])
def test_patched_module_end_to_end(load_kernel, device, kind, norm, params, status):
    """Through `patch_model`: the binding is found, and output and gradients equal the module's."""
    d = 33
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.norm = norm(d) if norm is not _UnscaledNorm else norm()
    model.to(device)
    variant = "gated" if kind == "norm.rms_gated" else "plain"
    kmod = load_kernel("rmsnorm", variant, params, CPU_CONFIG)
    block = Block(path="norm", kind=kind, layer=0, class_name=norm.__name__, attrs={"dim": d, "eps": 1e-6})
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, d, generator=gen).to(device)
    z = torch.randn(5, 7, d, generator=gen).to(device)
    call = (lambda m, a, b: m.norm(a, gate=b)) if kind == "norm.rms_gated" else (lambda m, a, b: m.norm(a))
    xr, zr = x.clone().requires_grad_(), z.clone().requires_grad_()
    expected = call(model, xr, zr)
    ref_grads = torch.autograd.grad(expected, [xr, zr, *model.parameters()], torch.ones_like(expected),
                                    allow_unused=True)
    with patch_model(model, SimpleNamespace(blocks=[block]), {("norm", "rmsnorm"): kmod}) as patches:
        call(model, x, z)  # calibration
        (rec,) = patches.records
        assert rec.status == status, rec
        if status != "active":
            return
        xk, zk = x.clone().requires_grad_(), z.clone().requires_grad_()
        out = call(model, xk, zk)
        grads = torch.autograd.grad(out, [xk, zk, *model.parameters()], torch.ones_like(out), allow_unused=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_sample_inputs_fit_the_entry(load_kernel, variant, params):
    check_sample_inputs_fit(load_kernel("rmsnorm", variant, params, CPU_CONFIG), family, variant, params, [2, 5, 33])
