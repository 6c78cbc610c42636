"""Benchmark cases for the MoE experts family (`moe_experts`) and the fused LoRA linear (`lora`).

``moe_experts``, issue 6's shapes (E experts, top-K, hidden D, expert FFN F, N tokens, bf16):
the anchor E=64 K=8 D=2048 F=512 N=8192; Qwen3-Next's E=512 K=10 D=2048 F=512; DeepSeek-V3's
E=256 K=8 D=7168 F=2048 at N=8192 and N=32768. Uniform routing everywhere, Zipf-skewed routing
(expert popularity ~ 1/rank) at the two D=2048 shapes. Non-gated experts (variant ``mlp``,
relu(x)^2 as nemotron_h's) at the anchor's sizes, ``anchor_mlp``. Each shape gives two cases, ``.../fwd``
(forward only, under no_grad) and ``.../fwdbwd`` (forward + backward to x, routing weights and
both expert weights), so that every row carries TFLOP/s; the anchor and Qwen3-Next (uniform) add
``.../fwdbwd_frozen`` (the expert weights frozen, as LoRA training on attention leaves them:
gradients to x and the routing weights only). Impls:

- ``ours``: the rendered ``swiglu`` experts kernel (permute -> grouped GEMM + SwiGLU -> grouped
  GEMM + routing weight -> combine);
- ``loop``: the per-expert loop transformers runs (one-hot mask, per hit expert: gather, two
  linears, index_add);
- ``grouped_mm``: argsort by expert + ``torch._grouped_mm`` for both GEMMs + index_add.

(``anchor_mlp``: the same three with up [E, F, D] -> relu^2 -> down in place of SwiGLU.)

FLOPs: forward 6 S D F for S = N K routed rows (gate/up 4 S D F, down 2 S D F; non-gated 4 S D
F); forward + backward 3x that (dx and both weight gradients), 2x with frozen experts (dx
only). ``check`` (fwdbwd cases): the bf16 kernel against the fp32 per-expert reference at the case's E, K, D, F on 4096 tokens (DeepSeek shapes:
32 of the experts, so the fp32 copies fit beside the bf16 case), output and every gradient.

``lora``: the fused LoRA linear at rank 16, x [N, I] -> [N, O] at real projection shapes
(Qwen3/Llama-style o_proj 4096->4096 and GQA k/v_proj 4096->1024, a 2048->8192 up projection,
DeepSeek-V3's q_a_proj 7168->1536), N=8192 tokens. Impls: ``ours`` (the default base="torch":
one Triton kernel writing the rank-r term, then torch's GEMM adding x W^T or dy W onto it; grads to
x, A, B; W frozen), ``ours@base=triton`` (everything in our Triton GEMM, the rank-r product in its
accumulator), ``base`` (x W^T alone, grad to x only: the floor LoRA adds to), ``unfused`` (PEFT's
torch formulation x W^T + s (x A^T) B^T). Read the LoRA overhead over the base GEMM as
``1 / ratios["base"] - 1`` (the issue's goal: <= 15% at rank 16). FLOPs count the LoRA step
(base GEMMs plus the rank-r products), so ``base`` rows overstate their own rate by ~r/min(I, O).
At o_proj, ``ours@BLOCK_M=...`` rows time the low-rank kernel under other tiles
(``LORA_SWEEP``).

At the anchor and Qwen3-Next shapes (uniform routing) ``ours@...`` rows time the experts kernel
under other tile configs of its D bucket, around the bf16 defaults, for picking them: the forward
tiles in the ``fwd`` case (``MOE_FWD_SWEEP``), the backward kernels' own tiles in the ``fwdbwd``
case (``MOE_BWD_SWEEP``, forward tiles left at the bucket's). Both shapes share the D bucket but
not the rows per expert (anchor 1024, Qwen3-Next 160: 128-row tiles pad the latter by 60%).

Shape legend: x [N, D]; topk [N, K]; gate_up [E, 2F, D] (non-gated up [E, F, D]); down [E, D, F]; LoRA W [O, I],
A [r, I], B [O, r].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from onboarding.bench.cases import N_SETS, _check, _config_sweep, _fwd_bwd, _kernel, _leaf, shared_inputs
from onboarding.bench.harness import BenchCase, Step

# (name, E, K, D, F, N, routings)
MOE_SHAPES = (
    ("anchor", 64, 8, 2048, 512, 8192, ("uniform", "zipf")),
    ("qwen3_next", 512, 10, 2048, 512, 8192, ("uniform", "zipf")),
    ("deepseek_v3", 256, 8, 7168, 2048, 8192, ("uniform",)),
    ("deepseek_v3", 256, 8, 7168, 2048, 32768, ("uniform",)),
    ("anchor_mlp", 64, 8, 2048, 512, 8192, ("uniform",)),
)
# shapes whose experts are non-gated (variant "mlp", relu(x)^2)
MLP_LABELS = ("anchor_mlp",)
MLP_ACTIVATION = "relu2"
# shapes that also time a backward with frozen expert weights (LoRA training on attention only:
# gradients to x and the routing weights; `fwdbwd_frozen`), uniform routing
FROZEN_LABELS = ("anchor", "qwen3_next")
CHECK_TOKENS, CHECK_MAX_EXPERTS_WIDE = 4096, 32
# (name, N, I, O): rank-16 LoRA on real projections
LORA_SHAPES = (
    ("o_proj", 8192, 4096, 4096),
    ("kv_proj_gqa", 8192, 4096, 1024),
    ("up_proj", 8192, 2048, 8192),
    ("deepseek_v3_q_a", 8192, 7168, 1536),
)
LORA_RANK, LORA_SCALING = 16, 2.0
# In-place update kernel tiles timed at o_proj (base="torch"; memory-bound): rows per program x
# column step x the x A^T reduction step x warps x stages. BLOCK_M is a cap: the launch halves it
# until every SM has a program (16 or 32 at N=8192 on an H200).
LORA_SWEEP = [
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
]
# Tile configs timed beside the defaults at the anchor shape (bf16 tensor-core dots): row tile x
# column tile x K step x warps x pipeline stages. Forward (fwd case): the measured best (the
# d_le_4k default since, 1.95 ms on the H200) first, then the old default (64-row tiles) and its
# neighbours.
MOE_FWD_SWEEP = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
]
# Backward kernels' tiles (fwdbwd case): the measured best (64 x 128 x 64, 8 warps, 4 stages: the
# default since), 128-row tiles (6.54 ms fwd+bwd when they drove every kernel), 3 stages (the old
# default) and neighbours.
MOE_BWD_SWEEP = [
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 4},
    {"BWD_BLOCK_M": 128, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 3},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 3},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 128, "BWD_BLOCK_K": 32, "bwd_warps": 8, "bwd_stages": 4},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 64, "BWD_BLOCK_K": 64, "bwd_warps": 4, "bwd_stages": 4},
    {"BWD_BLOCK_M": 128, "BWD_BLOCK_N": 64, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 4},
    {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 256, "BWD_BLOCK_K": 64, "bwd_warps": 8, "bwd_stages": 3},
]


def routing(kind: str, n: int, e: int, k: int, device: torch.device,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_indices [n, k] (distinct experts per token) and routing weights [n, k] summing to 1."""
    if kind == "zipf":
        probs = 1.0 / torch.arange(1, e + 1, device=device, dtype=torch.float32)
        probs = probs[torch.randperm(e, device=device, generator=gen)]  # popular experts anywhere
    else:
        probs = torch.ones(e, device=device)
    idx = torch.multinomial(probs.expand(n, e), k, replacement=False, generator=gen)
    w = torch.rand(n, k, device=device, generator=gen) + 0.05
    return idx, w / w.sum(-1, keepdim=True)


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _relu2(h: torch.Tensor) -> torch.Tensor:
    return torch.relu(h).square()


