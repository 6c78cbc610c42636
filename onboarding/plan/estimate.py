"""Communication bytes and step time of one layout.

All-to-all per MoE layer and step, per rank: its N tokens x top-k rows of D bf16 values leave for
the other EP ranks ((ep - 1) / ep of them) in the dispatch and come back in the combine, forward
and backward (4 transfers; 6 with recompute ``full``, `a2a_transfers`), times the expected load
imbalance (the busiest rank sets the pace).
An EP group is ``ep`` consecutive ranks, so past one node its traffic to the other nodes goes over
the inter-node links. FSDP all-gathers the bf16 dense weights twice a step (forward, and again in
the backward: reshard after forward) and reduce-scatters the gradients (LoRA: the fp32 adapter
gradients; full: bf16 dense gradients, and expert gradients all-reduced over the ranks holding
the same experts). A ring over ``world`` ranks moves (world - 1) / world of the buffer per rank;
its slowest link sets its time.

Step time: GEMMs at the GEMM rate (experts: at least the time to read their weights), fused
attention cores at the attention rate (each layer's keys capped at its local window,
`onboarding.plan.shapes.local_window`), memory-bound work (4 passes over the activations the
forward writes, kept or not, ~20 bytes per logit) at the HBM rate, and host time (ATen ops per
block from the op graph's capture, x3 for the backward, at ``launch_us`` each) when that is
longer: eager PyTorch is launch bound at small widths. FLOPs as `onboarding.train.flops` counts
them (LoRA-correct: 4N for frozen GEMMs, 6 x adapters). Recompute adds one more forward of what
it re-runs (`rerun`): those blocks' forward GEMMs (2 FLOPs per weight, frozen or trained: half
of a LoRA step's 4N for frozen weights, a third of full training's 6N), a third of their
attention-core and memory-bound time (a forward and a backward of twice its work, whatever
trains) and their forward's ops; ``full`` the decoder layers' forward (not the head's),
``selective`` its blocks (`memory.recompute_blocks`). With overlap the step is max(compute,
communication); without, the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from onboarding.plan.config import ClusterConfig, PlanConfig, Rates
from onboarding.plan.memory import BF16, FP32, Layout, Memory, expert_lora_params, \
    in_layer, inner_blocks, lora_params, pairs_per_token, recompute_blocks
from onboarding.plan.shapes import BlockShape, ExpertShape, ModelShape, ceil_div


@dataclass(kw_only=True, slots=True)
class Comm:
    a2a_layer_bytes: float  # per MoE layer per step, per rank (`a2a_transfers` of them)
    a2a_bytes: float  # all MoE layers
    a2a_s: float
    fsdp_gather_bytes: float
    fsdp_reduce_bytes: float
    fsdp_s: float
    offload_bytes: float
    offload_s: float

    @property
    def seconds(self) -> float:
        return self.a2a_s + self.fsdp_s + self.offload_s


@dataclass(kw_only=True, slots=True)
class StepTime:
    flops: float  # per rank per step
    gemm_s: float
    attn_s: float
    memory_s: float
    host_s: float
    rerun_s: float  # GPU time of the recompute's extra forward (in compute_s, not in the above)
    compute_s: float
    overlap_s: float  # step with communication hidden behind compute
    serial_s: float  # step with no overlap
    mfu: float  # at the overlapped step time, against the datasheet peak
    tokens_per_s: float  # all ranks


def _link_time(nbytes: float, group: int, cluster: ClusterConfig) -> float:
    """Seconds to move ``nbytes`` per rank inside a group of ``group`` consecutive ranks."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    g = cluster.gpus_per_node
    if group <= g:
        return nbytes / (cluster.nvlink_gbps * 1e9)
    inter = nbytes * (group - g) / (group - 1)  # peers on other nodes
    return max((nbytes - inter) / (cluster.nvlink_gbps * 1e9),
               inter / (cluster.internode_gbps * 1e9))


