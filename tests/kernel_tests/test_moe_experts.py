"""MoE experts family (permute -> grouped GEMM with SwiGLU -> grouped GEMM with routing weight ->
combine): forward and every gradient vs the per-expert loop, over routing patterns; the grouped
expert LoRA variant (routed and pre-sorted entries) the same way; the non-gated `mlp` variant
(up [E, F, D] -> activation -> down [E, D, F]) for every activation it renders; per-expert biases
(`bias`) and gpt-oss's experts (gate_up [E, D, 2F] interleaved, down [E, F, D], biases) through
the patch binding's layout conversion."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import OPCHECK_SPLIT, case_id, zero_fill_shapes

from onboarding.generate import aot
from onboarding.errors import InputError
from onboarding.families import family_module
moe_experts = family_module("moe_experts")
from onboarding.testing import (
    KernelFixture,
    check_aot_sm90,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
)
from onboarding.testing.tolerance import Tolerance
from onboarding.testing.tolerance import rel_rms as rel

GPT_OSS = {"limit": 1.0, "alpha": 1.702, "up_offset": 1.0}
CASES = [("swiglu", {}), ("swiglu", GPT_OSS), ("swiglu", {"capacity_factor": 0.75})]
CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in CASES]
LORA_CASES = [("swiglu_lora", {}), ("swiglu_lora", GPT_OSS)]
# BLOCK_M=16 with expert loads of 0..74 rows: counts are not tile multiples; 32-wide N tiles over
# D=24/40 and F=20 leave partial column tiles too.
# The backward kernels' own tiles (BWD_*) pinned alike.
CPU_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "BWD_BLOCK_M": 16, "BWD_BLOCK_N": 32, "BWD_BLOCK_K": 16,
              "dot_precision": "ieee"}
ROUTINGS = ["uniform", "zipf", "all_to_one", "empty_experts"]


def routing_grid(cases: list) -> list:
    """Every (case, routing) pair of ``cases`` (pytest.params of variant, params) x ROUTINGS.
    CI's command runs half of the grid, a checkerboard: each case under two routings, each
    routing under half the cases (every case and every routing still runs); the other half is
    marked slow and runs nightly."""
    return [pytest.param(*c.values, kind, id=f"{c.id}-{kind}",
                         marks=[pytest.mark.slow] if (i + j) % 2 else [])
            for i, c in enumerate(cases) for j, kind in enumerate(ROUTINGS)]


@pytest.fixture(scope="module")
def load(load_kernel):
    def load(variant, params):
        module = load_kernel("moe_experts", variant, params)
        module.set_config(CPU_CONFIG)  # on a GPU too, as before: the fp32 checks use these tiles
        return module

    return load


def routing(kind: str, n: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] distinct experts per token; `empty_experts` never uses the last two experts."""
    if kind == "all_to_one":
        if k == 1:
            return torch.zeros(n, 1, dtype=torch.int64)
        rest = torch.stack([torch.randperm(e - 1, generator=gen)[: k - 1] + 1 for _ in range(n)])
        return torch.cat([torch.zeros(n, 1, dtype=torch.int64), rest], 1)
    if kind == "zipf":
        probs = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 2
    elif kind == "empty_experts":
        probs = torch.tensor([1.0] * (e - 2) + [0.0, 0.0], dtype=torch.float64)
    else:
        probs = torch.ones(e, dtype=torch.float64)
    return torch.multinomial(probs.expand(n, e), k, replacement=False, generator=gen)


def fixture(module, kind: str, n=37, d=24, e=5, f=20, k=2, gated: bool = True) -> KernelFixture:
    """x [n, d], top-k routing of `kind`, gate_up [E, 2F, D] (not `gated`: up [E, F, D]), down
    [E, D, F]."""
    def make_inputs(dtype, device, gen):
        x = torch.randn(n, d, generator=gen)
        idx = routing(kind, n, e, k, gen)
        w = torch.rand(n, k, generator=gen) + 0.1
        gate_up = torch.randn(e, (2 if gated else 1) * f, d, generator=gen) / d ** 0.5
        down = torch.randn(e, d, f, generator=gen) / f ** 0.5
        return [x.to(device, dtype), idx.to(device), w.to(device, dtype), gate_up.to(device, dtype),
                down.to(device, dtype)]

    name = f"moe_experts/{kind}" if gated else f"moe_experts_mlp/{kind}"
    return KernelFixture(name=name, module=module, make_inputs=make_inputs, weights=(2, 3, 4))


@pytest.mark.parametrize("variant,params,kind", routing_grid(CASE_PARAMS))
def test_forward_backward(load, device, variant, params, kind):
    check_forward_backward(fixture(load(variant, params), kind), torch.float32, device)


@pytest.mark.parametrize("shape", [dict(n=37, d=40, e=5, f=24, k=2), dict(n=64, d=24, e=8, f=16, k=1),
                                   dict(n=1, d=24, e=5, f=20, k=2)], ids=["d40", "k1", "n1"])
def test_shapes(load, device, shape):
    check_forward_backward(fixture(load("swiglu", {}), "uniform", **shape), torch.float32, device)


def test_all_tokens_one_expert_top1(load, device):
    check_forward_backward(fixture(load("swiglu", {}), "all_to_one", k=1), torch.float32, device)


def _gpu_rounding(fx: KernelFixture, device: torch.device) -> KernelFixture:
    """On a GPU the kernel's 16-bit dots and the bf16 reference's matmuls round differently, so
    single elements land a bf16 ulp or two outside atol + rtol * |b| (H200, sixth session: 1 of
    888 in dx at rel RMS 4.0e-3; 7 of 1848 in the pre-sorted LoRA entry at 3.9e-3): up to 1% may,
    while the relative-RMS bound still holds for every element."""
    if device.type == "cuda":
        for kind in ("elementwise", "reduction"):
            fx.tolerances[kind] = dataclasses.replace(fx.tolerance(torch.bfloat16, kind), max_outlier_frac=0.01)
    return fx


def test_bf16_inputs(load, device):
    """bf16 weights and activations: loads upcast to fp32, so the interpreter's bf16 maths is never
    hit; on a GPU the 16-bit dots (see `_gpu_rounding`)."""
    check_forward_backward(_gpu_rounding(fixture(load("swiglu", {}), "zipf"), device), torch.bfloat16, device)


def test_capacity_drops_slots(load, device):
    module = load("swiglu", {"capacity_factor": 0.75})
    idx = torch.zeros(37, 2, dtype=torch.int64, device=device)
    idx[:, 1] = 1
    rt = module.route(idx, 5, 16)
    cap = module.capacity(74, 5)
    # 2 * cap kept slots; S, the rows, is the bound min(N K, E cap) a host knows without a sync
    assert rt["offsets"][-1] == 2 * cap and rt["S"] == module.n_rows(74, 5) == min(74, 5 * cap)
    assert (rt["pos"][cap:] == -1).all() and (rt["pos"][:cap] >= 0).all()
    assert sorted(rt["pos"][rt["pos"] >= 0].tolist()) == list(range(2 * cap))
    dropless = load("swiglu", {})
    assert dropless.capacity(74, 5) is None and dropless.route(idx, 5, 16)["S"] == 74


ATOMIC_CASES = [pytest.param("swiglu", {}, id="swiglu"), pytest.param("swiglu", {"capacity_factor": 0.75}, id="cf"),
                pytest.param("mlp", {"activation": "relu2"}, id="mlp")]


@pytest.mark.parametrize("variant,params,kind", routing_grid(ATOMIC_CASES))
def test_atomic_combine_forward_backward(load, device, monkeypatch, variant, params, kind):
    """combine "atomic": the down and dx GEMMs add each slot's row into its token's fp32 row, no
    per-slot rows and no combine launch, and the output and every gradient still match."""
    module = load(variant, params)
    fx = fixture(module, kind, gated=variant != "mlp")
    launches = _checked_launches(fx, device, monkeypatch, {**CPU_CONFIG, "combine": "atomic"})
    assert "moe_combine_kernel" not in {n for n, _ in launches}
    assert all(kw["ATOMIC"] for n, kw in launches if n in ("moe_down_fwd_kernel", "moe_dx_kernel"))


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
@pytest.mark.parametrize("entry", ["swiglu", "mlp", "swiglu_lora"])
def test_half_tail_tiles(load, device, monkeypatch, entry, kind):
    """half_tail with 32-row tiles: tiles of 16 rows or fewer run the forward GEMMs at half
    height. The routings leave both kinds of tile, and the output and every gradient match."""
    module = load(entry, {"activation": "relu2"} if entry == "mlp" else {})
    fx = (lora_fixture if entry == "swiglu_lora" else fixture)(module, kind, **({"gated": False} if entry == "mlp" else {}))
    args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(0))
    rows = module.route(args[1], 5, 32)
    heights = (torch.minimum(rows["offsets"][rows["tile_expert"].clamp(max=4) + 1], rows["tile_start"] + 32)
               - rows["tile_start"])[rows["tile_expert"] < 5]
    assert (heights <= 16).any() and (heights > 16).any(), heights
    module.set_config({**CPU_CONFIG, "BLOCK_M": 32, "half_tail": True})
    try:
        check_forward_backward(fx, torch.float32, device)
        log = _LaunchLog(module, monkeypatch)
        fx.module.entry(*args)
        launches = log.take()
    finally:
        module.set_config(CPU_CONFIG)
    assert all(kw["HALF_TAIL"] for n, kw in launches if n in ("moe_gate_up_fwd_kernel", "moe_down_fwd_kernel"))


@pytest.mark.parametrize("kind", ["uniform", "empty_experts"])
@pytest.mark.parametrize("variant,params", [pytest.param("swiglu", {}, id="swiglu"),
                                            pytest.param("swiglu", {"bias": True, **GPT_OSS}, id="gpt_oss"),
                                            pytest.param("mlp", {"activation": "relu2"}, id="mlp")])
def test_tma_weight_loads(load, device, monkeypatch, variant, params, kind):
    """tma: the forward GEMMs load the expert weights through tensor descriptors (zero-filled past
    the weight, other experts' rows feeding masked columns only); the output and every gradient
    still match, and both forward launches took the descriptor path."""
    module = load(variant, params)
    if module.TensorDescriptor is None:
        pytest.skip("this triton has no host tensor descriptors")
    fx = (bias_fixture(module, kind) if params.get("bias") else
          fixture(module, kind, gated=variant != "mlp"))
    module.set_config({**CPU_CONFIG, "tma": True})
    try:
        check_forward_backward(fx, torch.float32, device)
        log = _LaunchLog(module, monkeypatch)
        fx.module.entry(*fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(1)))
        launches = log.take()
    finally:
        module.set_config(CPU_CONFIG)
    assert [kw["TMA"] for n, kw in launches if n in ("moe_gate_up_fwd_kernel", "moe_down_fwd_kernel")] == [True, True]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_down_gemm_own_tiles(load, device, monkeypatch, tma):
    """DOWN_BLOCK_N / down_stages give the forward down GEMM its own column tile and pipeline
    depth (D=40 over 64 columns: one partial tile); the output and every gradient still match."""
    module = load("swiglu", {})
    if tma and module.TensorDescriptor is None:
        pytest.skip("this triton has no host tensor descriptors")
    fx = fixture(module, "zipf", d=40)
    module.set_config({**CPU_CONFIG, "DOWN_BLOCK_N": 64, "down_stages": 2, "tma": tma})
    try:
        check_forward_backward(fx, torch.float32, device)
        log = _LaunchLog(module, monkeypatch)
        fx.module.entry(*fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(1)))
        launches = dict(log.take())
    finally:
        module.set_config(CPU_CONFIG)
    assert (launches["moe_down_fwd_kernel"]["BLOCK_N"], launches["moe_down_fwd_kernel"]["num_stages"]) == (64, 2)
    assert launches["moe_gate_up_fwd_kernel"]["BLOCK_N"] == CPU_CONFIG["BLOCK_N"]


@pytest.mark.parametrize("entry", ["swiglu", "mlp"])
def test_weight_gradient_gemms_own_tiles(load, device, monkeypatch, entry):
    """DW_* give the weight-gradient GEMMs their own output tile, row step, warps and stages
    (32 x 16 over D = 24 and F = 20: partial tiles both ways); every gradient still matches, and
    the other backward kernels keep the backward tiles."""
    module = load(entry, {"activation": "relu2"} if entry == "mlp" else {})
    fx = fixture(module, "zipf", gated=entry != "mlp")
    dw = {"DW_BLOCK_M": 32, "DW_BLOCK_N": 16, "DW_BLOCK_K": 32, "dw_warps": 2, "dw_stages": 2}
    launches = dict(_checked_launches(fx, device, monkeypatch, {**CPU_CONFIG, **dw}))
    for name in ("moe_dwd_kernel", "moe_dwgu_kernel"):
        kw = launches[name]
        assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"]) == (32, 16, 32, 2, 2)
    assert launches["moe_dx_kernel"]["BLOCK_M"] == CPU_CONFIG["BWD_BLOCK_M"]


@pytest.mark.parametrize("entry,tma", [("swiglu", True), ("mlp", True)])
def test_backward_weight_tma_and_dx_tiles(load, device, monkeypatch, entry, tma):
    """bwd_tma: the down backward and dx GEMMs read the expert weights through tensor descriptors
    (D = 40 and 2F = 40 over 16-row blocks: blocks run past an expert's rows into the next's and
    past the last); DX_BLOCK_M / DX_BLOCK_N / dx_stages: dx's own tile and tile map (32-row
    tiles over counts that are not multiples of it). Every gradient matches."""
    module = load(*{"swiglu": ("swiglu", {}), "mlp": ("mlp", {"activation": "relu2"})}[entry])
    if tma and module.TensorDescriptor is None:
        pytest.skip("this triton has no host tensor descriptors")
    fx = fixture(module, "zipf", d=40, gated=entry != "mlp")
    config = {**CPU_CONFIG, "bwd_tma": tma, "DX_BLOCK_M": 32, "DX_BLOCK_N": 16, "dx_stages": 2}
    launches = _checked_launches(fx, device, monkeypatch, config)
    dx = [kw for n, kw in launches if n == "moe_dx_kernel"]
    down = [kw for n, kw in launches if n == "moe_down_bwd_kernel"]
    assert dx and all((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"], kw["TMA"]) == (32, 16, 2, tma) for kw in dx)
    assert down and all((kw["BLOCK_M"], kw["TMA"]) == (CPU_CONFIG["BWD_BLOCK_M"], tma) for kw in down)


# The persistent weight-gradient kernel's tiles: 16 x 16 output tiles over 2F = 40 (3 row tiles,
# the last partial) x D = 24 (2 column tiles) per expert and 16-row steps over 0..~37 rows per
# expert, walked by 3 programs per "SM" (the interpreter's stand-in count) or 1.
PERSISTENT = {"DW_BLOCK_M": 16, "DW_BLOCK_N": 16, "DW_BLOCK_K": 16, "dw_warps": 4, "dw_stages": 2}


@pytest.mark.parametrize("entry,kind,per_sm", [("mlp", "zipf", 2), ("bias", "empty_experts", 1)])
def test_persistent_weight_gradients(load, device, monkeypatch, entry, kind, per_sm):
    """dw_persistent: each weight gradient (and with `bias` its bias gradient) from one persistent
    kernel whose programs walk several (output tile, row step) pairs in one flat loop: 37 tokens
    (odd rows per expert, partial row steps and tiles), unused experts (one all-masked step, zero
    gradient: poisoned outputs would show an unwritten one); every gradient matches the
    reference, and neither grid kernel launches."""
    module = load(*{"swiglu": ("swiglu", {}), "mlp": ("mlp", {"activation": "relu2"}),
                    "bias": ("swiglu", {"bias": True})}[entry])
    fx = bias_fixture(module, kind) if entry == "bias" else fixture(module, kind, gated=entry != "mlp")
    config = {**CPU_CONFIG, **PERSISTENT, "dw_persistent": per_sm}
    launches = _checked_launches(fx, device, monkeypatch, config)
    names = [n for n, _ in launches]
    assert names.count("moe_dw_persistent_kernel") == 2 and not {"moe_dwd_kernel", "moe_dwgu_kernel"} & set(names)
    assert all(kw["BLOCK_M"] == 16 and kw["BLOCK_K"] == 16 for n, kw in launches if n == "moe_dw_persistent_kernel")


@pytest.mark.parametrize("kind,persistent", [("zipf", 0), ("empty_experts", 1)])
def test_sorted_rows_weight_gradients(load, device, monkeypatch, kind, persistent):
    """dw_sorted: the weight-gradient kernels (grid, or persistent) read x and dy already in slot
    order (no token load in their loop); every gradient, the bias gradients too, matches on odd
    rows per expert and unused experts."""
    module = load("swiglu", {"bias": True})
    config = {**CPU_CONFIG, "dw_sorted": True, **(PERSISTENT if persistent else {}), "dw_persistent": persistent}
    launches = _checked_launches(bias_fixture(module, kind), device, monkeypatch, config)
    dw = [kw for n, kw in launches if n in ("moe_dwd_kernel", "moe_dwgu_kernel", "moe_dw_persistent_kernel")]
    assert len(dw) == 2 and all(kw["SORTED"] for kw in dw)


def test_persistent_weight_gradients_match_grid_kernels(load, device):
    """The persistent kernel and the grid kernels give the same weight gradients (the same fp32
    sums in the same row order) on fresh inputs with an expert left empty, frozen down included."""
    module = load("swiglu", {})
    args = fixture(module, "empty_experts", n=29).make_inputs(torch.float32, device, torch.Generator().manual_seed(5))
    grads = []
    for per_sm in (0, 1):
        module.set_config({**CPU_CONFIG, **PERSISTENT, "dw_persistent": per_sm})
        try:
            leaves = [a.clone().requires_grad_(i in (0, 2, 3)) if a.is_floating_point() else a for i, a in enumerate(args)]
            module.entry(*leaves).square().sum().backward()
            grads.append([leaves[i].grad for i in (0, 2, 3)])
        finally:
            module.set_config(CPU_CONFIG)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert grads[1][2][3:].abs().max() == 0  # experts 3 and 4 took no rows


DW_KERNELS = {"moe_dwd_kernel", "moe_dwgu_kernel", "moe_dw_persistent_kernel"}


def _count_grouped_mm(monkeypatch) -> list[tuple]:
    """Wraps torch._grouped_mm so each call records (mat_a shape, mat_b shape, offsets)."""
    calls, real = [], torch._grouped_mm

    def spy(a, b, *args, offs=None, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape), None if offs is None else offs.tolist()))
        return real(a, b, *args, offs=offs, **kwargs)
    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return calls


