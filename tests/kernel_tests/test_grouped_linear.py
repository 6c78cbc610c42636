"""Grouped linear family (a linear per expert over rows sorted by expert, counts on the device):
forward and every gradient vs the split -> F.linear -> cat reference over routing patterns and odd
shapes, empty inputs, padding rows, frozen weights, opcheck, and shape errors."""

from __future__ import annotations

import pytest
import torch

from onboarding.testing import (
    KernelFixture,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
)

# BLOCK_M=16 with per-expert counts of 0..37 rows (never all tile multiples), 32-wide column
# tiles over N=40 / K=24 leave partial column tiles, BLOCK_K=16 partial reduction steps.
CPU_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "BWD_BLOCK_M": 16, "BWD_BLOCK_N": 32, "BWD_BLOCK_K": 16,
              "dot_precision": "ieee"}
ROUTINGS = ["uniform", "skewed", "all_to_one", "empty_experts"]


@pytest.fixture(scope="module")
def module(load_kernel):
    m = load_kernel("grouped_linear", "sorted", {})
    m.set_config(CPU_CONFIG)  # on a GPU too: the fp32 checks use these tiles
    return m


def counts_for(kind: str, s: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Per-expert row counts [e] summing to s: `skewed` ~ 1/rank^2, `all_to_one` every row to
    expert 1, `empty_experts` the first and last two experts get none."""
    if kind == "all_to_one":
        out = torch.zeros(e, dtype=torch.int64)
        out[1] = s
        return out
    probs = torch.ones(e, dtype=torch.float64)
    if kind == "skewed":
        probs = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 2
    elif kind == "empty_experts":
        probs[[0, e - 2, e - 1]] = 0.0
    picks = torch.multinomial(probs, s, replacement=True, generator=gen) if s else torch.zeros(0, dtype=torch.int64)
    return torch.bincount(picks, minlength=e)


def fixture(module, kind: str, s=37, k=24, n=40, e=5, pad=0, counts_dtype=torch.int64) -> KernelFixture:
    """x [s + pad, k] sorted by expert with counts of `kind` summing to s (pad > 0: rows past
    sum(counts); pad < 0: counts past the rows), weight [e, n, k]."""
    def make_inputs(dtype, device, gen):
        counts = counts_for(kind, s, e, gen)
        x = torch.randn(s + pad, k, generator=gen)
        w = torch.randn(e, n, k, generator=gen) / k ** 0.5
        return [x.to(device, dtype), counts.to(device, counts_dtype), w.to(device, dtype)]

    return KernelFixture(name=f"grouped_linear/{kind}", module=module, make_inputs=make_inputs, weights=(2,))


@pytest.mark.parametrize("kind", ROUTINGS)
def test_forward_backward(module, device, kind):
    check_forward_backward(fixture(module, kind), torch.float32, device)


# pad < 0: counts sum past the rows given; both sides cut the last experts' rows at S
@pytest.mark.parametrize("shape", [dict(s=53, k=20, n=17, e=3, counts_dtype=torch.int32), dict(s=29, pad=6),
                                   dict(s=29, pad=-5), dict(s=0, pad=0), dict(s=1, e=2)],
                         ids=["k20-n17-int32", "pad6", "overfull", "s0", "s1"])
def test_shapes(module, device, shape):
    check_forward_backward(fixture(module, "uniform", **shape), torch.float32, device)


@pytest.mark.parametrize("shape", [dict(), dict(s=29, pad=6, k=20, n=36)], ids=["k24-n40", "pad6-k20-n36"])
@pytest.mark.parametrize("kind", ["skewed", "empty_experts"])
def test_tma_operands(module, device, monkeypatch, kind, shape):
    """tma: the forward and dx GEMMs load rows and weight tiles through tensor descriptors (zero
    past the tensors, the next expert's rows feeding masked rows or columns only); the output and
    every gradient still match, and both GEMMs took the descriptor path."""
    if module.TensorDescriptor is None:
        pytest.skip("this triton has no host tensor descriptors")
    taken = []
    for name in ("grouped_linear_fwd_kernel", "grouped_linear_dx_kernel"):
        kernel = getattr(module, name)

        class Logged:
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kwargs):
                    taken.append((name, kwargs["TMA"]))
                    return kernel[grid](*args, **kwargs)
                return launch
        monkeypatch.setattr(module, name, Logged())
    module.set_config({**CPU_CONFIG, "tma": True})
    try:
        check_forward_backward(fixture(module, kind, **shape), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG)
    assert ("grouped_linear_fwd_kernel", True) in taken and ("grouped_linear_dx_kernel", True) in taken
    assert all(tma for _, tma in taken)


def test_frozen_weight_skips_dweight(module, device, monkeypatch):
    """A weight that needs no gradient gets none and its GEMM never launches."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("dweight kernel launched for a frozen weight")

    x, counts, w = fixture(module, "skewed").make_inputs(torch.float32, device, torch.Generator().manual_seed(3))
    x.requires_grad_(True)
    dy = torch.randn(x.shape[0], w.shape[1], device=device)
    ref = torch.autograd.grad(module.reference(x, counts, w), x, dy)[0]
    monkeypatch.setattr(module, "grouped_linear_dw_kernel", NoLaunch())
    got = torch.autograd.grad(module.entry(x, counts, w), x, dy)[0]
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4)


def test_contract_and_opcheck(module, device):
    check_module_contract(module)
    # small: opcheck runs every op many times over (schema, fake tensors, autograd, AOT dispatch)
    assert check_opcheck(fixture(module, "empty_experts", s=19, k=16, n=20, e=4), torch.float32, device) == 3


def test_shape_errors_name_the_shapes(module):
    x, counts, w = torch.randn(10, 8), torch.tensor([4, 6]), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"weight \(2, 5, 9\)"):
        module.entry(x, counts, torch.randn(2, 5, 9))
    with pytest.raises(ValueError, match=r"counts \(3,\)"):
        module.entry(x, torch.tensor([4, 3, 3]), w)
    with pytest.raises(ValueError, match=r"x \(10,\)"):
        module.entry(torch.randn(10), counts, w)
    with pytest.raises(ValueError, match="int32/int64"):
        module.entry(x, counts.float(), w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs show on a GPU only")
def test_no_host_sync_on_gpu(module):
    """Counts stay on the device: forward and backward launch without waiting for the GPU."""
    x, counts, w = fixture(module, "skewed").make_inputs(torch.float32, torch.device("cuda"),
                                                         torch.Generator().manual_seed(5))
    x.requires_grad_(True)
    w.requires_grad_(True)
    module.entry(x, counts, w).sum().backward()  # warm-up: compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        module.entry(x, counts, w).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.slow  # sm_90 build, nightly: 10.4 + 8 s on CI's cold Triton cache (28th session)
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_aot_sm90(module, tmp_path, tma):
    """Every kernel compiles for sm_90 from its bf16 specs at K=2048 (the GPU bucket's tiles),
    with the row-tiled GEMMs' operands as pointers or as tensor descriptors (a copy of the
    rendered module whose defaults turn `tma` on: the compile runs in a child process)."""
    from pathlib import Path

    from onboarding.generate import aot

    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    if tma and module.TensorDescriptor is None:
        pytest.skip("this triton has no host tensor descriptors")
    src = Path(module.__file__).read_text()
    if tma:
        assert src.count("'tma': False") == 1, "the rendered DEFAULT_CONFIG no longer spells tma as expected"
        src = src.replace("'tma': False", "'tma': True")
    path = tmp_path / "sorted.py"
    path.write_text(src)
    [results] = aot.compile_files([path], size=2048, registers=False).values()
    assert {r.kernel for r in results} == {"grouped_linear_fwd_kernel", "grouped_linear_dx_kernel",
                                           "grouped_linear_dw_kernel"}
    for r in results:
        assert r.ok, f"{r.kernel}: {r.error}"