def _ring_time(nbytes: float, world: int, cluster: ClusterConfig) -> float:
    if world <= 1 or nbytes <= 0:
        return 0.0
    bw = cluster.nvlink_gbps if world <= cluster.gpus_per_node else cluster.internode_gbps
    return nbytes / (bw * 1e9)


def a2a_transfers(recompute: str) -> int:
    """All-to-all transfers of each MoE layer's rows in a step: dispatch and combine, forward and
    backward, and with recompute ``full`` the re-run's dispatch and combine again: `onboard
    train` re-runs each whole decoder layer, its EP module's forward included, at least up to
    the combine (which keeps the pair order for its backward). ``selective`` re-runs only the
    expert compute after the dispatch (`onboarding.train.parallel.apply_recompute`): no
    all-to-all."""
    return 6 if recompute == "full" else 4


def communication(shape: ModelShape, cfg: PlanConfig, lay: Layout, mem: Memory,
                  cluster: ClusterConfig) -> Comm:
    world, ep = lay.world, lay.ep
    tokens = cfg.micro_batch * cfg.seq
    a2a_layer = a2a = 0.0
    if ep > 1:
        transfers = a2a_transfers(lay.recompute)
        for e in shape.routed_layers:  # alternatives: a token is sent to one of them
            per = transfers * tokens * pairs_per_token(shape, cfg, ep, e.top_k) * e.hidden \
                * BF16 * (ep - 1) / ep
            a2a_layer = max(a2a_layer, per)
            a2a += e.count * per
    frac = (world - 1) / world if world > 1 else 0.0
    dense_bytes = BF16 * shape.dense
    # a part besides the language model (`ModelShape.towers`): in the root's group, gathered
    # once (the root keeps it unsharded to the end of the backward), frozen: nothing to reduce
    # the root's own group (`ModelShape.root_tensors`: embedding, final norm, head) is gathered
    # once too, for the same reason: the backward does not gather it again
    gather = (2 * dense_bytes - BF16 * shape.root + BF16 * sum(shape.tower_params().values())) \
        * frac
    if cfg.mode != "full":
        reduce = FP32 * lora_params(shape, cfg)[0] * frac
        exp_reduce = 0.0
        if cfg.expert_lora and lay.fsdp > 1:
            exp_reduce = 2 * FP32 * expert_lora_params(shape, cfg) / ep * (lay.fsdp - 1) \
                / lay.fsdp
    else:
        reduce = dense_bytes * frac
        local_experts = sum(e.count * ceil_div(e.n_experts, ep) * e.per_expert
                            for e in shape.experts)
        exp_reduce = 2 * BF16 * local_experts * (lay.fsdp - 1) / lay.fsdp if lay.fsdp > 1 \
            else 0.0
    fsdp_s = _ring_time(gather + reduce + exp_reduce, world, cluster)
    # weights in for the forward and again for the backward; optimizer state out and back
    # (a part besides the language model and the root's own group once: the root's group comes
    # in for the whole step)
    offload = 2 * mem.host_weights - mem.host_towers - mem.host_root + 2 * mem.host_optimizer
    return Comm(a2a_layer_bytes=a2a_layer, a2a_bytes=a2a, a2a_s=_link_time(a2a, ep, cluster),
                fsdp_gather_bytes=gather, fsdp_reduce_bytes=reduce + exp_reduce, fsdp_s=fsdp_s,
                offload_bytes=offload, offload_s=offload / (cluster.pcie_gbps * 1e9))


# GEMM FLOPs per weight and token in each pass of a step: the forward, the input gradient (every
# weight a gradient passes through, frozen or trained) and the weight gradient (trained weights
# alone): 6 per trained weight, 4 per frozen one, as `onboarding.train.flops` counts them
FORWARD, INPUT_GRAD, WEIGHT_GRAD = 2.0, 2.0, 2.0