@pytest.mark.parametrize("entry,kind", [("swiglu", "zipf"), ("mlp", "empty_experts"), ("bias", "empty_experts"),
                                        ("bias_cf", "all_to_one"), ("gpt_oss", "uniform")])
def test_grouped_mm_weight_gradients(load, device, monkeypatch, entry, kind):
    """dw_grouped_mm: both weight gradients (and with `bias` both bias gradients) by
    torch._grouped_mm over each expert's rows, grouped on the reduction dim: every gradient
    matches the reference on odd rows per expert, unused experts (zero gradient), capacity
    dropping (rows past the kept slots) and the clamped gpt-oss SwiGLU; off a GPU no Triton
    weight-gradient kernel runs, on one (fp32 here) the Triton kernels keep the gradients."""
    variant, params = {"swiglu": ("swiglu", {}), "mlp": ("mlp", {"activation": "relu2"}),
                       "bias": ("swiglu", {"bias": True}), "bias_cf": ("swiglu", {"bias": True, "capacity_factor": 0.75}),
                       "gpt_oss": ("swiglu", GPT_OSS)}[entry]
    module = load(variant, params)
    fx = bias_fixture(module, kind) if entry.startswith("bias") else fixture(module, kind, gated=entry != "mlp")
    calls = _count_grouped_mm(monkeypatch)
    launches = _checked_launches(fx, device, monkeypatch, {**CPU_CONFIG, "dw_grouped_mm": True})
    names = {n for n, _ in launches}
    assert "moe_dx_kernel" in names and "moe_down_bwd_kernel" in names
    if device.type == "cuda":  # fp32 operands: the Triton kernels (torch's grouped GEMM is bf16-only there)
        assert {"moe_dwd_kernel", "moe_dwgu_kernel"} <= names and not calls
        return
    assert not DW_KERNELS & names
    d, f = 24, 20
    gu = f if variant == "mlp" else 2 * f
    # the last two calls are the checked forward + backward's: d down_proj [D, S] x [S, F], then d up [GU, S] x [S, D]
    (a2, b2, offs2), (a1, b1, offs1) = calls[-2:]
    assert (a2[0], b2[1], a1[0], b1[1]) == (d, f, gu, d) and offs1 == offs2 and len(offs1) == 5
    # the groups cover every kept slot: all S rows dropless, with capacity dropping the kept ones
    # (fewer than N * K), the rows after them (dropped slots) in no group
    if module.CAPACITY_FACTOR is None:
        assert offs1[-1] == a2[1] == b1[0]
    else:
        assert offs1[-1] < a2[1] == b1[0]


# Template v28: dx's GEMM by torch._grouped_mm (`dx_grouped_mm`), alone and beside the weight gradients'.
GMM_DX = {"dx": {"dx_grouped_mm": True}, "all": {"dx_grouped_mm": True, "dw_grouped_mm": True, "dy_sorted": True}}


@pytest.mark.parametrize("entry,kind,name", [
    ("swiglu", "zipf", "all"), ("mlp", "empty_experts", "all"), ("swiglu_cf", "all_to_one", "all"),
    ("gpt_oss", "uniform", "dx"), ("bias", "empty_experts", "all"), ("swiglu", "uniform", "dx")])
def test_grouped_mm_dx(load, device, monkeypatch, entry, kind, name):
    """dx_grouped_mm: the output and every gradient match the reference on odd rows per expert,
    unused experts, capacity dropping (rows past the kept slots: d(gate|up) rows that no group and
    no combine may read), biases and the clamped gpt-oss SwiGLU. Off a GPU the Triton dx kernel does
    not launch, dx's rows go through the combine pass (no atomics under `combine` "atomic"), and
    torch._grouped_mm's groups are each expert's end row; on a GPU (fp32 here) the Triton kernel
    keeps dx."""
    variant, params = {"swiglu": ("swiglu", {}), "mlp": ("mlp", {"activation": "relu2"}),
                       "swiglu_cf": ("swiglu", {"capacity_factor": 0.75}), "bias": ("swiglu", {"bias": True}),
                       "gpt_oss": ("swiglu", GPT_OSS)}[entry]
    module = load(variant, params)
    fx = bias_fixture(module, kind) if entry == "bias" else fixture(module, kind, gated=entry != "mlp")
    calls = _count_grouped_mm(monkeypatch)
    config = {**CPU_CONFIG, "combine": "atomic", **GMM_DX[name]}
    names = [n for n, _ in _checked_launches(fx, device, monkeypatch, config)]
    assert "moe_down_bwd_kernel" in names
    if device.type == "cuda":
        assert "moe_dx_kernel" in names and "moe_combine_kernel" not in names
        return
    assert "moe_dx_kernel" not in names
    assert names.count("moe_combine_kernel") == 1  # "atomic": the forward adds its rows itself, dx's combine
    gu = 20 if variant == "mlp" else 40
    # the last forward + backward's 2-D x 3-D call ([S, GU] x [E, GU, D]; the checked runs before it
    # drew other routings)
    a, b, offs = [c for c in calls if len(c[1]) == 3][-1]
    assert (a[1], b[1:]) == (gu, (gu, 24)) and len(offs) == 5
    assert (offs[-1] < a[0]) == (module.CAPACITY_FACTOR is not None)  # dropped rows are in no group


@pytest.mark.slow  # 21 s on 2 cores (opcheck runs each op several times)
def test_grouped_mm_opcheck(load, device, monkeypatch):
    """torch.library.opcheck of the backward op with dw_grouped_mm (the fake's gradient shapes,
    dtypes and the weights left ungraded when not wanted): the grouped_mm path is the one that ran
    (off a GPU)."""
    module = load("swiglu", {"bias": True})
    calls = _count_grouped_mm(monkeypatch)
    module.set_config({**CPU_CONFIG, "dw_grouped_mm": True})
    try:
        check_opcheck(bias_fixture(module, "empty_experts", n=9), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG)
    assert bool(calls) == (device.type != "cuda")


@pytest.mark.parametrize("frozen", [(3,), (4,)], ids=["gate_up", "down"])
def test_grouped_mm_frozen_weight(load, device, monkeypatch, frozen):
    """dw_grouped_mm with one expert weight frozen: only the other weight's grouped GEMM runs;
    every wanted gradient equals the Triton kernels' (up to the order of fp32 sums)."""
    module = load("swiglu", {})
    args = fixture(module, "zipf").make_inputs(torch.float32, device, torch.Generator().manual_seed(4))
    dy = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(5)).to(device)
    grads = []
    calls = _count_grouped_mm(monkeypatch)
    for gmm in (False, True):
        module.set_config({**CPU_CONFIG, "dw_grouped_mm": gmm})
        try:
            part = [a.clone().requires_grad_(i != 1 and i not in frozen) for i, a in enumerate(args)]
            grads.append(torch.autograd.grad(module.entry(*part), [part[i] for i in (0, 2, 3, 4) if i not in frozen], dy))
        finally:
            module.set_config(CPU_CONFIG)
    assert len(calls) == (0 if device.type == "cuda" else 1)
    if calls:
        assert calls[0][1][1] == (20 if frozen == (3,) else 24)  # d down_proj: hr [S, F]; d gate_up: x[tok] [S, D]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# The backward's slot-ordered rows and split epilogue (template v15): `dy_sorted` (the down
# backward reads dy[tok] copied into slot order; the weight gradients reuse the copy), `rows_tma`
# (that copy and dx's d(gate|up) through tensor descriptors, blocks running past an expert's rows
# into the next's and past S), `bwd_epi_split` (the down backward's epilogue on 2 or 4 column
# slices: F = 20 or 40 over 32-column tiles leaves partial and all-masked slices).
ROWS_CONFIGS = {"dy_sorted": {"dy_sorted": True}, "rows_tma": {"dy_sorted": True, "rows_tma": True},
                "dx_rows_tma": {"rows_tma": True, "DX_BLOCK_M": 32, "DX_BLOCK_N": 16},
                "split2": {"bwd_epi_split": 2}, "split4": {"bwd_epi_split": 4},
                "all_gmm": {"dy_sorted": True, "rows_tma": True, "bwd_epi_split": 2, "dw_grouped_mm": True},
                "all_sorted_dw": {"dy_sorted": True, "bwd_epi_split": 4, "dw_sorted": True},
                # template v18: eight prefetched epilogue slices. Of 32-column tiles (4 columns each): at
                # F = 38 the first tile's eight slices are full (a slice's mix-up shows), the second's
                # first full, then a partial one, then six all-masked; of a 64-column tile (8 each)
                # at F = 20 two full, one partial, five masked.
                "split8": {"bwd_epi_split": 8, "BWD_BLOCK_M": 32},
                "split8_wide": {"bwd_epi_split": 8, "BWD_BLOCK_M": 32, "BWD_BLOCK_N": 64},
                "split8_rows": {"dy_sorted": True, "rows_tma": True, "bwd_epi_split": 8, "BWD_BLOCK_M": 32,
                                "dw_grouped_mm": True},
                # template v19: the down backward on its own tile (DOWN_BWD_*), whose row tiles route
                # the slots: dx on the backward's 16-row tiles takes its own tile map, or (DX_BLOCK_M
                # 32) shares the down backward's, with both row operands by TMA in 32-row blocks
                "own_tile": {"DOWN_BWD_BLOCK_M": 32, "DOWN_BWD_BLOCK_N": 64, "down_bwd_stages": 2,
                             "bwd_epi_split": 8},
                "own_tile_rows": {"DOWN_BWD_BLOCK_M": 32, "DX_BLOCK_M": 32, "dy_sorted": True, "rows_tma": True,
                                  "bwd_epi_split": 8, "dw_grouped_mm": True}}


