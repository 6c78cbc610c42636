"""The plan's step time under activation recompute (`onboarding.plan.estimate`): what a layout's
recompute frees it runs again in the backward, and the estimate charges that re-run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from onboarding.plan import ClusterConfig, PlanConfig
from onboarding.plan.estimate import a2a_transfers, communication, forward_ops, rerun, \
    rerun_flops, step_flops, step_time
from onboarding.plan.memory import Layout, block_saved, inner_blocks, lora_params, memory, \
    recompute_blocks
from onboarding.plan.shapes import BlockShape, ExpertShape, ModelShape

D, F, FE, V, LAYERS = 256, 1024, 512, 4096, 4


def _block(pattern: str, kind: str, linears: list[tuple[str, int, int]], ops: int,
           **kw) -> BlockShape:
    return BlockShape(pattern=pattern, kind=kind, count=kw.pop("count", LAYERS),
                      params=sum(i * o for _, i, o in linears), linears=linears, attrs={},
                      ops=ops, nested=False, **kw)


def _moe_shape(*, mlp: bool = True) -> ModelShape:
    """A small MoE decoder: attention (adapters on q, k, v, o), a norm, a router, 8 routed
    experts (top-2) and a shared expert per layer, and (``mlp``) a dense MLP in each layer;
    without ``mlp``, none of the blocks selective recompute re-runs and no experts."""
    attn = [("q_proj", D, D), ("k_proj", D, D), ("v_proj", D, D), ("o_proj", D, D)]
    shared = [("gate_proj", D, F), ("up_proj", D, F), ("down_proj", F, D)]
    blocks = [_block("layers.*.attn", "attention.full", attn, 40, lora_targets=attn),
              _block("layers.*.norm", "norm.rms", [], 6, width=D),
              _block("layers.*.mlp.gate", "moe.router", [("weight", D, 8)], 8)]
    experts = []
    if mlp:
        blocks += [_block("layers.*.mlp.experts", "moe.experts", [], 200),
                   _block("layers.*.mlp.shared_expert", "moe.shared_expert", shared, 9),
                   _block("layers.*.ffn", "mlp.dense", shared, 7)]
        experts = [ExpertShape(pattern="layers.*.mlp.experts", count=LAYERS, n_experts=8,
                               top_k=2, per_expert=3 * D * FE, hidden=D, width=FE, gated=True,
                               matrices=[(D, 2 * FE), (FE, D)])]
    matmul = sum(b.count * b.params for b in blocks if b.kind != "moe.experts") + D * V
    routed = sum(e.count * e.n_experts * e.per_expert for e in experts)
    return ModelShape(name="synthetic-moe", hidden=D, vocab=V, n_layers=LAYERS,
                      total=matmul + routed + D * V, routed=routed,
                      dense_tensors=[(D, matmul // D + V)], experts=experts, blocks=blocks,
                      layer_dense_max=matmul // LAYERS, dense_matmul=matmul, config=None)


def _time(shape: ModelShape, cfg: PlanConfig, recompute: str):
    cluster = ClusterConfig(gpu_mem_gib=141.0)
    lay = Layout(ep=1, fsdp=1, recompute=recompute, offload="none")
    mem = memory(shape, cfg, lay, cluster)
    return step_time(shape, cfg, lay, mem, communication(shape, cfg, lay, mem, cluster),
                     cluster)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_selective_recompute_pays_for_what_it_runs_again(mode):
    """Selective recompute frees the MLP and expert activations (`block_saved`'s re-run part)
    and runs those blocks' forward again in the backward: its step is no recompute's plus that
    forward (its blocks' launches, a third of the passes over the bytes it writes again, and the
    forward's share of their GEMM time, read off the step estimate without them: a third of full
    training's forward + input and weight gradients, half a LoRA step's forward + input
    gradient, these blocks having no adapters), and full recompute, which re-runs every block,
    costs more. Before, selective only lowered the memory-bound term and looked faster than no
    recompute; then a LoRA re-run was charged a third of its blocks' GEMM time."""
    cfg = PlanConfig(gpus=1, ep=1, seq=1024, mode=mode)
    shape = _moe_shape()
    r = ClusterConfig().rates
    none, sel, full = (_time(shape, cfg, rc) for rc in ("none", "selective", "full"))
    rerun = [b for b in shape.blocks if b.kind in ("moe.experts", "moe.shared_expert",
                                                  "mlp.dense")]
    tokens = cfg.micro_batch * cfg.seq
    launches = sum(b.count * b.ops for b in rerun) * r.launch_us * 1e-6
    written = sum(b.count * block_saved(b, shape, cfg, 1)[1] for b in rerun) * tokens
    passes = 4 / 3 * written / (r.hbm_tbps * 1e12)  # a third of a step's 4 passes
    # the step's GEMM time of those blocks: the step's less the same model's without them
    bare = _moe_shape(mlp=False)
    gemm = (none.gemm_s - _time(bare, cfg, "none").gemm_s) * {"lora": 1 / 2, "full": 1 / 3}[mode]
    assert written > 0 and launches > 0 and gemm > 0
    assert sel.memory_s == pytest.approx(none.memory_s)  # the forward writes them all the same
    # a MoE step: host and GPU time add up (no communication on one GPU)
    assert sel.overlap_s - none.overlap_s == pytest.approx(launches + passes + gemm, rel=1e-9)
    assert sel.rerun_s == pytest.approx(passes + gemm, rel=1e-9)
    assert full.overlap_s > sel.overlap_s > none.overlap_s
    assert full.host_s - none.host_s == pytest.approx(
        forward_ops(shape, cfg) * r.launch_us * 1e-6)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_re_run_costs_the_forward_of_its_gemms(mode):
    """The forward a recompute runs again costs 2 FLOPs per weight and token, frozen or
    trained, adapters included: half of a LoRA step's frozen GEMMs (forward + input gradient,
    no weight gradient) and a bit less of its adapters' (6 per parameter), a third of full
    training's. Here the dense MLP carries adapters; selective re-runs it, the shared expert and
    the routed experts, full the whole forward (every dense GEMM and adapter: the head's GEMM is
    no block here, so it counts as re-run). Before, both modes were charged a third of the
    step's GEMMs: 4N / 3 for LoRA."""
    cfg = PlanConfig(gpus=1, ep=1, seq=1024, mode=mode, lora_rank=8)
    shape = _moe_shape()
    ffn = next(b for b in shape.blocks if b.kind == "mlp.dense")
    ffn.lora_targets = list(ffn.linears)
    lora = mode == "lora"
    rerun_blocks = [b for b in shape.blocks if b.kind in ("mlp.dense", "moe.shared_expert")]
    n = sum(b.count * sum(i * o for _, i, o in b.linears) for b in rerun_blocks)
    a = LAYERS * sum(cfg.lora_rank * (i + o) for _, i, o in ffn.linears) if lora else 0
    e = shape.experts[0]
    routed = e.count * e.top_k * e.per_expert
    assert rerun_flops(shape, cfg, "selective") == (2 * (n + a), 2 * routed, 0.0)
    adapters = lora_params(shape, cfg)[0] if lora else 0
    assert adapters >= a > 0 if lora else adapters == 0
    assert rerun_flops(shape, cfg, "full") == (
        2 * (shape.dense_matmul + adapters), 2 * routed, step_flops(shape, cfg)[2] / 3)
    # the re-run's GPU time: those FLOPs at the GEMM rate (the experts at least one read of
    # their weights), a third of the 4 memory passes over the bytes written again
    cluster = ClusterConfig(gpu_mem_gib=141.0)
    r = cluster.rates
    lay = Layout(ep=1, fsdp=1, recompute="selective", offload="none")
    mem = memory(shape, cfg, lay, cluster)
    tokens = cfg.micro_batch * cfg.seq
    gemm = (2 * (n + a) * tokens + max(2 * routed * tokens,
                                       mem.weights_experts / (r.hbm_tbps * 1e12)
                                       * r.gemm_tflops * 1e12)) / (r.gemm_tflops * 1e12)
    passes = 4 / 3 * mem.recomputed / (r.hbm_tbps * 1e12)
    assert rerun(shape, cfg, lay, mem, r)[0] == pytest.approx(gemm + passes, rel=1e-12)



def test_full_recompute_re_runs_the_decoder_layers_alone():
    """`onboard train`'s full recompute checkpoints the decoder layers (`decoder_blocks`, the
    items of the layer list): the embedding, the final norm and the head run once. The plan's
    re-run is the blocks inside the layers (a ``*`` in their pattern): its GEMMs lack the
    head's D x V, its ops the blocks outside, and the final norm keeps its input as it does
    without recompute. Before, full recompute re-ran the whole forward, the head included, and
    freed the final norm's bytes."""
    cfg = PlanConfig(gpus=1, ep=1, seq=1024)
    shape = _moe_shape()
    layers = list(shape.blocks)
    outside = [_block("embed", "embedding", [], 1, count=1),
               _block("norm", "norm.rms", [], 6, count=1, width=D),
               _block("lm_head", "lm_head", [("", D, V)], 4, count=1)]
    shape.blocks += outside
    assert recompute_blocks(shape, "full") == layers
    e = shape.experts[0]
    assert rerun_flops(shape, cfg, "full")[:2] == (
        2 * (shape.dense_matmul - D * V + lora_params(shape, cfg)[0]),
        2 * e.count * e.top_k * e.per_expert)
    cluster = ClusterConfig(gpu_mem_gib=141.0)
    lay = Layout(ep=1, fsdp=1, recompute="full", offload="none")
    mem = memory(shape, cfg, lay, cluster)
    norm = block_saved(outside[1], shape, cfg, 1)[0] * cfg.micro_batch * cfg.seq
    assert norm > 0 and mem.activations["norms"] == norm
    assert mem.recomputed == pytest.approx(mem.produced - norm - mem.activations["logits (bf16)"])
    assert rerun(shape, cfg, lay, mem, cluster.rates)[1] == forward_ops(shape, cfg) - sum(
        b.count * b.ops for b in outside)

@pytest.mark.parametrize("ep", [4, 16])
def test_full_recompute_repeats_the_expert_all_to_all(ep):
    """`onboard train`'s full recompute re-runs each whole decoder layer in the backward, the EP
    module's dispatch and combine with it: 6 all-to-all transfers of each MoE layer's rows a
    step (forward and backward dispatch + combine, and the re-run's). Selective checkpoints only
    the expert compute after the dispatch (`apply_recompute`: the EP module's `_compute`), so it
    moves what no recompute moves. Before, every recompute was charged 4 transfers. EP 16 spans
    two nodes of 8 (the inter-node link); the step without overlap adds the whole of it."""
    cfg = PlanConfig(gpus=ep, ep=ep, seq=1024, imbalance=1.25)
    cluster = ClusterConfig(gpu_mem_gib=141.0)
    shape = _moe_shape()
    e = shape.experts[0]
    # one transfer of one MoE layer: each token's top-k rows of D bf16 values, the share for the
    # other EP ranks, the busiest rank's load
    one = cfg.micro_batch * cfg.seq * e.top_k * 1.25 * D * 2 * (ep - 1) / ep
    comms, times = {}, {}
    for rc, transfers in (("none", 4), ("selective", 4), ("full", 6)):
        lay = Layout(ep=ep, fsdp=1, recompute=rc, offload="none")
        mem = memory(shape, cfg, lay, cluster)
        comms[rc] = communication(shape, cfg, lay, mem, cluster)
        times[rc] = step_time(shape, cfg, lay, mem, comms[rc], cluster)
        assert comms[rc].a2a_layer_bytes == pytest.approx(transfers * one, rel=1e-12)
        assert comms[rc].a2a_bytes == pytest.approx(LAYERS * transfers * one, rel=1e-12)
        assert times[rc].serial_s == pytest.approx(times[rc].compute_s + comms[rc].seconds)
    assert comms["full"].a2a_s == pytest.approx(1.5 * comms["none"].a2a_s, rel=1e-12)
    assert comms["selective"].a2a_s == pytest.approx(comms["none"].a2a_s, rel=1e-12)
    assert comms["none"].a2a_s > 0



def _selective_frees(shape: ModelShape, cfg: PlanConfig) -> tuple[float, float]:
    """(activation bytes selective recompute frees, bytes it writes again) of ``shape``."""
    cluster = ClusterConfig(gpu_mem_gib=141.0)
    none, sel = (memory(shape, cfg, Layout(ep=1, fsdp=1, recompute=rc, offload="none"), cluster)
                 for rc in ("none", "selective"))
    return sum(none.activations.values()) - sum(sel.activations.values()), sel.recomputed


def test_selective_recompute_re_runs_the_norm_inside_a_low_rank_branch(parse_model):
    """Selective recompute checkpoints a low-rank residual branch's whole module
    (`apply_recompute`; Gemma 3n's LAuReL, here our own fixture: D -> r -> D, then an RMSNorm
    inside the module), so `onboard train` runs the norm inside it again in the backward, and
    the norm keeps nothing. The plan frees what the norm keeps and charges its re-run (its ops,
    a third of the memory passes over its bytes; no linears: the branch lists its two already),
    as it does the branch's rank-r product. Before, the norm's input stayed kept and its re-run
    was not charged."""
    import importlib.util

    from onboarding.plan.shapes import model_shape
    from onboarding.train.parallel import apply_recompute

    ref = Path(__file__).parent / "fixtures" / "residual_stream_models.py"
    spec = importlib.util.spec_from_file_location("_low_rank_fixture", ref)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    graph = parse_model("tests/fixtures/residual_stream_models.py:LowRankResidualLM", seq=12)
    torch.manual_seed(0)
    model = mod.LowRankResidualLM()
    shape = model_shape(model, None, graph)
    (low,) = [b for b in shape.blocks if b.kind == "residual.low_rank"]
    (norm,) = [b for b in shape.blocks if b.pattern == "layers.*.low_rank.norm"]
    assert norm.kind.startswith("norm.") and norm.nested
    assert norm.parents == [(low.pattern, low.kind)]
    # onboard train: the norm inside the checkpointed branch runs again in the backward (a
    # pre-hook: the re-run stops inside the norm, at the last tensor the backward needs, before
    # a forward hook would see it)
    calls = []
    model.layers[0]["low_rank"].norm.register_forward_pre_hook(lambda *a: calls.append(1))
    apply_recompute(model, graph, [], "selective")
    loss = model(torch.randint(0, 64, (1, 9))).square().mean()
    assert len(calls) == 1
    loss.backward()
    assert len(calls) == 2
    # the plan
    cfg = PlanConfig(gpus=1, ep=1, seq=1024)
    tokens = cfg.micro_batch * cfg.seq
    blocks = recompute_blocks(shape, "selective")
    outer = [b for b in blocks if b is not norm]
    assert any(b is norm for b in blocks) and any(b is low for b in outer)
    norm_kept = norm.count * block_saved(norm, shape, cfg, 1)[0] * tokens
    outer_part = sum(b.count * block_saved(b, shape, cfg, 1)[1] for b in outer) * tokens
    assert norm_kept > 0
    assert _selective_frees(shape, cfg) == pytest.approx((outer_part + norm_kept,) * 2)
    assert forward_ops(shape, cfg, blocks) == sum(b.count * b.ops for b in outer) \
        + norm.count * norm.ops
    assert rerun_flops(shape, cfg, "selective")[0] == 2 * sum(
        b.count * sum(i * o for _, i, o in b.linears) for b in outer)



def test_a_shared_path_pattern_nests_nothing():
    """A block is inside another's module by their paths (`BlockShape.parents`), not their
    patterns: DeepSeek-V3's first layers hold a dense MLP at ``model.layers.*.mlp``, the later
    ones an MoE wrapper (no block) there, whose router and experts are inside no dense MLP, so
    selective recompute re-runs the experts' part and the router keeps its scores."""
    shape = _moe_shape()
    shape.blocks.append(_block("layers.*.mlp", "mlp.dense", [("up", D, F), ("down", F, D)], 5,
                               count=1))
    blocks = recompute_blocks(shape, "selective")
    assert inner_blocks(blocks) == [] and not any(b.kind == "moe.router" for b in blocks)

@pytest.mark.slow
def test_gemma3n_selective_recompute_frees_the_laurel_norm():
    """hf:gemma3n_text's full-size plan: its LAuReL branch (`residual.low_rank`, found by
    structure) holds a norm, ``post_laurel_norm``, that selective recompute re-runs with the
    branch: the plan frees what it keeps, one norm input per layer (transformers' RMSNorm keeps
    its fp32 input on the torch path: 4 x 2048 bytes a token)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.plan.capture import plan_graph
    from onboarding.plan.run import shape_of

    if "gemma3n_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma3n_text")
    info = load_stage(load_model("hf:gemma3n_text"), "tiny")
    shape = shape_of(info, plan_graph(info)[0])
    (low,) = [b for b in shape.blocks if b.kind == "residual.low_rank"]
    inside = [b for b in shape.blocks if b.pattern.startswith(low.pattern + ".")]
    assert [b.kind for b in inside] == ["norm.rms"] and inside[0].width == shape.hidden == 2048
    assert any(b is inside[0] for b in recompute_blocks(shape, "selective"))
    cfg = PlanConfig(gpus=1, ep=1, seq=1024, kernels=False)
    freed, _ = _selective_frees(shape, cfg)
    outer = sum(b.count * block_saved(b, shape, cfg, 1)[1] for b in shape.blocks
                if b.kind in ("mlp.dense", "moe.shared_expert", "residual.low_rank"))
    assert freed - outer * cfg.seq == pytest.approx(low.count * 4 * 2048 * cfg.seq)

class _Exchange(torch.autograd.Function):
    """One process's stand-in for the EP module's autograd all-to-all
    (``all_to_all_single_autograd``: its backward is the reverse all-to-all, and it keeps no
    tensor, only the splits): the identity, each pass's rows recorded in ``log``."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        log.append(("forward", x.shape[-1]))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("backward", grad.shape[-1]))
        return grad.clone(), None


def _ep_layer(monkeypatch, log: list, d: int):
    """A decoder layer's MoE half around `onboard train`'s EP module (``x + experts(x)``: the
    residual add keeps nothing), its exchanges through `_Exchange` over a group of one that
    takes the all-to-all path (``group`` set)."""
    from onboarding.train import moe_ep

    monkeypatch.setattr(moe_ep, "all_to_all_single_autograd",
                        lambda x, out_splits, in_splits, group: _Exchange.apply(x, log))
    monkeypatch.setattr(moe_ep.dist, "all_to_all_single",
                        lambda recv, send, group=None: recv.copy_(send))

    class Packed(nn.Module):
        def __init__(self, e: int = 4, f: int = 6):
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, d, generator=gen))
            self.down_proj = nn.Parameter(torch.randn(e, d, f, generator=gen))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = moe_ep.EPExperts(
                Packed(), path="layers.0.mlp.experts", layer=0,
                ep=moe_ep.EPGroup(group=object(), rank=0, size=1), width=d, act=nn.functional.silu)

        def forward(self, x, idx, w):
            return x + self.experts(x, idx, w)

    return Layer()


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_expert_all_to_alls_a_recompute_repeats(monkeypatch, recompute):
    """`a2a_transfers` counts what `onboard train`'s EP module exchanges: the rows go out and come
    back in the forward and again, reversed, in the backward (4); selective recompute
    checkpoints only the expert compute after the dispatch (`apply_recompute`: `_compute`), no
    exchange; full re-runs the layer, and torch's non-reentrant checkpoint re-runs it only as
    far as the last tensor its backward needs. That tensor is the combine's (`_CombinePairs`
    keeps each pair's token row, ``rows``, for its backward's gather, which exchanges nothing):
    after the rows come back, so the re-run repeats both exchanges (6). Were the combine to keep
    nothing, the re-run would stop at the expert compute, before the rows come back (5): the
    assertions below break with the plan's count when what it keeps changes."""
    from onboarding.train import _moe_ep_ops
    from onboarding.train.parallel import _checkpoint_forward, apply_activation_checkpointing

    d, n, k = 8, 5, 2
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=gen, requires_grad=True)
    idx = torch.randint(0, 4, (n, k), generator=gen)
    w = torch.rand(n, k, generator=gen, requires_grad=True)

    def rows_exchanged(layer, log) -> int:
        layer(x, idx, w).square().sum().backward()
        return sum(1 for _, width in log if width == d)  # the routing weights travel apart

    log: list = []
    layer = _ep_layer(monkeypatch, log, d)
    if recompute == "full":
        apply_activation_checkpointing([("layers.0", layer)])
    elif recompute == "selective":
        _checkpoint_forward(layer.experts, "_compute")
    assert rows_exchanged(layer, log) == a2a_transfers(recompute)
    # the combine keeps the rows alone, and its backward exchanges nothing
    log.clear()
    po = _moe_ep_ops._PairOrder.of(torch.argsort(idx.reshape(-1), stable=True), k)
    y = torch.randn(n * k, d, requires_grad=True)
    out = _moe_ep_ops._combine_pairs(y, po, k)
    (kept,) = out.grad_fn.saved_tensors
    assert torch.equal(kept, po.rows)
    out.sum().backward()
    assert log == [] and torch.equal(y.grad, torch.ones(n * k, d))
    if recompute != "full":
        return

    class KeepsNothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y_sorted, rows, inverse, k, kernel=None):
            ctx.rows = rows  # on the context, not saved: no re-run brings it back
            return _moe_ep_ops._sum_pairs(y_sorted, inverse, k, kernel)

        @staticmethod
        def backward(ctx, grad):
            return grad.index_select(0, ctx.rows), None, None, None, None

    monkeypatch.setattr(_moe_ep_ops, "_CombinePairs", KeepsNothing)
    log.clear()
    layer = _ep_layer(monkeypatch, log, d)
    apply_activation_checkpointing([("layers.0", layer)])
    assert rows_exchanged(layer, log) == 5
