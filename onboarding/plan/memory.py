"""Bytes per device of one layout: weights, trainable state, activations by block kind, workspace.

Weights are bf16: dense parameters sharded by FSDP2 over every rank (as `onboard train` shards
them: dim 0 in ceil-sized chunks, so the largest shard is counted), routed experts split by EP.
The parts besides the language model that the trained model holds (a causal LM that is the whole
multimodal model, Gemma 3's: its vision tower and projector) are a line each, frozen, in the
weights' dtype, in the root's FSDP2 group: their shard and, through the step, the whole part on
every GPU (`tower_weights`). So is the root's own group (`ModelShape.root_tensors`: the token
embedding, the final norm, the head, a tied head once): beside its shard in the dense line, its
unsharded copy (FSDP2's padded all-gather output) on every GPU from the root's forward to the end
of the backward, a line of its own (`root_weights`); their activations only where the captured forward ran them (their
blocks are then the op graph's, counted as any block's). A language model taken out alone
(Qwen2-VL's, Mllama's, Llama 4's) trains without its towers: they are on no GPU.
Trainable state, fp32: LoRA parameters, gradients and Adam moments (16 bytes per adapter
parameter), or for full training bf16 gradients, an fp32 master copy and Adam moments (2 + 4 + 8
bytes per parameter: with the bf16 weight, the article's 16 bytes per parameter).

Activations are the tensors autograd keeps for the backward, per token of one rank (N = micro
batch x seq), by block kind, from the block's full-size widths (`onboarding.plan.shapes`), in the
step `onboard train` runs: on a GPU with onboard's kernels patched into every block a family of
them matches (`PlanConfig.kernels`, `BlockShape.kernels`), where such a block keeps what the
kernel's autograd keeps; else (a CPU run, ``--no-kernels``) every block's own torch path:
  - attention (full, gated, sliding, MLA, compressed, top-k sparse): its projections' outputs
    except the one back to the residual and those of a module that passes no gradient out (a
    top-k indexer), the core's output (heads x d_v) and its fp32 log-sum-exp (heads); an output
    gate (`gate_activation`) adds the output it gates and the gate (heads x d_v, or heads: one
    value per head; the heads the config's, else a per-head gate's projection's:
    `block_heads`); top-k sparse adds the indexer's scores ``[B, T, index_heads, T]`` in fp32
    as a transient (one layer at a time), compressed attention with an indexer its
    ``[B, T, index_heads, T / r]`` scores over the pooled entries. With onboard's gathered
    top-k kernel (`_topk_kernel`: not MLA's layout under an adapter on its latents) the
    kernel's q, k and v and the int32 top-k positions instead of the projections
    (`_topk_kernel_saved`);
  - linear attention with onboard's delta-rule kernel: its 16-bit intermediates, inputs and
    the decay's tensors (`delta_rule_kernel_saved`); on the torch path the chunked form's fp32
    copies, C x C matrices and states (`_delta_rule_torch_saved`); its causal conv keeps its
    input and its activation's, its gated norm is a norm (below);
  - a state-space mixer (Mamba-1's selective scan, Mamba-2's chunked SSD): with onboard's
    selective_scan or ssd kernel patched in, what that kernel's autograd Function saves (its
    family's `saved_shapes`, `_scan_saved`); else what its torch path keeps by its widths read
    off its projections and conv (`_scan_torch_saved`);
  - MoE: the router's fp32 scores (2 x E), per routed (token, expert) pair the expert's gate and
    up outputs (2F; the routing weight scales the activation, whose silu the backward
    recomputes), the pair's routing weight and two int64 indices; with expert LoRA on the torch
    path the fp32 forms its adapters need (D + 3F); pairs per token are top-k x the expected
    load imbalance (capped by a capacity factor) on an EP rank; dispatch buffers (x sorted,
    received, regrouped, and back: 4 x D per pair) are a transient of one layer;
  - dense MLP and shared experts: gate, up, activation (3F, gated; onboard's SwiGLU 2F);
  - a gated per-layer input (`residual.input_gate`): the gate's output, its activation and their
    product with the layer's input (3P, "other");
  - a low-rank residual branch (`residual.low_rank`, D -> r -> D): its rank-r product (r,
    "other"), which selective recompute re-runs;
  - norms: their input (2D with onboard's kernel, 4D for transformers' fp32 upcast), once: a norm
    module inside another norm block (a gated norm's own RMSNorm, AXK2's) is counted in the
    outer block's bytes, which keep the normalised input already; a gated norm adds its gate's
    tensors by the ops it runs (`_gate_saved`: 6D and the gate MLP's rank-r hidden for AXK2's
    sigmoid(mlp(y)) * y, 10D for a silu gate after the norm, 12D before it);
  - LoRA adapters: each keeps its input as it came, the block's input once for all that read it
    (q, k and v), every other adapter's its own (a softmax attention's output projection reads
    the core's output, already kept), and its rank-r product in fp32 (`_lora_saved`);
  - full training adds each block's input (2D) and the expert/MLP inputs the weight gradients
    need (2 (D + F));
  - the loss: the logits' gradient (2V per token in bf16: the loss writes it in its forward
    and autograd keeps it instead of the logits), plus, at the end of the forward, the logits
    themselves (2V) and the loss's own temporaries: with onboard's loss kernel (a GPU run) its
    fp32 loss per token, on the torch path `_ChunkedCE`'s fp32 chunks
    (`chunked_ce_temporaries`). The head's backward frees the gradient before any layer's
    backward runs, so a layer's workspace is not counted on top of it (`loss_workspace`).
Recompute ``full`` keeps each decoder layer's input (2D) and re-runs one layer at a time in the
backward (the blocks outside the layers, the final norm, keep theirs); ``selective`` re-runs the
MLP/expert activations (the 3F parts), a low-rank residual branch's rank-r product and whatever
the blocks inside those modules keep (a norm inside the low-rank branch), and keeps the rest
(`recompute_blocks`).
`Memory.produced` and `Memory.recomputed` say what the forward writes and what the backward
writes again, for the step time (`onboarding.plan.estimate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onboarding.graph.opgraph import CONV_KINDS
from onboarding.modpath import inside
from onboarding.plan.config import GIB, ClusterConfig, PlanConfig
from onboarding.plan.shapes import (BlockShape, ModelShape, attention_heads, ceil_div,
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
    # activation bytes per device the forward writes for the backward (what no recompute keeps,
    # the logits included), and of them what the layout's recompute frees and writes again in
    # the backward: its memory-bound work is done whatever is kept
    produced: float
    recomputed: float
    notes: list[str] = field(default_factory=list)
    # bytes per device of the parts besides the language model the trained model holds
    # (`ModelShape.towers`), by part; of `host_weights`, the bytes that are theirs
    weights_towers: dict[str, float] = field(default_factory=dict)
    host_towers: float = 0.0
    # bytes per device of the root group's unsharded copy through the step (`root_weights`); of
    # `host_weights`, the root group's shard (offloaded weights)
    weights_root: float = 0.0
    host_root: float = 0.0

    @property
    def allocated(self) -> float:
        """What ``torch.cuda.max_memory_allocated`` should read at the peak."""
        return (self.weights_dense + self.weights_experts + sum(self.weights_towers.values())
                + self.weights_root + self.fsdp_buffers + sum(self.trainable.values())
                + sum(self.activations.values()) + self.workspace)

    @property
    def host(self) -> float:
        return self.host_weights + self.host_optimizer

    @property
    def total(self) -> float:
        return self.allocated + self.slack + self.reserved

    def components(self) -> dict[str, float]:
        out = {"weights: dense (FSDP)": self.weights_dense,
               "weights: experts (EP)": self.weights_experts,
               ROOT_KEY: self.weights_root,
               **{tower_key(k): v for k, v in self.weights_towers.items()},
               "FSDP gather buffers": self.fsdp_buffers}
        out.update(self.trainable)
        out.update({f"activations: {k}": v for k, v in self.activations.items()})
        out["workspace: " + self.workspace_what] = self.workspace
        out["allocator slack + reserved"] = self.slack + self.reserved
        return {k: v for k, v in out.items() if v > 0}


ROOT_KEY = "weights: root group (embedding, head) unsharded through the step"


def root_weights(shape: ModelShape, lay: Layout, wb: int) -> tuple[float, float]:
    """(bytes per GPU through the step, host bytes) of the root's FSDP2 group of the language
    model (`ModelShape.root_tensors`: what `onboard train` leaves outside the decoder layers it
    wraps one by one, `parallel.shard`: the token embedding, the final norm, the head; a tied
    head once, one storage). torch's FSDP2 does not reshard the root after its forward: from the
    root's forward (its all-gather) to the end of the backward every GPU holds the group's
    unsharded copy, FSDP2's all-gather output, ``world`` ceil-sized shards of each tensor (the
    padding included), beside its own shard (counted in the dense line);
    `tests/test_plan_root.py` reads both off FSDP2 on a fake process group. One GPU: no FSDP,
    the weights once (the dense line), nothing more. Offloaded weights: the shard in host memory
    (of `host_weights`), the unsharded copy on the GPU for the step."""
    if lay.world <= 1 and lay.offload != "params":
        return 0.0, 0.0
    full = wb * sum(lay.world * fsdp_shard(d0, rest, lay.world) for d0, rest in
                    shape.root_tensors)
    host = wb * sum(fsdp_shard(d0, rest, lay.world) for d0, rest in shape.root_tensors) \
        if lay.offload == "params" else 0.0
    return full, host


def tower_key(part: str) -> str:
    """The memory table's line of a part besides the language model (`ModelShape.towers`)."""
    return f"weights: {part} part (frozen)"


