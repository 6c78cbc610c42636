"""FLOPs of one LoRA training step, counted the LoRA-correct way, and device peak FLOP/s.

Per token, with N the matmul parameters a token passes through:
  - frozen base GEMMs: forward plus input gradient, 4 N (no weight-gradient GEMM: the weights are
    frozen); routed experts count the tokens actually routed to them (else top-k / E weighting);
  - adapters: forward, input gradient and weight gradient, 6 x adapter parameters (expert adapters
    per routed token-expert pair);
  - attention cores (no parameters): forward ``2 H (d_qk + d_v)`` per query-key pair, causal
    (query i sees i + 1 keys; ``min(i + 1, window)`` sliding, ``(i mod c) + 1`` in chunks of c,
    ``min(i + 1, K)`` top-k sparse; each layer's window or chunk by the mask conventions of
    `local_window`, which the plan shares), and
    the backward twice the forward; the top-k indexer forward only (the selection passes no
    gradient to it);
  - chunked linear attention (chunk C, per value head): intra-chunk ``Q K^T``, ``K K^T`` (the
    delta rule's triangular transform) and ``A V``, plus three state products per token
    (``q S``, ``w S``, ``k^T v``), backward twice the forward.
Embedding lookups (every table a token reads by index and no GEMM multiplies: `lookup_tables`),
norms and elementwise ops are not counted (MFU convention).
Attention widths come from the model's config fields. A model without a config (``file.py:Name``,
a plain ``nn.Module``) has them from the op graph the run already parsed: each softmax-attention
block's ``core_widths`` (its heads, query/key and value widths, read off the captured core's ops:
fused SDPA, or the score and value matmuls around a softmax) and its top-k's k, the model's own
(such a model's capture is the model that trains), counted at the training sequence length by the
rules above (`CapturedCore`). What that leaves out, linear attention's widths (its heads and
state widths are config fields) and a top-k indexer's scores, is not counted; blocks whose
widths are unknown are listed in ``uncounted_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onboarding.load.accounting import TOPK_NAMES, path_pattern
from onboarding.graph.classify import stack_of
from onboarding.graph.opgraph import OpGraph
from onboarding.train.lm import model_text_config
from onboarding.train.lora import LoRALinear, adapter_modules, default_targets

# Dense bf16 tensor-core peaks from the vendor datasheets (FLOP/s, no sparsity).
PEAK_BF16 = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
             ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12))


def peak_flops(device: Any) -> float | None:
    """Datasheet dense bf16 FLOP/s of a CUDA ``device``; None on the CPU or an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((f for key, f in PEAK_BF16 if key in name), None)


class Chunk(int):
    """A chunked-attention cap (Llama 4's ``chunked_attention`` layers): the sequence is cut
    into chunks of this many tokens and a query sees the causal keys of its own chunk only,
    (i mod c) + 1 of them, where a sliding window of c would show min(i + 1, c)."""

    def __repr__(self) -> str:
        return f"Chunk({int(self)})"

    def __str__(self) -> str:  # the number, as a window's (notes, JSON)
        return str(int(self))


def _causal_keys(seq: int, cap: int | None = None) -> float:
    """Mean keys a query sees in a causal sequence of ``seq`` tokens (capped at ``cap``: a
    sliding window, or the chunks of a `Chunk`)."""
    if isinstance(cap, Chunk) and 0 < cap < seq:
        whole, rest = divmod(seq, int(cap))
        return (whole * cap * (cap + 1) / 2 + rest * (rest + 1) / 2) / seq
    cap = seq if cap is None or cap <= 0 else min(cap, seq)
    # queries 0..cap-1 see i + 1 keys; the rest see cap keys
    return (cap * (cap + 1) / 2 + (seq - cap) * cap) / seq


def per_layer_overrides(cfg: Any) -> dict[int, dict[str, Any]]:
    """{layer: {field: value}} of a heterogeneous config (transformers' per-layer overrides), {}
    for others."""
    spec = vars(cfg).get("_heterogeneity_spec") if hasattr(cfg, "__dict__") else None
    return getattr(spec, "per_layer_overrides", None) or {}