def _loop(x, topk_indices, topk_weights, gate_up_proj, down_proj, act: Callable):
    y = torch.zeros_like(x)
    E = gate_up_proj.shape[0]
    with torch.no_grad():
        mask = F.one_hot(topk_indices, num_classes=E).permute(2, 1, 0)
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
    for e in hit:
        e = e[0]
        slot, tok = torch.where(mask[e])
        h = F.linear(act(F.linear(x[tok], gate_up_proj[e])), down_proj[e]) * topk_weights[tok, slot, None]
        y.index_add_(0, tok, h.to(y.dtype))
    return y


def transformers_loop(x, topk_indices, topk_weights, gate_up_proj, down_proj):
    """The per-expert loop of transformers' packed experts (Qwen3MoeExperts.forward et al.)."""
    return _loop(x, topk_indices, topk_weights, gate_up_proj, down_proj, _swiglu)


def transformers_loop_mlp(x, topk_indices, topk_weights, up_proj, down_proj):
    """The same loop for non-gated relu^2 experts (NemotronHExperts.forward)."""
    return _loop(x, topk_indices, topk_weights, up_proj, down_proj, _relu2)


def _grouped(x, topk_indices, topk_weights, gate_up_proj, down_proj, act: Callable):
    N, K = topk_indices.shape
    E = gate_up_proj.shape[0]
    flat = topk_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    h = act(torch._grouped_mm(x[tok], gate_up_proj.transpose(1, 2), offs=offs))
    o = torch._grouped_mm(h, down_proj.transpose(1, 2), offs=offs)
    o = o * topk_weights.reshape(-1)[order, None].to(o.dtype)
    return torch.zeros_like(x).index_add_(0, tok, o)


