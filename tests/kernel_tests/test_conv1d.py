"""Causal depthwise conv1d family (W 2-4, bias or not, SiLU or not): fwd + x/weight/bias grads."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, case_id

from onboarding.generate import aot
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck

CASES = [
    ("causal", {"kernel_size": 4, "activation": "silu"}),
    ("causal", {"kernel_size": 3}),
    ("causal", {"kernel_size": 2, "activation": "silu"}),
]
# (B, T, C, bias)
SHAPES = [(2, 63, 100, True), (1, 5, 7, False), (3, 2, 33, True)]
CPU_CONFIG = {"BLOCK_T": 32, "BLOCK_C": 128, "num_warps": 4}
CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in CASES]


def shape_id(s) -> str:
    B, T, C, bias = s
    return f"B{B}T{T}C{C}" + ("-bias" if bias else "-nobias")


def fixture(module, shape) -> KernelFixture:
    B, T, C, bias = shape
    W = module.KERNEL_SIZE

    def make_inputs(dtype, device, gen):
        x = torch.randn(B, T, C, generator=gen).to(device, dtype)
        w = (0.5 * torch.randn(C, W, generator=gen)).to(device, dtype)
        b = torch.randn(C, generator=gen).to(device, dtype) if bias else None
        return [x, w, b]

    return KernelFixture(name=f"conv1d/W{W}", module=module, make_inputs=make_inputs, weights=(1, 2))


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_forward_backward(load_kernel, device, variant, params, dtype, shape):
    module = load_kernel("conv1d", variant, params, CPU_CONFIG)
    check_forward_backward(fixture(module, shape), dtype, device)


def test_grid_stride_backward(load_kernel, device):
    """Fewer time programs than time blocks: the grid-stride loop and partial dW/db sums."""
    module = load_kernel("conv1d", *CASES[0], CPU_CONFIG)
    old = module._num_programs
    module._num_programs = lambda n, dev, per_sm=4: 1
    try:
        check_forward_backward(fixture(module, (2, 70, 20, True)), torch.float32, device)
    finally:
        module._num_programs = old


@pytest.mark.parametrize("variant,params", [CASES[1], CASES[0]], ids=["plain", "silu"])
def test_backward_own_time_tile(load_kernel, device, variant, params):
    """The backward's time tile (BWD_BLOCK_T) apart from the forward's, over a partial last block
    and two programs per time stride; with SiLU the da pass keeps the forward's tile."""
    module = load_kernel("conv1d", variant, params, {**CPU_CONFIG, "BWD_BLOCK_T": 8, "BWD_PER_SM": 2})
    check_forward_backward(fixture(module, (2, 45, 20, True)), torch.float32, device)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_opcheck_and_contract(load_kernel, device, variant, params):
    module = load_kernel("conv1d", variant, params, CPU_CONFIG)
    check_module_contract(module)
    for shape in [(1, 6, 9, True), (1, 6, 9, False)]:
        check_opcheck(fixture(module, shape), torch.float32, device)


def test_accepts_conv1d_weight_layout(load_kernel, device):
    """nn.Conv1d's [C, 1, W] weight works and matches nn.Conv1d itself."""
    module = load_kernel("conv1d", *CASES[1], CPU_CONFIG)
    conv = torch.nn.Conv1d(12, 12, 3, groups=12, padding=2).to(device)
    x = torch.randn(2, 10, 12, device=device)
    expected = conv(x.transpose(1, 2))[..., :10].transpose(1, 2)
    with torch.no_grad():
        actual = module.causal_conv1d(x, conv.weight, conv.bias)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_shape_errors_name_shapes(load_kernel, device):
    module = load_kernel("conv1d", *CASES[0], CPU_CONFIG)
    with pytest.raises(ValueError, match=r"weight \(8, 3\)"):
        module.causal_conv1d(torch.randn(1, 4, 8, device=device), torch.randn(8, 3, device=device))


@pytest.mark.slow  # sm_90 build, nightly: 21.7 s on CI's cold Triton cache (28th session)
def test_aot_sm90(load_kernel):
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    paths = [load_kernel("conv1d", v, p).__file__ for v, p in CASES]
    for path, rs in aot.compile_files(paths, registers=False).items():
        assert rs, path
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"


