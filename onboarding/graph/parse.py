"""The parse stage: capture a proxy model and classify its blocks into an `OpGraph`."""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onboarding.load.accounting import (ParamCounts, _same_structure, count_parameters, path_pattern,
                                         take_alternatives, token_embedding)
from onboarding.graph.capture import Capture, capture
from onboarding.graph.classify import Classifier, Context, stack_of
from onboarding.graph._records import layer_of
from onboarding.errors import InputError
from onboarding.load.model import LoadedModel
from onboarding.load.multimodal import account
from onboarding.graph.opgraph import Block, OpGraph
from onboarding.load.proxy import proxy_config, text_config
from onboarding.modpath import inside

# One letter per mixer / feed-forward kind in the layer pattern string.
MIXER_CODES = {"attention.full": "A", "attention.gated": "A", "attention.sliding": "W",
               "attention.mla": "M", "attention.compressed": "P", "sparse_attention.topk": "S",
               "linear_attention.gated_delta": "D", "linear_attention.kimi_delta": "K",
               "linear_attention.mamba": "m", "linear_attention.other": "L",
               "conv.gated": "C", "unknown": "?"}
FFN_CODES = {"moe.experts": "E", "mlp.dense": "F"}
PATTERN_LEGEND = ("A attention, W sliding, M MLA, P over pooled (compressed) keys, S top-k sparse, "
                  "D gated delta, K Kimi delta, "
                  "m mamba, L other linear attention, C gated short conv, ? unknown; E MoE, "
                  "F dense MLP")


@dataclass(kw_only=True)
class ModelInfo:
    """What the load stage produces: the full-size accounting and the proxy config."""

    loaded: LoadedModel
    full: ParamCounts
    proxy_config: Any
    proxy_note: str
    proxy_size: str


def load_stage(loaded: LoadedModel, proxy_size: str = "tiny") -> ModelInfo:
    full_model = loaded.build(device="meta", seed=None)
    empty = [f"{n} {list(p.shape)}" for n, p in full_model.named_parameters() if p.numel() == 0]
    if empty:  # a width or count set to 0 (a --set, a factory argument): nothing would run
        raise InputError(f"{loaded.ref}: the model has parameters of size 0 ({', '.join(empty[:3])}"
                         f"{', ...' if len(empty) > 3 else ''}): is a width or count 0?")
    full = account(full_model, loaded.config)  # a multimodal model: the whole, by part
    cfg, note = proxy_config(loaded, proxy_size, full_model, full.total)
    return ModelInfo(loaded=loaded, full=full, proxy_config=cfg, proxy_note=note,
                     proxy_size=proxy_size)


def example_inputs(model: nn.Module, config: Any, batch: int, seq: int, seed: int
                   ) -> tuple[tuple, dict]:
    """Seeded inputs: the model's own `example_inputs(batch, seq)` if it has one, else token ids."""
    if hasattr(model, "example_inputs"):
        args = model.example_inputs(batch, seq)
        return (tuple(args) if isinstance(args, (tuple, list)) else (args,)), {}
    vocab = getattr(text_config(config), "vocab_size", None) if config is not None else None
    if vocab is None:
        emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        if not emb:
            raise InputError(f"{type(model).__name__}: cannot infer example inputs (no config "
                             "vocab_size, no nn.Embedding); define example_inputs(batch, seq)")
        vocab = emb[0].num_embeddings
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    kwargs = {"use_cache": False} if config is not None else {}
    return (ids,), kwargs


def load_weights(model: nn.Module, files: list) -> int:
    """Load safetensors weights into ``model``, every name and shape checked
    (`onboarding.load.weights`); returns the number of tensors loaded."""
    from onboarding.load.weights import load_safetensors

    return load_safetensors(model, files)


def load_shipped_weights(model: nn.Module, info: ModelInfo) -> int:
    """The directory's ``*.safetensors`` into ``model`` when it runs at full size (0: none)."""
    if info.loaded.weights and info.proxy_note.startswith("full size"):
        return load_weights(model, info.loaded.weights)
    return 0