def tower_weights(shape: ModelShape, lay: Layout, wb: int
                  ) -> tuple[dict[str, float], float, float]:
    """(bytes per GPU by part, of them what the step allocates, host bytes) of the parts besides
    the language model that the trained model holds (`ModelShape.towers`), as `onboard train`
    holds them: frozen (no adapter: the op graph has no block of theirs to target), cast to the
    weights' dtype with the rest, and outside the decoder layers it wraps one by one
    (`parallel.shard`), so in the root's FSDP2 group, which the root's forward gathers and, as
    the root's, keeps unsharded until the end of the backward (torch's FSDP2: no reshard after
    the root's forward): every GPU holds its shard and, through the step, the whole part
    (`tests/test_plan_towers.py` reads both off FSDP2 on a fake process group). On one GPU
    there is no FSDP: the part once. With the weights offloaded the shard lives in host memory
    and the whole part comes in for the step."""
    out: dict[str, float] = {}
    step = host = 0.0
    for part, tensors in shape.towers.items():
        whole = wb * sum(d0 * rest for d0, rest in tensors)
        shard = wb * sum(fsdp_shard(d0, rest, lay.world) for d0, rest in tensors)
        if lay.offload == "params":
            out[part], step, host = whole, step + whole, host + shard
        elif lay.world > 1:
            out[part], step = shard + whole, step + whole
        else:
            out[part] = whole
    return out, step, host


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
    dense = sum(b.count * sum(r * (i + o) for _, i, o in b.lora_targets) for b in shape.blocks
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


def output_projection(b: BlockShape, d: int) -> str | None:
    """The path of block ``b``'s output projection: its last linear back to the model width."""
    return next((n for n, _, o in reversed(b.linears) if o == d), None)


def _lora_saved(b: BlockShape, d: int, r: int, *, output_input: bool = True) -> float:
    """Per token: each adapter's input in bf16, the block's own input once for all adapters
    that read it (q, k, v and the gates: D wide, the output projection aside), every other
    adapter's its own (the output projection's, the second half of a low-rank pair, MLA's
    up-projections of its latents), even where two are as wide (widths alone merged the
    output projection's input with the block's where H x d_v = D: the example's); less the
    output projection's where the caller counts that tensor already (``output_input`` False:
    a softmax core's output, which its backward keeps); and every adapter's fp32 rank-r
    product."""
    out = output_projection(b, d)
    own = [i for n, i, _ in b.lora_targets if (i != d or n == out) and (output_input or n != out)]
    shared = any(i == d and n != out for n, i, _ in b.lora_targets)
    return BF16 * (d * shared + sum(own)) + FP32 * r * len(b.lora_targets)


def _counted_blocks(shape: ModelShape) -> list[BlockShape]:
    """The blocks whose activations count: all but a norm inside another norm block's module (a
    gated norm's own RMSNorm: the outer block's bytes count its input already), found by their
    path patterns (layer numbers as ``*``), so a norm inside attention still counts."""
    norms = [b.pattern for b in shape.blocks if b.kind.startswith("norm.")]
    return [b for b in shape.blocks if not (b.kind.startswith("norm.") and any(
        p != b.pattern and inside(b.pattern, p) for p in norms))]


def in_layer(b: BlockShape) -> bool:
    """Whether block ``b`` is inside a decoder layer: an item of a layer list (a ``*`` in its
    pattern), what `onboard train`'s full recompute checkpoints (`parallel.decoder_blocks`);
    not the embedding, the final norm, the rotary table or the head, which run once."""
    return "*" in b.pattern.split(".")


def recompute_blocks(shape: ModelShape, recompute: str) -> list[BlockShape]:
    """The blocks whose forward the backward runs again: for ``full`` every one inside a
    decoder layer (`in_layer`), which keeps nothing but the layer's input; for ``selective``
    those of the kinds `onboard train` checkpoints (`SELECTIVE_KINDS`: MLPs, shared and routed
    experts, a low-rank residual branch), whose `block_saved` re-run part it frees,
    and the blocks inside their modules (`inner_blocks`: a low-rank branch's norm, Gemma 3n's
    ``laurel.post_laurel_norm``), which the checkpoint around the module runs again whole;
    none for ``none``."""
    from onboarding.train.parallel import SELECTIVE_KINDS

    if recompute == "full":
        return [b for b in shape.blocks if in_layer(b)]
    if recompute != "selective":
        return []
    outer = [b for b in shape.blocks if b.kind in SELECTIVE_KINDS]
    return outer + inner_blocks(shape.blocks, outer)


def inner_blocks(blocks: list[BlockShape], outer: list[BlockShape] | None = None
                 ) -> list[BlockShape]:
    """Those of ``blocks`` inside the module of one of ``outer`` (default: of ``blocks``), by
    their paths (`BlockShape.parents`): re-running the outer module runs them whole (all they
    keep is freed), and its linears list theirs already."""
    held = {(o.pattern, o.kind) for o in (blocks if outer is None else outer)}
    return [b for b in blocks if held.intersection(b.parents)
            and (outer is None or not any(b is o for o in outer))]


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


def _saving(patched: dict, what: str) -> list[str]:
    """The families patched into a block whose kernel keeps ``what`` (`FamilySpec.plan_saves`)."""
    from onboarding.families import get_family

    return [f for f in patched if get_family(f).plan_saves == what]


def _gate_saved(b: BlockShape, w: int, cfg: PlanConfig, *, fused: bool = False) -> float:
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
    With onboard's gated-norm kernel patched in (``fused``) the bf16 gate beside the bf16 input
    (4 w in all, as the hooks count the example's, hf:qwen3_next's, hf:kimi_linear's and
    hf:bailing_hybrid's with the kernels patched); an MLP gate's product is no kernel's
    (coverage lists it as unfused) and runs in torch either way.
    In all, the norm's input included: 10 w + 2 r for hf:axk2's (sigmoid after the norm, an MLP
    gate), 14 w for hf:qwen3_next's (silu after), 16 w for hf:zamba2's (silu before), as
    `saved_tensors_hooks` counts them in a LoRA step of the tiny proxies (axk2's and zamba2's:
    tests/test_plan.py)."""
    mlp = b.attrs.get("gate") == "mlp"
    if fused and not mlp:
        return BF16 * w
    other = BF16 * w if b.attrs.get("norm_before_gate", True) else FP32 * w
    act = b.attrs.get("gate_activation") or b.attrs.get("activation")
    gate = FP32 * w * (1 if act in BACKWARD_READS_OUTPUT else 2)
    hidden = 0.0
    if mlp:
        r = min((o for _, i, o in b.linears if i == w), default=0)
        hidden = BF16 * r * (2 if cfg.mode == "full" else 1)
    return other + gate + hidden


def _per_channel_decay(b: BlockShape) -> bool:
    """Whether linear-attention block ``b`` decays per key channel (Kimi's), not per head."""
    return bool(b.attrs.get("per_channel_decay")) or b.kind == "linear_attention.kimi_delta"


def _kv_latent(b: BlockShape) -> int | None:
    """MLA's latent width (attrs ``kv_latent``, recorded as a width or a list of them)."""
    latent = b.attrs.get("kv_latent")
    return latent[0] if isinstance(latent, (list, tuple)) and latent else latent


def _delta_rule_widths(b: BlockShape, shape: ModelShape) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, d_k, d_v, decay values per token: the value heads, x d_k for a
    per-channel decay) of linear-attention block ``b``; key heads from the config's
    ``linear_num_key_heads`` (``linear_num_heads``), else as many as the value heads."""
    from onboarding.train.flops import _int

    hv, dk, dv, _ = block_heads(b, shape)
    dk = dk or dv
    hk = _int(shape.config, "linear_num_key_heads", "linear_num_heads") if shape.config else None
    return hk or hv, hv, dk, dv, hv * dk if _per_channel_decay(b) else hv


def delta_rule_intermediates(b: BlockShape, shape: ModelShape, params: dict
                             ) -> tuple[float, float]:
    """(16-bit elements, fp32 bytes) per token that onboard's delta-rule kernel keeps from its
    training forward for the backward (`saved_shapes` in
    kernel_templates/gated_delta/_gated_delta_host.py.j2, one chunk of BT tokens, the family's
    ``chunk_size``): per value head w, kd and qg (3 d_k), v_new (d_v), the Aqk, Tm and M
    matrices (3 BT), the state entering each chunk (d_k d_v / BT), all in the inputs' 16-bit
    dtype where the dots are 16-bit (a GPU; the CPU runs them, and keeps these, in fp32); and
    the fp32 log decay at each chunk's end."""
    _, hv, dk, dv, g = _delta_rule_widths(b, shape)
    bt = int(params.get("chunk_size") or 64)
    return hv * (3 * dk + dv + 3 * bt + dk * dv / bt), FP32 * g / bt


def delta_rule_kernel_saved(b: BlockShape, shape: ModelShape, params: dict) -> float:
    """Per token, what a linear-attention block keeps with onboard's delta-rule kernel patched
    in (a family whose `plan_saves` is "delta_rule"), its adapters aside: the kernel's intermediates
    (`delta_rule_intermediates`, 16-bit), the q, k and v it was handed (bf16: 2 H_k d_k + H_v d_v;
    the kernel keeps its inputs), the decay and its torch activation's tensors (three fp32 of
    its width: the activation's input and output and the decay) and beta; where the block
    normalises q and k itself (``qk_l2norm_in_torch``: the function it calls takes no l2 flag)
    their fp32 copies. The conv before it and the gated norm after it are blocks of their own.
    Measured with `saved_tensors_hooks` over a LoRA step of the tiny proxies with the kernels
    patched in (CPU, Triton's interpreter: tests/test_plan_kept.py)."""
    hk, hv, dk, dv, g = _delta_rule_widths(b, shape)
    sixteen, fp32 = delta_rule_intermediates(b, shape, params)
    l2 = FP32 * 2 * hk * dk if params.get("qk_l2norm_in_torch") else 0
    return BF16 * sixteen + fp32 + BF16 * (2 * hk * dk + hv * dv) + FP32 * (3 * g + hv) + l2


def _delta_rule_torch_saved(b: BlockShape, shape: ModelShape) -> float:
    """Per token, what a linear-attention block keeps running the chunked delta rule in torch
    (no kernel: a CPU run, or no family for it), its adapters aside: per value head the fp32
    copies and products of q, k and v the chunked form keeps (6 d_k + 6 d_v), five C x C
    intra-chunk matrices and three states (d_k d_v) per chunk; a per-channel decay (Kimi's)
    adds its [C, C, d_k] pairwise decays (three per chunk) and the per-row products of the
    intra-chunk loop (C^2 / 3 a head). The projections' outputs are what the conv (q, k, v)
    and the gated norm (the gate, and the core's output) keep, blocks of their own. Within 3%
    of what `saved_tensors_hooks` counts over a LoRA step of the tiny proxies of hf:kimi_linear
    and hf:bailing_hybrid (transformers' torch forms) and the example's, 6% over hf:qwen3_next's
    (the layer with its conv and gated norm). Before: 4 C x C matrices, 8 d_v and one state,
    the projections counted besides the conv: 20% and 22% under the example's and
    hf:qwen3_next's layers, a tenth of Kimi's."""
    hv, dk, dv = _delta_rule_widths(b, shape)[1:4]
    c = int(b.attrs.get("chunk") or 64)
    kept = FP32 * hv * (6 * dk + 6 * dv + 5 * c) + 3 * FP32 * hv * dk * dv / c
    if _per_channel_decay(b):
        kept += FP32 * hv * (3 * c * dk + c * c / 3)
    return kept


def _scan_widths(b: BlockShape, shape: ModelShape) -> dict[str, int] | None:
    """The full-size widths of state-space block ``b`` (``linear_attention.mamba``), read off its
    projections and its causal conv (a block nested in it), as the model's own torch path runs
    them; None where they do not read as one:
      - Mamba-1 (attrs ``scan`` "selective"): I the output projection's input (back to the
        residual), x_proj I -> R + 2N beside dt_proj R -> I: ``inner``, ``state``, ``rank``;
      - Mamba-2 (SSD): I the output projection's input, the conv's channels I + 2 G N, the input
        projection's I (z) + I + 2 G N + H (x, B, C and one time step a head): ``inner``,
        ``heads``, ``groups`` x ``state`` (N from the config's state size; without it, one
        group), ``chunk`` (the chunked scan's, `attrs`)."""
    from onboarding.train.flops import _int

    d = shape.hidden
    inner = next((i for _, i, o in b.linears if o == d and i != d), None)
    if inner is None:
        return None
    if b.attrs.get("scan") == "selective":
        x_proj = [o for _, i, o in b.linears if i == inner and o != d]
        dt_proj = [i for _, i, o in b.linears if o == inner and i != d]
        pair = next(((o, r) for o in x_proj for r in dt_proj if o > r and (o - r) % 2 == 0), None)
        if pair is None:
            return None
        return {"inner": inner, "state": (pair[0] - pair[1]) // 2, "rank": pair[1]}
    conv = next((c.width for c in shape.blocks if c.kind == "conv.causal1d"
                 and (b.pattern, b.kind) in c.parents), None)
    in_proj = next((o for _, i, o in b.linears if i == d and o > inner), None)
    if conv is None or in_proj is None or conv <= inner or (conv - inner) % 2:
        return None
    heads, gn = in_proj - inner - conv, (conv - inner) // 2
    n = _int(shape.config, "state_size", "ssm_state_size", "mamba_d_state", "d_state") \
        if shape.config else None
    if heads <= 0 or not n or gn % n:
        n = gn
    return {"inner": inner, "heads": heads, "groups": gn // n, "state": n,
            "chunk": int(b.attrs.get("chunk") or 256)}


def _scan_torch_saved(b: BlockShape, shape: ModelShape) -> float | None:
    """Per token, what a state-space block (``linear_attention.mamba``) keeps running its own
    torch path, its conv and (gated) norms aside (blocks of their own), its adapters aside; None
    where its widths do not read (`_scan_widths`). As `saved_tensors_hooks` counts them in
    transformers' torch forms (bf16, frozen weights: tests/test_plan_scan.py):
      - Mamba-1's sequential scan: the fp32 discretised A and B (I x N each, for the whole
        sequence), the fp32 state each step multiplies and its bf16 copy the read-out by C takes
        (14 I N bytes); the time step before and after its bias and softplus, the fp32 scan input,
        the gate and its activation, the scan's output (16 I beyond the conv's 4 I); B and C in
        fp32 (4 N);
      - Mamba-2's chunked scan (SSD): three fp32 C x C matrices a head (the decay's segment
        sums, their exp, the masked C B^T), five fp32 tensors of H x N (B and C repeated to the
        heads and their products), four fp32 of I (x, and x and the decays by position within
        the chunk), the states each chunk makes and enters with (2 I N / C fp32), the time step
        (2 H fp32) and the conv's padded output (I + 2 G N, bf16).
    With their conv and norms, within 3% of the measured bytes of tiny Mamba-1 (Jamba's) and
    Mamba-2 mixers, and of the full-size hf:jamba (T 128: 2.00 MB a token measured) and
    hf:mamba2 (T 512: 1.08 MB) mixers. Before, the block was charged as one attention-like head
    with an I x I state a chunk (`_delta_rule_torch_saved`): 3.7x and 1.2x those tiny mixers'
    bytes; at full size the mixer block alone 19.3 MB a token for hf:jamba (now 1.99 MB) and
    3.55 MB for hf:mamba2 (now 0.91 MB). Onboard's selective_scan and ssd kernels keep less (their
    inputs, fp32 states every S steps or each chunk's entering state): a block they serve is
    charged their own count (`_scan_saved`)."""
    w = _scan_widths(b, shape)
    if w is None:
        return None
    i, n = w["inner"], w["state"]
    if "rank" in w:
        return FP32 * 3 * i * n + BF16 * i * n + 16 * i + FP32 * n
    h, c, g = w["heads"], w["chunk"], w["groups"]
    return FP32 * (3 * c * h + 5 * h * n + 4 * i + 2 * i * n / c + 2 * h) \
        + BF16 * (i + 2 * g * n)


def _scan_saved(b: BlockShape, shape: ModelShape, cfg: PlanConfig, patched: dict
                ) -> float | None:
    """Per token, what state-space block ``b`` keeps for its scan: with onboard's ssd or
    selective_scan kernel patched in (a family whose `plan_saves` is "scan"), what that kernel's
    autograd Function saves (the family's `plan_saved` from its `saved_shapes`: the inputs it is
    handed, bf16, and its fp32 checkpoints every S steps (selective_scan) or each chunk's
    entering state (ssd) in place of the torch path's per-step I x N tensors and C x C
    matrices); else the torch path's (`_scan_torch_saved`). None where the widths do not read."""
    from onboarding.families import family_module

    w = _scan_widths(b, shape)
    family = next(iter(_saving(patched, "scan")), None)
    kernel = None if w is None or family is None else \
        family_module(family).plan_saved(w, max(int(cfg.seq), 1))
    return _scan_torch_saved(b, shape) if kernel is None else kernel


def _topk_kernel(b: BlockShape, patched: dict, cfg: PlanConfig) -> bool:
    """Whether onboard's gathered top-k kernel serves top-k block ``b``: its family binds it,
    except the MLA layout under LoRA with an adapter on the latents' up-projection, which the
    absorbed form multiplies by itself and so refuses wrapped (kernel_templates/
    sparse_attention/binding.py, `_check_plain_projection`): the block's own attention runs."""
    if not _saving(patched, "topk_positions"):
        return False
    if b.attrs.get("layout") != "mla" or cfg.mode == "full":
        return True
    latent = _kv_latent(b)
    return not any(i == latent for _, i, _ in b.lora_targets)


def _topk_kernel_saved(b: BlockShape, shape: ModelShape, h: int, dqk: int, dv: int) -> float:
    """Per token, what the gathered top-k kernel keeps (kernel_templates/sparse_attention): the
    q, k and v it is handed, bf16 (k and v at the query heads, as the model repeats them for its
    own attention; MLA's absorbed layout one latent head of the latent plus its rope part, the
    queries over that width), the selected positions (int32, top-k), the output and its fp32
    log-sum-exp. The projections' outputs before (normed, roped) are what the q/k norms keep,
    blocks of their own."""
    from onboarding.train.flops import _int

    topk = int(b.attrs.get("topk") or _int(shape.config, "index_topk") or 0)
    if b.attrs.get("layout") == "mla":
        width = int(_kv_latent(b) or dv) + (_int(shape.config, "qk_rope_head_dim") or 0)
        qkv = h * width + width
    else:
        qkv = h * (dqk or dv) * 2 + h * dv
    return BF16 * (qkv + h * dv) + 4 * topk + FP32 * h


def block_saved(b: BlockShape, shape: ModelShape, cfg: PlanConfig, ep: int
                ) -> tuple[float, float, float]:
    """(bytes kept per token, of which selective recompute re-runs, transient bytes per token of
    one layer at a time) of one instance of block ``b``."""
    d, r = shape.hidden, cfg.lora_rank
    full = cfg.mode == "full"
    kind = b.kind
    # the kernels `onboard train` patches into this block (none when the run keeps torch paths;
    # `getattr`: callers that pass a bare config of their own)
    patched = b.kernels if b.kernels and getattr(cfg, "kernels", True) else {}
    lora = 0.0 if full else _lora_saved(b, d, r)
    if kind.startswith("linear_attention."):
        kept = lora + (BF16 * d if full else 0)
        family = next(iter(_saving(patched, "delta_rule")), None)
        if family is not None:
            return kept + delta_rule_kernel_saved(b, shape, patched[family]), 0.0, 0.0
        scan = _scan_saved(b, shape, cfg, patched) if kind == "linear_attention.mamba" else None
        if scan is not None:
            return kept + scan, 0.0, 0.0
        return kept + _delta_rule_torch_saved(b, shape), 0.0, 0.0
    if kind.startswith(("attention.", "sparse_attention.")):
        h, dqk, dv, _ = block_heads(b, shape)
        silent = b.attrs.get("no_gradient_modules") or ()
        # what a module that passes no gradient out computes (a top-k indexer) keeps nothing
        lin_out = max(sum(o for n, _, o in b.linears
                          if not any(inside(n, x) for x in silent)) - d, 0)
        lora = 0.0 if full else _lora_saved(b, d, r, output_input=False)
        kept = lora + (BF16 * d if full else 0)
        if kind == "sparse_attention.topk" and _topk_kernel(b, patched, cfg):
            kept += _topk_kernel_saved(b, shape, h, dqk, dv)
        else:
            kept += BF16 * (lin_out + h * dv) + FP32 * h  # projections, core output, LSE
        if kind == "attention.gated" or b.attrs.get("gate_activation"):
            # the product keeps the output it gates and the activated gate (one value per
            # head, or per channel); an activation that differentiates from its input
            # (softplus, silu) reads the gate projection's output, counted in `lin_out`
            gate = h if b.attrs.get("gate_per_head") else h * dv
            kept += BF16 * (h * dv + gate)
        transient = 0.0
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
        # gate, up and the activation; onboard's fused SwiGLU keeps gate and up alone (its
        # backward recomputes the activation)
        act = (2 if _saving(patched, "gate_and_up") else 3 if gated else 2) * f
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
        # transformers' RMSNorm upcasts: its fp32 input is kept (onboard's kernel keeps bf16)
        fused = bool(_saving(patched, "norm_input"))
        per = BF16 * w if fused else FP32 * w
        if kind == "norm.rms_gated":
            per += _gate_saved(b, w, cfg, fused=fused)
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
    w_towers, towers_step, host_towers = tower_weights(shape, lay, wb)
    host_w += host_towers
    w_root, host_root = root_weights(shape, lay, wb)
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
    trans_layer = produced = recomputed = 0.0
    rerun_blocks = recompute_blocks(shape, lay.recompute)
    rerun = {id(b) for b in rerun_blocks}
    whole = {id(b) for b in inner_blocks(rerun_blocks)}
    for b in _counted_blocks(shape):
        kept, selective, trans = block_saved(b, shape, cfg, ep)
        produced += b.count * kept * tokens
        if id(b) in rerun:
            freed = kept if lay.recompute == "full" or id(b) in whole else selective
            kept -= freed
            recomputed += b.count * freed * tokens
        g = kind_group(b.kind)
        acts[g] = acts.get(g, 0.0) + b.count * kept * tokens
        trans_layer = max(trans_layer, trans * tokens)
    layer_ws, layer_what = trans_layer, "one layer's dispatch / indexer buffers"
    if lay.recompute == "full":
        # the layers keep their inputs; the blocks outside them (the final norm) their own
        acts = {"layer inputs (checkpoints)": BF16 * shape.hidden * tokens * shape.n_layers,
                **{g: v for g, v in acts.items() if v}}
        layer_ws += _per_layer_max(shape, cfg, ep, tokens)
        layer_what = "one layer recomputed"
    # The peak is the end of the forward (the logits, their gradient and the loss's own
    # temporaries) or a layer's forward or backward (that layer's workspace), when the logits
    # are not there yet or no longer: the head's backward, before any layer's, frees the
    # gradient autograd kept for it (`logits_key`'s bytes, counted with the activations).
    logits = wb * shape.vocab * tokens
    acts[logits_key(cfg)] = logits
    produced += logits
    loss_ws, loss_what = loss_workspace(shape, cfg, tokens)
    if loss_ws >= layer_ws - logits:
        workspace, what = loss_ws, loss_what
    else:
        workspace = layer_ws - logits
        what = f"{layer_what}, less the logits' gradient the head's backward freed"
    if cfg.mode == "full":
        notes.append("full training: gradients are reduce-scattered per layer; the peak "
                     "counts every shard's gradient at once")
    dynamic = sum(acts.values()) + workspace + gather + towers_step + w_root
    return Memory(weights_dense=w_dense, weights_experts=w_exp, fsdp_buffers=gather,
                  weights_towers=w_towers, host_towers=host_towers,
                  weights_root=w_root, host_root=host_root,
                  trainable=trainable, activations=acts, workspace=workspace,
                  workspace_what=what, slack=cluster.slack * dynamic,
                  reserved=cluster.reserved_gib * GIB, host_weights=host_w,
                  host_optimizer=host_opt, produced=produced, recomputed=recomputed,
                  notes=notes)


def logits_key(cfg: PlanConfig) -> str:
    """The activations' entry of the bytes the loss keeps for the backward: the logits'
    gradient, written by the loss's forward in the logits' dtype (the model's: bf16, or fp32)."""
    return f"logits ({'fp32' if cfg.dtype == 'fp32' else 'bf16'})"


def chunked_ce_temporaries(tokens: int, vocab: int) -> int:
    """fp32 elements `onboarding.train.worker._ChunkedCE`'s forward holds at once besides the
    logits and their gradient, over ``tokens`` rows of ``vocab`` logits in chunks of
    `CE_CHUNK_ELEMENTS // vocab` rows: in the first chunk its log-softmax, the one-hot gradient
    and the gradient of the log-softmax (3 chunks; the fp32 copy of the logits is freed by
    then); from the second on, the previous chunk's log-softmax and one-hot gradient are still
    held (their names are rebound only after) while the next chunk's fp32 copy and
    log-softmax are made (2 + 2). Counted from the op outputs of the CPU's run
    (tests/test_plan_loss.py)."""
    step = max(1, CE_CHUNK_ELEMENTS // max(vocab, 1))
    first = min(step, tokens) * vocab
    second = min(step, max(0, tokens - step)) * vocab
    return max(3 * first, 2 * first + 2 * second) if second else 3 * first


def loss_workspace(shape: ModelShape, cfg: PlanConfig, tokens: int) -> tuple[float, str]:
    """(bytes, what) the loss holds at the end of the forward besides the gradient autograd
    keeps (`logits_key`): the logits themselves, and with onboard's loss kernel on a GPU
    (`ModelShape.loss_kernel`, `PlanConfig.kernels`) its fp32 loss per row (it writes the
    gradient in the forward, one pass, no other buffer); on the torch path (`_ChunkedCE`: a
    CPU run, ``--no-kernels``, no family serving the loss) the fp32 temporaries of its chunks
    (`chunked_ce_temporaries`)."""
    logits = (FP32 if cfg.dtype == "fp32" else BF16) * shape.vocab * tokens
    if cfg.kernels and shape.loss_kernel:
        return logits + FP32 * tokens, \
            f"loss (the logits, and {shape.loss_kernel}'s fp32 loss per token)"
    return logits + FP32 * chunked_ce_temporaries(tokens, shape.vocab), \
        "loss (the logits, and the chunked cross-entropy's fp32 temporaries)"


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
