"""ssd's `bwd_head_unroll` 2 (template v32, issue 35): ssd_bwd_split_fused_kernel's head loops two heads a
trip (HU 2; an odd head count's last head alone after them), against the fp32 reference and against the
default's one head a trip, under each of "paired" (the P <= 64 bucket's), "fused" and "triple" (ROLES 1, 2,
3). Shapes: T 41 (three split chunks of 16, the last 9 tokens), 2 groups of 3 heads (one pair and a tail per
program), 2 groups of 4 (pairs only; P 20 padded to 32), one group of 6 heads under DBC_SPLIT 2 (two programs
of 3, dB / dC as fp32 partials), 2 batches at T 23 without D, dt_bias or initial state; else D, dt_bias and an
initial state; N 24 padded to 32."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import LaunchSpy
from test_ssd import _BAR_NAMES, CPU_CONFIG, PARAMS, SPLIT_FUSED, _outputs_and_grads, _split, fixture, mild

from onboarding.testing import check_forward_backward

UNROLL = {**SPLIT_FUSED[0].values[0], "bwd": "split", "bwd_head_unroll": 2}  # split chunks of 16, one row block
# (B, T, H, P, G, N, D and dt_bias, initial state)
ODD = (1, 41, 6, 8, 2, 24, True, True)     # 3 heads a group: a pair, then the last head alone
EVEN = (1, 41, 8, 20, 2, 24, True, True)   # 4 heads a group: two pairs; P 20 padded
NO_SKIP = (2, 23, 6, 8, 2, 16, False, False)  # 2 batches, no D / dt_bias / initial state
ONE_GROUP = (1, 41, 6, 8, 1, 24, True, True)  # DBC_SPLIT 2: 3 heads a program, dB / dC fp32 partials


@pytest.fixture(scope="module")
def module(load_kernel):
    return load_kernel("ssd", "scan", PARAMS, CPU_CONFIG)


def _restore(module, device):
    module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("dbc,shape", [
    pytest.param("paired", ODD, id="paired-G2x3-T41"),
    pytest.param("paired", EVEN, id="paired-G2x4-P20-T41"),
    pytest.param("paired", NO_SKIP, id="paired-B2-noD-T23"),
    pytest.param("fused", ODD, id="fused-G2x3-T41"),
    pytest.param("triple", ODD, id="triple-G2x3-T41"),
])
def test_head_unroll_against_reference(module, device, dbc, shape):
    """y, the final state and every gradient (x, dt, A, B, C, D, dt_bias, initial state) against the
    reference, outputs poisoned and loads bounds-checked, A mild (earlier chunks' state terms weigh in)."""
    _split(module, device, {**UNROLL, "split_dbc": dbc})
    try:
        check_forward_backward(mild(fixture(module, shape)), torch.float32, device)
    finally:
        _restore(module, device)


def _inputs(shape, device, seed=5):
    gen = torch.Generator().manual_seed(seed)
    b, t, h, p, g, n = shape[:6]
    args = [torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen) - 1.0,
            -0.02 * torch.exp(torch.rand(h, generator=gen)), 0.5 * torch.randn(b, t, g, n, generator=gen),
            0.5 * torch.randn(b, t, g, n, generator=gen), torch.randn(h, generator=gen),
            torch.randn(h, generator=gen), 0.3 * torch.randn(b, h, p, n, generator=gen)]
    dy, dht = torch.randn(b, t, h, p, generator=gen), torch.randn(b, h, p, n, generator=gen)
    return [a.to(device) for a in args], dy.to(device), dht.to(device)


@pytest.mark.parametrize("dbc,extra", [
    pytest.param("paired", {}, id="paired"),
    pytest.param("paired", {"DBC_SPLIT": 2}, id="paired-split2"),
    pytest.param("fused", {}, id="fused"),
    pytest.param("triple", {}, id="triple"),
])
def test_head_unroll_matches_default(module, device, monkeypatch, dbc, extra):
    """`bwd_head_unroll` 2 reaches ssd_bwd_split_fused_kernel (HU 2, num_stages at most 2) and gives the
    default's (HU 1) y, final state and every gradient within fp32 rounding (the same products and sums
    in the same order), at 2 groups of 3 heads (a pair and a tail per program; with DBC_SPLIT 2 one group of 6
    heads in two programs of 3), T 41, D, dt_bias, initial state."""
    seen = []
    monkeypatch.setattr(module, "ssd_bwd_split_fused_kernel", LaunchSpy(
        module.ssd_bwd_split_fused_kernel, lambda grid, kw: seen.append((kw["HU"], kw.get("num_stages", 3)))))
    args, dy, dht = _inputs(ONE_GROUP if extra else ODD, device)
    got = {}
    for hu in (1, 2):
        _split(module, device, {**UNROLL, "split_dbc": dbc, "bwd_head_unroll": hu, **extra})
        try:
            got[hu] = _outputs_and_grads(module, args, dy, dht)
        finally:
            _restore(module, device)
    assert seen == [(1, 3), (2, 2)]
    for name, a, r in zip(_BAR_NAMES, got[2], got[1]):
        torch.testing.assert_close(a, r, rtol=2e-5, atol=2e-5 * r.abs().max().item(), msg=name)


def test_head_unroll_aot_spec(module):
    """The AOT specs hold the fused kernel at HU 2 ("paired", num_stages 2: the sm_90 build at 3 stages takes
    238 KB of shared memory) beside the default's HU 1, and at HU 2's config every fused spec is HU 2."""
    module.set_config(None)
    try:
        specs = [s for s in module.aot_specs("bf16", 64) if s["kernel"] == "ssd_bwd_split_fused_kernel"]
        module.set_config({"bwd_head_unroll": 2})
        unrolled = [s for s in module.aot_specs("bf16", 64) if s["kernel"] == "ssd_bwd_split_fused_kernel"]
    finally:
        module.set_config(CPU_CONFIG)
    hu2 = [s for s in specs if s["constexprs"]["HU"] == 2]
    assert len(hu2) == 1 and hu2[0]["constexprs"]["ROLES"] == 2 and hu2[0]["num_stages"] == 2
    assert all("num_stages" not in s for s in specs if s["constexprs"]["HU"] == 1)
    assert sum(s["constexprs"]["HU"] == 2 for s in unrolled) == len(unrolled) - 1