def _context(model: nn.Module, cap: Capture, config: Any, seq: int) -> Context:
    children: dict[str, list[str]] = {}
    for path, _ in model.named_modules():
        if path:
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            children.setdefault(parent, []).append(path)
    emb = token_embedding(model)
    tc = text_config(config) if config is not None else None
    types = getattr(tc, "layer_types", None) if tc is not None else None
    hints = {i: str(t) for i, t in enumerate(types)} if isinstance(types, (list, tuple)) else {}
    lists = {p: len(m) for p, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and _same_structure(list(m))}
    vocabs = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    # the output head may predict fewer rows than the embedding holds (Mllama's table has 8
    # image-token rows past the vocabulary): its own width and the config's vocabulary count too
    try:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except Exception:  # noqa: BLE001 - the model's own accessor, whatever it raises
        head = None
    if isinstance(head, nn.Linear):
        vocabs.add(head.out_features)
    if isinstance(v := getattr(tc, "vocab_size", None), int) and not isinstance(v, bool) and v > 0:
        vocabs.add(v)
    return Context(seq=seq, vocab=emb.num_embeddings if emb else None,
                   hidden=emb.embedding_dim if emb else None, layer_hints=hints,
                   param_shapes={n: list(p.shape) for n, p in model.named_parameters()},
                   children=children, module_types=cap.module_types, identical_lists=lists,
                   vocabs=tuple(sorted(vocabs)))


def _not_run_block(path: str, mod: nn.Module, params: dict[str, list[int]], why: str) -> Block:
    """The `unknown` block of a module that ran no op in the proxy's forward (``attrs["not_run"]``:
    why, which coverage gives as its reason and the report lists apart)."""
    return Block(path=path, kind="unknown", layer=layer_of(path), class_name=type(mod).__name__,
                 evidence=[why], params=params, attrs={"not_run": why})


def unrun_layers(model: nn.Module, cap: Capture) -> list[Block]:
    """An `unknown` block for each layer of a layer list that ran no op in the forward while
    another layer of the list did: a layer the model skips without inputs the language model
    alone is not given (Mllama's cross-attention layers without image states). Left out, its
    blocks were missing from the graph, the layer pattern and coverage, unsaid."""
    ran = {r.module for r in cap.records}
    out: list[Block] = []
    for path, mod in model.named_modules():
        # a layer stack: a list outside every layer (an expert list inside a layer may leave
        # an expert without tokens)
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2 or layer_of(path) is not None:
            continue
        items = [(f"{path}.{i}" if path else str(i), m) for i, m in enumerate(mod)]
        live = [p for p, _ in items if any(inside(r, p) for r in ran)]
        if not live:
            continue
        for p, m in items:
            params = {n: list(t.shape) for n, t in m.named_parameters()}
            if p in live or not params:
                continue
            why = (f"ran no op in the proxy's forward while {len(live)} of the {len(items)} layers "
                   f"of {path or 'the model'} did: a layer the model skips without inputs it was "
                   "not given (states of another modality?); not captured, not checked")
            out.append(_not_run_block(p, m, params, why))
    return out


_LAYER_INDEX = re.compile(r"(?:^|\.)\d+(?=\.|$)")


def unrun_branches(model: nn.Module, cap: Capture, skip: list[Block]) -> list[Block]:
    """An `unknown` block for each module inside a layer that ran no op and read none of its
    parameters while a sibling of its class (same parent) did: a branch another modality's
    tokens take (ERNIE 4.5 VL's vision_moe beside text_moe). Left out, its parameters (half the
    routed experts there) were in no block, and coverage and alignment said nothing of them.
    Modules inside a list within the layer (experts without tokens) and inside a layer
    `unrun_layers` already reported (``skip``) are not judged."""
    ran = {r.module for r in cap.records}
    read = {n for r in cap.records for n in r.params.values()}
    mods = dict(model.named_modules())

    def live(path: str) -> bool:  # an op ran in it, or an op read one of its parameters
        return (any(inside(r, path) for r in ran)
                or any(inside(n.rpartition(".")[0], path) for n in read))

    out: list[Block] = []
    for path, mod in mods.items():
        if layer_of(path) is None or any(inside(path, b.path) for b in skip + out):
            continue
        # below a layer only, and not in a list inside it (an index past the layer's own)
        rest = path[_LAYER_INDEX.search(path).end():]
        if not rest or _LAYER_INDEX.search(rest):
            continue
        parent, _, name = path.rpartition(".")
        params = {n: list(t.shape) for n, t in mod.named_parameters()}
        if not params or live(path):
            continue
        sibs = [n for n, m in mods[parent].named_children()
                if n != name and type(m) is type(mod) and live(f"{parent}.{n}")]
        if not sibs:
            continue
        why = (f"ran no op in the proxy's forward while its sibling {sibs[0]} (the same class, "
               f"in the same {parent}) did: a branch the model takes for inputs it was not given "
               "(another modality's tokens?); not captured, not checked")
        out.append(_not_run_block(path, mod, params, why))
    return out


