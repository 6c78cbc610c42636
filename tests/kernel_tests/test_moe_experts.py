"""MoE experts family (permute -> grouped GEMM with SwiGLU -> grouped GEMM with routing weight ->
combine): forward and every gradient vs the per-expert loop, over routing patterns."""

from __future__ import annotations

import pytest
import torch
from conftest import case_id

from onboarding import aot, templating
from onboarding.families import moe_experts
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck

GPT_OSS = {"limit": 1.0, "alpha": 1.702, "up_offset": 1.0}
CASES = [("swiglu", {}), ("swiglu", GPT_OSS), ("swiglu", {"capacity_factor": 0.75})]
CASE_PARAMS = [pytest.param(v, p, id=case_id(v, p)) for v, p in CASES]
# BLOCK_M=16 with expert loads of 0..74 rows: counts are not tile multiples; 32-wide N tiles over
# D=24/40 and F=20 leave partial column tiles too.
CPU_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "dot_precision": "ieee"}
ROUTINGS = ["uniform", "zipf", "all_to_one", "empty_experts"]
_MODULES: dict = {}


@pytest.fixture(scope="module")
def load(kernel_root):
    def load(variant, params):
        key = (variant, tuple(sorted(params.items())))
        if key not in _MODULES:
            src = templating.render(moe_experts.FAMILY, variant, params)
            name = case_id(variant, params).replace("=", "_").replace("-", "_").replace(".", "p").lower()
            module = templating.load_module(templating.write_module(src, kernel_root / "moe_experts" / f"{name}.py"))
            module.set_config(CPU_CONFIG)
            _MODULES[key] = module
        return _MODULES[key]

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


def fixture(module, kind: str, n=37, d=24, e=5, f=20, k=2) -> KernelFixture:
    def make_inputs(dtype, device, gen):
        x = torch.randn(n, d, generator=gen)
        idx = routing(kind, n, e, k, gen)
        w = torch.rand(n, k, generator=gen) + 0.1
        gate_up = torch.randn(e, 2 * f, d, generator=gen) / d ** 0.5
        down = torch.randn(e, d, f, generator=gen) / f ** 0.5
        return [x.to(device, dtype), idx.to(device), w.to(device, dtype), gate_up.to(device, dtype),
                down.to(device, dtype)]

    return KernelFixture(name=f"moe_experts/{kind}", module=module, make_inputs=make_inputs, weights=(2, 3, 4))


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_forward_backward(load, device, variant, params, kind):
    check_forward_backward(fixture(load(variant, params), kind), torch.float32, device)


@pytest.mark.parametrize("shape", [dict(n=37, d=40, e=5, f=24, k=2), dict(n=64, d=24, e=8, f=16, k=1),
                                   dict(n=1, d=24, e=5, f=20, k=2)], ids=["d40", "k1", "n1"])
def test_shapes(load, device, shape):
    check_forward_backward(fixture(load("swiglu", {}), "uniform", **shape), torch.float32, device)


def test_all_tokens_one_expert_top1(load, device):
    check_forward_backward(fixture(load("swiglu", {}), "all_to_one", k=1), torch.float32, device)


def test_bf16_inputs(load, device):
    """bf16 weights and activations: loads upcast to fp32, so the interpreter's bf16 maths is never hit."""
    check_forward_backward(fixture(load("swiglu", {}), "zipf"), torch.bfloat16, device)


def test_capacity_drops_slots(load, device):
    module = load("swiglu", {"capacity_factor": 0.75})
    idx = torch.zeros(37, 2, dtype=torch.int64, device=device)
    idx[:, 1] = 1
    rt = module.route(idx, 5, 16)
    cap = module.capacity(74, 5)
    assert rt["S"] == 2 * cap and (rt["pos"][cap:] == -1).all() and (rt["pos"][:cap] >= 0).all()
    dropless = load("swiglu", {})
    assert dropless.capacity(74, 5) is None and dropless.route(idx, 5, 16)["S"] == 74


def test_matches_transformers_experts(load, device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=24, num_experts=5, moe_intermediate_size=20,
                                        num_experts_per_tok=2)).to(device)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(hf.gate_up_proj.shape, generator=gen) / 5)
        hf.down_proj.copy_(torch.randn(hf.down_proj.shape, generator=gen) / 5)
    x = torch.randn(37, 24, generator=gen).to(device)
    idx = routing("zipf", 37, 5, 2, gen).to(device)
    w = torch.rand(37, 2, generator=gen).to(device)
    y = load("swiglu", {}).entry(x, idx, w, hf.gate_up_proj, hf.down_proj)
    torch.testing.assert_close(y, hf(x, idx, w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant,params", CASE_PARAMS)
def test_opcheck_and_contract(load, device, variant, params):
    module = load(variant, params)
    check_module_contract(module)
    check_opcheck(fixture(module, "zipf", n=9), torch.float32, device)


def test_shape_errors_name_shapes(load, device):
    module = load("swiglu", {})
    with pytest.raises(ValueError, match=r"down_proj \(5, 24, 19\)"):
        module.entry(torch.randn(4, 24), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2),
                     torch.randn(5, 40, 24), torch.randn(5, 24, 19))


def test_aot_sm90(load):
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    paths = [load(v, p).__file__ for v, p in CASES]
    for path, rs in aot.compile_files(paths, registers=False).items():
        assert rs, path
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"
            assert r.shared_bytes is not None and r.shared_bytes <= aot.H100_SHARED_BYTES


@pytest.mark.parametrize("ref", ["hf:qwen3_moe", "hf:deepseek_v32", "hf:mixtral"])
def test_match_parsed_blocks(parse_model, ref):
    blocks = parse_model(ref).blocks
    experts = [b for b in blocks if b.kind == "moe.experts"]
    assert experts
    for b in experts:
        assert moe_experts.match(b) == {"variant": "swiglu", "params": moe_experts.FAMILY.resolve("swiglu", {})}
    assert all(moe_experts.match(b) is None for b in blocks if b.kind != "moe.experts")
