"""Bytes per device of one layout: weights, trainable state, activations by block kind, workspace.

Weights are bf16: dense parameters sharded by FSDP2 over every rank (as `onboard train` shards
them: dim 0 in ceil-sized chunks, so the largest shard is counted), routed experts split by EP.
Trainable state, fp32: LoRA parameters, gradients and Adam moments (16 bytes per adapter
parameter), or for full training bf16 gradients, an fp32 master copy and Adam moments (2 + 4 + 8
bytes per parameter: with the bf16 weight, the article's 16 bytes per parameter).

Activations are the tensors autograd keeps for the backward, per token of one rank (N = micro
batch x seq), by block kind, from the block's full-size widths (`onboarding.plan.shapes`):
  - attention (full, gated, sliding, MLA, compressed, top-k sparse): its projections' outputs
    except the one back to the residual (q, k, v or MLA's latents and up-projections), the core's
    output (heads x d_v) and its fp32 log-sum-exp (heads); an output gate (`gate_activation`)
    adds the output it gates and the gate (heads x d_v, or heads: one value per head; the heads
    the config's, else a per-head gate's projection's: `block_heads`); top-k sparse adds the
    indexer's scores ``[B, T, index_heads, T]`` in fp32 as a transient (one layer at a time),
    compressed attention with an indexer its ``[B, T, index_heads, T / r]`` scores over the
    pooled entries;
  - linear attention: the same projections and output, plus per chunk of C tokens the fp32
    state ``heads x d_k x d_v`` and the ``C x C`` intra-chunk matrix per head; its causal conv
    keeps its activated output;
  - MoE: the router's fp32 scores (2 x E), per routed (token, expert) pair the expert's gate and
    up outputs (2F; the routing weight scales the activation, whose silu the backward
    recomputes), the pair's routing weight and two int64 indices; with expert LoRA on the torch
    path the fp32 forms its adapters need (D + 3F); pairs per token are top-k x the expected
    load imbalance (capped by a capacity factor) on an EP rank; dispatch buffers (x sorted,
    received, regrouped, and back: 4 x D per pair) are a transient of one layer;
  - dense MLP and shared experts: gate, up, activation (3F, gated);
  - a gated per-layer input (`residual.input_gate`): the gate's output, its activation and their
    product with the layer's input (3P, "other");
  - a low-rank residual branch (`residual.low_rank`, D -> r -> D): its rank-r product (r,
    "other"), which selective recompute re-runs;
  - norms: their input (2D with a fused kernel, 4D for transformers' fp32 upcast), once: a norm
    module inside another norm block (a gated norm's own RMSNorm, AXK2's) is counted in the
    outer block's bytes, which keep the normalised input already; a gated norm adds its gate's
    tensors by the ops it runs (`_gate_saved`: 6D and the gate MLP's rank-r hidden for AXK2's
    sigmoid(mlp(y)) * y, 10D for a silu gate after the norm, 12D before it);
  - LoRA adapters: each keeps its input as it came, once per distinct input (q, k and v share
    theirs; an attention output projection's input is the core's output, already kept), and its
    rank-r product in fp32;
  - full training adds each block's input (2D) and the expert/MLP inputs the weight gradients
    need (2 (D + F));
  - the loss: the bf16 logits (2V per token), plus, at the end of the forward, their bf16
    gradient (2V: the chunked cross-entropy writes it there and keeps it instead of the logits,
    which are then freed) and one chunk's fp32 temporaries.
Recompute ``full`` keeps each decoder layer's input (2D) and re-runs one layer at a time in the
backward; ``selective`` re-runs the MLP/expert activations (the 3F parts) and a low-rank residual
branch's rank-r product, and keeps the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onboarding.graph.opgraph import CONV_KINDS
from onboarding.plan.config import GIB, ClusterConfig, PlanConfig
from onboarding.plan.shapes import (BlockShape, ModelShape, _inside, attention_heads, ceil_div,
                                   fsdp_shard)

BF16, FP32 = 2, 4
CE_CHUNK_ELEMENTS = 1 << 26  # onboarding.train.worker's loss chunk (fp32 elements)


@dataclass(kw_only=True, slots=True)
class Layout:
    ep: int
    fsdp: int
    recompute: str
    offload: str

    @property
    def world(self) -> int:
        return self.ep * self.fsdp

    @property
    def name(self) -> str:
        return f"EP {self.ep} x FSDP {self.fsdp}, recompute {self.recompute}, " \
               f"offload {self.offload}"


@dataclass(kw_only=True, slots=True)
class Memory:
    """Bytes per device by component; ``activations`` by block kind group."""

    weights_dense: float
    weights_experts: float
    fsdp_buffers: float
    trainable: dict[str, float]
    activations: dict[str, float]
    workspace: float
    workspace_what: str
    slack: float
    reserved: float
    host_weights: float  # bytes per device offloaded to host memory: weights
    host_optimizer: float  # and optimizer state
    notes: list[str] = field(default_factory=list)

    @property
    def allocated(self) -> float:
        """What ``torch.cuda.max_memory_allocated`` should read at the peak."""
        return (self.weights_dense + self.weights_experts + self.fsdp_buffers
                + sum(self.trainable.values()) + sum(self.activations.values()) + self.workspace)

    @property
    def host(self) -> float:
        return self.host_weights + self.host_optimizer

    @property
    def total(self) -> float:
        return self.allocated + self.slack + self.reserved

    def components(self) -> dict[str, float]:
        out = {"weights: dense (FSDP)": self.weights_dense,
               "weights: experts (EP)": self.weights_experts,
               "FSDP gather buffers": self.fsdp_buffers}
        out.update(self.trainable)
        out.update({f"activations: {k}": v for k, v in self.activations.items()})
        out["workspace: " + self.workspace_what] = self.workspace
        out["allocator slack + reserved"] = self.slack + self.reserved
        return {k: v for k, v in out.items() if v > 0}


def kind_group(kind: str) -> str:
    if kind.startswith("sparse_attention."):
        return "sparse attention"
    if kind.startswith("linear_attention") or kind in (*CONV_KINDS, "conv.gated"):
        return "linear attention"
    if kind.startswith("attention"):
        return "attention"
    if kind.startswith("moe"):
        return "MoE"
    if kind == "mlp.dense":
        return "dense MLP"
    if kind.startswith("norm"):
        return "norms"
    return "other"


def lora_params(shape: ModelShape, cfg: PlanConfig) -> tuple[int, int]:
    """(dense adapter parameters in the whole model, expert adapter parameters per expert-layer
    per expert) at the default targets."""
    r = cfg.lora_rank
    dense = sum(b.count * sum(r * (i + o) for i, o in b.lora_targets) for b in shape.blocks
                if not b.nested)
    return dense, 0


def expert_lora_params(shape: ModelShape, cfg: PlanConfig) -> int:
    """Expert adapter parameters in the whole model (per expert r (in + out) per matrix)."""
    if not cfg.expert_lora:
        return 0
    return sum(e.count * e.n_experts * sum(cfg.lora_rank * (i + o) for i, o in e.matrices)
               for e in shape.experts)


def pairs_per_token(shape: ModelShape, cfg: PlanConfig, ep: int, top_k: int) -> float:
    """(token, expert) pairs an EP rank computes per token of its own: top-k, times the
    expected max/mean load on one rank when experts are split (capped by a capacity factor)."""
    load = cfg.imbalance if ep > 1 else 1.0
    if cfg.capacity_factor is not None:
        load = min(load, cfg.capacity_factor)
    return top_k * load


def _lora_saved(b: BlockShape, r: int) -> float:
    """Per token: each distinct adapter input once in bf16 (q, k and v share theirs), and every
    adapter's fp32 rank-r product."""
    return sum(BF16 * i for i in {i for i, _ in b.lora_targets}) + FP32 * r * len(b.lora_targets)