def layer_pattern(blocks: list[Block], first_op: dict[str, int] | None = None
                  ) -> tuple[str, list[list[str]]]:
    """One token per layer (mixer letters, then feed-forward letters), layers grouped by the
    stack that holds them (`stack_of`). With one stack (a decoder's ``model.layers``), the tokens
    alone. With several (a byte model's patcher, encoder, global and decoder stacks), one
    ``name: tokens`` segment per stack, joined by `` | ``, in forward order (``first_op``: a
    module path -> the index of its first recorded op; path order without it); ``name`` is the
    stack owner's last path component (the list's path for a list at the root). ``layer_kinds``
    follows the same order."""
    layers: dict[tuple[str, int], list[str]] = {}
    members: dict[str, list[str]] = {}  # stack -> its pattern blocks' paths
    for b in blocks:
        key = (stack_of(b.path) or "", b.layer)
        if b.layer is not None and (b.kind in MIXER_CODES or b.kind in FFN_CODES):
            layers.setdefault(key, []).append(b.kind)
            members.setdefault(key[0], []).append(b.path)
        if b.layer is not None and b.attrs.get("inline_mlp"):  # an MLP inside the attention module
            layers.setdefault(key, []).append("mlp.dense")
    stacks: dict[str, list[int]] = {}
    for s, i in layers:
        stacks.setdefault(s, []).append(i)
    names = sorted(first_op or {})

    def first(path: str) -> float:
        """The first op index of ``path`` or a module under it."""
        lo = bisect.bisect_left(names, path)
        hi = bisect.bisect_left(names, path + "/")  # "/" sorts right after ".": the subtree
        return min((first_op[m] for m in names[lo:hi] if inside(m, path)),
                   default=float("inf"))

    def order(s: str) -> tuple:
        return (min((first(p) for p in members.get(s, [])), default=float("inf")),
                [int(p) if p.isdigit() else p for p in s.split(".")])

    segments, kinds = [], []
    for s in sorted(stacks, key=order):
        pattern = []
        for i in sorted(stacks[s]):
            ks = layers[(s, i)]
            mixer = "".join(MIXER_CODES[k] for k in ks if k in MIXER_CODES) or "-"
            ffn = "".join(FFN_CODES[k] for k in ks if k in FFN_CODES) or "-"
            pattern.append(mixer + ffn)
            kinds.append(sorted(set(ks)))
        name = s.rsplit(".", 1)[-1] if s else next(
            (b.path.split(".")[0] for b in blocks if stack_of(b.path) == ""), "")
        segments.append((name, " ".join(pattern)))
    if len(segments) == 1:
        return segments[0][1], kinds
    return " | ".join(f"{name}: {p}" for name, p in segments), kinds


def by_kind_params(full: ParamCounts, blocks: list[Block]) -> dict[str, int]:
    """Full-size parameters per block kind, joining full-size modules to proxy blocks by path.
    A block whose compute runs in a sibling module too (`residual.input_gate`: its second
    projection, attrs `projection`) joins that module as well."""
    pairs = [(path_pattern(b.path), b.kind) for b in blocks]
    pairs += [(path_pattern(b.attrs["projection"]), b.kind) for b in blocks
              if b.kind == "residual.input_gate" and isinstance(b.attrs.get("projection"), str)]
    patterns = sorted(pairs, key=lambda t: -len(t[0]))
    out: Counter = Counter()
    for comp, n in full.by_component.items():
        kind = next((k for p, k in patterns if inside(comp, p)), None)
        out[kind or "other"] += n
    return dict(out.most_common())