def config_field(cfg: Any, name: str, layer: int | None = None) -> Any:
    """``cfg.<name>`` (None when absent), also on a heterogeneous config: transformers' per-layer
    overrides (Gemma 4's 512-wide heads on its full-attention layers, dots3's wider MLA layers)
    make such a config refuse a global read of a field some layers override. There, layer
    ``layer``'s value; with no layer, the largest of the global and per-layer integer values (an
    estimate holds the widest layer)."""
    overrides = per_layer_overrides(cfg)
    if not any(name in o for o in overrides.values()):
        return getattr(cfg, name, None)
    base = vars(cfg).get(name)
    if layer is not None:
        return overrides.get(layer, {}).get(name, base)
    ints = [v for v in (base, *(o.get(name) for o in overrides.values()))
            if isinstance(v, int) and not isinstance(v, bool)]
    return max(ints) if ints else base


def _int(cfg: Any, *names: str, layer: int | None = None) -> int | None:
    for n in names:
        v = config_field(cfg, n, layer)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _attention_widths(cfg: Any, kind: str, layer: int | None = None) -> tuple[int, int, int] | None:
    """(heads, d_qk, d_v) of a softmax-attention block from config fields (of decoder layer
    ``layer`` where a heterogeneous config overrides them per layer: `config_field`).

    A query/key head split into a position-free part and a rotary part (MLA: DeepSeek V2/V3's
    ``qk_nope_head_dim`` + ``qk_rope_head_dim``; GLM-5-Next's rotary part is 0) is as wide as
    the two together; such configs' ``head_dim`` may name the rotary part alone (transformers'
    DeepSeek V3 and GLM-5-Next set it so), so the split wins there. A ``qk_rope_head_dim``
    without a position-free part is the rotary share of a whole head (DeepSeek V4: ``head_dim``
    x ``partial_rotary_factor``), not its width: the head is ``head_dim`` (else hidden / heads)
    as for any attention. The widths are the config's, not the op graph's ``core_widths``: the
    graph is captured on a proxy whose heads and head widths may be shrunk, while the config is
    the size that trains or is planned."""
    def read(*names: str) -> int | None:
        return _int(cfg, *names, layer=layer)

    heads = read("num_attention_heads", "n_head", "num_heads")
    if heads is None:
        return None
    nope = read("qk_nope_head_dim")
    if kind in ("attention.mla", "sparse_attention.topk") and nope:
        d_qk = nope + (read("qk_rope_head_dim") or 0)
        return heads, d_qk, read("v_head_dim") or d_qk
    hidden = read("hidden_size", "d_model")
    d = read("head_dim") or (hidden // heads if hidden else None)
    return (heads, d, read("v_head_dim") or d) if d else None


BY_KIND = "kind"  # `_attention_core`'s window: the kind's own rule (below)


WINDOW_FIELDS = ("sliding_window", "sliding_window_size", "attention_window")
CHUNK_FIELD = "attention_chunk_size"  # the chunk of a chunked layer type (Llama 4's)
SOFTMAX_PREFIXES = ("attention.", "sparse_attention.")


def _positive_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def local_window(cfg: Any, module: nn.Module | None, layer: int | None
                 ) -> tuple[int | None, str]:
    """(keys a query sees at most, or None: full causal; where that came from) of the attention
    ``module`` of decoder layer ``layer``, by the rules of `onboarding.plan.shapes`' docstring
    (the plan's and this module's count share them). ("" when no rule applies: the block
    kind's own rule stands, `_attention_core`.)"""
    types = getattr(cfg, "layer_types", None) if cfg is not None else None
    types = list(types) if isinstance(types, (list, tuple)) else None
    kind = str(types[layer]) if types is not None and layer is not None \
        and 0 <= layer < len(types) else None
    if kind == "full_attention":
        return None, "layer_types: 'full_attention'"
    if module is not None and hasattr(module, "sliding_window"):
        attr = getattr(module, "sliding_window")
        if _positive_int(attr):
            return attr, "the attention module's sliding_window attribute"
        if attr is None:
            return None, "the attention module's sliding_window attribute is None"
    if kind is not None and "chunk" in kind:
        chunk = _positive_int(config_field(cfg, CHUNK_FIELD, layer))
        if chunk:  # the mask of a chunked layer type: transformers' create_chunked_causal_mask
            return Chunk(chunk), f"config {CHUNK_FIELD}, layer type {kind!r}"
    name = next((n for n in WINDOW_FIELDS if _positive_int(config_field(cfg, n, layer))), None)
    if name is None:
        return None, ""
    if kind is not None and ("sliding" in kind or "local" in kind):
        return config_field(cfg, name, layer), f"config {name}, layer type {kind!r}"
    if types is None:
        return config_field(cfg, name, layer), f"config {name}, no layer_types: every layer"
    return None, ""


def block_window(cfg: Any, block, module: nn.Module | None
                 ) -> tuple[int | None | str, int | None]:
    """(``window`` for `_attention_core`, decoder layer) of attention block ``block`` (a
    captured block; ``module``: the model's module at its path): the layer's local window by
    `local_window`, `BY_KIND` where no rule applies."""
    from onboarding.graph.classify import layer_of

    layer = layer_of(block.path) if block.path else None
    if not block.kind.startswith(SOFTMAX_PREFIXES):
        return BY_KIND, layer
    w, src = local_window(cfg, module, layer)
    return (w if src else BY_KIND), layer


def _attention_core(cfg: Any, kind: str, seq: int, attrs: dict,
                    window: int | None | str = BY_KIND, layer: int | None = None) -> float | None:
    """Training FLOPs per token of one attention block's core (no projections).

    ``window``: the local keys a query sees (a sliding window, or the chunks of a `Chunk`, whose
    mask is built outside the block: `local_window` finds it), None for full causal attention, or
    `BY_KIND`: ``attention.sliding`` capped at the config's ``sliding_window``, others not. It
    caps the causal keys of softmax attention, the local keys of ``attention.compressed`` and
    the candidates of a top-k over key positions."""
    if kind.startswith("linear_attention."):
        hv = _int(cfg, "linear_num_value_heads", "linear_num_heads")
        dk = _int(cfg, "linear_key_head_dim", "linear_head_dim")
        dv = _int(cfg, "linear_value_head_dim", "linear_head_dim")
        if not (hv and dk and dv):
            return None
        c = min(int(attrs.get("chunk") or 64), seq)
        intra = 2 * c * (2 * dk + dv) / 2  # causal half of C x C products, per token
        state = 3 * 2 * dk * dv
        return 3 * hv * (intra + state)
    widths = _attention_widths(cfg, kind, layer)
    if widths is None:
        return None
    heads, d_qk, d_v = widths
    if window == BY_KIND:
        window = _int(cfg, "sliding_window", "attention_window") \
            if kind == "attention.sliding" else None
    cap = window
    extra = 0.0
    if kind == "sparse_attention.topk":
        k = _int(cfg, "index_topk")
        cap = min(x for x in (k, window) if x) if (k or window) else None
        ih, idim = _int(cfg, "index_n_heads"), _int(cfg, "index_head_dim")
        if ih and idim:
            extra = 2 * ih * idim * _causal_keys(seq)  # indexer forward only
    keys = _causal_keys(seq, cap)
    if kind == "attention.compressed":
        # the T local keys (capped at ``window``: their mask is built outside the block) plus
        # the T // r pooled entries a query sees, at most the indexer's k of the config when a
        # top-k picks them (the proxy's k is shrunk), and the indexer's scores over every entry
        r = int(attrs.get("compress_ratio") or 1)
        pooled = max(seq // r, 1)
        k = _int(cfg, "index_topk") if attrs.get("topk") else None
        keys = (keys if attrs.get("local_keys", True) else 0) + _causal_keys(pooled, k)
        ih, idim = _int(cfg, "index_n_heads"), _int(cfg, "index_head_dim")
        if attrs.get("topk") and ih and idim:
            extra = 2 * ih * idim * _causal_keys(pooled)  # indexer forward only
    return 3 * 2 * heads * (d_qk + d_v) * keys + extra


@dataclass(frozen=True)
class CapturedCore:
    """The config fields `_attention_core` reads, for a block of a model without a config: the
    heads and widths of its captured softmax-attention core (the op graph's ``core_widths``)
    and, for a top-k over keys or pooled entries, the k the capture ran (``topk``). No indexer
    widths: a top-k indexer's scores stay uncounted."""

    num_attention_heads: int
    head_dim: int
    v_head_dim: int
    index_topk: int | None = None

    @classmethod
    def of(cls, block) -> CapturedCore | None:
        """``block``'s, or None where the capture read no widths (no softmax core, or an op
        graph written before ``core_widths`` existed)."""
        w = block.attrs.get("core_widths")
        if not isinstance(w, dict) or not all(_positive_int(w.get(k)) for k in
                                              ("heads", "d_qk", "d_v")):
            return None
        return cls(num_attention_heads=w["heads"], head_dim=w["d_qk"], v_head_dim=w["d_v"],
                   index_topk=_positive_int(block.attrs.get("topk")))


def _numel(p: torch.Tensor) -> int:
    return int(p.numel())


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def lookup_tables(model: nn.Module, graph: OpGraph | None = None) -> set[int]:
    """ids of the parameters of ``model`` that a token only reads by index, no GEMM: the weight
    of every ``nn.Embedding``, the 2-D (or wider) parameters of ``graph``'s ``embedding``
    blocks (an ``aten.embedding`` and no matmul: a table read with ``F.embedding`` off a bare
    parameter) and those its forward read by slices and no matmul (``graph.sliced_tables``: a
    learned position table ``pos[:T]`` held as a bare parameter), both matched by path pattern,
    as a proxy's layers are fewer; wherever they sit: the token table, a per-layer input table
    (Gemma 3n's, L x P values per token), a position table.
    Less the tables a GEMM multiplies too, which stay GEMM weights: one an ``nn.Linear`` holds
    (a head tied to the token table, by its weight's identity) or the output embeddings'
    (transformers' ``get_output_embeddings``). The plan's count (`plan.shapes`) and this
    module's share it: parameters counted by size would take every table for a GEMM."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if graph is not None:
        names = {path_pattern(f"{b.path}.{n}" if b.path else n)
                 for b in graph.by_kind("embedding") for n in b.params}
        names |= {path_pattern(n) for n in graph.sliced_tables}
        tables |= {id(p) for n, p in model.named_parameters()
                   if p.ndim >= 2 and path_pattern(n) in names}
    gemm = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out_emb, nn.Module) and isinstance(getattr(out_emb, "weight", None),
                                                     torch.Tensor):
        gemm.add(id(out_emb.weight))
    return tables - gemm


def dense_gemm_params(model: nn.Module, graph: OpGraph | None, skip: set[int]) -> int:
    """The dense GEMM parameters a token passes through, N of the frozen 4N (full: 6N), by one
    rule for the plan (`plan.shapes.ModelShape.dense_matmul`) and this module's count: every
    distinct parameter of two or more dims, less the tables a token only reads
    (`lookup_tables`) and ``skip`` (ids: routed experts and adapters, counted apart). A 1-D
    parameter (a norm's weight, a bias, a per-channel scale anywhere) multiplies no matrix:
    elementwise work, uncounted (the MFU convention) wherever it sits; the plan had counted
    those its parameter categories call dense (biases, a scale on a module with children)."""
    skip = skip | lookup_tables(model, graph)
    n, seen = 0, set()
    for p in model.parameters():  # DTensor numel is the global (unsharded) size
        if id(p) in seen or p.ndim < 2 or id(p) in skip:
            continue
        seen.add(id(p))
        n += _numel(p)
    return n


def _moe_blocks(graph: OpGraph, cfg: Any, lora_rank: int) -> list[dict[str, Any]]:
    """Routed-expert blocks from the op graph (the unsharded proxy's shapes, whatever EP did to
    the live model): path, top-k, parameters per expert, expert-LoRA parameters per expert."""
    # by stack and layer: a model with several layer stacks numbers each from 0 (`stack_of`)
    top_k = {(stack_of(b.path), b.layer): b.attrs.get("top_k") for b in graph.by_kind("moe.router")}
    default_k = _int(cfg, *TOPK_NAMES) if cfg is not None else None
    out = []
    for b in graph.by_kind("moe.experts"):
        n = b.attrs.get("n_experts")
        if not n:
            continue
        shapes = [s for s in b.params.values() if len(s) >= 2]
        per_expert = sum(_prod(s) for s in shapes) / n
        # packed [E, out, in]: r (in + out) per expert; per-expert [out, in] lists: summed / E
        adapter = sum(lora_rank * (s[-1] + s[-2]) / (1 if len(s) == 3 else n) for s in shapes)
        out.append({"path": b.path, "n_experts": n, "per_expert": per_expert,
                    "top_k": top_k.get((stack_of(b.path), b.layer)) or default_k or 1,
                    "adapter_per_expert": adapter})
    return out


def step_flops(graph: OpGraph, model: nn.Module, *, tokens: int, seq_len: int, lora_rank: int,
               expert_lora: bool, routed_tokens: int | None = None) -> dict[str, float]:
    """FLOPs of one optimizer step over ``tokens`` tokens (all ranks), by part, plus ``total``.

    ``routed_tokens``: token-expert assignments summed over all MoE layers in the step (what the
    router actually sent, drops included); None assumes ``tokens * top_k`` per MoE layer.
    ``total_6n`` is the naive ``6 x active parameters`` count, for comparison. Expert shapes and
    top-k come from ``graph`` (the unsharded proxy), so an expert-parallel model counts right.
    """
    cfg = model_text_config(model)  # None for a config-less model: widths from the graph
    moe = _moe_blocks(graph, cfg, lora_rank)
    modules = dict(model.named_modules())
    expert_ids: set[int] = set()
    for m in moe:
        if m["path"] in modules:  # whatever holds the experts now (e.g. the EP module)
            expert_ids.update(id(p) for p in modules[m["path"]].parameters())
    adapter_ids = {id(p) for mod in adapter_modules(model).values() for n, p in
                   mod.named_parameters() if "lora" in n}
    dense_n = dense_gemm_params(model, graph, expert_ids | adapter_ids)
    parts: dict[str, float] = {"base_dense": 4.0 * dense_n * tokens}

    # routed experts: per-expert parameters x actual (or expected) routed token count
    assignments = routed_tokens if routed_tokens is not None else \
        sum(tokens * m["top_k"] for m in moe)
    mean_pe = sum(m["per_expert"] for m in moe) / len(moe) if moe else 0.0
    parts["base_experts"] = 4.0 * mean_pe * assignments

    # adapters: actual LoRALinear layers, or the default targets when not injected yet
    lora_layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if lora_layers:
        dense_adapter = sum(m.rank * (m.in_features + m.out_features) for m in lora_layers)
    else:
        dense_adapter = sum(lora_rank * (modules[p].in_features + modules[p].out_features)
                            for p in default_targets(model, graph))
    parts["adapters"] = 6.0 * dense_adapter * tokens
    expert_adapter = sum(m["adapter_per_expert"] for m in moe) / len(moe) \
        if moe and expert_lora else 0.0
    parts["expert_adapters"] = 6.0 * expert_adapter * assignments

    n_seq = tokens / seq_len
    uncounted = 0
    for kind_prefix in ("attention.", "sparse_attention.", "linear_attention."):
        key = kind_prefix[:-1]  # the part: the block kinds' group
        total = 0.0
        for b in graph.blocks:
            if not b.kind.startswith(kind_prefix):
                continue
            per_token = None
            fields = cfg if cfg is not None else CapturedCore.of(b)
            if fields is not None:  # each layer's keys capped at its local window, as the plan's
                window, layer = block_window(fields, b, modules.get(b.path))
                per_token = _attention_core(fields, b.kind, seq_len, b.attrs, window, layer=layer)
            if per_token is None:
                uncounted += 1
                continue
            total += per_token * seq_len * n_seq
        parts[key] = total
    parts["total"] = sum(parts.values())
    active = dense_n + (mean_pe * assignments / tokens if tokens else 0.0)
    parts["total_6n"] = 6.0 * active * tokens
    parts["uncounted_blocks"] = float(uncounted)
    return parts