def _gemm_flops(cfg: PlanConfig, matmul: float, adapters: float, experts: list[ExpertShape],
                *, forward_only: bool = False) -> tuple[float, float]:
    """(dense, expert) GEMM FLOPs per token of a step over ``matmul`` dense GEMM parameters,
    ``adapters`` dense adapter parameters and the routed ``experts``; ``forward_only``: of its
    forward alone (what a recompute runs again). Full training trains every weight; LoRA the
    adapters (the experts' with ``expert_lora``), the base weights frozen."""
    routed = sum(e.count * e.top_k * e.per_expert for e in experts)
    if cfg.mode == "full":
        frozen, trained = (0.0, 0.0), (matmul, routed)
    else:
        exp_adapters = sum(e.count * e.top_k * sum(cfg.lora_rank * (i + o) for i, o in e.matrices)
                           for e in experts) if cfg.expert_lora else 0
        frozen, trained = (matmul, routed), (adapters, exp_adapters)
    per_frozen, per_trained = (FORWARD, FORWARD) if forward_only else \
        (FORWARD + INPUT_GRAD, FORWARD + INPUT_GRAD + WEIGHT_GRAD)
    dense, expert = (per_frozen * f + per_trained * t for f, t in zip(frozen, trained))
    return dense, expert


def _core_flops(shape: ModelShape, cfg: PlanConfig, blocks: list[BlockShape]) -> float:
    return sum(attention_core(shape, b, cfg.seq) for b in blocks
               if b.kind.startswith(("attention.", "sparse_attention.", "linear_attention.")))


def step_flops(shape: ModelShape, cfg: PlanConfig) -> tuple[float, float, float]:
    """(GEMM FLOPs, expert GEMM FLOPs, attention-core FLOPs) per token of one training step."""
    dense, experts = _gemm_flops(cfg, shape.dense_matmul, lora_params(shape, cfg)[0],
                                 shape.routed_layers)
    return dense, experts, _core_flops(shape, cfg, shape.blocks)


# a step's work in units of its forward where the backward does twice the forward's, whatever
# trains (the input gradient flows through under LoRA too): an attention core's, as
# `onboarding.train.flops._attention_core` counts it, and the memory-bound passes' (assumed)
FWD_BWD_PASSES = 3


def rerun_flops(shape: ModelShape, cfg: PlanConfig, recompute: str
                ) -> tuple[float, float, float]:
    """(GEMM, expert GEMM, attention-core) FLOPs per token of the forward ``recompute`` runs again
    in the backward (`recompute_blocks`): for ``full`` the decoder layers' (the whole forward
    but the blocks outside the layers: the head); for ``selective`` its blocks' linears and
    their adapters (a block inside another's module, `inner_blocks`, adds none: the outer block
    lists them), the routed experts of an experts block (its own linears
    aside: a list of experts lists every one) and the attention cores among them (none:
    attention keeps its activations). The GEMMs' forward share of the step is what trains:
    half a LoRA step's frozen GEMMs, a third of full training's."""
    blocks = recompute_blocks(shape, recompute)
    if recompute == "full":
        # the model's dense GEMMs and adapters less those of the blocks outside the layers
        # (the head), which the re-run does not run: what no block holds counts as re-run
        outside = [b for b in shape.blocks if not b.nested and not in_layer(b)]
        matmul = shape.dense_matmul - sum(b.count * sum(i * o for _, i, o in b.linears)
                                          for b in outside)
        adapters = lora_params(shape, cfg)[0] - sum(
            b.count * sum(cfg.lora_rank * (i + o) for _, i, o in b.lora_targets)
            for b in outside)
        dense, experts = _gemm_flops(cfg, matmul, adapters, shape.routed_layers,
                                     forward_only=True)
        return dense, experts, _core_flops(shape, cfg, blocks) / FWD_BWD_PASSES
    inner = {id(b) for b in inner_blocks(blocks)}  # their linears are the outer block's
    linear = [b for b in blocks if b.kind != "moe.experts" and id(b) not in inner]
    matmul = sum(b.count * sum(i * o for _, i, o in b.linears) for b in linear)
    adapters = sum(b.count * sum(cfg.lora_rank * (i + o) for _, i, o in b.lora_targets)
                   for b in linear) if cfg.mode != "full" else 0
    experts = [e for e in shape.routed_layers
               if any(b.kind == "moe.experts" and b.pattern == e.pattern for b in blocks)]
    return (*_gemm_flops(cfg, matmul, adapters, experts, forward_only=True),
            _core_flops(shape, cfg, blocks) / FWD_BWD_PASSES)