def grouped_mm(x, topk_indices, topk_weights, gate_up_proj, down_proj):
    """argsort by expert, torch._grouped_mm for gate/up and down, weight, index_add."""
    return _grouped(x, topk_indices, topk_weights, gate_up_proj, down_proj, _swiglu)


def grouped_mm_mlp(x, topk_indices, topk_weights, up_proj, down_proj):
    """The same for non-gated relu^2 experts."""
    return _grouped(x, topk_indices, topk_weights, up_proj, down_proj, _relu2)


def _fwd(fn: Callable, sets: list[tuple]) -> Step:
    def step(i: int):
        with torch.no_grad():
            return fn(*sets[i % len(sets)])
    return step


@shared_inputs
def _moe_sets(E, K, D, Fw, N, kind, device, grad: bool, gated: bool = True, frozen: bool = False) -> list[tuple]:
    """N_SETS token sets (x, indices, weights) sharing one set of expert weights: the weights
    (0.2-23 GB in bf16) are far past the L2 on their own, and three copies would not fit. `grad`:
    x, the routing weights and (unless `frozen`) the expert weights require gradients."""
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    gate_up = (torch.randn(E, (2 if gated else 1) * Fw, D, device=device, generator=gen) / D ** 0.5).to(bf16)
    down = (torch.randn(E, D, Fw, device=device, generator=gen) / Fw ** 0.5).to(bf16)
    if grad and not frozen:
        gate_up, down = _leaf(gate_up), _leaf(down)
    sets = []
    for _ in range(N_SETS):
        x = torch.randn(N, D, device=device, generator=gen).to(bf16)
        idx, w = routing(kind, N, E, K, device, gen)
        w = w.to(bf16)
        sets.append((_leaf(x) if grad else x, idx, _leaf(w) if grad else w, gate_up, down))
    return sets


def _fwd_sweep(mod, fn: Callable, sets, size: int, configs: list[dict]) -> dict[str, Step]:
    """Forward-only ``ours@cfg`` steps, each pinning its config for the size's bucket while it runs."""
    bucket, base = mod.shape_bucket(size), mod.config_for(size)
    def pinned(full: dict) -> Step:
        def step(i: int):
            mod.set_config(full, bucket=bucket)
            try:
                return _fwd(fn, sets)(i)
            finally:
                mod.set_config(None, bucket=bucket)
        return step

    return {"ours@" + ",".join(f"{k}={v}" for k, v in cfg.items()): pinned({**base, **cfg}) for cfg in configs}