def _assert_same_grads(y, y_ref, x, x2, mine, ref) -> None:
    """One random cotangent through the patched and the reference mixer: dx and every parameter's
    gradient agree."""
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for n, p in mine.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad, rtol=1e-4, atol=1e-5)


def test_binding_is_a_drop_in_and_hands_back_time_major(load_kernel, device):
    """The binding serves a mixer's ``conv1d(x [B, C, T], padding=K-1)[..., :T]`` (Qwen3-Next's
    use): the same output and gradients as the module's own conv, and the [B, C, T + K - 1]
    result is a view of a time-major tensor, so the usual slice and transpose back to [B, T, C]
    is contiguous (no transposing copies downstream)."""
    from torch import nn
    from torch.nn import functional as F

    from onboarding.graph.opgraph import Block
    from onboarding.patching.core import PatchRecord
    from onboarding.families import family_module

    module = load_kernel("conv1d", "causal", {"kernel_size": 4}, CPU_CONFIG)
    B, T, C = 2, 13, 24

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = nn.Conv1d(C, C, 4, groups=C, padding=3, bias=True)

        def forward(self, h):
            out = self.conv1d(h.transpose(1, 2))
            self.seen = out
            return F.silu(out[..., :T]).transpose(1, 2)

    torch.manual_seed(0)
    ref, mine = Mixer().to(device), Mixer().to(device)
    mine.load_state_dict(ref.state_dict())
    model = nn.Sequential(mine)
    rec = PatchRecord(path="0.conv1d", kind="conv.causal1d", family="conv1d")
    undo = family_module("conv1d").FAMILY.binding(
        Block(path="0.conv1d", kind="conv.causal1d", layer=0, class_name="Conv1d"),
        mine.conv1d, [module], rec, model)
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y_ref = model(x), ref(x2)
    assert rec.status == "active"
    assert mine.seen.shape == (B, C, T + 3) and mine.seen.transpose(1, 2).is_contiguous()
    assert y.is_contiguous()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    _assert_same_grads(y, y_ref, x, x2, mine, ref)
    undo()
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("k,pad,bias", [(4, 3, True), (3, 5, False)], ids=["pad-k-1", "pad-more"])
def test_binding_serves_an_unpadded_conv_after_the_callers_left_pad(load_kernel, device, k, pad, bias):
    """A mixer that pads the sequence itself and runs the conv unpadded (`left_pad`: our
    LeftPadConvLM with P = K-1; ZAYA's CCA with P past K-1, its [B, C, T + P - K + 1] output
    trimmed by a conv after it): the binding's kernel call gives the module's own output (shape
    and values, a view of a time-major tensor) and gradients to x, weight and bias."""
    from torch import nn
    from torch.nn import functional as F

    from onboarding.families import family_module
    from onboarding.graph.opgraph import Block
    from onboarding.patching.core import PatchRecord

    module = load_kernel("conv1d", "causal", {"kernel_size": k}, CPU_CONFIG)
    B, T, C = 2, 11, 20

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(C, C, k, groups=C, padding=0, bias=bias)

        def forward(self, h):
            out = self.conv(F.pad(h.transpose(1, 2), (pad, 0)))
            self.seen = out
            return out[..., out.shape[-1] - T:].transpose(1, 2)

    torch.manual_seed(1)
    ref, mine = Mixer().to(device), Mixer().to(device)
    mine.load_state_dict(ref.state_dict())
    model = nn.Sequential(mine)
    rec = PatchRecord(path="0.conv", kind="conv.causal1d", family="conv1d")
    block = Block(path="0.conv", kind="conv.causal1d", layer=0, class_name="Conv1d", attrs={"left_pad": pad})
    undo = family_module("conv1d").FAMILY.binding(block, mine.conv, [module], rec, model)
    assert "left pad of" in rec.binding, rec.binding
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y_ref = model(x), ref(x2)
    assert rec.status == "active"
    assert mine.seen.shape == ref.seen.shape == (B, C, T + pad - k + 1)
    torch.testing.assert_close(mine.seen, ref.seen, rtol=1e-5, atol=1e-5)
    _assert_same_grads(y, y_ref, x, x2, mine, ref)
    undo()