def attention_core(shape: ModelShape, b: BlockShape, seq: int) -> float:
    """Core FLOPs per token of every instance of attention block ``b``: each instance with its
    own local window (`onboarding.plan.shapes.local_window`), else the kind's own rule, and its
    own layer's widths where the config overrides them per layer (`flops.config_field`). A model
    without a config has each block's captured widths (`flops.CapturedCore`, as `onboard train`
    counts them: such a model's capture is the model itself); a block without them (linear
    attention, no softmax core captured) counts none."""
    from onboarding.train.flops import BY_KIND, CapturedCore, Chunk, _attention_core, \
        per_layer_overrides

    fields = shape.config if shape.config is not None else CapturedCore.of(b)
    if fields is None:
        return 0.0
    per_layer = bool(per_layer_overrides(fields))
    groups: dict[tuple, int] = {}
    for layer, w, src in b.instances or [(None, None, "")] * b.count:
        # a chunk of c and a window of c are equal ints: the key tells them apart
        key = (layer if per_layer else None, w if src else BY_KIND, isinstance(w, Chunk))
        groups[key] = groups.get(key, 0) + 1
    return sum(n * (_attention_core(fields, b.kind, seq, b.attrs, w, layer=layer) or 0.0)
               for (layer, w, _), n in groups.items())


# Host ops of `onboard train`'s step beyond the captured blocks, counted with a dispatch mode on
# the CPU for hf:qwen3_moe and hf:qwen3_next tiny proxies (docs/LOG.md): a LoRA adapter's
# forward (upcast, A, B, scale, cast, add), the EP module's sort / dispatch / regroup / combine
# per MoE layer (without its CPU per-expert loop), AdamW per trainable tensor (single-tensor
# form), and the backward at 1.26 x the forward's ops.
ADAPTER_OPS, EP_OPS, ADAM_OPS, BACKWARD_OPS = 8, 60, 10, 1.26


def forward_ops(shape: ModelShape, cfg: PlanConfig, blocks: list[BlockShape] | None = None,
                *, ep_modules: bool | None = None) -> float:
    """ATen ops of one forward: the op graph's blocks, adapters, EP modules. Every block's,
    nested ones too: a block's op histogram holds none of the ops of the blocks inside it (a
    child that became a block claimed its own; one taken in was removed), so a norm inside
    attention or a linear attention's conv adds its own launches. Adapters: the outermost
    blocks' LoRA targets (`model_shape` lists every linear under a block's module, those of the
    blocks inside it too). ``blocks``: those blocks' ops and adapters alone (what a recompute
    re-runs), with the EP modules' where ``ep_modules`` (default: all blocks'; full recompute
    re-runs them, selective only their expert compute, not the dispatch)."""
    if ep_modules is None:
        ep_modules = blocks is None
    blocks = shape.blocks if blocks is None else blocks
    ops = sum(b.count * b.ops for b in blocks)
    adapters = 0 if cfg.mode == "full" else ADAPTER_OPS * sum(
        b.count * len(b.lora_targets) for b in blocks if not b.nested)
    ep = EP_OPS * sum(e.count for e in shape.routed_layers) if ep_modules else 0
    return ops + adapters + ep


def host_ops(shape: ModelShape, cfg: PlanConfig) -> float:
    """Ops launched per step: forward, backward and the optimizer."""
    if cfg.mode == "full":
        tensors = len(shape.dense_tensors) + 2 * sum(e.count for e in shape.experts)
    else:
        tensors = 2 * sum(b.count * len(b.lora_targets) for b in shape.blocks if not b.nested)
    return forward_ops(shape, cfg) * (1 + BACKWARD_OPS) + ADAM_OPS * tensors


