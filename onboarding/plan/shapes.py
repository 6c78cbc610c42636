"""The full-size model's shapes, joined to the op graph's block kinds, for the plan.

The op graph is captured on a proxy; the plan needs the full size. Every module of the full
model built on ``meta`` is matched to a proxy block by its path pattern (layer numbers as ``*``)
*and* its parameter names, so a layer-0 dense MLP and a later layer's MoE wrapper that share the
pattern ``model.layers.*.mlp`` are told apart by what they hold, never by class names. Widths
(linear in/out features, expert counts and widths) are read off the meta tensors; attention head
counts from the config fields `onboarding.train.flops` reads.

A softmax attention's local window is rarely in its block's structure: the sliding-window mask is
built outside the block and passed in. `local_window` (in `onboarding.train.flops`, whose MFU
count takes the same windows) finds it for each instance (layer) by the conventions transformers
builds those masks by, in this order:
  1. ``layer_types[i] == "full_attention"``: no window (a module may hold the config's window
     and pass it only on its sliding layers);
  2. the full-size attention module's ``sliding_window`` attribute (what transformers' attention
     modules pass their attention kernels as the window; None: none);
  3. a layer type that names chunks (``chunked_attention``): the config's
     ``attention_chunk_size``, as a `Chunk` (query i sees the (i mod c) + 1 keys of its own
     chunk: transformers' chunked causal mask); a layer type that names a sliding or local
     window: the config's ``sliding_window`` (or ``sliding_window_size``, ``attention_window``);
  4. no ``layer_types`` at all: the config's ``sliding_window``, on every layer (the mask
     is built sliding for every layer when it is set).
Layers of one pattern and parameters may differ (Gemma's 5 sliding : 1 full): `BlockShape.windows`
keeps each window with its instance count and where it came from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from onboarding.graph.opgraph import CONV_KINDS, OpGraph
from onboarding.load.accounting import find_moe, path_pattern, token_embedding
from onboarding.load.proxy import text_config
from onboarding.modpath import inside
from onboarding.train.flops import SOFTMAX_PREFIXES, dense_gemm_params, local_window
from onboarding.train.lora import ATTENTION_PREFIXES, mixer_output_names, no_gradient_names


@dataclass(kw_only=True, slots=True)
class BlockShape:
    """One kind of block of the full model: every instance with the same pattern and params."""

    pattern: str
    kind: str
    count: int  # instances in the full model
    params: int  # parameters per instance (a `sibling_module`'s included)
    # (path under the block, in, out) of its nn.Linear; ``../<name>...`` for those of a module
    # beside it that its compute runs in too (`sibling_module`)
    linears: list[tuple[str, int, int]]
    attrs: dict[str, Any]
    ops: int  # ATen ops per call in the proxy capture (launch count)
    nested: bool  # inside another block (a norm inside attention, a linear attention's conv)
    # (pattern, kind) of the blocks whose modules hold its instances, by their paths (a pattern
    # alone may name a dense MLP in one layer and an MoE wrapper in the next)
    parents: list[tuple[str, str]] = field(default_factory=list)
    # patterns of the modules that hold parameters it shares (a head tied to the token table):
    # `params` leaves those out, counted once, on their holder (`_own_params`)
    tied: list[str] = field(default_factory=list)
    # elements per token a norm normalises, or a conv's channels (0 for other kinds)
    width: int = 0
    # default LoRA targets: (path under the block, in, out)
    lora_targets: list[tuple[str, int, int]] = field(default_factory=list)
    # attention kinds, per instance: (decoder layer or None, local window or None, where the
    # window came from) (`local_window`)
    instances: list[tuple[int | None, int | None, str]] = field(default_factory=list)
    # an attention with a per-head output gate: its heads at full size, read off the gate's
    # projection (`gate_heads`; 0: no such gate, or its projection not found)
    gate_heads: int = 0
    # the onboard kernel families `onboard train` patches into the block on a GPU, each with
    # the params it renders (`kernel_families`); a delta-rule family's also say whether the
    # model normalises q and k in torch before handing them over (`qk_l2norm_in_torch`)
    kernels: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def windows(self) -> list[tuple[int | None, int, str]]:
        """`instances` by window: (local window or None, instances, where it came from)."""
        counts: dict[tuple[int | None, str], int] = {}
        for _, w, src in self.instances:
            counts[(w, src)] = counts.get((w, src), 0) + 1
        return [(w, n, src) for (w, src), n in counts.items()]


@dataclass(kw_only=True, slots=True)
class ExpertShape:
    """One routed-experts pattern: E experts of ``per_expert`` parameters, top-k of them used."""

    pattern: str
    count: int  # MoE layers
    n_experts: int
    top_k: int
    per_expert: int
    hidden: int  # D
    width: int  # F (one expert's intermediate width)
    gated: bool
    matrices: list[tuple[int, int]]  # (in, out) per expert weight matrix
    # the pattern of the experts a token takes instead of these (sibling MoE blocks of one
    # class of which the proxy's forward ran one: `accounting.take_alternatives`): held in
    # memory, but no token's compute or all-to-all; "": a token takes these
    alternative_to: str = ""


@dataclass(kw_only=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    vocab: int
    n_layers: int
    total: int
    routed: int
    dense_tensors: list[tuple[int, int]]  # (dim 0, elements per dim-0 row) of dense parameters
    experts: list[ExpertShape]
    blocks: list[BlockShape]
    layer_dense_max: int  # most dense parameters in one decoder layer (FSDP's unsharded unit)
    dense_matmul: int  # parameters of dense GEMMs a token passes through (lm_head included)
    config: Any
    unmatched: list[str] = field(default_factory=list)  # proxy block patterns not found
    # the kernel family whose training variant `onboard train` attaches on a GPU as the loss
    # over the model's output embedding (`loss_kernel_family`); "": none, `_ChunkedCE` runs
    loss_kernel: str = ""
    # the parameters of the parts besides the language model that the model `onboard train`
    # builds holds (`load.multimodal.resident_parts`: a causal LM that is the whole multimodal
    # model, Gemma 3's), by part, as (dim 0, elements per dim-0 row): frozen, left out of
    # `dense_tensors` and of the layer counts; ``towers_run``: those of them whose modules ran an
    # op in the captured forward (token ids, as `onboard train` feeds the model)
    towers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    towers_run: list[str] = field(default_factory=list)
    # of `dense_tensors`, those outside the decoder layers `onboard train` wraps one by one
    # (`root_tensors`): the root's FSDP2 group (the token embedding, the final norm, the head; a
    # tied head once), which the root keeps unsharded from its forward to the end of the backward
    root_tensors: list[tuple[int, int]] = field(default_factory=list)

    @property
    def dense(self) -> int:
        return sum(d0 * rest for d0, rest in self.dense_tensors)

    @property
    def root(self) -> int:
        return sum(d0 * rest for d0, rest in self.root_tensors)

    def tower_params(self) -> dict[str, int]:
        return {k: sum(d0 * rest for d0, rest in v) for k, v in self.towers.items()}

    @property
    def routed_layers(self) -> list[ExpertShape]:
        """The experts a token is routed through: one of each group of alternatives."""
        return [e for e in self.experts if not e.alternative_to]

    @property
    def n_experts(self) -> int | None:
        counts = {e.n_experts for e in self.experts}
        return counts.pop() if len(counts) == 1 else (max(counts) if counts else None)

    def by_kind(self, prefix: str) -> list[BlockShape]:
        return [b for b in self.blocks if b.kind.startswith(prefix)]


def _params_signatures(model: nn.Module) -> dict[str, frozenset[str]]:
    """Module path -> the names, under it, of the parameters ``model.named_parameters()`` lists
    under it: as the op graph names a block's params (`Context.param_shapes`), a tensor held
    twice under its first holder alone, so a head tied to the token table holds none there and
    here alike (its own module lists the weight: the match missed the head)."""
    out: dict[str, set[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        for i in range(1, len(parts)):
            out.setdefault(".".join(parts[:i]), set()).add(".".join(parts[i:]))
    return {k: frozenset(v) for k, v in out.items()}


def _own_params(module: nn.Module, path: str, holders: dict[int, str]) -> tuple[int, set[str]]:
    """The parameters of ``module`` (at ``path``) that the model lists under it, and the path
    patterns of the modules that hold the others: a tensor held twice is counted once, under its
    first holder, as the model's totals count it (a head tied to the token table holds no
    parameter of its own; the table's V x D are the embedding's)."""
    own, tied = 0, set()
    for name, p in module.named_parameters(prefix=path):
        holder = holders.get(id(p), name)
        if holder == name:
            own += p.numel()
        else:
            tied.add(path_pattern(holder.rsplit(".", 1)[0] if "." in holder else ""))
    return own, tied


def _module_lists(model: nn.Module, skip: frozenset[int] = frozenset()
                  ) -> Iterator[tuple[str, nn.ModuleList]]:
    """(path, list) of each ModuleList of ``model`` that holds no parameter of ``skip`` (ids: a
    tower's, `resident_parts`: `onboard train` wraps the decoder's layers,
    `parallel.decoder_blocks`, and leaves a tower to the root's group)."""
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not (skip and any(id(p) in skip for p in m.parameters())):
            yield path, m


def _decoder_layers(model: nn.Module, skip: frozenset[int] = frozenset()) -> int:
    """Length of the longest ModuleList whose members are all called ``<list>.<i>``: the layers;
    not a list that holds a parameter of ``skip`` (`_module_lists`)."""
    return max((len(m) for _, m in _module_lists(model, skip)), default=1)


def model_shape(model: nn.Module, config: Any, graph: OpGraph, *, name: str = "") -> ModelShape:
    """Shapes of ``model`` (the full size, on meta) with ``graph``'s block kinds."""
    from onboarding.load.accounting import count_parameters, take_alternatives

    counts = count_parameters(model, config)
    take_alternatives(counts, [b.path for b in graph.blocks if b.attrs.get("not_run")])
    alternative = {m.path: m.alternative_to for m in counts.moe if m.alternative_to}
    block_experts = {m.path: m.experts_path for m in counts.moe}
    moe = [m for m in find_moe(model, config) if m.router_path is not None] or find_moe(
        model, config)
    modules = dict(model.named_modules())
    expert_paths = [m.experts_path for m in moe]
    proxy = {}
    for b in graph.blocks:
        if b.path:
            proxy.setdefault((path_pattern(b.path), frozenset(b.params)), b)
    proxy_paths = [b.path for b in graph.blocks if b.path]
    # instances: full modules whose (pattern, parameter names) a proxy block has
    inst: dict[tuple[str, frozenset], list[str]] = {}
    signatures = _params_signatures(model)
    for path in modules:
        if not path:
            continue
        key = (path_pattern(path), signatures.get(path, frozenset()))
        if key in proxy:
            inst.setdefault(key, []).append(path)
    blocks: list[BlockShape] = []
    holders = {id(p): n for n, p in model.named_parameters()}  # a shared tensor: its first holder
    all_paths = [p for ps in inst.values() for p in ps]
    excluded = [p for key, ps in inst.items() if proxy[key].kind in ("moe.router", "moe.experts")
                for p in ps]
    parents = {key: sorted({(k[0], proxy[k].kind) for k, ps in inst.items()
                            if k != key and inside(key[0], k[0])
                            and any(p != q and inside(p, q) for p in paths for q in ps)})
               for key, paths in inst.items()}
    for key, paths in inst.items():
        b = proxy[key]
        first = modules[paths[0]]
        lin = [(n, m.in_features, m.out_features) for n, m in first.named_modules()
               if isinstance(m, nn.Linear)]
        # the default LoRA targets (`onboarding.train.lora.default_targets`): the linears of
        # every attention-kind block, except those inside a router or experts nested in it and
        # a selective state-space mixer's output projection (`mixer_output_names`) and the
        # linears of a module that passes no gradient out (`no_gradient_names`)
        mixer_out = mixer_output_names(b)
        silent = no_gradient_names(b)
        targets = [(n, i, o) for n, i, o in lin if b.kind.startswith(ATTENTION_PREFIXES)
                   and n not in mixer_out and not any(inside(n, s) for s in silent)
                   and not any(inside(f"{paths[0]}.{n}", e) for e in excluded)]
        n_params, tied = _own_params(first, paths[0], holders)
        # a module beside the block that its compute runs in too: its linears and parameters
        # are the block's (the proxy block's own params, by which the full-size modules were
        # matched, are its first module's)
        sibling = sibling_module(b)
        side = modules.get(f"{paths[0].rsplit('.', 1)[0]}.{sibling}") if sibling else None
        if side is not None:
            lin += [(f"../{sibling}" + (f".{n}" if n else ""), m.in_features, m.out_features)
                    for n, m in side.named_modules() if isinstance(m, nn.Linear)]
            side_params, side_tied = _own_params(side, f"{paths[0].rsplit('.', 1)[0]}.{sibling}",
                                                 holders)
            n_params, tied = n_params + side_params, tied | side_tied
        blocks.append(BlockShape(
            pattern=key[0], kind=b.kind, count=len(paths),
            params=n_params, tied=sorted(tied), linears=lin, attrs=dict(b.attrs),
            ops=sum(b.op_histogram.values()), lora_targets=targets,
            nested=any(p != paths[0] and inside(paths[0], p) for p in all_paths),
            parents=parents[key],
            width=_width(b, first, paths[0], graph, modules),
            instances=_instances(b.kind, paths, modules, config), gate_heads=gate_heads(b, first),
            kernels=kernel_families(b, first)))
    matched = {k[0] for k in inst}
    unmatched = sorted({path_pattern(p) for p in proxy_paths} - matched)

    experts = []
    cfg = text_config(config) if config is not None else None
    for info in moe:
        key = path_pattern(info.experts_path)
        same = [m for m in moe if path_pattern(m.experts_path) == key]
        if info is not same[0]:
            continue
        mod = modules[info.experts_path]
        mats = _expert_matrices(mod, info.n_experts)
        hidden = _hidden(model)
        ins = [i for i, _ in mats] + [o for _, o in mats]
        width = min((x for x in ins if x != hidden), default=hidden)
        gated = any(o == 2 * width for _, o in mats) or len(mats) >= 3
        kept = block_experts.get(alternative.get(info.path, ""), "")
        experts.append(ExpertShape(
            pattern=key, count=len(same), n_experts=info.n_experts,
            top_k=info.top_k or 1, per_expert=info.routed_params // info.n_experts,
            hidden=hidden, width=width, gated=gated, matrices=mats,
            alternative_to=path_pattern(kept) if kept else ""))

    from onboarding.load.multimodal import resident_parts

    parts = resident_parts(model, config)  # the towers the model that trains holds
    towers: dict[str, list[tuple[int, int]]] = {}
    tower_ids = frozenset(id(p) for n, p in model.named_parameters() if n in parts)
    layer_lists = _wrapped_layer_lists(model, graph, tower_ids)
    dense, root, seen = [], [], set()
    for pname, p in model.named_parameters():
        owner = pname.rsplit(".", 1)[0] if "." in pname else ""
        if id(p) in seen or any(inside(owner, e) for e in expert_paths):
            continue
        seen.add(id(p))
        d0 = p.shape[0] if p.ndim else 1
        t = (int(d0), int(p.numel() // d0) if d0 else 0)
        (towers.setdefault(parts[pname], []) if pname in parts else dense).append(t)
        if pname not in parts and not any(inside(owner, lst) for lst in layer_lists):
            root.append(t)
    n_layers = _decoder_layers(model, tower_ids)
    layer_dense = _layer_dense_max(model, expert_paths, tower_ids)
    vocab = getattr(cfg, "vocab_size", None) or max(
        (m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    return ModelShape(name=name or graph.model, hidden=_hidden(model), vocab=int(vocab),
                      n_layers=n_layers, total=counts.total, routed=counts.routed_experts,
                      dense_tensors=dense, experts=experts, blocks=blocks,
                      layer_dense_max=layer_dense, config=cfg, unmatched=unmatched,
                      dense_matmul=_dense_matmul(model, counts, graph),
                      loss_kernel=loss_kernel_family(model), towers=towers,
                      towers_run=_towers_run(graph, parts), root_tensors=root)


def _wrapped_layer_lists(model: nn.Module, graph: OpGraph, skip: frozenset[int]) -> list[str]:
    """The ``ModuleList`` paths whose items `onboard train` wraps one by one with FSDP2
    (`parallel.decoder_blocks`: the lists owning the graph's layer blocks; on the full-size model
    every item of such a list); where the graph names no layer block (a shape built without a
    capture), the longest list holding no parameter of ``skip`` (a tower's), the plan's layers
    (`_decoder_layers`). Every other parameter is the root's."""
    from onboarding.errors import InputError
    from onboarding.train.parallel import decoder_blocks

    try:
        lists = sorted({path.rsplit(".", 1)[0] for path, _ in decoder_blocks(model, graph)})
    except InputError:  # layer blocks that no list owns: train stops; the fallback below
        lists = []
    if lists:
        return lists
    cands = [(len(m), n) for n, m in _module_lists(model, skip) if len(m)]
    return [max(cands)[1]] if cands else []


def _towers_run(graph: OpGraph, parts: dict[str, str]) -> list[str]:
    """The parts of ``parts`` (parameter name -> part) a block of ``graph`` that ran (not
    ``not_run``) holds a parameter of, by path pattern (the proxy's layer numbers)."""
    by_pattern = {path_pattern(n): part for n, part in parts.items()}
    ran = {by_pattern[k] for b in graph.blocks if b.path and not b.attrs.get("not_run")
           for n in b.params if (k := path_pattern(f"{b.path}.{n}")) in by_pattern}
    return sorted(ran)


def loss_kernel_family(model: nn.Module) -> str:
    """The family `onboarding.train.kernels.attach_loss_kernel` gives the training loss of
    ``model`` on a GPU (the first whose `training_variants` serve its `LOSS_KIND`), or "" where
    it attaches none: no such family, or no 2-D output embedding weight (the vocabulary it is
    checked at). A kernel that fails its check on the device leaves `_ChunkedCE`: the plan
    cannot know that and takes the kernel, as for the blocks (`kernel_families`)."""
    from onboarding.families import training_kernel
    from onboarding.train.kernels import LOSS_KIND

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    served = training_kernel(LOSS_KIND)
    if served is None or weight is None or weight.dim() != 2:
        return ""
    return served[0]


def sibling_module(b) -> str | None:
    """The name of a module beside block ``b``'s own (same parent) that its compute also runs
    in, as the classifier found it: attrs ``projection`` naming a module path (a gated
    per-layer input's second projection, P -> D, `residual.input_gate`: the block is named
    after the first projection, whose parameters alone are its ``params``)."""
    p = b.attrs.get("projection")
    if not (isinstance(p, str) and b.path and "." in p and p != b.path):
        return None
    parent, name = p.rsplit(".", 1)
    return name if parent == b.path.rsplit(".", 1)[0] else None


# a block's attr: the length of the capture it came from when not its graph's (`plan.capture`)
CAPTURE_SEQ = "capture_seq"


def _instances(kind: str, paths: list[str], modules: dict[str, nn.Module], config: Any
               ) -> list[tuple[int | None, int | None, str]]:
    """(decoder layer, `local_window`) of each instance of a softmax-attention block."""
    if not kind.startswith(SOFTMAX_PREFIXES):
        return []
    from onboarding.graph.classify import layer_of

    cfg = text_config(config) if config is not None else None
    return [(layer_of(p), *local_window(cfg, modules.get(p), layer_of(p))) for p in paths]


def gate_heads(b, full: nn.Module) -> int:
    """The heads of attention block ``b`` (the proxy's) at full size (``full``, its first
    instance) from its per-head output gate, one value per head: the full-size weight of the
    projection the gate was read from (attrs ``gate_projection``, ``gate_width``: the gate's
    values per token in the capture), its output dim (the proxy weight's dim as wide as the
    gate, else a multiple of it) over the share the gate took of it (1: the gate's own). 0
    without such a gate or weight. What the plan takes where the config names no head count."""
    name, n = b.attrs.get("gate_projection"), b.attrs.get("gate_width")
    proxy = b.params.get(name) if b.attrs.get("gate_per_head") and name else None
    if not (proxy and len(proxy) == 2 and isinstance(n, int) and n > 0):
        return 0
    try:
        weight = full.get_parameter(name)
    except AttributeError:
        return 0
    dim = next((i for i in (0, 1) if proxy[i] == n), None)
    if dim is None:
        dim = next((i for i in (0, 1) if proxy[i] % n == 0), None)
    return int(weight.shape[dim]) * n // proxy[dim] if dim is not None and weight.ndim == 2 else 0


def kernel_families(b, full: nn.Module) -> dict[str, dict[str, Any]]:
    """{family: render params} of the onboard kernel families `onboard train` patches into block
    ``b`` (the proxy's; ``full`` its first full-size instance) on a GPU: every family whose
    `match` takes the block and that has a patch binding (`onboarding.train.kernels`: blocks
    that expert parallelism owns are its own, experts written as a list of MLPs aside). A family
    that refuses a block, or a kernel that fails its check on the device, leaves the block's own
    code: the plan cannot know the latter and takes the kernel. A delta-rule family's params
    add ``qk_l2norm_in_torch``: the block normalises q and k itself before the call when the
    function it hands them to takes no ``use_qk_l2norm_in_kernel`` flag (with one, the kernel
    does: `onboarding.patching.linear_attention`)."""
    from onboarding.families import get_family, match_block
    from onboarding.train.kernels import EP_OWNED, _member_experts

    if b.kind in EP_OWNED and not _member_experts(b):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for family, m in match_block(b):
        if get_family(family).binding is not None and family not in out:
            out[family] = dict(m.get("params") or {})
    for params in out.values():
        if params.get("qk_l2norm"):
            params["qk_l2norm_in_torch"] = not _delta_rule_takes_l2_flag(full)
    return out


def _delta_rule_takes_l2_flag(module: nn.Module) -> bool:
    """Whether a function ``module`` hands its delta rule to (at least five required positional
    arguments: q, k, v, g, beta) takes a ``use_qk_l2norm_in_kernel`` flag."""
    import inspect

    from onboarding.patching.callswap import min_required, reachable
    from onboarding.patching.linear_attention import L2_FLAG

    def takes(fn) -> bool:
        try:
            return L2_FLAG in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False
    return any(takes(f) for _, _, f in reachable(module, min_required(5)))


def _dense_matmul(model: nn.Module, counts, graph: OpGraph) -> int:
    """Dense GEMM parameters per token, as `onboard train`'s MFU count takes them
    (`dense_gemm_params`: no 1-D parameter, no table a token only reads, the input embedding,
    per-layer input and position tables wherever they sit; tied to the head, the token table
    is the head's GEMM), less the routed experts (``counts.moe``)."""
    modules = dict(model.named_modules())
    experts = {id(p) for m in counts.moe if m.experts_path in modules
               for p in modules[m.experts_path].parameters()}
    return dense_gemm_params(model, graph, experts)


def _width(b, full: nn.Module, full_path: str, graph: OpGraph,
           modules: dict[str, nn.Module]) -> int:
    """A norm's elements per token at full size, a conv's channels. A norm over heads (a q or k
    norm with a [head_dim] weight, or none: [B, T, H, D] or [B, H, T, D] input) normalises the
    output of one of its parent's projections: the proxy projection whose output has the captured
    per-token size names the full-size one. A norm with no weight of its own around a norm
    block (a gated norm wrapping its RMSNorm module) has that block's width."""
    if b.kind in CONV_KINDS:
        w = [p for p in full.parameters(recurse=False) if p.ndim == 3]
        return int(w[0].shape[0]) if w else int(b.attrs.get("channels") or 0)
    if not b.kind.startswith("norm.") or not b.inputs:
        return 0
    weight = next((p for p in full.parameters(recurse=False) if p.ndim == 1), None)
    shp = b.inputs[0].shape
    per_token = _per_token(shp, int(b.attrs.get(CAPTURE_SEQ) or graph.seq), graph.batch)
    proxy_w = next((s[0] for s in b.params.values() if len(s) == 1), None)
    if weight is None:
        # a norm module whose weight is a norm module's inside it (a gated norm wrapping its
        # RMSNorm): that norm's width, not the proxy's captured one
        inner = min((x for x in graph.blocks if x.kind.startswith("norm.") and x.path
                     and x.path.startswith(b.path + ".")), key=lambda x: len(x.path), default=None)
        if inner is not None and (mod := modules.get(
                sub := full_path + inner.path[len(b.path):])) is not None:
            return _width(inner, mod, sub, graph, modules)
    if weight is None and len(shp) < 4:
        return per_token  # weightless: the captured width (no full-size tensor to read)
    if weight is not None and (not proxy_w or per_token == proxy_w):
        return int(weight.numel())
    parent = max((x for x in graph.blocks if x.path and b.path.startswith(x.path + ".")),
                 key=lambda x: len(x.path), default=None)
    if parent is not None:
        suffix = b.path[len(parent.path):]  # ".q_norm"
        root = full_path[: len(full_path) - len(suffix)]
        linears = [(shape, mod) for name, shape in parent.params.items() if len(shape) == 2
                   and isinstance(mod := modules.get(root + "." + name.rsplit(".", 1)[0]),
                                  nn.Linear)]
        # the output projection, the last back to the parent's input width: a norm over the
        # value heads (a linear attention's gated norm) normalises its input, the core's
        # output, never its output
        d = parent.inputs[0].shape[-1] if parent.inputs and parent.inputs[0].shape else None
        out = next((x for x in reversed(linears) if x[0][0] == d), None)
        for shape, mod in linears:
            if shape[0] in (per_token, 2 * per_token) and (out is None or mod is not out[1]):
                return mod.out_features // (shape[0] // per_token)
        if out is not None and out[0][1] == per_token:
            return out[1].in_features
    if weight is None:
        return per_token  # weightless, no projection of that width: the captured width
    return int(weight.numel()) * (per_token // proxy_w)


def _per_token(shape: list[int], seq: int, batch: int = 1) -> int:
    """Elements per token of a captured activation: the last dim of [B, T, D]; of a 4-D one all
    but the batch and the sequence dim ([B, T, H, D] and [B, H, T, D] alike); of a 2-D one whose
    rows are a multiple of the B x T tokens, those rows per token times the last dim (a norm
    over heads run on [B * T * H, d], Qwen3-Next's gated norm: H x d, not d)."""
    if len(shape) == 2 and shape[0] > batch * seq and shape[0] % (batch * seq) == 0:
        return shape[0] // (batch * seq) * shape[1]
    if len(shape) < 4:
        return shape[-1] if shape else 0
    rest = list(shape[1:])
    if seq in rest:
        rest.remove(seq)
    else:
        rest.pop(0)
    return math.prod(rest)


def _hidden(model: nn.Module) -> int:
    emb = token_embedding(model)
    return int(emb.embedding_dim) if emb is not None else 0


def _expert_matrices(mod: nn.Module, n_experts: int) -> list[tuple[int, int]]:
    """(in, out) of one expert's weight matrices: packed [E, out, in] (or [E, in, out]: the
    hidden width decides which is which later) or the first member of a list of experts."""
    packed = [p for p in mod.parameters(recurse=False) if p.ndim == 3 and p.shape[0] == n_experts]
    if packed:
        return [(int(p.shape[2]), int(p.shape[1])) for p in packed]
    if isinstance(mod, nn.ModuleList) and len(mod):
        return [(m.in_features, m.out_features) for m in mod[0].modules()
                if isinstance(m, nn.Linear)]
    return [(int(p.shape[-1]), int(p.shape[-2])) for p in mod.parameters() if p.ndim >= 2]


def _layer_dense_max(model: nn.Module, expert_paths: list[str],
                     skip: frozenset[int] = frozenset()) -> int:
    """Dense parameters of the biggest decoder layer (FSDP gathers one layer at a time); not of
    a list that holds a parameter of ``skip`` (`_module_lists`)."""
    best = 0
    for path, mod in _module_lists(model, skip):
        for i, layer in enumerate(mod):
            n = 0
            for pname, p in layer.named_parameters():
                full = f"{path}.{i}.{pname}".rsplit(".", 1)[0]
                if not any(inside(full, e) for e in expert_paths):
                    n += p.numel()
            best = max(best, n)
    return best


def attention_heads(cfg: Any, kind: str) -> tuple[int, int, int] | None:
    """(heads, d_qk, d_v) of an attention block from config fields (linear attention: value
    heads and key/value head dims)."""
    from onboarding.train.flops import _attention_widths, _int

    if cfg is None:
        return None
    if kind.startswith("linear_attention."):
        hv = _int(cfg, "linear_num_value_heads", "linear_num_heads")
        dk = _int(cfg, "linear_key_head_dim", "linear_head_dim")
        dv = _int(cfg, "linear_value_head_dim", "linear_head_dim")
        return (hv, dk, dv) if hv and dk and dv else None
    return _attention_widths(cfg, kind)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else a


def fsdp_shard(dim0: int, rest: int, world: int) -> int:
    """Elements of the largest FSDP2 shard (rank 0's: dim 0 split in ceil-sized chunks)."""
    return ceil_div(dim0, world) * rest if world > 1 else dim0 * rest


def isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)