def parse_stage(info: ModelInfo, *, batch: int = 1, seq: int = 64, seed: int = 0,
                dtype: torch.dtype = torch.float32, try_export: bool = True,
                on_step: Callable[[str], None] | None = None,
                model: nn.Module | None = None) -> OpGraph:
    """The op graph of ``info``'s proxy config. ``model``: that model already built on the CPU in
    ``dtype`` (from ``seed``, its shipped weights loaded as here; or from a fixed fill, the
    training preflight's `LoadedModel.build` with ``init=False``), captured instead of a second
    build (the build is the slow part at billions of parameters); its train/eval mode is
    restored afterwards."""
    loaded = info.loaded
    training = None
    if model is None:
        model = loaded.build(info.proxy_config, device="cpu", seed=seed).to(dtype).eval()
        load_shipped_weights(model, info)
    else:
        training = model.training
        model.eval()
    try:
        return _parse(info, model, batch, seq, seed, dtype, try_export, on_step)
    finally:
        if training is not None:
            model.train(training)


def _parse(info: ModelInfo, model: nn.Module, batch: int, seq: int, seed: int, dtype: torch.dtype,
           try_export: bool, on_step: Callable[[str], None] | None) -> OpGraph:
    loaded = info.loaded
    inputs, kwargs = example_inputs(model, info.proxy_config, batch, seq, seed)
    # a vision tower given a grid (`load.vision`) sizes its attention from the grid's values,
    # which torch.export cannot trace (data-dependent guards): the dispatch recording it is
    grid = getattr(model, "grid_arg", None) is not None
    cap = capture(model, inputs, kwargs, try_export=try_export and not grid, on_step=on_step)
    if grid and try_export:
        cap.note = ("export not attempted: the vision tower's sequence lengths are read from the "
                    "values of its grid input (data-dependent for torch.export)")
    if on_step:
        on_step("classify blocks")
    # a vision tower (`load.vision`): attention runs over each image's patches, its own config
    ctx_seq = model.tokens_per_image(batch, seq) if hasattr(model, "tokens_per_image") else seq
    ctx_cfg = model.config if hasattr(model, "tokens_per_image") else info.proxy_config
    blocks = Classifier(cap, _context(model, cap, ctx_cfg, ctx_seq)).run()
    blocks += unrun_layers(model, cap)
    blocks += unrun_branches(model, cap, [b for b in blocks if b.attrs.get("not_run")])
    # what the call-swapping bindings would find in the blocks their families match (one more
    # forward): coverage runs each binding's acceptance test on it (`onboarding.patching.probe`)
    from onboarding.patching.probe import probe_core_calls

    probe_note = probe_core_calls(model, blocks, lambda: model(*inputs, **kwargs))
    for note in (cap.no_gradient_note, probe_note):
        if note:
            cap.note = f"{cap.note}; {note}" if cap.note else note
    first_op: dict[str, int] = {}
    for r in cap.records:
        first_op.setdefault(r.module, r.index)
    pattern, kinds = layer_pattern(blocks, first_op)
    # sibling MoE blocks of which one ran no op: a token takes one (its active parameters)
    not_run = [b.path for b in blocks if b.attrs.get("not_run")]
    take_alternatives(info.full, not_run)
    proxy_counts = count_parameters(model, info.proxy_config)
    take_alternatives(proxy_counts, not_run)
    params = {
        "full": {k: v for k, v in info.full.to_dict().items() if k not in ("by_component",)},
        "full_by_kind": by_kind_params(info.full, blocks),
        "proxy": {"total": proxy_counts.total, "active": proxy_counts.active},
        "proxy_note": info.proxy_note,
    }
    return OpGraph(model=loaded.name, capture=cap.method, capture_note=cap.note, batch=batch,
                   seq=seq, dtype=str(dtype).replace("torch.", ""), blocks=blocks,
                   layer_pattern=pattern, layer_kinds=kinds, param_counts=params,
                   total_flops=sum(b.flops for b in blocks), sliced_tables=cap.sliced_tables)