def _gemm_attn_s(flops: tuple[float, float, float], expert_weights: float, cfg: PlanConfig,
                 r: Rates, *, forward_only: bool = False) -> tuple[float, float]:
    """(GEMM, attention-core) seconds of ``flops`` per token: a step's (`step_flops`), or with
    ``forward_only`` a re-run forward's (`rerun_flops`), over ``expert_weights`` bytes of
    routed experts."""
    tokens = cfg.micro_batch * cfg.seq
    dense_f, exp_f, core_f = flops
    gemm_rate = r.gemm_tflops * 1e12
    # experts with few tokens each are bound by reading their weights once per pass over them:
    # the forward, the input gradient, and the weight gradient when they train
    passes = 1 if forward_only else 3 if cfg.mode == "full" else 2
    expert_read = passes * expert_weights / (r.hbm_tbps * 1e12)
    gemm_s = dense_f * tokens / gemm_rate + max(exp_f * tokens / gemm_rate, expert_read)
    return gemm_s, core_f * tokens / (r.attn_tflops * 1e12)


def rerun(shape: ModelShape, cfg: PlanConfig, lay: Layout, mem: Memory, r: Rates
          ) -> tuple[float, float]:
    """(GPU seconds, host ops) of the forward that ``lay``'s recompute runs again in the
    backward: the GEMM and attention time of that forward's FLOPs (`rerun_flops`; the expert
    weights read once, in the share of the forward's expert FLOPs re-run), a third of the
    memory passes over what it writes again (`Memory.recomputed`: the step's 4 passes are a
    forward's and a backward's, whatever trains), and its blocks' forward ops (`forward_ops`;
    ``full``: the decoder layers', EP modules included)."""
    if lay.recompute == "none":
        return 0.0, 0.0
    flops = rerun_flops(shape, cfg, lay.recompute)
    forward_exp = rerun_flops(shape, cfg, "full")[1]
    gemm_s, attn_s = _gemm_attn_s(flops, mem.weights_experts * flops[1] / forward_exp
                                  if forward_exp else 0.0, cfg, r, forward_only=True)
    memory_s = 4 * mem.recomputed / (r.hbm_tbps * 1e12) / FWD_BWD_PASSES
    ops = forward_ops(shape, cfg, recompute_blocks(shape, lay.recompute),
                      ep_modules=lay.recompute == "full")
    return gemm_s + attn_s + memory_s, ops


def step_time(shape: ModelShape, cfg: PlanConfig, lay: Layout, mem: Memory, comm: Comm,
              cluster: ClusterConfig) -> StepTime:
    r = cluster.rates
    tokens = cfg.micro_batch * cfg.seq
    dense_f, exp_f, core_f = step_flops(shape, cfg)
    gemm_s, attn_s = _gemm_attn_s((dense_f, exp_f, core_f), mem.weights_experts, cfg, r)
    memory_s = (4 * mem.produced + 20 * shape.vocab * tokens) / (r.hbm_tbps * 1e12)
    rerun_s, rerun_ops = rerun(shape, cfg, lay, mem, r)
    host_s = (host_ops(shape, cfg) + rerun_ops) * r.launch_us * 1e-6
    gpu_s = gemm_s + attn_s + memory_s + rerun_s
    # the EP module reads its split sizes on the host (.tolist()) in every MoE layer: the host
    # cannot run ahead of the GPU, so host and device time add up; without MoE they overlap
    compute_s = gpu_s + host_s if shape.experts else max(gpu_s, host_s)
    overlap = max(compute_s, comm.seconds)
    serial = compute_s + comm.seconds
    flops = (dense_f + exp_f + core_f) * tokens
    mfu = flops / overlap / (r.peak_tflops * 1e12) if overlap else 0.0
    return StepTime(flops=flops, gemm_s=gemm_s, attn_s=attn_s, memory_s=memory_s,
                    host_s=host_s, rerun_s=rerun_s, compute_s=compute_s, overlap_s=overlap,
                    serial_s=serial, mfu=mfu, tokens_per_s=tokens * lay.world / overlap if overlap else 0.0)