def _counted_blocks(shape: ModelShape) -> list[BlockShape]:
    """The blocks whose activations count: all but a norm inside another norm block's module (a
    gated norm's own RMSNorm: the outer block's bytes count its input already), found by their
    path patterns (layer numbers as ``*``), so a norm inside attention still counts."""
    norms = [b.pattern for b in shape.blocks if b.kind.startswith("norm.")]
    return [b for b in shape.blocks if not (b.kind.startswith("norm.") and any(
        p != b.pattern and _inside(b.pattern, p) for p in norms))]


def block_heads(b: BlockShape, shape: ModelShape) -> tuple[int, int, int, str]:
    """(heads, d_qk, d_v, where the head count came from) of attention block ``b``: the config's
    fields ("config", `attention_heads`); without them the output projection's input stands for
    the core's output (heads x d_v), over the heads a per-head output gate's projection gives
    at full size ("gate projection", `shapes.gate_heads`), else over one head (""), which
    undercounts a per-head gate and the log-sum-exp (the plan notes it: `search.head_notes`)."""
    heads = attention_heads(shape.config, b.kind)
    if heads is not None:
        return (*heads, "config")
    out_in = next((i for _, i, o in b.linears if o == shape.hidden), shape.hidden)
    h = b.gate_heads if b.gate_heads and out_in % b.gate_heads == 0 else 0
    return (h, 0, out_in // h, "gate projection") if h else (1, 0, out_in, "")


# activations whose backward reads their output, which the gate's product keeps anyway (so
# nothing more); the others (silu, gelu, softplus) read their input, one more tensor
BACKWARD_READS_OUTPUT = frozenset({"sigmoid", "tanh", "relu"})


def _gate_saved(b: BlockShape, w: int, cfg: PlanConfig) -> float:
    """Per token, what a gated norm keeps beyond its norm's input, by the ops it runs (as
    transformers writes them: the gate cast to fp32, activated, and the product in fp32):
      - the product's other operand: the bf16 normalised output (gated after the norm; an MLP
        gate's reads its norm module's output, in the model's dtype, and Qwen3-Next's casts it
        back before the weight) or, gated before it (``norm_before_gate`` false, Mamba-2's),
        the fp32 input, the norm's input then being the product. An implementation that keeps
        the normalised output in fp32 (the weight applied in fp32: bailing_hybrid's) keeps 2w
        more, which the fp32 capture cannot tell apart;
      - the fp32 activated gate, and the fp32 gate it was computed from when the activation's
        backward reads its input (`BACKWARD_READS_OUTPUT`);
      - a gate that is a low-rank MLP of the normalised output (gate "mlp", AXK2's: D -> r -> D)
        keeps its rank-r hidden, the activation's input (and, for full training, its output:
        the second projection's weight gradient reads it); its projections' input is the
        normalised output, kept already.
    A fused gated-norm kernel keeps the bf16 gate; an MLP gate's product is no kernel's (coverage
    lists it as unfused) and runs in torch either way.
    In all, the norm's input included: 10 w + 2 r for hf:axk2's (sigmoid after the norm, an MLP
    gate), 14 w for hf:qwen3_next's (silu after), 16 w for hf:zamba2's (silu before), as
    `saved_tensors_hooks` counts them in a LoRA step of the tiny proxies (axk2's and zamba2's:
    tests/test_plan.py)."""
    mlp = b.attrs.get("gate") == "mlp"
    if cfg.kernels_norm and not mlp:
        return BF16 * w
    other = BF16 * w if b.attrs.get("norm_before_gate", True) else FP32 * w
    act = b.attrs.get("gate_activation") or b.attrs.get("activation")
    gate = FP32 * w * (1 if act in BACKWARD_READS_OUTPUT else 2)
    hidden = 0.0
    if mlp:
        r = min((o for _, i, o in b.linears if i == w), default=0)
        hidden = BF16 * r * (2 if cfg.mode == "full" else 1)
    return other + gate + hidden


def block_saved(b: BlockShape, shape: ModelShape, cfg: PlanConfig, ep: int
                ) -> tuple[float, float, float]:
    """(bytes kept per token, of which selective recompute re-runs, transient bytes per token of
    one layer at a time) of one instance of block ``b``."""
    d, r = shape.hidden, cfg.lora_rank
    full = cfg.mode == "full"
    kind = b.kind
    lora = 0.0 if full else _lora_saved(b, r)
    if kind.startswith(("attention.", "sparse_attention.", "linear_attention.")):
        lin_out = max(sum(o for _, _, o in b.linears) - d, 0)
        h, dqk, dv, _ = block_heads(b, shape)
        if not full and not kind.startswith("linear_attention."):
            lora -= BF16 * h * dv * any(i == h * dv for i, _ in b.lora_targets)  # the core's output
        kept = BF16 * (lin_out + h * dv) + lora + (BF16 * d if full else 0)
        transient = 0.0
        if kind.startswith("linear_attention."):
            # the chunked delta rule as transformers' torch form runs it: fp32 copies of q, k,
            # v, beta-weighted k and v, w, u and the output (8 x heads x d_v), the C x C
            # intra-chunk matrices (4 per head) and the state entering each chunk
            c = int(b.attrs.get("chunk") or 64)
            kept += FP32 * (8 * h * dv + 4 * h * c) + FP32 * h * dqk * dv / c
        else:
            kept += FP32 * h  # log-sum-exp
            if kind == "attention.gated" or b.attrs.get("gate_activation"):
                # the product keeps the output it gates and the activated gate (one value per
                # head, or per channel); an activation that differentiates from its input
                # (softplus, silu) reads the gate projection's output, counted in `lin_out`
                gate = h if b.attrs.get("gate_per_head") else h * dv
                kept += BF16 * (h * dv + gate)
        if kind == "sparse_attention.topk" or (kind == "attention.compressed"
                                               and b.attrs.get("topk")):
            from onboarding.train.flops import _int

            # the indexer's fp32 scores, per token: [B, T, H_idx, T] over every key, or
            # [B, T, H_idx, T / r] over compressed attention's pooled entries
            r = int(b.attrs.get("compress_ratio") or 1) if kind == "attention.compressed" else 1
            transient = FP32 * (_int(shape.config, "index_n_heads") or 1) * max(cfg.seq // r, 1)
        return kept, 0.0, transient
    if kind == "moe.router":
        e = shape.n_experts or 1
        k = max((x.top_k for x in shape.experts), default=1)
        return FP32 * e + 12 * k + FP32, 0.0, 0.0  # scores, top-k ids and weights
    if kind == "moe.experts":
        ex = next((x for x in shape.experts if x.pattern == b.pattern), None)
        if ex is None:
            return 0.0, 0.0, 0.0
        f = ex.width
        # `onboard train`'s EP module: gate/up (the weighted SwiGLU keeps [gate | up], a
        # non-gated expert its up output and the weighted activation: 2F either way), the
        # routing weight and two int64 indices (token of each pair, pair order)
        per_pair = BF16 * 2 * f + BF16 + 2 * 8
        if cfg.expert_lora and not full:  # torch path: gate/up in fp32 instead, x and act fp32
            per_pair += FP32 * (d + (2 * f if ex.gated else f) + f) + 2 * FP32 * r - BF16 * 2 * f
        if full:
            per_pair += BF16 * (d + f)
        pairs = pairs_per_token(shape, cfg, ep, ex.top_k)
        return pairs * per_pair, pairs * BF16 * 2 * f, pairs * 4 * BF16 * d
    if kind in ("mlp.dense", "moe.shared_expert"):
        outs = [o for _, i, o in b.linears if i == d]
        f = min(outs) if outs else d
        gated = len(outs) >= 2 or (outs and max(outs) == 2 * min(outs))
        if len(outs) == 1 and gated:
            f = outs[0] // 2
        act = (3 if gated else 2) * f
        return BF16 * act + lora + (BF16 * (d + f) if full else 0), BF16 * act, 0.0
    if kind == "residual.low_rank":
        # D -> r -> D: the rank-r product (the second projection's input) is kept, and re-run
        # by selective recompute (train's SELECTIVE_KINDS); its norm is a block of its own
        r_out = min((o for _, i, o in b.linears if i == d), default=0)
        return BF16 * r_out + lora + (BF16 * d if full else 0), BF16 * r_out, 0.0
    if kind == "residual.input_gate":
        # the gate projection's output, its activation and their product with the layer's own
        # input (P wide each: the activation's, the product's and the second projection's
        # backward); the block is the first projection's module, whose out features are P
        p = next((o for _, i, o in b.linears if i == d), 0)
        return 3 * BF16 * p + lora + (BF16 * d if full else 0), 0.0, 0.0
    if kind.startswith("norm."):
        w = b.width or d
        # transformers' RMSNorm upcasts: its fp32 input is kept (a fused kernel keeps bf16)
        per = BF16 * w if cfg.kernels_norm else FP32 * w
        if kind == "norm.rms_gated":
            per += _gate_saved(b, w, cfg)
        return per, 0.0, 0.0
    if kind in CONV_KINDS:
        return 2 * BF16 * b.width, 0.0, 0.0  # its input and its activated output
    if kind == "conv.gated":
        # the projections' outputs but the last (the gates and the conv's operand, kept for the
        # products' backward) and the last projection's input; the conv keeps its own (above)
        lin_out = max(sum(o for _, _, o in b.linears) - d, 0)
        last_in = next((i for _, i, o in reversed(b.linears) if o == d), 0)
        return BF16 * (lin_out + last_in) + lora + (BF16 * d if full else 0), 0.0, 0.0
    return 0.0, 0.0, 0.0


def memory(shape: ModelShape, cfg: PlanConfig, lay: Layout, cluster: ClusterConfig) -> Memory:
    """Peak bytes per device of ``lay`` (the largest shard and the busiest EP rank)."""
    world, ep = lay.world, lay.ep
    tokens = cfg.micro_batch * cfg.seq
    notes: list[str] = []
    # weights
    dense_el = sum(fsdp_shard(d0, rest, world) for d0, rest in shape.dense_tensors)
    expert_el = sum(e.count * ceil_div(e.n_experts, ep) * e.per_expert for e in shape.experts)
    wb = FP32 if cfg.dtype == "fp32" else BF16
    w_dense, w_exp = wb * dense_el, wb * expert_el
    layer_experts = max((ceil_div(e.n_experts, ep) * e.per_expert for e in shape.experts),
                        default=0)
    gather = wb * 2 * shape.layer_dense_max if world > 1 else 0.0  # this layer + prefetch
    host_w = host_opt = 0.0
    if lay.offload == "params":
        host_w = w_dense + w_exp
        gather = wb * 2 * (shape.layer_dense_max + layer_experts)
        w_dense = w_exp = 0.0
        notes.append("offload params: sharded weights live in host memory; two layers "
                     "(dense + local experts) are on the GPU at a time")
    # trainable state
    trainable: dict[str, float] = {}
    if cfg.mode != "full":
        n_dense, _ = lora_params(shape, cfg)
        n_exp = expert_lora_params(shape, cfg)
        per = ceil_div(n_dense, world) + ceil_div(n_exp, ep)
        trainable["LoRA params + grads (fp32)"] = 2 * FP32 * per
        adam = 2 * FP32 * per
        if lay.offload in ("optimizer", "params"):
            host_opt, adam = adam, 0.0
        trainable["LoRA Adam moments (fp32)"] = adam
    else:
        n = dense_el + expert_el
        trainable["grads (bf16)"] = BF16 * n
        master, adam = FP32 * n, 2 * FP32 * n
        if lay.offload in ("optimizer", "params"):
            host_opt, master, adam = master + adam, 0.0, 0.0
        trainable["fp32 master weights"] = master
        trainable["Adam moments (fp32)"] = adam
    # activations
    acts: dict[str, float] = {}
    trans_layer = 0.0
    for b in _counted_blocks(shape):
        kept, selective, trans = block_saved(b, shape, cfg, ep)
        if lay.recompute == "selective":
            kept -= selective
        g = kind_group(b.kind)
        acts[g] = acts.get(g, 0.0) + b.count * kept * tokens
        trans_layer = max(trans_layer, trans * tokens)
    layer_ws, layer_what = trans_layer, "one layer's dispatch / indexer buffers"
    if lay.recompute == "full":
        acts = {"layer inputs (checkpoints)": BF16 * shape.hidden * tokens * shape.n_layers}
        layer_ws += _per_layer_max(shape, cfg, ep, tokens)
        layer_what = "one layer recomputed"
    # The peak is the end of the forward (the logits and their gradient, one loss chunk's
    # fp32 temporaries) or a layer's backward (that layer's workspace).
    v = shape.vocab
    acts["logits (bf16)"] = BF16 * v * tokens
    loss_ws = BF16 * v * tokens + 3 * FP32 * min(CE_CHUNK_ELEMENTS, v * tokens)
    if loss_ws >= layer_ws:
        workspace, what = loss_ws, "loss (the logits and their gradient, one chunk in fp32)"
    else:
        workspace, what = layer_ws, layer_what
    if cfg.mode == "full":
        notes.append("full training: gradients are reduce-scattered per layer; the peak "
                     "counts every shard's gradient at once")
    dynamic = sum(acts.values()) + workspace + gather
    return Memory(weights_dense=w_dense, weights_experts=w_exp, fsdp_buffers=gather,
                  trainable=trainable, activations=acts, workspace=workspace,
                  workspace_what=what, slack=cluster.slack * dynamic,
                  reserved=cluster.reserved_gib * GIB, host_weights=host_w,
                  host_optimizer=host_opt, notes=notes)


def _per_layer_max(shape: ModelShape, cfg: PlanConfig, ep: int, tokens: int) -> float:
    """About what one decoder layer keeps (recompute full re-runs one layer at a time): the
    largest block of each kind group (mixer, feed-forward, norms) summed."""
    by_group: dict[str, float] = {}
    for b in _counted_blocks(shape):
        g = kind_group(b.kind)
        by_group[g] = max(by_group.get(g, 0.0), block_saved(b, shape, cfg, ep)[0] * tokens)
    return sum(by_group.values())


def gib(x: float) -> float:
    return x / GIB