def _variant(label: str) -> tuple[str, dict, bool]:
    """(variant, params, gated) of a MOE_SHAPES label."""
    if label in MLP_LABELS:
        return "mlp", {"activation": MLP_ACTIVATION}, False
    return "swiglu", {}, True


def _moe_steps(label, E, K, D, Fw, N, kind, backward: bool, sweep: bool, device,
               frozen: bool = False) -> dict[str, Step]:
    variant, params, gated = _variant(label)
    mod, ours = _kernel("moe_experts", variant, params)
    impls = {"ours": ours, "loop": transformers_loop if gated else transformers_loop_mlp,
             "grouped_mm": grouped_mm if gated else grouped_mm_mlp}
    sets = _moe_sets(E, K, D, Fw, N, kind, device, backward, gated, frozen)
    if not backward:
        steps = {name: _fwd(fn, sets) for name, fn in impls.items()}
        return {**steps, **(_fwd_sweep(mod, ours, sets, D, MOE_FWD_SWEEP) if sweep else {})}
    grads = [torch.randn(N, D, device=device, dtype=torch.bfloat16)]
    steps = {name: _fwd_bwd(fn, sets, grads) for name, fn in impls.items()}
    return {**steps, **(_config_sweep(mod, ours, sets, grads, D, MOE_BWD_SWEEP) if sweep else {})}


def _moe_check(label, E, K, D, Fw, kind) -> Callable[[torch.device], dict[str, float]]:
    e = E if D < 4096 else min(E, CHECK_MAX_EXPERTS_WIDE)
    variant, params, gated = _variant(label)

    def make(dtype):
        gen = torch.Generator(device="cuda").manual_seed(0)
        idx, w = routing(kind, CHECK_TOKENS, e, K, torch.device("cuda"), gen)
        return (torch.randn(CHECK_TOKENS, D, device="cuda", generator=gen).to(dtype), idx, w.to(dtype),
                (torch.randn(e, (2 if gated else 1) * Fw, D, device="cuda", generator=gen) / D ** 0.5).to(dtype),
                (torch.randn(e, D, Fw, device="cuda", generator=gen) / Fw ** 0.5).to(dtype))

    def check(device):
        mod, ours = _kernel("moe_experts", variant, params)
        return _check(ours, mod.reference, make)(device)
    return check


def moe_experts_cases() -> list[BenchCase]:
    cases = []
    for label, E, K, D, Fw, N, kinds in MOE_SHAPES:
        S = N * K
        mats = 3 if _variant(label)[2] else 2  # weight matrices of F x D per expert
        # bytes: x, y (bf16) and the expert weights once; the backward reads dy, x, the weights
        # and writes dx and both weight gradients
        fwd_bytes = 2 * (2 * N * D + mats * E * Fw * D)
        for kind in kinds:
            sweep = label in ("anchor", "qwen3_next") and kind == "uniform"
            frozen_too = label in FROZEN_LABELS and kind == "uniform"
            for backward, frozen in ((False, False), (True, False)) + (((True, True),) if frozen_too else ()):
                mode = "fwdbwd_frozen" if frozen else "fwdbwd" if backward else "fwd"
                # the backward reads dy, x and the weights and writes dx (+ both weight gradients)
                bwd_bytes = 2 * (3 * N * D + (1 if frozen else 2) * mats * E * Fw * D)
                cases.append(BenchCase(
                    family="moe_experts", name=f"{label}/E{E}K{K}D{D}F{Fw}N{N}/{kind}/{mode}",
                    shape={"E": E, "K": K, "D": D, "F": Fw, "N": N},
                    min_bytes=fwd_bytes + (bwd_bytes if backward else 0),
                    flops=(1 + (1 if frozen else 2) * backward) * 2 * mats * S * D * Fw,
                    setup=lambda device, a=(label, E, K, D, Fw, N, kind, backward, sweep and not frozen), f=frozen:
                        _moe_steps(*a, device, frozen=f),
                    check=_moe_check(label, E, K, D, Fw, kind) if backward and not frozen else None,
                    note=f"{kind} routing; " + ("forward + backward to x and the routing weights (frozen experts)"
                                                if frozen else "forward + backward" if backward else "forward only")))
    return cases