@pytest.mark.parametrize("entry,kind,name,f", [
    ("swiglu", "zipf", "rows_tma", 20), ("gpt_oss_bias", "empty_experts", "all_gmm", 20),
    ("mlp", "empty_experts", "split4", 20), ("swiglu", "uniform", "dx_rows_tma", 20),
    ("bias", "zipf", "all_sorted_dw", 20),
    pytest.param("swiglu", "all_to_one", "dy_sorted", 20, marks=pytest.mark.slow),
    pytest.param("mlp", "zipf", "rows_tma", 40, marks=pytest.mark.slow),
    pytest.param("swiglu", "zipf", "split2", 40, marks=pytest.mark.slow),
    pytest.param("swiglu", "zipf", "rows_tma", 40, marks=pytest.mark.slow),
    pytest.param("mlp", "uniform", "all_gmm", 20, marks=pytest.mark.slow),
    ("swiglu", "zipf", "split8", 38), ("gpt_oss_bias", "empty_experts", "split8_rows", 38),
    ("mlp", "empty_experts", "split8", 38), ("swiglu", "uniform", "split8_wide", 20),
    pytest.param("swiglu", "all_to_one", "split8_rows", 38, marks=pytest.mark.slow),
    pytest.param("bias", "zipf", "split8", 38, marks=pytest.mark.slow),
    ("swiglu", "zipf", "own_tile", 38), ("mlp", "empty_experts", "own_tile_rows", 20),
    pytest.param("gpt_oss_bias", "all_to_one", "own_tile_rows", 20, marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_backward_sorted_rows_and_split_epilogue(load, device, monkeypatch, entry, kind, name, f):
    """dy_sorted / rows_tma / bwd_epi_split / DOWN_BWD_* (ROWS_CONFIGS): the output and every
    gradient (bias gradients too) match the reference on odd rows per expert, unused experts and
    one expert with every token; the down backward and dx launches took the paths and tiles asked
    for."""
    variant, params = {"swiglu": ("swiglu", {}), "mlp": ("mlp", {"activation": "relu2"}),
                       "bias": ("swiglu", {"bias": True}),
                       "gpt_oss_bias": ("swiglu", {"bias": True, **GPT_OSS})}[entry]
    module = load(variant, params)
    config = ROWS_CONFIGS[name]
    if config.get("rows_tma") and module.TensorDescriptor is None:
        pytest.skip("this triton has no host tensor descriptors")
    fx = (bias_fixture(module, kind, d=40, f=f) if entry in ("bias", "gpt_oss_bias")
          else fixture(module, kind, d=40, f=f, gated=entry != "mlp"))
    launches = _checked_launches(fx, device, monkeypatch, {**CPU_CONFIG, **config})
    down = [kw for n, kw in launches if n == "moe_down_bwd_kernel"]
    dx = [kw for n, kw in launches if n == "moe_dx_kernel"]
    sorted_dy, rows = bool(config.get("dy_sorted")), bool(config.get("rows_tma"))
    bwd = {k: config.get(f"BWD_{k}", CPU_CONFIG[f"BWD_{k}"]) for k in ("BLOCK_M", "BLOCK_N")}
    tile = tuple(config.get(f"DOWN_BWD_{k}") or bwd[k] for k in bwd)
    assert down and all((kw["DY_SORTED"], kw["ROWS_TMA"], kw["EPI_SPLIT"], kw["BLOCK_M"], kw["BLOCK_N"]) ==
                        (sorted_dy, rows and sorted_dy, config.get("bwd_epi_split", 1), *tile) for kw in down)
    assert dx and all(kw["ROWS_TMA"] == rows and kw["BLOCK_M"] == config.get("DX_BLOCK_M", bwd["BLOCK_M"]) for kw in dx)


def test_sorted_dy_is_gathered_once(load, device, monkeypatch):
    """With dy_sorted the weight gradients reuse the down backward's dy[tok] copy: one backward
    gathers x and dy once each (grouped_mm weight gradients; Triton ones on slot-ordered rows), not
    dy twice."""
    module = load("swiglu", {})
    args = fixture(module, "zipf").make_inputs(torch.float32, device, torch.Generator().manual_seed(2))
    real, calls = torch.Tensor.index_select, []

    def spy(t, dim, index, *a, **k):
        calls.append(tuple(t.shape))
        return real(t, dim, index, *a, **k)
    counts = []
    for extra in ({"dw_grouped_mm": True}, {"dw_sorted": True}):
        for dy_sorted in (False, True):
            module.set_config({**CPU_CONFIG, **extra, "dy_sorted": dy_sorted})
            try:
                leaves = [a.clone().requires_grad_(i != 1) for i, a in enumerate(args)]
                y = module.entry(*leaves)
                monkeypatch.setattr(torch.Tensor, "index_select", spy)
                calls.clear()
                y.sum().backward()
                monkeypatch.undo()
                counts.append(len(calls))
            finally:
                module.set_config(CPU_CONFIG)
    on_cpu = device.type != "cuda"  # fp32 on a GPU: the Triton kernels, still on slot-ordered rows for dw_sorted
    # CPU: grouped_mm (x and dy gathered for it) then the slot-ordered Triton kernels: two gathers each
    # time, never a second dy; fp32 on a GPU: grouped_mm falls back to the grid kernels (no gather)
    assert counts == ([2, 2, 2, 2] if on_cpu else [0, 1, 2, 2]), counts


# Template v17's options: `dw_tma` (the persistent weight-gradient kernel's slot-ordered operands
# by TMA: row steps running past an expert's rows into the next's and past S, zeroed after the
# load, or with `dw_pad` meeting the zero rows padding the gathered operand; output tiles partial
# over 2F = 40 and D = 40 in 16 x 16 tiles), `h_tma` (the forward down GEMM's h rows by TMA;
# beside half-height tiles by their own descriptor since v20), `dx_warps` / `down_warps` (dx's
# and the forward down GEMM's own warps).
V17_CONFIGS = {"dw_tma": {**PERSISTENT, "dw_persistent": 2, "dw_sorted": True, "dw_tma": True},
               "dw_tma1": {**PERSISTENT, "dw_persistent": 1, "dw_sorted": True, "dw_tma": True, "dy_sorted": True},
               "dw_tma_unsorted": {**PERSISTENT, "dw_persistent": 1, "dw_tma": True},
               "dw_pad": {**PERSISTENT, "dw_persistent": 2, "dw_sorted": True, "dw_tma": True, "dw_pad": True},
               "dw_pad_dy": {**PERSISTENT, "dw_persistent": 1, "dw_sorted": True, "dw_tma": True, "dw_pad": True,
                             "dy_sorted": True},
               "h_tma": {"h_tma": True}, "h_tma_atomic": {"h_tma": True, "combine": "atomic", "BLOCK_M": 32},
               "h_tma_half": {"h_tma": True, "half_tail": True, "BLOCK_M": 32},
               "warps": {"bwd_warps": 4, "dx_warps": 2, "down_warps": 2}}


# ~11 s a case in CI: one case per option there (dw_tma, dw_pad, h_tma, the warps), the rest nightly
_SLOW = pytest.mark.slow
@pytest.mark.parametrize("entry,kind,name", [
    pytest.param("swiglu", "zipf", "dw_tma", marks=_SLOW), ("bias", "empty_experts", "dw_tma1"),
    pytest.param("mlp", "uniform", "dw_tma", marks=_SLOW), pytest.param("swiglu", "uniform", "dw_tma_unsorted", marks=_SLOW),
    pytest.param("swiglu", "zipf", "h_tma", marks=_SLOW), ("mlp", "empty_experts", "h_tma_atomic"),
    pytest.param("swiglu", "uniform", "h_tma_half", marks=_SLOW), ("swiglu", "all_to_one", "warps"),
    pytest.param("swiglu", "zipf", "dw_pad", marks=_SLOW),
    ("bias", "empty_experts", "dw_pad_dy"), pytest.param("mlp", "all_to_one", "dw_pad", marks=pytest.mark.slow),
    pytest.param("bias", "all_to_one", "dw_tma", marks=pytest.mark.slow),
    pytest.param("gpt_oss_bias", "zipf", "h_tma", marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_v17_tma_rows_and_own_warps(load, device, monkeypatch, entry, kind, name):
    """dw_tma / dw_pad / h_tma / dx_warps / down_warps (V17_CONFIGS): the output and every gradient (bias
    gradients too) match the reference on odd rows per expert (37 tokens), unused experts, one
    expert with every token, D = 40 and F = 20 (partial tiles and row steps); the launches took
    the paths asked for: TMA operands only with slot-ordered rows, h by TMA (beside half-height
    tiles too since v20: their own descriptor), dx and the forward down GEMM on their own warps
    beside the down backward's and gate/up's."""
    variant, params = {"swiglu": ("swiglu", {}), "mlp": ("mlp", {"activation": "relu2"}),
                       "bias": ("swiglu", {"bias": True}),
                       "gpt_oss_bias": ("swiglu", {"bias": True, **GPT_OSS})}[entry]
    module = load(variant, params)
    config = V17_CONFIGS[name]
    if module.TensorDescriptor is None and (config.get("dw_tma") or config.get("h_tma")):
        pytest.skip("this triton has no host tensor descriptors")
    fx = (bias_fixture(module, kind, d=40) if entry in ("bias", "gpt_oss_bias")
          else fixture(module, kind, d=40, gated=entry != "mlp"))
    launches = _checked_launches(fx, device, monkeypatch, {**CPU_CONFIG, **config})
    dw = [kw for n, kw in launches if n == "moe_dw_persistent_kernel"]
    assert len(dw) == (2 if config.get("dw_persistent") else 0)
    assert all((kw["TMA"], kw["PAD"]) == (bool(config.get("dw_sorted")), bool(config.get("dw_pad"))) for kw in dw)
    down = [kw for n, kw in launches if n == "moe_down_fwd_kernel"]
    assert down and all(kw["ROWS_TMA"] == (name in ("h_tma", "h_tma_atomic", "h_tma_half")) for kw in down)
    if name == "warps":
        warps = {n: {kw["num_warps"] for m, kw in launches if m == n}
                 for n in ("moe_gate_up_fwd_kernel", "moe_down_fwd_kernel", "moe_down_bwd_kernel", "moe_dx_kernel")}
        assert warps == {"moe_gate_up_fwd_kernel": {module.config_for(40)["num_warps"]},
                         "moe_down_fwd_kernel": {2}, "moe_down_bwd_kernel": {4}, "moe_dx_kernel": {2}}


# Template v20: half-height tails beside TMA rows. `half_tail_bwd` runs the down backward's and
# dx's last tile of an expert at BLOCK_M / 2 rows when it holds that few, `half_tail_down` the
# forward down GEMM's (gate/up kept at full height); with `rows_tma` / `h_tma` those tiles load
# their rows through their own [BLOCK_M / 2, BLOCK_K] descriptors. Expert loads over 32-row tiles
# (half: 16) with remainders 1, 16 (BLOCK_M / 2), 17, 0 and 15, an empty expert and a one-row one:
# both kinds of last tile, and the rows a half-height descriptor block reads past its expert's
# end (the next expert's, or past S) masked at every store.
TAIL_COUNTS = [33, 16, 49, 64, 0, 47, 1]
_TAIL_BASE = {"BLOCK_M": 32, "BWD_BLOCK_M": 32}
TAIL_CONFIGS = {
    "bwd": {**_TAIL_BASE, "half_tail_bwd": True},  # pointer rows
    "bwd_rows": {**_TAIL_BASE, "half_tail_bwd": True, "dy_sorted": True, "rows_tma": True},
    # the bucket-like stack: every row operand by TMA, weights by TMA, atomic combine, eight
    # epilogue slices, the down backward and dx on their own 32-row tiles (one tile map)
    "all_rows": {**_TAIL_BASE, "half_tail_bwd": True, "half_tail_down": True, "h_tma": True, "dy_sorted": True,
                 "rows_tma": True, "tma": True, "bwd_tma": True, "combine": "atomic", "bwd_epi_split": 8,
                 "DOWN_BWD_BLOCK_M": 32, "DOWN_BWD_BLOCK_N": 64, "DX_BLOCK_M": 32, "dw_grouped_mm": True},
    # dx on its own 64-row tiles (own tile map, half: 32 rows) beside the 32-row down backward
    "dx_own": {**_TAIL_BASE, "half_tail_bwd": True, "rows_tma": True, "DX_BLOCK_M": 64, "DX_BLOCK_N": 16},
    "down": {**_TAIL_BASE, "half_tail_down": True, "h_tma": True},
    "down_ptrs": {**_TAIL_BASE, "half_tail_down": True},
    "fwd_h_tma": {**_TAIL_BASE, "half_tail": True, "h_tma": True},  # the v19 key, h by TMA since v20
}


def tail_routing(counts: list[int], gen: torch.Generator) -> torch.Tensor:
    """[sum(counts) / 2, 2] top-2 routing with exactly counts[e] slots on expert e: the slots sorted
    by expert, token t taking positions t and t + n (distinct experts while no count passes n),
    the tokens shuffled."""
    seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    n = seq.numel() // 2
    idx = torch.stack([seq[:n], seq[n:]], 1)
    assert seq.numel() == 2 * n and (idx[:, 0] != idx[:, 1]).all()
    return idx[torch.randperm(n, generator=gen)]


def tail_fixture(module, entry: str, d=40, f=20) -> KernelFixture:
    """x [n, d] routed by `tail_routing(TAIL_COUNTS)`; gate_up [E, 2F, D] (mlp: up [E, F, D]), down
    [E, D, F]; "bias": gpt-oss's clamped SwiGLU with both biases."""
    e, gated, bias = len(TAIL_COUNTS), entry != "mlp", entry == "bias"
    n = sum(TAIL_COUNTS) // 2

    def make_inputs(dtype, device, gen):
        x = torch.randn(n, d, generator=gen)
        idx = tail_routing(TAIL_COUNTS, gen)
        w = torch.rand(n, 2, generator=gen) + 0.1
        gate_up = torch.randn(e, (2 if gated else 1) * f, d, generator=gen) / d ** 0.5
        down = torch.randn(e, d, f, generator=gen) / f ** 0.5
        args = [x, idx, w, gate_up, down]
        if bias:
            args += [torch.randn(e, 2 * f, generator=gen) / 2, torch.randn(e, d, generator=gen) / 2]
        return [a.to(device) if i == 1 else a.to(device, dtype) for i, a in enumerate(args)]

    return KernelFixture(name=f"moe_experts/tails/{entry}", module=module, make_inputs=make_inputs,
                         weights=(2, 3, 4, 5, 6) if bias else (2, 3, 4))


def test_tail_routing_leaves_every_remainder(load):
    """TAIL_COUNTS over 32-row tiles: last tiles of 1, 16 and 15 rows (half height), 17 and 32 rows
    (full height), and the route's tile map holds exactly them."""
    module = load("swiglu", {})
    idx = tail_routing(TAIL_COUNTS, torch.Generator().manual_seed(0))
    assert torch.bincount(idx.flatten(), minlength=len(TAIL_COUNTS)).tolist() == TAIL_COUNTS
    rt = module.route(idx, len(TAIL_COUNTS), 32)
    real = rt["tile_expert"] < len(TAIL_COUNTS)
    ends = rt["offsets"][rt["tile_expert"].clamp(max=len(TAIL_COUNTS) - 1) + 1]
    heights = (torch.minimum(ends, rt["tile_start"] + 32) - rt["tile_start"])[real]
    assert sorted(heights.tolist()) == sorted([32, 1, 16, 32, 17, 32, 32, 32, 15, 1])


def test_half_tail_keys_off_by_default(load):
    """Template v20's keys are off in every bucket: the AOT specs (the GPU builds) of the down
    backward and dx take no half-height tiles and no half-height operand, and the forward down GEMM
    only d_le_4k's half_tail (h by pointers there)."""
    module = load("swiglu", {})
    module.set_config(None)
    try:
        for size in (512, 2048, 7168):
            cfg = module.config_for(size)
            assert not cfg["half_tail_bwd"] and not cfg["half_tail_down"], size
            specs = {s["kernel"]: s["constexprs"] for s in module.aot_specs("bf16", size)}
            for name, arg in (("moe_down_bwd_kernel", "p_dy_half"), ("moe_dx_kernel", "p_dgu_half")):
                assert specs[name]["HALF_TAIL"] is False and specs[name][arg] is None, (size, name)
            down = specs["moe_down_fwd_kernel"]
            assert (down["HALF_TAIL"], down["ROWS_TMA"], down["p_h_half"]) == (cfg["half_tail"], False, None), size
    finally:
        module.set_config(CPU_CONFIG)


@pytest.mark.parametrize("entry,name", [
    ("swiglu", "bwd"), ("swiglu", "bwd_rows"), ("swiglu", "all_rows"), ("mlp", "all_rows"), ("bias", "all_rows"),
    ("swiglu", "dx_own"), ("swiglu", "down"), ("mlp", "down_ptrs"), ("swiglu", "fwd_h_tma"),
    pytest.param("mlp", "bwd_rows", marks=pytest.mark.slow), pytest.param("bias", "bwd", marks=pytest.mark.slow),
    pytest.param("bias", "down", marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_half_tail_tma_rows(load, device, monkeypatch, entry, name):
    """half_tail_bwd / half_tail_down / half_tail beside TMA rows (TAIL_CONFIGS): the output and
    every gradient (dx, d topk_weights, d gate_up, d down; with biases theirs too) match the fp32
    reference on experts whose last tile holds 1, 15, 16, 17 or 32 rows; the launches took the
    half-height tiles and, where the config asks for TMA rows, a half-height descriptor beside the
    full-height one (gate/up's tiles stay full height with half_tail_down)."""
    module = load(*{"swiglu": ("swiglu", {}), "mlp": ("mlp", {"activation": "relu2"}),
                    "bias": ("swiglu", {"bias": True, **GPT_OSS})}[entry])
    config = TAIL_CONFIGS[name]
    if module.TensorDescriptor is None and any(config.get(k) for k in ("rows_tma", "h_tma", "tma", "bwd_tma")):
        pytest.skip("this triton has no host tensor descriptors")
    halves, real = [], module._half_rows

    def spy(rows, t, block_m, block_k, half):
        out = real(rows, t, block_m, block_k, half)
        halves.append(None if out is None else list(out.block_shape))
        return out
    monkeypatch.setattr(module, "_half_rows", spy)
    launches = _checked_launches(tail_fixture(module, entry), device, monkeypatch, {**CPU_CONFIG, **config})
    by = {n: [kw for m, kw in launches if m == n]
          for n in ("moe_gate_up_fwd_kernel", "moe_down_fwd_kernel", "moe_down_bwd_kernel", "moe_dx_kernel")}
    bwd, down = bool(config.get("half_tail_bwd")), bool(config.get("half_tail_down") or config.get("half_tail"))
    assert all(by.values()), by
    assert all(kw["HALF_TAIL"] == bool(config.get("half_tail")) for kw in by["moe_gate_up_fwd_kernel"])
    assert all((kw["HALF_TAIL"], kw["ROWS_TMA"]) == (down, bool(config.get("h_tma")))
               for kw in by["moe_down_fwd_kernel"])
    assert all(kw["HALF_TAIL"] == bwd for kw in by["moe_down_bwd_kernel"] + by["moe_dx_kernel"])
    # the last forward + backward's half-height operands (down forward, down backward, dx): a
    # descriptor of half-height blocks where that kernel's rows come by TMA, else none
    bk = {"fwd": config.get("BLOCK_K", CPU_CONFIG["BLOCK_K"]), "bwd": CPU_CONFIG["BWD_BLOCK_K"]}
    dx_m = config.get("DX_BLOCK_M") or config["BWD_BLOCK_M"]
    want = [[16, bk["fwd"]] if down and config.get("h_tma") else None,
            [16, bk["bwd"]] if bwd and config.get("rows_tma") and config.get("dy_sorted") else None,
            [dx_m // 2, bk["bwd"]] if bwd and config.get("rows_tma") else None]
    assert halves[-3:] == want, (halves[-3:], want)


# GPU-bucket configs checked against each other in bf16: the grid weight-gradient kernels (the
# reference point), the persistent kernel, the grid ones on slot-ordered rows, and the backward's weights by TMA and dx's own
# 128 x 128 and 128 x 256 tiles (the bench's DeepSeek-V3 sweep); the weight gradients by torch._grouped_mm, also
# beside the down backward on 64 x 64 tiles with dx kept at 64 x 128 (the bench's Qwen3-Next sweep).
BF16_BWD_CONFIGS = [{"dw_persistent": 0}, {"dw_persistent": 1}, {"dw_sorted": True},
                    {"dw_persistent": 1, "dw_sorted": True, "dw_stages": 4},
                    {"dw_persistent": 1, "bwd_tma": True, "DX_BLOCK_M": 128, "DX_BLOCK_N": 128, "dx_stages": 3},
                    {"dw_persistent": 1, "bwd_tma": True, "DX_BLOCK_M": 128, "DX_BLOCK_N": 256, "dx_stages": 3},
                    {"dw_grouped_mm": True},
                    {"dw_grouped_mm": True, "bwd_tma": True, "DX_BLOCK_M": 128, "DX_BLOCK_N": 256, "dx_stages": 3},
                    {"dw_grouped_mm": True, "BWD_BLOCK_N": 64, "DX_BLOCK_N": 128}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU buckets' tiles and bf16 dots run on a GPU only")
@pytest.mark.parametrize("d", [7168, 2048], ids=["d_big", "d_le_4k"])
def test_v28_grouped_mm_backward_bf16_cuda(load, d):
    """The bucket default (dx by torch._grouped_mm since v29) against the Triton dx kernel the bench
    times beside it (bench.MOE_V28_SWEEP) through `_check_bwd_configs_bf16`. Between the two runs the
    bar is 4e-3, not 2e-3: torch's grouped GEMM writes bf16 per-slot dx rows for the combine pass
    where the Triton kernel adds fp32 rows by atomics, one more bf16 rounding (~1.1e-3 relative RMS)
    on every row; against the fp32 reference the bar stays 1e-2."""
    configs = [{}] + moe_experts.bench.MOE_V28_SWEEP
    _check_bwd_configs_bf16(load("swiglu", {}), d, 16 if d < 4096 else 8, configs, same=4e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU buckets' tiles and bf16 dots run on a GPU only")
def test_backward_configs_bf16_cuda(load):
    """At D = 2048 (a GPU bucket: its tiles, bf16 dots) with an odd token count and two experts
    left empty, each of BF16_BWD_CONFIGS: every gradient within 1e-2 of the fp32 reference and
    within 2e-3 of the grid kernels' run; the empty experts' weight gradients are zero."""
    _check_bwd_configs_bf16(load("swiglu", {}), 2048, 16, list(BF16_BWD_CONFIGS))


def _check_bwd_configs_bf16(module, d: int, e: int, configs: list[dict], same: float = 2e-3) -> None:
    """Each of ``configs`` over the bucket of ``d`` (bf16 on a GPU, n 1531 odd, top-4 of ``e``
    experts, two left empty): the output and every gradient within 1e-2 of the fp32 reference and
    `same` of the first config's run (2e-3: the same sums up to bf16 roundings); the empty experts'
    weight gradients zero."""
    n, f, k = 1531, 256, 4
    gen = torch.Generator().manual_seed(3)
    idx = routing("empty_experts", n, e, k, gen).cuda()
    w = torch.rand(n, k, generator=gen) + 0.05
    ins = [torch.randn(n, d, generator=gen), w / w.sum(-1, keepdim=True),
           torch.randn(e, 2 * f, d, generator=gen) / d ** 0.5, torch.randn(e, d, f, generator=gen) / f ** 0.5]
    hi = [t.cuda().requires_grad_() for t in ins]
    dy = torch.randn(n, d, device="cuda")
    bucket = module.shape_bucket(d)
    runs = []
    for extra in configs:
        lo = [t.detach().to(torch.bfloat16).requires_grad_() for t in hi]
        module.set_config(None)
        module.set_config({**module.config_for(d), **extra}, bucket=bucket)
        try:
            y = module.entry(lo[0], idx, *lo[1:])
            y.backward(dy.to(torch.bfloat16))
        finally:
            module.set_config(None, bucket=bucket)
            module.set_config(CPU_CONFIG)
        runs.append([y.detach(), *[t.grad for t in lo]])
    y_ref = module.reference(hi[0], idx, *hi[1:])
    y_ref.backward(dy)
    for extra, outs in zip(configs, runs, strict=True):
        for i, (g, base, ref) in enumerate(zip(outs, runs[0], [y_ref.detach(), *[t.grad for t in hi]], strict=True)):
            assert rel(g, ref) <= 1e-2, (extra, i, rel(g, ref))
            assert rel(g, base) <= same, (extra, i, rel(g, base))
        assert outs[3][e - 2:].abs().max() == 0 and outs[4][e - 2:].abs().max() == 0, extra


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU buckets' tiles and bf16 dots run on a GPU only")
@pytest.mark.parametrize("d", [2048, 7168], ids=["d_le_4k", "d_big"])
def test_backward_v15_configs_bf16_cuda(load, d):
    """Template v15's backward rows as the bench times them (bench.MOE_V15_SWEEP at D 2048,
    MOE_V15_SWEEP_BIG at D 7168: the split epilogue, dy in slot order, rows by TMA, the 128-row
    down backward) against the bucket default (`_check_bwd_configs_bf16`)."""
    bench = moe_experts.bench
    configs = [{}] + (bench.MOE_V15_SWEEP if d < 4096 else bench.MOE_V15_SWEEP_BIG)
    _check_bwd_configs_bf16(load("swiglu", {}), d, 16 if d < 4096 else 8, configs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU buckets' tiles and bf16 dots run on a GPU only")
@pytest.mark.parametrize("d", [7168, 2048], ids=["d_big", "d_le_4k"])  # DeepSeek-V3's first: it decides the most
def test_v17_configs_bf16_cuda(load, d):
    """Template v17's rows as the bench times them (bench.MOE_V17_SWEEP at D 2048; at D 7168
    MOE_V17_SWEEP_BIG and MOE_V17_FWD_SWEEP_BIG: the persistent weight gradients on TMA rows, the
    down backward on 4 warps, h by TMA, the down GEMM on 128 x 128) against the bucket default
    (`_check_bwd_configs_bf16`: the output and every gradient)."""
    bench = moe_experts.bench
    configs = [{}] + (bench.MOE_V17_SWEEP if d < 4096 else bench.MOE_V17_SWEEP_BIG + bench.MOE_V17_FWD_SWEEP_BIG)
    _check_bwd_configs_bf16(load("swiglu", {}), d, 16 if d < 4096 else 8, configs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU buckets' tiles and bf16 dots run on a GPU only")
@pytest.mark.parametrize("d", [7168, 2048], ids=["d_big", "d_le_4k"])  # DeepSeek-V3's first: it decides the most
def test_v18_configs_bf16_cuda(load, d):
    """Template v18's rows as the bench times them (bench.MOE_V18_SWEEP at D 2048: the down backward
    on 128 x 256 / 64 x 256 tiles with its epilogue on eight prefetched slices) and v19's at D 7168
    (MOE_V19_SWEEP_BIG: d_big's down backward is on v18's 128 x 256 row since; the v18 default's
    down backward tile, 4 stages, 64 x 256) against the bucket default (`_check_bwd_configs_bf16`:
    the output and every gradient)."""
    bench = moe_experts.bench
    configs = [{}] + (bench.MOE_V18_SWEEP if d < 4096 else bench.MOE_V19_SWEEP_BIG)
    _check_bwd_configs_bf16(load("swiglu", {}), d, 16 if d < 4096 else 8, configs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU buckets' tiles and bf16 dots run on a GPU only")
@pytest.mark.parametrize("d", [7168, 2048], ids=["d_big", "d_le_4k"])  # DeepSeek-V3's first: it decides the most
def test_v20_configs_bf16_cuda(load, d):
    """Template v20's rows as the bench times them (bench.MOE_V20_SWEEP_BIG at D 7168, MOE_V20_SWEEP
    at D 2048: half-height tails in the down backward and dx, and in the forward down GEMM, with
    their rows by their own half-height descriptors) against the bucket default
    (`_check_bwd_configs_bf16`: the output and every gradient). Its routing leaves half-height last
    tiles: at D 7168 experts of 1027 and 1061 rows over 128-row tiles (3 and 37 rows), at D 2048
    three of 413-452 rows over the backward's 64-row tiles (29, 29 and 4)."""
    bench = moe_experts.bench
    configs = [{}] + (bench.MOE_V20_SWEEP if d < 4096 else bench.MOE_V20_SWEEP_BIG)
    _check_bwd_configs_bf16(load("swiglu", {}), d, 16 if d < 4096 else 8, configs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._grouped_mm's bf16 grouped GEMM runs on a GPU only")
@pytest.mark.parametrize("entry", ["mlp", "bias"])
def test_grouped_mm_weight_gradients_bf16_cuda(load, monkeypatch, entry):
    """dw_grouped_mm in bf16 at D = 2048 (a GPU bucket), odd token count, two experts left empty,
    non-gated experts (GU = F) and per-expert biases: torch._grouped_mm runs twice, every
    gradient is within 2e-3 of the Triton kernels' run and 1e-2 of the fp32 reference, and the
    empty experts' weight (and bias) gradients are zero. dx stays on the Triton kernel in both runs
    (`dx_grouped_mm` off; the bucket's default since v29 is on, test_v28_grouped_mm_backward_bf16_cuda
    checks it), so that only the weight gradients differ."""
    module = load(*{"mlp": ("mlp", {"activation": "relu2"}), "bias": ("swiglu", {"bias": True})}[entry])
    n, d, e, f, k = 1531, 2048, 16, 256, 4
    gu = f if entry == "mlp" else 2 * f
    gen = torch.Generator().manual_seed(3)
    idx = routing("empty_experts", n, e, k, gen).cuda()
    w = torch.rand(n, k, generator=gen) + 0.05
    ins = [torch.randn(n, d, generator=gen), w / w.sum(-1, keepdim=True),
           torch.randn(e, gu, d, generator=gen) / d ** 0.5, torch.randn(e, d, f, generator=gen) / f ** 0.5]
    if entry == "bias":
        ins += [torch.randn(e, gu, generator=gen) / 2, torch.randn(e, d, generator=gen) / 2]
    hi = [t.cuda().requires_grad_() for t in ins]
    dy = torch.randn(n, d, device="cuda")
    bucket = module.shape_bucket(d)
    calls = _count_grouped_mm(monkeypatch)
    runs = []
    for gmm in (False, True):
        lo = [t.detach().to(torch.bfloat16).requires_grad_() for t in hi]
        module.set_config(None)
        module.set_config({**module.config_for(d), "dw_grouped_mm": gmm, "dx_grouped_mm": False}, bucket=bucket)
        try:
            module.entry(lo[0], idx, *lo[1:]).backward(dy.to(torch.bfloat16))
        finally:
            module.set_config(None, bucket=bucket)
            module.set_config(CPU_CONFIG)
        runs.append([t.grad for t in lo])
    assert len(calls) == 2
    module.reference(hi[0], idx, *hi[1:]).backward(dy)
    for i, (g, tri, ref) in enumerate(zip(runs[1], runs[0], [t.grad for t in hi], strict=True)):
        assert rel(g, ref) <= 1e-2 and rel(g, tri) <= 2e-3, (i, rel(g, ref), rel(g, tri))
        if i >= 2:  # the weight and bias gradients: experts e-2, e-1 took no rows
            assert g[e - 2:].abs().max() == 0, i


def test_deterministic_mode_keeps_rows(load, device, monkeypatch):
    """Under torch.use_deterministic_algorithms an "atomic" config still sums fixed-order rows."""
    module = load("swiglu", {})
    fx = fixture(module, "zipf")
    args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(1))
    log = _LaunchLog(module, monkeypatch)
    module.set_config({**CPU_CONFIG, "combine": "atomic"})
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        module.entry(*args)
    finally:
        torch.use_deterministic_algorithms(was)
        module.set_config(CPU_CONFIG)
    launches = log.take()
    assert "moe_combine_kernel" in {n for n, _ in launches}
    assert not any(kw["ATOMIC"] for n, kw in launches if n == "moe_down_fwd_kernel")


def test_forward_without_grad_skips_gu(load, device, monkeypatch):
    """Without a gradient to take, the gate/up GEMM stores h alone (SAVE_GU off, gu empty); with
    one it keeps gu; backward through an op run with keep_gu=False names the problem."""
    module = load("swiglu", {})
    args = fixture(module, "uniform").make_inputs(torch.float32, device, torch.Generator().manual_seed(1))
    log = _LaunchLog(module, monkeypatch)
    with torch.no_grad():
        y0 = module.entry(*args)
    assert [kw["SAVE_GU"] for n, kw in log.take() if n == "moe_gate_up_fwd_kernel"] == [False]
    x = args[0].clone().requires_grad_()
    y1 = module.entry(x, *args[1:])
    assert [kw["SAVE_GU"] for n, kw in log.take() if n == "moe_gate_up_fwd_kernel"] == [True]
    torch.testing.assert_close(y0, y1.detach(), rtol=0, atol=0)
    y, gu = module.moe_experts_op(x, *args[1:], False)
    assert gu.shape[0] == 0
    with pytest.raises(RuntimeError, match="keep_gu=False"):
        y.sum().backward()


@pytest.mark.parametrize("frozen", [(3, 4), (3,), (4,)], ids=["both", "gate_up", "down"])
def test_frozen_weights_skip_their_gradient_gemms(load, device, monkeypatch, frozen):
    """Weights that need no gradient (frozen experts, LoRA elsewhere) get none and their
    weight-gradient kernel does not run; dx, d topk_weights and the other weight's gradient are
    the ones of the full backward."""
    module = load("swiglu", {})
    args = fixture(module, "zipf").make_inputs(torch.float32, device, torch.Generator().manual_seed(4))
    dy = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(5)).to(device)
    full = [a.clone().requires_grad_(i != 1) for i, a in enumerate(args)]
    ref = torch.autograd.grad(module.entry(*full), [full[i] for i in (0, 2, 3, 4)], dy)
    part = [a.clone().requires_grad_(i != 1 and i not in frozen) for i, a in enumerate(args)]
    log = _LaunchLog(module, monkeypatch)
    y = module.entry(*part)
    wanted = [i for i in (0, 2, 3, 4) if i not in frozen]
    got = torch.autograd.grad(y, [part[i] for i in wanted], dy)
    ran = {n for n, _ in log.take()}
    assert ("moe_dwgu_kernel" in ran) == (3 not in frozen) and ("moe_dwd_kernel" in ran) == (4 not in frozen)
    for i, g in zip(wanted, got):
        torch.testing.assert_close(g, ref[(0, 2, 3, 4).index(i)], rtol=1e-6, atol=1e-6)


def _check_vs_transformers_experts(module, hf, device, first: str = "gate_up_proj") -> None:
    """transformers' packed experts module `hf` (D=24, E=5, top-2; weights `first`, gate_up or
    up, and down_proj) with random weights: `module`'s kernel reproduces it."""
    hf = hf.to(device)
    gen = torch.Generator().manual_seed(3)
    first, down = getattr(hf, first), hf.down_proj
    with torch.no_grad():
        for p in (first, down):
            p.copy_(torch.randn(p.shape, generator=gen) / 5)
    x = torch.randn(37, 24, generator=gen).to(device)
    idx = routing("zipf", 37, 5, 2, gen).to(device)
    w = torch.rand(37, 2, generator=gen).to(device)
    torch.testing.assert_close(module.entry(x, idx, w, first, down), hf(x, idx, w), rtol=1e-4, atol=1e-5)


def test_matches_transformers_experts(load, device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=24, num_experts=5, moe_intermediate_size=20,
                                        num_experts_per_tok=2))
    _check_vs_transformers_experts(load("swiglu", {}), hf, device)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
@pytest.mark.parametrize("opcheck_utils", OPCHECK_SPLIT)
def test_opcheck_and_contract(load, device, variant, params, opcheck_utils):
    module = load(variant, params)
    check_module_contract(module)
    check_opcheck(fixture(module, "zipf", n=9), torch.float32, device, utils=opcheck_utils)


def test_shape_errors_name_shapes(load, device):
    module = load("swiglu", {})
    with pytest.raises(ValueError, match=r"down_proj \(5, 24, 19\)"):
        module.entry(torch.randn(4, 24), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2),
                     torch.randn(5, 40, 24), torch.randn(5, 24, 19))


@pytest.mark.slow  # 93 s of one CI worker on a cold Triton cache (twenty-seventh session)
def test_aot_sm90(load):
    check_aot_sm90([load(v, p).__file__ for v, p in CASES + LORA_CASES + BIAS_CASES[1:2]])  # + biases, clamped


# Compiles the named kernels of a rendered module for sm_90 from its bf16 `aot_specs` and prints
# the tensor-core instructions of each one's PTX (run without the interpreter, outside the repo
# root so that `kernels/` cannot shadow the HF package).
_PTX_MMA = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from onboarding.generate import aot
from onboarding.generate import templating

mod = templating.load_module(sys.argv[1])
names, kernels, out = sys.argv[2].split(","), aot.jit_kernels(mod), {}
for spec in mod.aot_specs("bf16"):
    if spec["kernel"] in names:
        src = ASTSource(fn=kernels[spec["kernel"]], signature=spec["signature"], constexprs=spec["constexprs"])
        opts = {"num_warps": spec.get("num_warps", 4), "num_stages": spec.get("num_stages", 3)}
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        out.setdefault(spec["kernel"], []).append(sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\S*", ptx))))
print(json.dumps(out))
"""


def sm90_mma(path, kernels: list[str], cwd) -> dict[str, list[list[str]]]:
    """{kernel: [mma instructions of each bf16 AOT spec]} of a rendered module compiled for sm_90."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PTX_MMA, str(path), ",".join(kernels)], capture_output=True,
                         text=True, env=env, cwd=cwd, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def assert_bf16_mma(found: dict, kernels: list[str]) -> None:
    """Every spec of every kernel runs bf16 x bf16 -> fp32 tensor-core instructions, and no tf32."""
    assert sorted(found) == sorted(kernels), found
    for name, per_spec in found.items():
        for mmas in per_spec:
            assert mmas and all(".bf16.bf16" in m and ".f32." in m for m in mmas), (name, mmas)


GEMM_KERNELS = ["moe_gate_up_fwd_kernel", "moe_down_fwd_kernel", "moe_down_bwd_kernel", "moe_dx_kernel",
                "moe_dwd_kernel", "moe_dwgu_kernel"]


# Compiles every kernel of a rendered module for sm_90 from its bf16 `aot_specs` at D = argv[3]
# under the config pin argv[2] (JSON) and prints {kernel: [registers, spilled bytes, shared bytes,
# HALF_TAIL]} of the named ones (argv[4]); like _PTX_MMA, without the interpreter.
_AOT_USAGE = r"""
import json, sys
from onboarding.generate import aot
from onboarding.generate import templating

mod = templating.load_module(sys.argv[1])
mod.set_config(json.loads(sys.argv[2]))
specs = {s["kernel"]: s for s in mod.aot_specs("bf16", int(sys.argv[3]))}
out = {}
for r in aot.compile_module(mod, size=int(sys.argv[3]), specialize="all"):
    if r.kernel in sys.argv[4].split(","):
        assert r.ok, (r.kernel, r.error)
        out[r.kernel] = [r.n_regs, r.n_spills, r.shared_bytes, specs[r.kernel]["constexprs"].get("HALF_TAIL")]
print(json.dumps(out))
"""
HALF_TAIL_KERNELS = ["moe_down_fwd_kernel", "moe_down_bwd_kernel", "moe_dx_kernel"]


def sm90_usage(path, config: dict, size: int, cwd) -> dict[str, list]:
    """{kernel: [registers, spilled bytes, shared bytes, HALF_TAIL]} of HALF_TAIL_KERNELS compiled
    for sm_90 (bf16, specialize="all") under `config` at D = `size`."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _AOT_USAGE, str(path), json.dumps(config), str(size),
                          ",".join(HALF_TAIL_KERNELS)], capture_output=True, text=True, env=env, cwd=cwd,
                         timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.slow  # sm_90 builds of every kernel, three times: 39 s on 2 cores (37th session)
def test_half_tail_tma_rows_aot_sm90(load, tmp_path):
    """Template v20's half-height tails beside TMA rows (the bench's MOE_V20 rows, all keys on)
    compile for sm_90 at both GPU buckets' D (7168: DeepSeek-V3's 128 x 256 down backward and dx,
    the forward down GEMM's 128 x 256 with h by TMA; 2048: the backward's 64-row tiles, half: 32)
    within an SM's shared memory, with HALF_TAIL on in the three kernels, no spilled byte in the
    down backward or dx, and the forward down GEMM spilling no more than with h_tma alone (the
    half-height loop adds none). Prints each build's registers / spills / shared bytes."""
    path = load("swiglu", {}).__file__
    rows = {"half_tail_bwd": True, "half_tail_down": True, "h_tma": True, "rows_tma": True, "dy_sorted": True}
    for size in (7168, 2048):
        got = sm90_usage(path, rows, size, tmp_path)
        print(f"D {size}: {got}")
        assert all(half for *_, half in got.values()), got
        assert all(smem <= aot.H100_SHARED_BYTES for _, _, smem, _ in got.values()), got
        assert got["moe_down_bwd_kernel"][1] == 0 and got["moe_dx_kernel"][1] == 0, got
        if size == 7168:
            alone = sm90_usage(path, {"h_tma": True}, size, tmp_path)
            print(f"D {size}, h_tma alone: {alone}")
            assert got["moe_down_fwd_kernel"][1] <= alone["moe_down_fwd_kernel"][1], (got, alone)


@pytest.mark.slow  # sm_90 build, nightly: 24.8 s on CI's cold Triton cache (28th session)
def test_bf16_specs_compile_to_bf16_mma(load, tmp_path):
    """bf16 AOT specs use the 16-bit dot mode: every grouped GEMM (and the LoRA variant's
    adapter kernels) compiles for sm_90 to bf16 tensor-core instructions."""
    assert {s["constexprs"]["DOT_PRECISION"] for s in load("swiglu", {}).aot_specs("bf16")
            if "DOT_PRECISION" in s["constexprs"]} == {"bf16"}
    assert_bf16_mma(sm90_mma(load("swiglu", {}).__file__, GEMM_KERNELS, tmp_path), GEMM_KERNELS)
    lora_kernels = ["moe_lora_proj_kernel", "moe_lora_wgrad_kernel", "moe_gate_up_fwd_kernel"]
    assert_bf16_mma(sm90_mma(load("swiglu_lora", {}).__file__, lora_kernels, tmp_path), lora_kernels)


def test_dot_mode_keeps_fp32_operands_off_gpu(load):
    """bf16 inputs on the CPU or in the interpreter keep fp32 operands (its bf16 dot is wrong);
    only a compiled GPU run picks the bf16 tensor-core dot."""
    module = load("swiglu", {})
    cfg = module.config_for(24)
    x = torch.zeros(2, 24, dtype=torch.bfloat16)
    mode = module._dot_mode(cfg["dot_precision"], torch.bfloat16, torch.device("cpu"))
    assert mode in ("ieee", "tf32") and not module._is16(mode)
    assert module._mid_dtype(x, mode) == torch.float32
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        assert module._dot_mode("tf32", torch.bfloat16, torch.device("cuda")) == "tf32"
    assert module._launch({**cfg, "BLOCK_K": 64}, "bf16")["BLOCK_K"] == 64
    assert module._launch({**cfg, "BLOCK_K": 64}, "ieee")["BLOCK_K"] == 32  # fp32 tiles: twice the bytes
    assert module._mid_dtype(x, "bf16") == torch.bfloat16


# Distinct forward / backward tiles: 16 x 32 x 16 forward, 32 x 16 x 32 backward (fp32 operands
# cap BLOCK_K at 32), other warps and stages, so every launch shows which set it took.
SPLIT_CONFIG = {**CPU_CONFIG, "num_warps": 4, "num_stages": 3, "BWD_BLOCK_M": 32, "BWD_BLOCK_N": 16,
                "BWD_BLOCK_K": 32, "bwd_warps": 2, "bwd_stages": 1}
FWD_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 3}
BWD_TILES = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2, "num_stages": 1}
TILE_GEMMS = {"moe_gate_up_fwd_kernel", "moe_down_fwd_kernel", "moe_down_bwd_kernel", "moe_dx_kernel",
              "moe_dwd_kernel", "moe_dwgu_kernel"}  # BLOCK_M x BLOCK_N output tiles from the config


class _LaunchLog:
    """Wraps every `*_kernel` of a module so each launch records (kernel, launch kwargs)."""

    def __init__(self, module, monkeypatch):
        self.launches: list[tuple[str, dict]] = []
        for name in [n for n in dir(module) if n.startswith("moe_") and n.endswith("_kernel")]:
            monkeypatch.setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name, kernel):
        log = self.launches

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    log.append((name, {k: v for k, v in kwargs.items() if isinstance(v, int)}))
                    return kernel[grid](*args, **kwargs)
                return launch
        return Launcher()

    def take(self) -> list[tuple[str, dict]]:
        out, self.launches[:] = list(self.launches), []
        return out


def _checked_launches(fx: KernelFixture, device, monkeypatch, config: dict) -> list[tuple[str, dict]]:
    """Under `config`: the output and every gradient checked against the reference, then the
    kernel launches (name, launch kwargs) of one forward + backward on fresh inputs."""
    module = fx.module
    module.set_config(config)
    try:
        check_forward_backward(fx, torch.float32, device)
        log = _LaunchLog(module, monkeypatch)
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(1))
        leaves = [a.requires_grad_() if i in fx.weights or i == 0 else a for i, a in enumerate(args)]
        fx.module.entry(*leaves).sum().backward()
        return log.take()
    finally:
        module.set_config(CPU_CONFIG)


def assert_tiles(launches: list[tuple[str, dict]], tiles: dict) -> None:
    """Every launch ran on `tiles`: the GEMMs' whole tile, the adapter kernels' K step, warps and
    stages (their rank-wide side is the rank's), the combine's column block and warps."""
    assert launches
    for name, kw in launches:
        if name == "moe_combine_kernel":
            assert (kw["BLOCK_D"], kw["num_warps"]) == (tiles["BLOCK_N"], tiles["num_warps"]), (name, kw)
            continue
        want = tiles if name in TILE_GEMMS else {k: tiles[k] for k in ("BLOCK_K", "num_warps", "num_stages")}
        assert {k: kw[k] for k in want} == want, (name, kw)


@pytest.mark.parametrize("entry", ["swiglu", "swiglu_lora", "swiglu_lora_sorted"])
def test_backward_kernels_use_backward_tiles(load, device, monkeypatch, entry):
    """With distinct forward and backward tiles pinned, forward launches take BLOCK_*/num_warps/
    num_stages and backward launches BWD_BLOCK_*/bwd_warps/bwd_stages (the row tile maps follow),
    and the output and every gradient still match the reference."""
    module = load("swiglu" if entry == "swiglu" else "swiglu_lora", {})
    fx = {"swiglu": fixture, "swiglu_lora": lora_fixture, "swiglu_lora_sorted": sorted_fixture}[entry](
        module, "zipf")
    module.set_config(SPLIT_CONFIG)
    try:
        check_forward_backward(fx, torch.float32, device)
        log = _LaunchLog(module, monkeypatch)
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(1))
        leaves = [a.requires_grad_() if i in fx.weights or i == 0 else a for i, a in enumerate(args)]
        y = fx.module.entry(*leaves)
        fwd = log.take()
        y.backward(torch.randn_like(y))
        bwd = log.take()
    finally:
        module.set_config(CPU_CONFIG)
    assert_tiles(fwd, FWD_TILES)
    assert_tiles(bwd, BWD_TILES)
    assert {n for n, _ in bwd} >= {"moe_down_bwd_kernel", "moe_dx_kernel"}
    assert not {n for n, _ in fwd} & {"moe_down_bwd_kernel", "moe_dx_kernel", "moe_dwd_kernel", "moe_dwgu_kernel"}


@pytest.mark.parametrize("entry", ["swiglu", "mlp", "swiglu_lora", "swiglu_lora_sorted"])
def test_backward_fills_no_zero_gradient_for_saved_outputs(load, device, entry):
    """The op's saved intermediates (gate/up pre-activations; LoRA's row products too) are outputs
    without a gradient: the backward gets None for them (v21), not an autograd-filled zero tensor
    the size of each ([S, 2F]: 537 MB of bf16 at DeepSeek-V3 N8192). The gradients still match."""
    module = load("swiglu_lora" if entry.startswith("swiglu_lora") else entry,
                  {"activation": "relu2"} if entry == "mlp" else {})
    fx = {"swiglu": fixture, "mlp": lambda m, k: fixture(m, k, gated=False), "swiglu_lora": lora_fixture,
          "swiglu_lora_sorted": sorted_fixture}[entry](module, "zipf")
    args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(3))
    leaves = [a.requires_grad_() if isinstance(a, torch.Tensor) and (i in fx.weights or i == 0) else a
              for i, a in enumerate(args)]
    y = fx.module.entry(*leaves)
    fills = zero_fill_shapes((y * torch.randn_like(y)).sum())
    S = args[0].shape[0] if entry == "swiglu_lora_sorted" else args[1].numel()  # (sorted: padding rows too)
    F = args[4].shape[2] if entry != "swiglu_lora_sorted" else args[3].shape[2]
    assert not [s for s in fills if s and s[0] == S and s[-1] in (F, 2 * F)], fills
    check_forward_backward(fx, torch.float32, device)


def test_backward_tile_keys_in_space_config_and_tuner(load):
    """BWD_BLOCK_M/N/K, bwd_warps, bwd_stages are tuning keys: the family spec and the module's
    set_config validate them, and the tuner's --space sub-space takes them (keeping the default)."""
    from onboarding.tune.search import search_space

    module = load("swiglu_lora", {})
    bwd_keys = {"BWD_BLOCK_M", "BWD_BLOCK_N", "BWD_BLOCK_K", "bwd_warps", "bwd_stages"}
    assert bwd_keys <= set(module.TUNING_SPACE) and bwd_keys <= set(module.DEFAULT_CONFIG)
    assert moe_experts.FAMILY.check_config({"BWD_BLOCK_M": 32, "bwd_stages": 4})["bwd_stages"] == 4
    with pytest.raises(InputError, match="BWD_BLOCK_M=48"):
        moe_experts.FAMILY.check_config({"BWD_BLOCK_M": 48})
    with pytest.raises(ValueError, match="bwd_warps=3"):
        module.set_config({"bwd_warps": 3})
    assert module.config_for(24) == {**module.DEFAULT_CONFIG, **CPU_CONFIG}  # the failed pin left it
    space = search_space(module, "d_le_4k", {"BWD_BLOCK_M": [32], "bwd_stages": [2]})
    assert space["BWD_BLOCK_M"] == [32, 64] and space["bwd_stages"] == [2, 4]  # + the bucket's backward default
    assert space["BLOCK_M"] == list(module.TUNING_SPACE["BLOCK_M"])
    with pytest.raises(InputError, match="BWD_BLOCK_K"):
        search_space(module, "d_le_4k", {"BWD_BLOCK_K": [48]})


def test_aot_specs_split_forward_and_backward_tiles(load):
    """At D=7168 (bucket d_big) the bf16 specs carry the measured GPU tiles: forward kernels
    128 x 128 x 64, 8 warps, 4 stages, the plain variant's down GEMM 256 columns wide; backward
    kernels 64 x 128 x 64, 8 warps, 4 stages, the plain variant's down backward and dx 128 x 256, 3
    stages (DOWN_BWD_*, DX_*), with their weights by TMA, the weight-gradient GEMMs 128 x 128 x 64,
    3 stages."""
    fwd = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    bwd = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    for variant in ("swiglu", "swiglu_lora"):
        module = load(variant, {})
        module.set_config(None)  # the buckets' own tiles, not the CPU pin
        try:
            specs = module.aot_specs("bf16", 7168)
        finally:
            module.set_config(CPU_CONFIG)
        got: dict[str, list] = {}
        for spec in specs:
            if "num_stages" in spec:
                tiles = {**{k: spec["constexprs"].get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")},
                         "num_warps": spec["num_warps"], "num_stages": spec["num_stages"]}
                got.setdefault(spec["kernel"], []).append(tiles)
        assert got["moe_gate_up_fwd_kernel"] == [fwd], (variant, got["moe_gate_up_fwd_kernel"])
        down = {**fwd, "BLOCK_N": 256 if variant == "swiglu" else 128}  # DOWN_BLOCK_N: not with LoRA
        assert got["moe_down_fwd_kernel"] == [down], (variant, got["moe_down_fwd_kernel"])
        wide = {**bwd, "BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 3}  # DOWN_BWD_*, DX_*: not with LoRA
        for name in ("moe_down_bwd_kernel", "moe_dx_kernel"):
            want = wide if variant == "swiglu" else bwd
            assert got.get(name, [want]) == [want], (variant, name, got[name])
            assert [s["constexprs"]["TMA"] for s in specs if s["kernel"] == name] == [variant == "swiglu"]
        assert [s["constexprs"]["EPI_SPLIT"] for s in specs if s["kernel"] == "moe_down_bwd_kernel"] == \
            [8 if variant == "swiglu" else 1]
        dw = {**bwd, "BLOCK_M": 128, "num_stages": 3}  # DW_*: the weight-gradient GEMMs' own tile
        for name in ("moe_dwd_kernel", "moe_dwgu_kernel"):
            assert got.get(name, [dw]) == [dw], (variant, name, got[name])
        if variant == "swiglu_lora":  # row projections in both passes, adapter gradients in the backward
            assert {t["BLOCK_M"] for t in got["moe_lora_proj_kernel"]} == {128, 64}
            assert all(t["num_stages"] == 4 and t["BLOCK_K"] == 64 for t in got["moe_lora_wgrad_kernel"])
        combines = [(s["constexprs"]["BLOCK_D"], s["num_warps"], s["signature"]["p_src"]) for s in specs
                    if s["kernel"] == "moe_combine_kernel"]
        # forward and backward combine tiles agree here; the rows they sum: fp32 forward, 16-bit
        # backward (one spec each) except with LoRA (fp32 both ways: one spec)
        srcs = ["*fp32"] if variant == "swiglu_lora" else ["*fp32", "*bf16"]
        assert combines == [(128, 8, src) for src in srcs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 tensor-core path runs on a GPU only")
@pytest.mark.parametrize("variant", ["swiglu", "swiglu_lora", "mlp"])
def test_bf16_tensor_core_accuracy_cuda(load, variant):
    """bf16 kernel (16-bit dots, the module's own GPU tiles) vs the fp32 reference on fp32 inputs:
    relative RMS <= 5e-3 on the output, <= 1e-2 on every gradient (the GPU acceptance bar)."""
    module = load(variant, {"activation": "relu2"} if variant == "mlp" else {})
    n, d, e, f, k = 4096, 1024, 16, 512, 4
    gen = torch.Generator().manual_seed(0)
    idx = routing("uniform", n, e, k, gen).cuda()
    w = torch.rand(n, k, generator=gen) + 0.05
    ins = [torch.randn(n, d, generator=gen), w / w.sum(-1, keepdim=True),
           torch.randn(e, f if variant == "mlp" else 2 * f, d, generator=gen) / d ** 0.5,
           torch.randn(e, d, f, generator=gen) / f ** 0.5]
    if variant == "swiglu_lora":
        ins += _adapters(e, d, f, 16, gen)
    hi = [t.cuda().requires_grad_() for t in ins]
    lo = [t.detach().to(torch.bfloat16).requires_grad_() for t in hi]
    extra = (0.5,) if variant == "swiglu_lora" else ()
    module.set_config(None)  # the GPU buckets' tiles, not the CPU pin
    try:
        y = module.entry(lo[0], idx, *lo[1:], *extra)
        dy = torch.randn(y.shape, device="cuda")
        y.backward(dy.to(y.dtype))
    finally:
        module.set_config(CPU_CONFIG)
    ref = module.reference(hi[0], idx, *hi[1:], *extra)
    ref.backward(dy)
    assert rel(y, ref) <= 5e-3
    for i, (a, b) in enumerate(zip(lo, hi)):
        if b.grad is not None and a.grad is not None:
            assert rel(a.grad, b.grad) <= 1e-2, (i, rel(a.grad, b.grad))


@pytest.mark.parametrize("ref", ["hf:qwen3_moe", "hf:deepseek_v32", "hf:mixtral"])
def test_match_parsed_blocks(parse_model, ref):
    blocks = parse_model(ref).blocks
    experts = [b for b in blocks if b.kind == "moe.experts"]
    assert experts
    for b in experts:
        assert moe_experts.match(b) == {"variant": "swiglu", "params": moe_experts.FAMILY.resolve("swiglu", {})}
    assert all(moe_experts.match(b) is None for b in blocks if b.kind != "moe.experts")


# ---- grouped expert LoRA (variant swiglu_lora) ------------------------------------------------
LORA_ARGS = ("lora_a_gate_up", "lora_b_gate_up", "lora_a_down", "lora_b_down")


def _adapters(e, d, f, rank, gen):
    """Per-expert A and B, B non-zero (PEFT starts B at 0; then dA would be trivially 0)."""
    return [torch.randn(e, rank, d, generator=gen) / d ** 0.5, torch.randn(e, 2 * f, rank, generator=gen) / rank,
            torch.randn(e, rank, f, generator=gen) / f ** 0.5, torch.randn(e, d, rank, generator=gen) / rank]


def lora_fixture(module, kind: str, n=37, d=24, e=5, f=20, k=2, rank=8) -> KernelFixture:
    def make_inputs(dtype, device, gen):
        x = torch.randn(n, d, generator=gen)
        idx = routing(kind, n, e, k, gen)
        w = torch.rand(n, k, generator=gen) + 0.1
        gate_up = torch.randn(e, 2 * f, d, generator=gen) / d ** 0.5
        down = torch.randn(e, d, f, generator=gen) / f ** 0.5
        floats = [t.to(device, dtype) for t in (gate_up, down, *_adapters(e, d, f, rank, gen))]
        return [x.to(device, dtype), idx.to(device), w.to(device, dtype), *floats, 0.5]

    # base expert weights frozen (no_grad); adapter and routing-weight gradients are sums over rows
    return KernelFixture(name=f"moe_experts_lora/{kind}", module=module, make_inputs=make_inputs,
                         weights=(2, 5, 6, 7, 8), no_grad=(3, 4))


class _SortedEntry:
    """The module seen through its pre-sorted entry, so the contract suite checks that entry."""

    def __init__(self, module):
        object.__setattr__(self, "_module", module)

    entry = property(lambda self: self._module.grouped_experts_lora)
    reference = property(lambda self: self._module.grouped_reference)

    def __getattr__(self, name):
        return getattr(self._module, name)

    def __setattr__(self, name, value):  # poisoning must reach the real module
        setattr(self._module, name, value)


def sorted_fixture(module, kind: str, n=37, d=24, e=5, f=20, k=2, rank=8, pad=3) -> KernelFixture:
    def make_inputs(dtype, device, gen):
        counts = torch.bincount(routing(kind, n, e, k, gen).flatten(), minlength=e)
        x = torch.randn(int(counts.sum()) + pad, d, generator=gen)  # + padding rows past sum(counts)
        gate_up = torch.randn(e, 2 * f, d, generator=gen) / d ** 0.5
        down = torch.randn(e, d, f, generator=gen) / f ** 0.5
        floats = [t.to(device, dtype) for t in (gate_up, down, *_adapters(e, d, f, rank, gen))]
        return [x.to(device, dtype), counts.to(device), *floats, 2.0]

    return KernelFixture(name=f"grouped_experts_lora/{kind}", module=_SortedEntry(module), make_inputs=make_inputs,
                         weights=(4, 5, 6, 7), no_grad=(2, 3))


@pytest.mark.parametrize("kind", ROUTINGS)
def test_lora_forward_backward(load, device, kind):
    check_forward_backward(lora_fixture(load("swiglu_lora", {}), kind), torch.float32, device)


@pytest.mark.parametrize("kind", ROUTINGS)
def test_lora_sorted_forward_backward(load, device, kind):
    check_forward_backward(sorted_fixture(load("swiglu_lora", {}), kind), torch.float32, device)


@pytest.mark.parametrize("shape", [dict(n=64, d=40, e=8, f=16, k=1, rank=16), dict(n=1, d=24, e=5, f=20, k=2, rank=3)],
                         ids=["k1-r16", "n1-r3"])
def test_lora_shapes(load, device, shape):
    check_forward_backward(lora_fixture(load("swiglu_lora", {}), "zipf", **shape), torch.float32, device)


def test_lora_clamped_and_bf16(load, device):
    check_forward_backward(lora_fixture(load("swiglu_lora", GPT_OSS), "zipf"), torch.float32, device)
    fx = sorted_fixture(load("swiglu_lora", {}), "all_to_one")
    # Adapter gradients here are sums over all 37 rows of expert 0 (RMS ~9, not O(1)), and the
    # kernel saves gate/up pre-activations in bf16 (as the base variant does) where the reference
    # keeps fp32: near-zero elements then err by ~1% of the RMS (measured 0.1 at RMS 9.2). The
    # absolute atol scales with that RMS; the relative-RMS bound stays the table's.
    fx.tolerances["reduction"] = Tolerance(atol=0.15, rtol=2e-2, max_rel_rms=1e-2)
    check_forward_backward(_gpu_rounding(fx, device), torch.bfloat16, device)


def test_lora_zero_adapters_equal_base_experts(load, device):
    """B = 0 (PEFT's initial state): exactly the frozen experts, and dA = 0 while dB is not."""
    lora_mod, base = load("swiglu_lora", {}), load("swiglu", {})
    gen = torch.Generator().manual_seed(5)
    x, idx = torch.randn(37, 24, generator=gen).to(device), routing("zipf", 37, 5, 2, gen).to(device)
    w = torch.rand(37, 2, generator=gen).to(device)
    gate_up = torch.randn(5, 40, 24, generator=gen).to(device) / 5
    down = torch.randn(5, 24, 20, generator=gen).to(device) / 5
    a_gu, b_gu, a_d, b_d = [t.to(device).requires_grad_() for t in _adapters(5, 24, 20, 4, gen)]
    with torch.no_grad():
        b_gu.zero_()
        b_d.zero_()
    gate_up.requires_grad_(True)  # frozen by the op even if the caller leaves requires_grad on
    y = lora_mod.entry(x, idx, w, gate_up, down, a_gu, b_gu, a_d, b_d, 2.0)
    torch.testing.assert_close(y, base.entry(x, idx, w, gate_up.detach(), down), rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    assert gate_up.grad is None
    assert a_gu.grad.abs().max() == 0 and a_d.grad.abs().max() == 0
    assert b_gu.grad.abs().max() > 0 and b_d.grad.abs().max() > 0
    assert not hasattr(lora_mod, "moe_dwgu_kernel"), "no base-weight gradient kernel in the LoRA variant"


def test_lora_sorted_matches_routed(load, device):
    """The pre-sorted entry on the routed slots, weighted and combined by hand, is the routed entry."""
    module = load("swiglu_lora", {})
    fx = lora_fixture(module, "zipf")
    x, idx, w, gate_up, down, *lora, s = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(2))
    rt = module.route(idx, 5, 16)
    ys = module.grouped_experts_lora(x[rt["tok"]], rt["offsets"].diff(), gate_up, down, *lora, s)
    y = torch.zeros_like(x).index_add_(0, rt["tok"], ys * w.reshape(-1)[rt["order"], None])
    torch.testing.assert_close(y, module.entry(x, idx, w, gate_up, down, *lora, s), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["zipf", "empty_experts", "none"])
@pytest.mark.parametrize("pad", [3, 40], ids=["pad3", "pad40"])
def test_lora_sorted_padding_rows_are_zero(load, device, kind, pad):
    """x_sorted's rows past sum(counts) (expert parallelism's receive buffer) run in no tile, yet
    every [S, *] tensor the pre-sorted op returns (y_sorted and the saved gu, xa, ha) is zero there,
    none left as the allocator had it (poisoned to NaN here; before v27 gu, xa and ha were): the
    op's outputs are a function of its inputs. Padding of 3 rows (inside the last expert's last
    16-row tile) and 40 (past it, over padding tiles); `empty_experts`: the last two experts get
    no rows; `none`: every row is padding. Forward and gradients still match the reference."""
    from onboarding.testing import poisoned

    module = load("swiglu_lora", {})
    fx = sorted_fixture(module, "zipf" if kind == "none" else kind, pad=pad)
    if kind == "none":
        make = fx.make_inputs
        fx = dataclasses.replace(fx, make_inputs=lambda *a: [(x := make(*a))[0], torch.zeros_like(x[1]), *x[2:]])
    args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(6))
    kept, S = int(args[1].sum()), args[0].shape[0]
    assert S == 37 * 2 + pad and kept == (0 if kind == "none" else 37 * 2)  # the routed slots (n * k) + pad
    with poisoned(module):
        outs = module.grouped_experts_lora_op(*args)
    assert len(outs) == 4  # y_sorted, gu, xa, ha
    for i, t in enumerate(outs):
        assert t.shape[0] == S and not t.isnan().any(), i
        assert (t[kept:] == 0).all(), (i, t[kept:].abs().amax(1))
    check_forward_backward(fx, torch.float32, device)


def test_padding_tiles_zero_each_row_past_the_kept_once(load):
    """The rule of the kernels' `_pad_rows` (padding tile t zeroes rows tile_start[t] - BLOCK_M ..
    tile_start[t] within [offsets[E], S)) on `tile_map`'s padding tiles hands every row past
    sum(counts) to exactly one of them, whatever the counts (empty experts, tile multiples, none
    at all) and the slack S - sum(counts): the kernels' zeros cover those rows without two
    programs writing one row."""
    module = load("swiglu_lora", {})
    gen = torch.Generator().manual_seed(7)
    for trial in range(400):
        e = int(torch.randint(1, 9, (1,), generator=gen))
        bm = (16, 32, 64, 128)[trial % 4]
        counts = torch.randint(0, 3 * bm, (e,), generator=gen) * (torch.rand(e, generator=gen) > 0.3)
        if trial % 5 == 0:
            counts = counts // bm * bm  # every expert's last tile full
        if trial % 7 == 0:
            counts[-1] = 0  # the last expert empty
        S = int(counts.sum()) + int(torch.randint(0, 4 * bm, (1,), generator=gen))
        tm = module.tile_map(counts, S, bm)
        starts = tm["tile_start"][tm["tile_expert"] >= e]
        rows = (starts[:, None] - bm + torch.arange(bm)).flatten()
        kept = int(tm["offsets"][-1])
        rows = rows[(rows >= kept) & (rows < S)]
        assert sorted(rows.tolist()) == list(range(kept, S)), (counts.tolist(), S, bm)


@pytest.mark.parametrize("opcheck_utils", OPCHECK_SPLIT)
def test_lora_opcheck_contract_and_errors(load, device, opcheck_utils):
    module = load("swiglu_lora", {})
    check_module_contract(module)
    check_opcheck(lora_fixture(module, "empty_experts", n=9), torch.float32, device, utils=opcheck_utils)
    x, idx, w, gate_up, down, *lora, s = lora_fixture(module, "uniform").make_inputs(
        torch.float32, device, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"lora_b_down \(5, 24, 7\)"):
        module.entry(x, idx, w, gate_up, down, *lora[:3], lora[3][..., :7], s)
    with pytest.raises(ValueError, match=r"counts must be an integer \[E\]=\(5,\)"):
        module.grouped_experts_lora(x, torch.ones(4, dtype=torch.int64), gate_up, down, *lora, s)


def test_bench_cases_construct_and_baselines_agree(load):
    """The GPU benchmark cases build on the CPU (nothing runs), and the two anchors they time
    compute what the kernel computes (fp32, tiny shapes)."""
    from onboarding.bench.cases import cases_for, routing

    bench = moe_experts.bench
    FROZEN_LABELS, MOE_BWD_SWEEP, MOE_FWD_SWEEP, MOE_SHAPES = (bench.FROZEN_LABELS, bench.MOE_BWD_SWEEP,
                                                               bench.MOE_FWD_SWEEP, bench.MOE_SHAPES)
    grouped_mm, transformers_loop = bench.grouped_mm, bench.transformers_loop
    LORA_SHAPES = family_module("lora").bench.LORA_SHAPES

    cases = cases_for(["moe_experts", "lora"])
    moe = {c.name: c for c in cases if c.family == "moe_experts"}
    lora_cases = [c for c in cases if c.family == "lora"]
    frozen = sum(s[0] in FROZEN_LABELS and "uniform" in s[-1] for s in MOE_SHAPES)  # + fwdbwd_frozen
    assert frozen == 2 and len(moe) == 2 * sum(len(s[-1]) for s in MOE_SHAPES) + frozen
    assert len(lora_cases) == 2 * len(LORA_SHAPES)
    anchor = "anchor/E64K8D2048F512N8192/uniform"
    assert moe[f"{anchor}/fwd"].flops == 6 * 8192 * 8 * 2048 * 512
    assert moe[f"{anchor}/fwdbwd"].flops == 3 * moe[f"{anchor}/fwd"].flops
    assert {"deepseek_v3/E256K8D7168F2048N32768/uniform/fwdbwd", "qwen3_next/E512K10D2048F512N8192/zipf/fwd"} <= set(moe)
    assert all(c.flops > 0 and c.min_bytes > 0 and callable(c.setup) for c in cases)
    assert all((c.check is not None) == c.name.endswith("fwdbwd") for c in cases)
    # forward cases sweep forward tiles only, fwd+bwd cases backward tiles only; both hold the measured bests
    fwd_keys, bwd_keys = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}, \
        {"BWD_BLOCK_M", "BWD_BLOCK_N", "BWD_BLOCK_K", "bwd_warps", "bwd_stages"}
    for sweep, keys in ((MOE_FWD_SWEEP, fwd_keys), (MOE_BWD_SWEEP, bwd_keys)):
        assert all(set(cfg) == keys and moe_experts.FAMILY.check_config(cfg) == cfg for cfg in sweep)
        assert len({tuple(cfg.items()) for cfg in sweep}) == len(sweep)
    assert {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3} in MOE_FWD_SWEEP
    assert {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 4} in MOE_BWD_SWEEP
    # every sweep row is a valid config of the family (v18's bwd_epi_split 8 included)
    for sweep in bench.SWEEPS.values():
        assert all(moe_experts.FAMILY.check_config(cfg) == cfg for cfg in sweep), sweep

    module = load("swiglu", {})
    gen = torch.Generator().manual_seed(0)
    idx, w = routing("zipf", 37, 6, 2, torch.device("cpu"), gen)
    assert (w.sum(-1) - 1).abs().max() < 1e-6 and all(len(set(r)) == 2 for r in idx.tolist())
    x, gate_up, down = torch.randn(37, 16, generator=gen), torch.randn(6, 24, 16, generator=gen), \
        torch.randn(6, 16, 12, generator=gen)
    expected = module.reference(x, idx, w, gate_up, down)
    for fn in (transformers_loop, grouped_mm):
        torch.testing.assert_close(fn(x, idx, w, gate_up, down), expected, rtol=1e-4, atol=1e-5)


# ---- non-gated experts (variant mlp) ----------------------------------------------------------
MLP_ACTS = ["relu2", "relu", "silu", "gelu", "gelu_tanh"]
MLP_CASES = [("mlp", {"activation": a}) for a in MLP_ACTS] + [("mlp", {"activation": "relu2", "capacity_factor": 0.75})]
MLP_CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in MLP_CASES]


def mlp_fixture(module, kind: str, n=37, d=24, e=5, f=20, k=2) -> KernelFixture:
    """up_proj [E, F, D], down_proj [E, D, F]; x at unit scale so relu/relu2 see both signs."""
    return fixture(module, kind, n, d, e, f, k, gated=False)


@pytest.mark.parametrize("variant,params,kind", routing_grid(MLP_CASE_PARAMS))
def test_mlp_forward_backward(load, device, variant, params, kind):
    """Forward and dx, d topk_weights, d up_proj, d down_proj vs the per-expert loop, outputs
    poisoned; with capacity_factor 0.75 every routing drops slots (12 kept of ~15-37 per expert)."""
    check_forward_backward(mlp_fixture(load(variant, params), kind), torch.float32, device)


@pytest.mark.parametrize("shape", [
    {"n": 37, "d": 40, "e": 5, "f": 24, "k": 2}, {"n": 64, "d": 24, "e": 8, "f": 16, "k": 1},
    {"n": 1, "d": 24, "e": 5, "f": 20, "k": 2}, {"n": 29, "d": 24, "e": 3, "f": 24, "k": 3},
    {"n": 53, "d": 36, "e": 6, "f": 18, "k": 2},
], ids=["d40", "k1", "n1", "f_eq_d-k3", "d_eq_2f"])
def test_mlp_shapes(load, device, shape):
    check_forward_backward(mlp_fixture(load("mlp", {"activation": "relu2"}), "zipf", **shape), torch.float32, device)


@pytest.mark.parametrize("cf", [0.75, 0.2])
def test_mlp_capacity_all_to_one_top1(load, device, cf):
    """All 37 tokens top-1 to expert 0: with cf 0.2 it keeps ceil(0.2 * 37 / 5) = 2 rows (the
    first two tokens), every other token's output and gradients are zero."""
    module = load("mlp", {"activation": "relu2", "capacity_factor": cf})
    check_forward_backward(mlp_fixture(module, "all_to_one", k=1), torch.float32, device)
    x, idx, w, up, down = mlp_fixture(module, "all_to_one", k=1).make_inputs(
        torch.float32, device, torch.Generator().manual_seed(1))
    cap = module.capacity(37, 5)
    y = module.entry(x, idx, w, up, down)
    assert (y[cap:] == 0).all() and (y[:cap].abs().sum(-1) > 0).all()


@pytest.mark.slow  # sm_90 build, nightly: 29.2 s on CI's cold Triton cache (28th session)
def test_mlp_aot_sm90(load):
    """The non-gated epilogues with libdevice maths (erf; tanh through sigmoid) compile for sm_90
    within the shared-memory budget."""
    check_aot_sm90([load("mlp", {"activation": a}).__file__ for a in ("gelu", "gelu_tanh")])


@pytest.mark.slow  # sm_90 build, nightly: 12.3 s on CI's cold Triton cache (28th session)
def test_mlp_bf16_specs_compile_to_bf16_mma(load, tmp_path):
    assert_bf16_mma(sm90_mma(load("mlp", {"activation": "relu2"}).__file__, GEMM_KERNELS, tmp_path), GEMM_KERNELS)


def test_mlp_bf16_inputs(load, device):
    fx = mlp_fixture(load("mlp", {"activation": "gelu_tanh"}), "zipf")
    check_forward_backward(_gpu_rounding(fx, device), torch.bfloat16, device)


@pytest.mark.parametrize("variant,params", MLP_CASE_PARAMS[:1] + MLP_CASE_PARAMS[-1:])
@pytest.mark.parametrize("opcheck_utils", OPCHECK_SPLIT)
def test_mlp_opcheck_and_contract(load, device, variant, params, opcheck_utils):
    module = load(variant, params)
    check_module_contract(module)
    check_opcheck(mlp_fixture(module, "empty_experts", n=9), torch.float32, device, utils=opcheck_utils)
    assert not hasattr(module, "_swiglu"), "no gated helper in the non-gated module"


@pytest.mark.parametrize("act", MLP_ACTS)
def test_mlp_matches_transformers_nemotron_h_experts(load, device, act):
    """transformers' own non-gated experts (NemotronHExperts, eager loop) with each activation's
    ACT2FN name: the kernel reproduces it."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    hf_act = {"relu2": "relu2", "relu": "relu", "silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_new"}[act]
    cfg = NemotronHConfig(hidden_size=24, n_routed_experts=5, moe_intermediate_size=20, num_experts_per_tok=2,
                          mlp_hidden_act=hf_act)
    _check_vs_transformers_experts(load("mlp", {"activation": act}), NemotronHExperts(cfg), device, "up_proj")


def test_mlp_errors_name_the_problem(load, device):
    module = load("mlp", {"activation": "relu2"})
    with pytest.raises(ValueError, match=r"up_proj \(5, 40, 24\)"):  # a gated [E, 2F, D] weight
        module.entry(torch.randn(4, 24), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2),
                     torch.randn(5, 40, 24), torch.randn(5, 24, 20))
    with pytest.raises(InputError, match="parameter 'activation' must be one of"):
        moe_experts.FAMILY.resolve("mlp", {"activation": "tanh"})
    with pytest.raises(InputError, match="'activation' must be 'silu'.*variant 'mlp'"):
        moe_experts.FAMILY.resolve("swiglu", {"activation": "relu2"})
    with pytest.raises(InputError, match="'limit' applies only to variants"):
        moe_experts.FAMILY.resolve("mlp", {"activation": "relu", "limit": 7.0})
    assert moe_experts.FAMILY.resolve("swiglu", {}) == moe_experts.FAMILY.resolve("swiglu", {"activation": "silu"})


def _experts_block(attrs: dict, params: dict):
    from onboarding.graph.opgraph import Block

    return Block(path="layers.0.experts", kind="moe.experts", layer=0, class_name="AnyName",
                 params=params, attrs={"n_experts": 4, "clamp": None, **attrs})


PACKED_MLP = {"w_in": [4, 20, 24], "w_out": [4, 24, 20]}
LIST_MLP = {f"{i}.{n}.weight": s for i in range(4) for n, s in (("fc1", [20, 24]), ("fc2", [24, 20]))}


@pytest.mark.parametrize("act", MLP_ACTS)
@pytest.mark.parametrize("layout,params", [("packed_3d", PACKED_MLP), ("module_list", LIST_MLP)])
def test_mlp_match_by_structure(act, layout, params):
    """Non-gated blocks match `mlp` with their activation whatever their names; the parameter
    names here are nobody's."""
    block = _experts_block({"layout": layout, "gated": False, "activation": act, "capacity_factor": 1.5}, params)
    assert moe_experts.match(block) == {"variant": "mlp", "params": moe_experts.FAMILY.resolve(
        "mlp", {"activation": act, "capacity_factor": 1.5})}


@pytest.mark.parametrize("attrs,params", [
    ({"activation": "tanh"}, PACKED_MLP),  # an activation the kernel does not render
    ({"activation": None}, PACKED_MLP),
    ({"activation": "relu2", "clamp": 7.0}, PACKED_MLP),  # a clamp: not in this kernel
    ({"activation": "relu2"}, {**PACKED_MLP, "b_in": [4, 20]}),  # a bias: not in this kernel
    ({"activation": "relu2"}, {"w_in": [4, 20, 24], "w_out": [4, 24, 21]}),  # not an up/down pair
    ({"activation": "relu2"}, {**LIST_MLP, "0.fc1.bias": [20]}),
])
def test_mlp_unsupported_stays_uncovered(attrs, params):
    layout = "module_list" if "0.fc1.weight" in params else "packed_3d"
    assert moe_experts.match(_experts_block({"layout": layout, "gated": False, **attrs}, params)) is None


def test_non_gated_silu_is_not_swiglu():
    """A non-gated SiLU block (two weights per expert, no gate product) is `mlp`, never SwiGLU,
    and a gated block never `mlp`."""
    for layout, params in (("packed_3d", PACKED_MLP), ("module_list", LIST_MLP)):
        m = moe_experts.match(_experts_block({"layout": layout, "gated": False, "activation": "silu"}, params))
        assert m is not None and m["variant"] == "mlp", (layout, m)
    gated = _experts_block({"layout": "packed_3d", "gated": True, "activation": "silu"},
                           {"gate_up": [4, 40, 24], "down": [4, 24, 20]})
    assert moe_experts.match(gated)["variant"] == "swiglu"
    assert moe_experts.match(_experts_block({"layout": "packed_3d", "gated": True, "activation": "relu2"},
                                            {"gate_up": [4, 40, 24], "down": [4, 24, 20]})) is None


def test_match_parsed_nemotron_h(parse_model):
    """transformers' nemotron_h proxy: relu2 experts with up [E, F, D] / down [E, D, F] and
    D = 2F, classified non-gated from the weight shapes and matched to `mlp`."""
    experts = [b for b in parse_model("hf:nemotron_h").blocks if b.kind == "moe.experts"]
    assert experts
    for b in experts:
        assert b.attrs["gated"] is False and b.attrs["activation"] == "relu2", b.attrs
        assert moe_experts.match(b) == {"variant": "mlp",
                                        "params": moe_experts.FAMILY.resolve("mlp", {"activation": "relu2"})}


# ---- per-expert biases (swiglu `bias`) and gpt-oss's layout -----------------------------------
BIAS_CASES = [("swiglu", {"bias": True}), ("swiglu", {"bias": True, **GPT_OSS}),
              ("swiglu", {"bias": True, "capacity_factor": 0.75})]


def bias_fixture(module, kind: str, n=37, d=24, e=5, f=20, k=2) -> KernelFixture:
    """`fixture` plus non-zero random gate_up_bias [E, 2F] and down_bias [E, D]; every bias
    gradient is a per-expert row sum (the "reduction" tolerance)."""
    base = fixture(module, kind, n=n, d=d, e=e, f=f, k=k)

    def make_inputs(dtype, device, gen):
        args = base.make_inputs(dtype, device, gen)
        b_gu = torch.randn(e, 2 * f, generator=gen) / 2
        b_d = torch.randn(e, d, generator=gen) / 2
        return [*args, b_gu.to(device, dtype), b_d.to(device, dtype)]

    return KernelFixture(name=f"moe_experts/bias/{kind}", module=module, make_inputs=make_inputs,
                         weights=(2, 3, 4, 5, 6))


@pytest.mark.parametrize("variant,params,kind", routing_grid([pytest.param(v, p, id=case_id(v, p)) for v, p in BIAS_CASES]))
def test_bias_forward_backward(load, device, variant, params, kind):
    """Forward and every gradient (x, topk_weights, both weights, both biases) vs the per-expert
    loop, over uniform, Zipf, all-to-one and empty-expert routing, plain, clamped gpt-oss style and
    with capacity dropping."""
    check_forward_backward(bias_fixture(load(variant, params), kind), torch.float32, device)


@pytest.mark.parametrize("shape", [dict(n=37, d=40, e=5, f=24, k=2), dict(n=1, d=24, e=5, f=20, k=2)],
                         ids=["d40", "n1"])
def test_bias_shapes(load, device, shape):
    check_forward_backward(bias_fixture(load("swiglu", {"bias": True}), "zipf", **shape), torch.float32, device)


def test_bias_gradients_are_per_expert_sums(load, device):
    """The bias gradients by their definition: d gate_up_bias[e] sums d(gate|up) over e's rows and
    d down_bias[e] = sum over e's slots of r * dy[token]; an expert nobody routes to gets zero."""
    module = load("swiglu", {"bias": True})
    args = bias_fixture(module, "empty_experts").make_inputs(torch.float32, device, torch.Generator().manual_seed(5))
    x, idx, w = args[:3]
    leaves = [a.clone().requires_grad_(True) for a in args[3:]]
    y = module.entry(x, idx, w, *leaves)
    dy = torch.randn_like(y)
    y.backward(dy)
    expect_bd = torch.zeros_like(leaves[3])
    for e in range(leaves[3].shape[0]):
        tok, slot = torch.where(idx == e)
        expect_bd[e] = (w[tok, slot, None] * dy[tok]).sum(0)
    torch.testing.assert_close(leaves[3].grad, expect_bd, rtol=1e-4, atol=1e-5)
    assert (leaves[2].grad[-2:] == 0).all() and (leaves[3].grad[-2:] == 0).all()  # experts 3, 4 unused
    assert leaves[2].grad[:3].abs().sum() > 0


@pytest.mark.parametrize("opcheck_utils", OPCHECK_SPLIT)
def test_bias_opcheck_and_contract(load, device, opcheck_utils):
    module = load("swiglu", {"bias": True, **GPT_OSS})
    check_module_contract(module)
    check_opcheck(bias_fixture(module, "zipf", n=9), torch.float32, device, utils=opcheck_utils)


def test_bias_shape_errors_name_shapes(load, device):
    module = load("swiglu", {"bias": True})
    args = [torch.randn(4, 24), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2), torch.randn(5, 40, 24),
            torch.randn(5, 24, 20)]
    with pytest.raises(ValueError, match=r"gate_up_bias \[E, 2F\].*gate_up_bias \(5, 20\)"):
        module.entry(*args, torch.randn(5, 20), torch.randn(5, 24))
    with pytest.raises(ValueError, match=r"down_bias \(24,\)"):
        module.entry(*args, torch.randn(5, 40), torch.randn(24))


def test_bias_only_in_swiglu():
    """Biases are rendered for `swiglu` only: asking them of the LoRA or non-gated variants is a
    clear error naming the parameter, never a silently bias-free kernel."""
    for variant in ("swiglu_lora", "mlp"):
        with pytest.raises(InputError, match=r"parameter 'bias' applies only to variants \['swiglu'\]"):
            moe_experts.FAMILY.resolve(variant, {"bias": True, "activation": "silu"})


def test_bias_default_renders_unchanged(load):
    """Without `bias` the entry, kernels and AOT signatures are those of before (no bias argument)."""
    import inspect

    module = load("swiglu", {})
    assert list(inspect.signature(module.entry).parameters) == [
        "x", "topk_indices", "topk_weights", "gate_up_proj", "down_proj"]
    names = {n for spec in module.aot_specs() for n in spec["signature"]}
    assert not names & {"p_bgu", "p_bd", "p_dbgu", "p_dbd"}, names
    biased = {n for spec in load("swiglu", {"bias": True}).aot_specs() for n in spec["signature"]}
    assert {"p_bgu", "p_bd", "p_dbgu", "p_dbd"} <= biased


def _gpt_oss_experts(device, d=24, f=20, e=5, limit=1.0, seed=3):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = GptOssExperts(GptOssConfig(hidden_size=d, intermediate_size=f, num_local_experts=e,
                                    num_experts_per_tok=2, swiglu_limit=limit))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random weights and non-zero random biases (the module starts empty)
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 4)
    return hf.to(device), gen


# What the classifier records for GptOssExperts (tests/test_patching.py checks it on the parsed
# gpt_oss proxy): x @ W weights, interleaved gate/up, both biases, clamped sigmoid GLU.
GPT_OSS_ATTRS = {"n_experts": 5, "layout": "packed_3d", "gated": True, "activation": "silu", "clamp": 1.0,
                 "clamp_style": "pre_act", "alpha": 1.702, "up_offset": 1.0, "weight_layout": "in_out",
                 "gate_up_split": "interleaved", "gate_up_bias": "gate_up_proj_bias", "down_bias": "down_proj_bias"}


def test_matches_transformers_gpt_oss_experts(load, device):
    """transformers' GptOssExperts itself (gate_up [E, D, 2F] used as x @ W with gate/up
    interleaved, down [E, F, D], both biases, clamp, slope 1.702, up + 1) through the patch path:
    matched from its structure, bound with the layout conversion, checked on the first call, then
    forward and every gradient (x, routing weights, both weights and both biases, in their own
    layouts) equal to the unpatched module's. Frozen weights convert once (cached) and convert
    again after an in-place update."""
    from onboarding.graph.opgraph import Block, OpGraph
    from onboarding.patching.core import patch_model

    hf, gen = _gpt_oss_experts(device)
    root = torch.nn.Module()
    root.experts = hf
    block = Block(path="experts", kind="moe.experts", layer=0, class_name="AnyName",
                  params={n: list(p.shape) for n, p in hf.named_parameters()}, attrs=dict(GPT_OSS_ATTRS))
    m = moe_experts.match(block)
    assert m == {"variant": "swiglu", "params": moe_experts.FAMILY.resolve(
        "swiglu", {"bias": True, "limit": 1.0, "alpha": 1.702, "up_offset": 1.0})}
    graph = OpGraph(model="toy", capture="export", capture_note="", batch=1, seq=37, dtype="fp32", blocks=[block],
                    layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)
    x = torch.randn(37, 24, generator=gen).to(device).requires_grad_(True)
    idx = routing("zipf", 37, 5, 2, gen).to(device)
    w = torch.rand(37, 2, generator=gen).to(device).requires_grad_(True)
    leaves = [x, w, *hf.parameters()]
    expected = hf(x, idx, w)
    dy = torch.randn(expected.shape, generator=gen).to(device)
    expected_grads = torch.autograd.grad(expected, leaves, dy)
    with patch_model(root, graph, {("experts", "moe_experts"): load(m["variant"], m["params"])}) as patches:
        with torch.no_grad():
            first = hf(x, idx, w)  # calibration: the kernel against the module's own output
        rec = patches.records[0]
        assert rec.status == "active", rec.detail
        assert "in_out interleaved + biases" in rec.binding, rec.binding
        got = hf(x, idx, w)
        grads = torch.autograd.grad(got, leaves, dy)
        with torch.no_grad():  # frozen: converted once, then from the cache
            hf.requires_grad_(False)
            cached = hf(x, idx, w)
            hf.gate_up_proj.mul_(0.5)  # in place: the cache must see the new version
            hf.gate_up_proj_bias.add_(0.25)
            updated = hf(x, idx, w)
    with torch.no_grad():
        updated_ref = hf(x, idx, w)  # restored: the module's own forward
    for out in (first, got, cached):
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(updated, updated_ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(updated_ref, expected, rtol=1e-3, atol=1e-3)
    for name, g, r in zip(["x", "routing_weights", *dict(hf.named_parameters())], grads, expected_grads):
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")


def test_gpt_oss_wrong_split_is_rejected(load, device):
    """The first-call check guards the layout: read as halves (what it is not), GptOssExperts
    stays unpatched and gives its own output."""
    from onboarding.graph.opgraph import Block, OpGraph
    from onboarding.patching.core import patch_model

    hf, gen = _gpt_oss_experts(device)
    root = torch.nn.Module()
    root.experts = hf
    block = Block(path="experts", kind="moe.experts", layer=0, class_name="AnyName",
                  params={n: list(p.shape) for n, p in hf.named_parameters()},
                  attrs={**GPT_OSS_ATTRS, "gate_up_split": "halves"})
    m = moe_experts.match(block)
    graph = OpGraph(model="toy", capture="export", capture_note="", batch=1, seq=37, dtype="fp32", blocks=[block],
                    layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)
    x = torch.randn(37, 24, generator=gen).to(device)
    idx = routing("uniform", 37, 5, 2, gen).to(device)
    w = torch.rand(37, 2, generator=gen).to(device)
    with torch.no_grad():
        expected = hf(x, idx, w)
        with patch_model(root, graph, {("experts", "moe_experts"): load(m["variant"], m["params"])}) as patches:
            got = hf(x, idx, w)
            assert patches.records[0].status == "rejected", patches.records[0]
    assert torch.equal(got, expected)


GPT_OSS_PARAMS = {"gate_up_proj": [4, 24, 40], "gate_up_proj_bias": [4, 40], "down_proj": [4, 20, 24],
                  "down_proj_bias": [4, 24]}
GPT_OSS_BLOCK = {"layout": "packed_3d", "gated": True, "activation": "silu", "weight_layout": "in_out",
                 "gate_up_split": "interleaved", "gate_up_bias": "gate_up_proj_bias", "down_bias": "down_proj_bias"}


@pytest.mark.parametrize("attrs,params,expect", [
    (GPT_OSS_BLOCK, GPT_OSS_PARAMS, {"bias": True}),
    # names are nobody's: the roles come from the attrs and shapes
    ({**GPT_OSS_BLOCK, "gate_up_bias": "b1", "down_bias": "b2"},
     {"w1": [4, 24, 40], "b1": [4, 40], "w2": [4, 20, 24], "b2": [4, 24]}, {"bias": True}),
    ({**GPT_OSS_BLOCK, "gate_up_bias": None, "down_bias": None},
     {"gate_up_proj": [4, 24, 40], "down_proj": [4, 20, 24]}, {}),
    ({**GPT_OSS_BLOCK, "weight_layout": "out_in", "gate_up_bias": None, "down_bias": None},
     {"gate_up": [4, 40, 24], "down": [4, 24, 20]}, {}),
    ({**GPT_OSS_BLOCK, "weight_layout": "out_in", "gate_up_split": "halves"},
     {"gate_up": [4, 40, 24], "down": [4, 24, 20], "gate_up_proj_bias": [4, 40], "down_proj_bias": [4, 24]},
     {"bias": True}),
])
def test_packed_layouts_match_swiglu(attrs, params, expect):
    """x @ W weights, interleaved gate/up and biases match `swiglu` (with `bias` for biases)."""
    assert moe_experts.match(_experts_block(attrs, params)) == {
        "variant": "swiglu", "params": moe_experts.FAMILY.resolve("swiglu", expect)}


@pytest.mark.parametrize("attrs,params", [
    ({**GPT_OSS_BLOCK, "gate_up_split": None}, GPT_OSS_PARAMS),  # the split could not be read
    ({**GPT_OSS_BLOCK, "down_bias": None}, GPT_OSS_PARAMS),  # one bias alone (and an unknown param)
    ({**GPT_OSS_BLOCK, "weight_layout": "out_in"}, GPT_OSS_PARAMS),  # shapes do not fit the layout
    ({**GPT_OSS_BLOCK, "weight_layout": None}, GPT_OSS_PARAMS),
    (GPT_OSS_BLOCK, {**GPT_OSS_PARAMS, "gate_up_proj_bias": [4, 24]}),  # a bias of the wrong width
    (GPT_OSS_BLOCK, {**GPT_OSS_PARAMS, "scales": [4, 7]}),  # a parameter the kernel would ignore
])
def test_unreadable_packed_layouts_stay_uncovered(attrs, params):
    assert moe_experts.match(_experts_block(attrs, params)) is None


# ---- no host sync: route's counts and every host op of forward and backward ------------------
def _route_by_bincount(idx: torch.Tensor, e: int, cap: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept slots' flat indices sorted by expert, kept slots per expert): route before v26, by
    torch.bincount and a boolean mask (both read device values on the host on CUDA)."""
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    if cap is not None:
        start = torch.cumsum(counts, 0) - counts
        order = order[torch.arange(order.numel()) - start[flat[order]] < cap]
        counts = counts.clamp(max=cap)
    return order, counts


def _edge_routings(gen: torch.Generator) -> dict:
    """[N, K] expert ids over E = 5: random, one expert left empty, every token on expert 3 (top-1),
    one token, no token."""
    return {"random": torch.randint(0, 5, (41, 3), generator=gen),
            "empty_expert": torch.randint(0, 4, (33, 2), generator=gen),
            "all_on_one": torch.full((29, 1), 3, dtype=torch.int64),
            "one_token": torch.tensor([[4, 1]]), "no_token": torch.zeros(0, 2, dtype=torch.int64)}


@pytest.mark.parametrize("params", [{}, {"capacity_factor": 0.75}, {"capacity_factor": 1.5}],
                         ids=["dropless", "cf0.75", "cf1.5"])
def test_route_matches_bincount_route(load, params):
    """expert_counts equals torch.bincount (values and int64 dtype), and route (scatter-add counts;
    with capacity dropping a stable partition of kept and dropped slots into S = n_rows rows, a
    bound) gives the bincount-and-mask route's kept slots, offsets, positions and tiles, int32 ids
    too; the rows after the kept ones hold the dropped slots, -1 in pos, and no tile runs them."""
    module = load("swiglu", params)
    gen = torch.Generator().manual_seed(7)
    for name, idx in _edge_routings(gen).items():
        for ids in (idx, idx.to(torch.int32)):
            counts = module.expert_counts(ids.reshape(-1), 5)
            want = torch.bincount(ids.reshape(-1), minlength=5)
            assert counts.dtype == want.dtype == torch.int64 and torch.equal(counts, want), name
            N, K = ids.shape
            cap = module.capacity(N * K, 5)
            order, kept = _route_by_bincount(ids, 5, cap)
            rt = module.route(ids, 5, 16)
            S, n = rt["S"], order.numel()
            assert S == module.n_rows(N * K, 5) >= n and rt["order"].shape == rt["tok"].shape == (S,), name
            assert (S == N * K) if cap is None else (S == min(N * K, 5 * cap)), name
            assert torch.equal(rt["order"][:n], order) and torch.equal(rt["tok"], rt["order"] // K), name
            assert torch.equal(rt["offsets"], torch.cat([kept.new_zeros(1), kept.cumsum(0)])), name
            pos = torch.full((N * K,), -1, dtype=torch.int64)
            pos[order] = torch.arange(n)
            assert torch.equal(rt["pos"].reshape(-1), pos), name
            # the dropped slots fill the rows after the kept ones, in expert order, as many as fit
            kept_slots = set(order.tolist())
            dropped = [s for s in torch.argsort(ids.reshape(-1), stable=True).tolist() if s not in kept_slots]
            assert rt["order"][n:].tolist() == dropped[:S - n], name
            old = module.tile_map(kept, n, 16)
            T = old["tile_expert"].numel()
            assert torch.equal(rt["tile_expert"][:T], old["tile_expert"]), name
            assert (rt["tile_expert"][T:] == 5).all(), name  # more padding tiles: none runs a row
            real = old["tile_expert"] < 5
            assert torch.equal(rt["tile_start"][:T][real], old["tile_start"][real]), name
    if params:  # every token on one expert keeps exactly cap slots
        rt = module.route(torch.full((29, 1), 3, dtype=torch.int64), 5, 16)
        assert rt["offsets"].diff().tolist() == [0, 0, 0, module.capacity(29, 5), 0]


@pytest.mark.parametrize("params", [{}, {"capacity_factor": 0.75}], ids=["dropless", "cf0.75"])
def test_route_tile_map_padded_rows_run_on_meta(load, params):
    """route, tile_map and _padded_rows on 'meta' tensors: an op whose output shape depends on
    the values (bincount, nonzero, a boolean-mask index, .item()) has no meta kernel, so these
    host steps of the forward and the backward read nothing back from the device. Shapes as on
    real inputs."""
    module = load("swiglu", params)
    idx = torch.empty(37, 2, dtype=torch.int64, device="meta")
    S = module.n_rows(74, 5)
    rt = module.route(idx, 5, 16)
    assert rt["S"] == S and rt["order"].shape == rt["tok"].shape == (S,) and rt["pos"].shape == (37, 2)
    assert rt["offsets"].shape == (6,) and rt["tile_expert"].shape == rt["tile_start"].shape == (-(-S // 16) + 5,)
    assert module.expert_counts(idx.reshape(-1), 5).shape == (5,)
    tm = module.tile_map(rt["offsets"].diff(), S, 32)
    assert tm["tile_expert"].shape == (-(-S // 32) + 5,)
    rows, poff = module._padded_rows(torch.empty(37, 24, device="meta"), rt, 16, torch.bfloat16)
    assert rows.shape == (S + 5 * 15, 24) and rows.dtype == torch.bfloat16 and poff.shape == (6,)


@pytest.mark.parametrize("variant", ["swiglu", "swiglu_lora"])
def test_capacity_rows_after_the_kept_are_defined(load, device, variant):
    """With capacity dropping S = n_rows rows run only up to the kept count (offsets[E]): every
    element of the forward op's outputs (y and the saved pre-activations; LoRA's row projections)
    is still written, none left as the allocator had it (poisoned to NaN here), so the op's
    outputs are a function of its inputs (opcheck compares eager and traced runs)."""
    from onboarding.testing import poisoned

    module = load(variant, {"capacity_factor": 0.75})
    fx = (lora_fixture if variant == "swiglu_lora" else fixture)(module, "all_to_one")
    args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(3))
    rt = module.route(args[1], 5, 16)
    assert rt["offsets"][-1] < rt["S"]  # rows after the kept ones exist
    with poisoned(module):
        outs = module._forward(*args)
    for i, t in enumerate(outs):
        assert t.shape[0] in (args[0].shape[0], rt["S"]) and not t.isnan().any(), i


NO_SYNC_CONFIGS = {"rows": {}, "atomic": {"combine": "atomic"},
                   "dx_tiles_dw_pad": {**PERSISTENT, "DX_BLOCK_M": 32, "dw_persistent": 1, "dw_sorted": True,
                                       "dw_tma": True, "dw_pad": True, "dy_sorted": True},
                   "grid_dw_sorted": {"dw_sorted": True}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the Triton interpreter's launches on CPU tensors; "
                    "on a GPU test_no_host_sync_cuda checks the same under CUDA's sync debug mode")
@pytest.mark.parametrize("entry", ["swiglu", "swiglu_cf", "bias_cf", "mlp", "swiglu_lora", "swiglu_lora_cf",
                                   "swiglu_lora_sorted"])
def test_forward_backward_read_nothing_on_the_host(load, entry):
    """One forward + backward of each entry (routed dropless, capacity dropping, biases, non-gated,
    grouped LoRA routed and pre-sorted) under several configs, counted by
    `onboarding.testing.hostcost`: no op that reads a device value on the host on CUDA (bincount,
    nonzero, a boolean-mask index, .item(), .tolist(), ...) in the module's host code (Triton
    kernels run by the interpreter). Before v26 route's bincount (and with capacity its mask)
    counted here."""
    from onboarding.testing.hostcost import counting

    variant, params = {"swiglu": ("swiglu", {}), "swiglu_cf": ("swiglu", {"capacity_factor": 0.75}),
                       "bias_cf": ("swiglu", {"bias": True, "capacity_factor": 0.75}),
                       "mlp": ("mlp", {"activation": "relu2"}), "swiglu_lora": ("swiglu_lora", {}),
                       "swiglu_lora_cf": ("swiglu_lora", {"capacity_factor": 0.75}),
                       "swiglu_lora_sorted": ("swiglu_lora", {})}[entry]
    module = load(variant, params)
    lora = variant == "swiglu_lora"
    fx = (sorted_fixture(module, "zipf") if entry.endswith("sorted") else lora_fixture(module, "zipf") if lora
          else bias_fixture(module, "empty_experts") if params.get("bias")
          else fixture(module, "all_to_one" if "capacity_factor" in params else "zipf", gated=variant != "mlp"))
    args = fx.make_inputs(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(4))
    configs = {"rows": {}} if lora else NO_SYNC_CONFIGS
    for name, extra in configs.items():
        module.set_config({**CPU_CONFIG, **extra})
        try:
            leaves = [a.detach().clone().requires_grad_(i == 0 or i in fx.weights)
                      if isinstance(a, torch.Tensor) and a.is_floating_point() else a for i, a in enumerate(args)]
            with counting() as mode:
                y = fx.module.entry(*leaves)
                y.backward(torch.ones_like(y))
        finally:
            module.set_config(CPU_CONFIG)
        assert not mode.cost.syncs, (name, dict(mode.cost.syncs))
        assert sum(mode.cost.triton.values()) >= 4, (name, dict(mode.cost.triton))  # the kernels ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode runs on a GPU only")
@pytest.mark.parametrize("entry", ["swiglu", "swiglu_cf", "bias_cf", "mlp", "swiglu_lora", "swiglu_lora_sorted"])
def test_no_host_sync_cuda(load, entry):
    """bf16 forward + backward with the GPU bucket's config (D = 2048) under
    torch.cuda.set_sync_debug_mode("error"): any op that waits for the device raises (CUDA's
    bincount read its largest index back before v26: two syncs per MoE layer's forward + backward,
    and no CUDA-graph capture). One warm-up run first (Triton compiles)."""
    variant, params = {"swiglu": ("swiglu", {}), "swiglu_cf": ("swiglu", {"capacity_factor": 0.75}),
                       "bias_cf": ("swiglu", {"bias": True, "capacity_factor": 0.75}),
                       "mlp": ("mlp", {"activation": "relu2"}), "swiglu_lora": ("swiglu_lora", {}),
                       "swiglu_lora_sorted": ("swiglu_lora", {})}[entry]
    module = load(variant, params)
    n, d, e, f, k = 300, 2048, 8, 256, 2
    lora = variant == "swiglu_lora"
    fx = (sorted_fixture(module, "zipf", n=n, d=d, e=e, f=f, k=k) if entry.endswith("sorted")
          else lora_fixture(module, "zipf", n=n, d=d, e=e, f=f, k=k) if lora
          else bias_fixture(module, "empty_experts", n=n, d=d, e=e, f=f, k=k) if params.get("bias")
          else fixture(module, "zipf", n=n, d=d, e=e, f=f, k=k, gated=variant != "mlp"))
    args = fx.make_inputs(torch.bfloat16, torch.device("cuda"), torch.Generator().manual_seed(0))

    # on the device before the checked run: a host-to-device copy waits for the stream
    dy = torch.randn(args[0].shape[0], d, generator=torch.Generator().manual_seed(1)).cuda()

    def run(inputs, fn):
        leaves = [a.detach().clone().requires_grad_(i == 0 or i in fx.weights)
                  if isinstance(a, torch.Tensor) and a.is_floating_point() else a for i, a in enumerate(inputs)]
        y = fn(*leaves)
        y.backward(dy.to(y.dtype))
        return [y, *[a.grad for a in leaves if isinstance(a, torch.Tensor) and a.grad is not None]]

    module.set_config(None)  # the GPU bucket's tiles
    try:
        warm = run(args, fx.module.entry)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = run(args, fx.module.entry)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        module.set_config(CPU_CONFIG)
    # and right (capacity dropping: rows after the kept ones in no group of torch._grouped_mm):
    # the fp32 reference on the same values, within twice the bf16 acceptance bar
    refs = run([a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args],
               fx.module.reference)
    for i, (a, b, ref) in enumerate(zip(outs, warm, refs, strict=True)):
        assert torch.isfinite(a.float()).all() and rel(a, b) <= 1e-2, i
        assert rel(a, ref) <= 2e-2, (i, rel(a, ref))