def _lora_steps(N, I, O, backward: bool, sweep: bool, device) -> dict[str, Step]:
    mod, ours = _kernel("lora", "linear")
    _, fused = _kernel("lora", "linear", {"base": "triton"})
    gen = torch.Generator(device=device).manual_seed(0)
    bf16, r = torch.bfloat16, LORA_RANK
    w = (torch.randn(O, I, device=device, generator=gen) / I ** 0.5).to(bf16)  # frozen: no grad
    a = (torch.randn(r, I, device=device, generator=gen) / I ** 0.5).to(bf16)
    b = (torch.randn(O, r, device=device, generator=gen) / r).to(bf16)
    if backward:
        a, b = _leaf(a), _leaf(b)
    sets = []
    for _ in range(N_SETS):
        x = torch.randn(N, I, device=device, generator=gen).to(bf16)
        sets.append((_leaf(x) if backward else x, w, a, b))
    ours_s = lambda x, w, a, b: ours(x, w, a, b, LORA_SCALING)
    impls = {
        "ours": ours_s,
        "ours@base=triton": lambda x, w, a, b: fused(x, w, a, b, LORA_SCALING),
        "base": lambda x, w, a, b: F.linear(x, w),
        "unfused": lambda x, w, a, b: F.linear(x, w) + LORA_SCALING * F.linear(F.linear(x, a), b),
    }
    configs = LORA_SWEEP if sweep else []
    if not backward:
        return {**{name: _fwd(fn, sets) for name, fn in impls.items()}, **_fwd_sweep(mod, ours_s, sets, I, configs)}
    grads = [torch.randn(N, O, device=device, dtype=bf16)]
    return {**{name: _fwd_bwd(fn, sets, grads) for name, fn in impls.items()},
            **_config_sweep(mod, ours_s, sets, grads, I, configs)}


def lora_cases() -> list[BenchCase]:
    cases = []
    r = LORA_RANK
    for label, N, I, O in LORA_SHAPES:
        fwd_flops = 2 * N * I * O + 2 * N * r * (I + O)
        # backward: dx = dy W + s (dy B) A, dA, dB: one more base GEMM and three more rank-r products
        bwd_flops = 2 * N * O * I + 3 * 2 * N * r * (I + O)
        fwd_bytes = 2 * (N * I + O * I + N * O)
        for backward in (False, True):
            def make(dtype, N=N, I=I, O=O):
                gen = torch.Generator(device="cuda").manual_seed(0)
                return (torch.randn(N, I, device="cuda", generator=gen).to(dtype),
                        (torch.randn(O, I, device="cuda", generator=gen) / I ** 0.5).to(dtype),
                        (torch.randn(r, I, device="cuda", generator=gen) / I ** 0.5).to(dtype),
                        (torch.randn(O, r, device="cuda", generator=gen) / r).to(dtype))

            def check(device, make=make):
                mod, ours = _kernel("lora", "linear")
                return _check(lambda *t: ours(*t, LORA_SCALING), lambda *t: mod.reference(*t, LORA_SCALING),
                              make)(device)

            cases.append(BenchCase(
                family="lora", name=f"{label}/N{N}I{I}O{O}r{r}/{'fwdbwd' if backward else 'fwd'}",
                shape={"N": N, "I": I, "O": O, "r": r},
                min_bytes=fwd_bytes + (2 * (2 * N * O + N * I + O * I) if backward else 0),
                flops=fwd_flops + (bwd_flops if backward else 0),
                setup=lambda device, a=(N, I, O, backward, label == "o_proj"): _lora_steps(*a, device),
                check=check if backward else None,
                note="overhead over the base GEMM = 1 / ratios['base'] - 1"))
    return cases
