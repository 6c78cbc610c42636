"""Models whose config maps to no causal LM (image-text-to-text, conditional generation, an omni
"thinker", a bare ``*_text`` decoder): the language model inside them, and the whole model's
parameters by component.

Everything goes by structure, never by class or model names:

- the *text config* is the sub-config that holds a vocabulary and a layer count (the config's own
  ``get_text_config()`` where that is such a node);
- the *whole model* is built from the model's own classes: the auto classes transformers (or the
  remote code's ``auto_map``) registers for the config, else the classes of the config's modeling
  module whose ``config_class`` is the config's class; where the root does not build, the
  sub-config on the way to the text config does (what was not built is a note); where every
  class that builds leaves some sub-config without a module, the first such class (or the last
  tried) is the whole, and a note names what it leaves out and why (another class's error);
- the *decoder* is the shallowest module with an embedding over the text vocabulary and a
  ModuleList of the text layer count; the *lm_head* is the whole model's output embedding (a
  linear to the vocabulary), else a new linear (tied where the decoder's config ties);
- *components*: the module built from each sub-config (``model.config is sub``; for a
  sub-config no module keeps, the modules whose constructor was given it: `config_modules`) is
  that component (``vision_config`` -> ``vision``, ``audio_config`` -> ``audio``; the text config is
  ``language``, with the lm_head); inside a tower, the children after its layer stack that hold
  linear or convolution layers and take its features out of its width (the width its layer stack
  reads, not a config field that may hold the language model's), and anything outside every
  component that holds them or a bare matrix from a tower's width to the language model's
  embedding width, are the ``projector``; what is left is ``other``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onboarding.errors import InputError
from onboarding.modpath import inside

LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers")
# Auto classes tried in order for the whole model: the ones with a language-model head first.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMultimodalLM",
                "AutoModelForVision2Seq", "AutoModelForSeq2SeqLM", "AutoModel")


def _is_config(v: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(v, PretrainedConfig)


def sub_configs(cfg: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(attribute path, config) of ``cfg`` and every nested sub-config, root first."""
    yield path, cfg
    for k, v in vars(cfg).items():
        if _is_config(v) and not k.startswith("_"):
            yield from sub_configs(v, path + (k,))


# module -> the config its constructor was given, for modules built under `recording_configs`
_BUILT_FROM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextmanager
def recording_configs() -> Iterator[None]:
    """While models are built in it: each module whose constructor was given a config among its
    arguments (``Head(config.flow_head_config)``) is recorded as built from it (`built_from`),
    whether or not it keeps the config as ``.config``. The constructor's arguments are read off
    its frame when it calls ``nn.Module.__init__`` (``super().__init__()``)."""
    init = nn.Module.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        frame = sys._getframe(1)
        code = frame.f_code
        if code.co_name != "__init__" or frame.f_locals.get("self") is not self:
            return
        for name in code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]:
            if _is_config(v := frame.f_locals.get(name)):
                _BUILT_FROM[self] = v
                return

    nn.Module.__init__ = recording
    try:
        yield
    finally:
        nn.Module.__init__ = init


def built_from(m: nn.Module) -> Any:
    """The config ``m`` was built from: its own ``config``, else the config its constructor was
    given where it was built under `recording_configs` (a tower or head that keeps none), else
    None."""
    c = getattr(m, "config", None)
    return c if _is_config(c) else _BUILT_FROM.get(m)


def config_modules(model: nn.Module) -> dict[str, int]:
    """Module path -> ``id`` of the config it is built from: the modules that keep a config as
    ``.config``, and for a config that no module keeps, the modules whose constructor was given
    it and that hold parameters (`built_from`: a head built as ``Head(config.flow_head_config)``;
    not a rotary table given a config its encoder keeps no trace of). A config some module keeps
    is matched by that alone: a projector given the vision config for its widths is not the
    vision tower."""
    kept: dict[str, int] = {}
    given: dict[str, int] = {}
    for path, m in model.named_modules():
        c = getattr(m, "config", None)
        if _is_config(c):
            kept[path] = id(c)
        elif (r := _BUILT_FROM.get(m)) is not None and any(True for _ in m.parameters()):
            given[path] = id(r)
    held = set(kept.values())
    out = {**{p: c for p, c in given.items() if c not in held}, **kept}
    return {p: out[p] for p, _ in model.named_modules() if p in out}


def _int(c: Any, name: str) -> int | None:
    v = getattr(c, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _layers(c: Any) -> int | None:
    return next((v for n in LAYER_COUNT_NAMES if (v := _int(c, n)) is not None), None)


def _is_text_node(c: Any) -> bool:
    return _int(c, "vocab_size") is not None and _layers(c) is not None \
        and _int(c, "hidden_size") is not None


def text_config_path(cfg: Any) -> tuple[str, ...]:
    """The attribute path to the sub-config that holds the text model (vocab size, layers)."""
    nodes = [(p, c) for p, c in sub_configs(cfg) if _is_text_node(c)]
    preferred = cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
    for p, c in nodes:
        if c is preferred:
            return p
    if not nodes:
        raise InputError(f"{type(cfg).__name__}: no sub-config holds a text model (a "
                         "vocab_size, hidden_size and layer count): the text part cannot be found")
    return min(nodes, key=lambda pc: (len(pc[0]), -(_layers(pc[1]) * pc[1].hidden_size)))[0]


def _get(cfg: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        cfg = getattr(cfg, k)
    return cfg


def has_causal_lm(cfg: Any, trust_remote_code: bool) -> bool:
    """Whether transformers (or the remote code's auto_map) maps a causal LM for ``cfg``."""
    from transformers import AutoModelForCausalLM

    auto_map = getattr(cfg, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return True
    try:
        return type(cfg) in AutoModelForCausalLM._model_mapping
    except Exception:  # noqa: BLE001 - a mapping that cannot be read: let transformers decide
        return True


def _builders(cfg: Any, trust_remote_code: bool) -> list[tuple[str, Any]]:
    """(description, callable building a model from ``cfg``) in the order they are tried."""
    import transformers
    from transformers import GenerationMixin, PreTrainedModel

    out: list[tuple[str, Any]] = []
    auto_map = getattr(cfg, "auto_map", None) or {}
    for name in AUTO_CLASSES:
        auto = getattr(transformers, name, None)
        if auto is None:
            continue
        try:
            mapped = type(cfg) in auto._model_mapping
        except Exception:  # noqa: BLE001
            mapped = False
        if mapped or (trust_remote_code and name in auto_map):
            out.append((name, lambda c, a=auto: a.from_config(c, trust_remote_code=trust_remote_code)))
    modeling = type(cfg).__module__.replace("configuration_", "modeling_")
    try:
        mod = importlib.import_module(modeling)
    except Exception:  # noqa: BLE001 - no modeling module next to the config: nothing to scan
        mod = None
    if mod is not None:
        classes = [o for o in vars(mod).values()
                   if inspect.isclass(o) and issubclass(o, PreTrainedModel)
                   and getattr(o, "config_class", None) is type(cfg)
                   and o.__init__ is not PreTrainedModel.__init__]
        classes.sort(key=lambda o: not issubclass(o, GenerationMixin))  # with an LM head first
        out += [(o.__name__, lambda c, o=o: o(c)) for o in classes]
    return out


def build_whole(cfg: Any, trust_remote_code: bool) -> tuple[nn.Module, tuple[str, ...], list[str]]:
    """The whole model from its own classes (on the current device), the config path it was built
    from (``()``: the root) and notes on what was not built."""
    text_path = text_config_path(cfg)
    notes: list[str] = []
    errors: list[str] = []
    for depth in range(len(text_path) + 1):
        node_path = text_path[:depth]
        node = _get(cfg, node_path)
        partial: tuple[nn.Module, str, list[str]] | None = None
        builders = _builders(node, trust_remote_code)
        for i, (what, build) in enumerate(builders):
            try:
                with recording_configs():
                    model = build(node)
            except Exception as exc:  # noqa: BLE001 - the model's own code, whatever it raises
                errors.append(f"{what}: {type(exc).__name__}: {_first_line(exc)}")
                continue
            if isinstance(model, nn.Module) and any(True for _ in model.parameters()):
                # a class that builds the text part alone (Mllama's causal LM beside its
                # conditional-generation model): a later class may build the towers too
                missing = _unbuilt_parts(model, node, text_path[depth:])
                if missing and i + 1 < len(builders):
                    errors.append(f"{what}: builds no module from {', '.join(missing)}")
                    partial = partial or (model, what, missing)
                    continue
                if node_path:
                    skipped = [".".join(p) for p, _ in sub_configs(cfg)
                               if len(p) == 1 and p[0] != node_path[0]]
                    notes.append(f"built from {'.'.join(node_path)} ({errors[0] if errors else 'the root has no model class'}); "
                                 f"not built: {', '.join(skipped) or 'none'}")
                if missing and (note := _partial_note(what, missing, node_path, errors)):
                    notes.append(note)
                return model, node_path, notes
        if partial is not None:
            model, what, missing = partial
            if note := _partial_note(what, missing, node_path, errors):
                notes.append(note)
            return model, node_path, notes
    detail = errors[0] if errors else "no model class is registered for the config"
    raise InputError(f"building the model failed: {detail}")


def _partial_note(what: str, missing: list[str], node_path: tuple[str, ...],
                  errors: list[str]) -> str | None:
    """The note of a whole model that builds no module from some sub-configs of the node it was
    built from, where another class of the config raised (it may have built them: its error is
    the why); None where none raised (a sub-config of settings, such as an attention config,
    that no class builds a module from)."""
    names = [".".join(node_path + (m,)) for m in missing]
    why = next((e for e in errors if not e.startswith(f"{what}:")
                and "builds no module from" not in e), None)
    if why is None:  # no class raised: a sub-config of settings no class builds a module from
        return None
    return f"built by {what}, which builds no module from {', '.join(names)} ({why}); " \
           f"not built: {', '.join(names)}"


def _unbuilt_parts(model: nn.Module, node: Any, text_rest: tuple[str, ...]) -> list[str]:
    """The sub-configs of ``node`` (one level down, not the one on the way to the text config)
    from which no module of ``model`` is built (``module.config is sub``)."""
    built = set(config_modules(model).values())
    return [k for k, v in vars(node).items() if _is_config(v) and not k.startswith("_")
            and (not text_rest or k != text_rest[0]) and id(v) not in built]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def find_decoder(model: nn.Module, text_cfg: Any) -> tuple[str, nn.Module]:
    """The shallowest module with an embedding over the vocabulary and a ModuleList of the text
    layer count among its children."""
    vocab, n_layers = _int(text_cfg, "vocab_size"), _layers(text_cfg)
    if getattr(text_cfg, "is_encoder_decoder", False) is True:
        # an encoder and a decoder stack over one vocabulary: the shallowest match would be the
        # (bidirectional) encoder, run as if it were a causal decoder
        raise InputError(f"{type(text_cfg).__name__}: the language model is an encoder-decoder "
                         "(its config's is_encoder_decoder): onboard takes a decoder-only "
                         "language model")
    found = []
    for path, mod in model.named_modules():
        kids = list(mod.children())
        if any(isinstance(k, nn.Embedding) and k.num_embeddings >= vocab for k in kids) and \
                any(isinstance(k, nn.ModuleList) and len(k) == n_layers for k in kids):
            exact = any(isinstance(k, nn.Embedding) and k.num_embeddings == vocab for k in kids)
            found.append((not exact, path.count(".") + bool(path), path, mod))
    if not found:
        raise InputError(f"{type(model).__name__}: no module holds an embedding of the text "
                         f"vocabulary ({vocab}) and {n_layers} layers: the text part cannot be found")
    # an embedding of exactly the vocabulary first; else one with rows past it (Mllama's
    # image-token rows)
    _, _, path, mod = min(found, key=lambda t: t[:2])
    return path, mod


def find_lm_head(model: nn.Module, decoder_path: str, text_cfg: Any) -> nn.Linear | None:
    vocab = _int(text_cfg, "vocab_size")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear) and head.out_features == vocab:
        return head
    for path, mod in model.named_modules():
        # not inside the decoder (at "", the whole model: a bare decoder has no head of its own),
        # where an MLP as wide as the vocabulary is no head
        if isinstance(mod, nn.Linear) and mod.out_features == vocab and \
                not inside(path, decoder_path):
            return mod
    return None


def whole_of_causal_lm(model: nn.Module, cfg: Any, trust_remote_code: bool) -> Layout | None:
    """For a causal LM built from a config whose text model is a sub-config beside others (the
    towers: Mllama's and Llama 4's causal LM over the text config alone; Gemma 3's, which holds
    the whole): the layout of the whole model, for the accounting. The whole is ``model`` when it
    builds a module from every sub-config, else the first of the config's own classes (on
    ``meta``) that does, kept only when its language part (decoder and lm_head) has the
    parameters ``model`` has. None where the text config is the root; where no class builds the
    towers (or its language part differs), None and a ComponentsWarning: the totals leave them
    out."""
    try:
        text_path = text_config_path(cfg)
    except InputError:
        return None
    if not text_path:
        return None  # the text model is the root: a language model alone
    text_cfg = _get(cfg, text_path)
    missing = _unbuilt_parts(model, cfg, text_path)
    whole: nn.Module | None = None if missing else model
    errors: list[str] = []
    if whole is None:
        for what, build in _builders(cfg, trust_remote_code):
            try:
                with torch.device("meta"), warnings.catch_warnings(), recording_configs():
                    warnings.simplefilter("ignore")
                    candidate = build(cfg)
            except Exception as exc:  # noqa: BLE001 - the model's own code, whatever it raises
                errors.append(f"{what}: {type(exc).__name__}: {_first_line(exc)}")
                continue
            if isinstance(candidate, nn.Module) and not _unbuilt_parts(candidate, cfg, text_path):
                whole = candidate
                break
    if whole is None:
        warnings.warn(f"parameter totals: the language model alone ({type(model).__name__}); "
                      f"no class of the config built {', '.join(missing)} "
                      f"({errors[0] if errors else 'none builds them'}): left out",
                      ComponentsWarning, stacklevel=3)
        return None
    try:
        dec_path, dec = find_decoder(whole, text_cfg)
    except InputError:
        return None
    head = find_lm_head(whole, dec_path, text_cfg)
    if whole is not model:
        lang = {id(p): p.numel() for p in dec.parameters()}
        if head is not None:
            lang.update({id(p): p.numel() for p in head.parameters()})
        own = {id(p): p.numel() for p in model.parameters()}
        if sum(lang.values()) != sum(own.values()):
            warnings.warn(f"parameter totals: the language model alone ({type(model).__name__}); "
                          f"the language part of {type(whole).__name__}, which builds "
                          f"{', '.join(missing)}, has {sum(lang.values()):,} parameters, not "
                          f"{sum(own.values()):,}: its other parts are left out",
                          ComponentsWarning, stacklevel=3)
            return None
    return Layout(whole=whole, node_path=(), text_path=text_path, decoder_path=dec_path,
                  decoder=dec, lm_head=head, notes=[])


class LanguageModelForCausalLM(nn.Module):
    """A decoder stack and its lm_head as a causal LM: ``forward(input_ids)`` returns logits."""

    def __init__(self, model: nn.Module, lm_head: nn.Linear, config: Any, tied: bool):
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        self.config = config
        if tied:
            self.lm_head.weight = self.get_input_embeddings().weight

    def get_input_embeddings(self) -> nn.Embedding:
        vocab = self.lm_head.out_features
        tables = [m for m in self.model.children()
                  if isinstance(m, nn.Embedding) and m.num_embeddings >= vocab]
        return min(tables, key=lambda m: m.num_embeddings != vocab)  # exact rows first

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_experts_implementation(self, impl: str):  # the decoder's, where it has one
        return self.model.set_experts_implementation(impl)

    def set_attn_implementation(self, impl: str):
        return self.model.set_attn_implementation(impl)

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("labels", None)
        out = self.model(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))


@dataclass(kw_only=True)
class Layout:
    whole: nn.Module
    node_path: tuple[str, ...]  # the config path the whole model was built from
    text_path: tuple[str, ...]
    decoder_path: str
    decoder: nn.Module
    lm_head: nn.Linear | None
    notes: list[str]


def layout(cfg: Any, trust_remote_code: bool) -> Layout:
    """Build the whole model on ``meta`` and find its decoder and lm_head."""
    with torch.device("meta"):
        whole, node_path, notes = build_whole(cfg, trust_remote_code)
    text_path = text_config_path(cfg)
    text_cfg = _get(cfg, text_path)
    dec_path, dec = find_decoder(whole, text_cfg)
    return Layout(whole=whole, node_path=node_path, text_path=text_path, decoder_path=dec_path,
                  decoder=dec, lm_head=find_lm_head(whole, dec_path, text_cfg), notes=notes)


def _tied(lay: Layout, text_cfg: Any) -> bool:
    if lay.lm_head is None:
        return bool(getattr(text_cfg, "tie_word_embeddings", False))
    emb = [m for m in lay.decoder.children() if isinstance(m, nn.Embedding)]
    return any(m.weight is lay.lm_head.weight for m in emb)


def _shapes(m: nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


def build_language_model(cfg: Any, trust_remote_code: bool, device: str | torch.device
                         ) -> LanguageModelForCausalLM:
    """The language model of ``cfg`` (decoder + lm_head) on ``device``. On ``meta`` it shares
    the whole model's modules (``whole_model`` holds the whole); elsewhere the decoder is built
    alone from its own class when that gives the same parameters, else taken from a whole model
    built on ``device``."""
    lay = layout(cfg, trust_remote_code)
    text_cfg = getattr(lay.decoder, "config", None) or _get(cfg, lay.text_path)
    tied = _tied(lay, text_cfg)
    hidden = lay.decoder.get_input_embeddings().embedding_dim if hasattr(
        lay.decoder, "get_input_embeddings") else _int(text_cfg, "hidden_size")
    vocab = _int(_get(cfg, lay.text_path), "vocab_size")
    bias = lay.lm_head is not None and lay.lm_head.bias is not None
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            head = lay.lm_head if lay.lm_head is not None else nn.Linear(hidden, vocab, bias=False)
        lm = LanguageModelForCausalLM(lay.decoder, head, text_cfg, tied and lay.lm_head is None)
        object.__setattr__(lm, "whole_model", lay)
        return lm
    decoder = None
    with torch.device(device):
        try:
            cls = type(lay.decoder)
            decoder = cls._from_config(text_cfg) if hasattr(cls, "_from_config") else cls(text_cfg)
            if _shapes(decoder) != _shapes(lay.decoder):
                decoder = None
        except Exception:  # noqa: BLE001 - its class wants more than the config: use the whole
            decoder = None
        if decoder is None:
            whole, _, _ = build_whole(cfg, trust_remote_code)
            decoder = whole.get_submodule(lay.decoder_path) if lay.decoder_path else whole
        head = nn.Linear(hidden, vocab, bias=bias)
        std = getattr(text_cfg, "initializer_range", None)
        if isinstance(std, float):
            nn.init.normal_(head.weight, std=std)
            if head.bias is not None:
                nn.init.zeros_(head.bias)
    return LanguageModelForCausalLM(decoder, head, text_cfg, tied)


# -- accounting -------------------------------------------------------------------------------

def _component_name(path: tuple[str, ...], text_path: tuple[str, ...]) -> str:
    if path == text_path:
        return "language"
    name = path[-1]
    return name[: -len("_config")] if name.endswith("_config") else name


def _has_layers(m: nn.Module) -> bool:
    return any(isinstance(x, (nn.Linear, nn.modules.conv._ConvNd)) for x in m.modules())


def _widths(m: nn.Module) -> list[tuple[int, int]]:
    out = []
    for x in m.modules():
        if isinstance(x, nn.Linear):
            out.append((x.in_features, x.out_features))
        elif isinstance(x, nn.modules.conv._ConvNd):
            out.append((x.in_channels, x.out_channels))
    return out


def _read_width(layer: nn.Module) -> int | None:
    ins = [x.in_features for x in layer.modules() if isinstance(x, nn.Linear)]
    return max(ins, key=ins.count) if ins else None


def _stack_width(layers: nn.Module | None) -> int | None:
    """The width a layer stack works at: the input width most linear layers of a layer read
    (q/k/v, the output projection, the MLP's up/gate read it; the down projection alone does
    not), the same in its first and last layer; None for no ModuleList, no linear layer, or a
    stack whose width changes (a convolutional encoder's stages)."""
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    first, last = _read_width(layers[0]), _read_width(layers[-1])
    return first if first == last else None


def _config_width(tower: nn.Module) -> int | None:
    cfg = getattr(tower, "config", None)
    return next((v for n in ("hidden_size", "d_model", "embed_dim") if (v := _int(cfg, n))), None)


def _tower_width(tower: nn.Module) -> int | None:
    """A tower's width by structure: its layer stack's (`_stack_width`; the stack the largest
    ModuleList in it), else its config's width field. The config's ``hidden_size`` can be the
    width of what the tower hands the language model (Qwen2-VL's vision config: 3584, the
    language model's, beside ``embed_dim`` 1280, the tower's own)."""
    lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList)]
    stack = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    return _stack_width(stack) or _config_width(tower)


def _projects(m: nn.Module, towers: set[int], language: int | None) -> bool:
    """Whether a module outside every component is a projector, by structure: it holds linear or
    convolution layers, or a bare weight matrix whose sides are a tower's width (``towers``) and
    the language model's (``language``, its token embedding's width): a projection from a tower's
    features into the language model's embedding space written as ``x @ W`` (Gemma 3's)."""
    if _has_layers(m):
        return True
    return language is not None and any(
        p.dim() == 2 and ((p.shape[0] in towers and p.shape[1] == language)
                          or (p.shape[1] in towers and p.shape[0] == language))
        for p in m.parameters())


def _embedding_width(decoder: nn.Module) -> int | None:
    """The width of the language model's input: its largest embedding's (the token table)."""
    embs = [m for m in decoder.modules() if isinstance(m, nn.Embedding)]
    return max(embs, key=lambda m: m.num_embeddings).embedding_dim if embs else None


def _tower_heads(tower: nn.Module) -> list[str]:
    """Children of a tower that project its features out: not its layer stack (the ModuleList of
    the tower's layer count, else the largest one), the last layer's output not the tower's width
    (its stack's, `_stack_width`, else its config's), some layer's input at least that width (a
    stem from pixels or mel bins starts below it)."""
    cfg = getattr(tower, "config", None)
    lists = [(n, c) for n, c in tower.named_children() if isinstance(c, nn.ModuleList)]
    n_layers = _layers(cfg) or _int(cfg, "depth") or _int(cfg, "encoder_layers")
    stack = next((n for n, c in lists if len(c) == n_layers), None) or max(
        lists, key=lambda nc: sum(p.numel() for p in nc[1].parameters()), default=(None,))[0]
    width = _stack_width(dict(lists).get(stack)) or _config_width(tower)
    if width is None:
        return []
    heads = []
    for name, child in tower.named_children():
        w = _widths(child)
        if name != stack and w and w[-1][1] != width and max(i for i, _ in w) >= width:
            heads.append(name)
    return heads


def component_params(lay: Layout, cfg: Any) -> dict[str, int]:
    """Parameters of the whole model by component (language, vision, projector, audio...);
    tied tensors counted once, the parts sum to the whole."""
    out: dict[str, int] = {}
    for p, comp in param_components(lay, cfg).values():
        out[comp] = out.get(comp, 0) + p.numel()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def resident_parts(model: nn.Module, cfg: Any) -> dict[str, str]:
    """The parameters of ``model`` (a causal LM built on ``meta``, as `onboard train` builds it)
    outside its language part, by name (as ``model.named_parameters()`` lists them) -> component
    (`param_components`): the towers and projector of a causal LM that holds the whole model
    (Gemma 3's), which training keeps beside the language model; {} for a language model taken
    out alone (`build_language_model`, Mllama's and Llama 4's causal LM over the text config),
    whose towers are not built, and for a model with no other part."""
    lay = getattr(model, "whole_model", None)
    if lay is None or cfg is None:
        return {}
    if not isinstance(lay, Layout):  # `whole_of_causal_lm`, not called yet
        try:
            text_path = text_config_path(cfg)
        except InputError:
            return {}
        built = set(config_modules(model).values())
        others = [c for p, c in sub_configs(cfg)
                  if p and p != text_path[:len(p)] and p[:len(text_path)] != text_path]
        if not any(id(c) in built for c in others):  # no module of another part: no tower here
            return {}
        lay = lay()
        if not isinstance(lay, Layout):
            return {}
    if lay.lm_head is None and lay.decoder is lay.whole:  # a bare decoder: all of it language
        return {}
    comps = param_components(lay, cfg)
    return {n: comps[id(p)][1] for n, p in model.named_parameters()
            if comps.get(id(p), (None, "language"))[1] != "language"}


def param_components(lay: Layout, cfg: Any) -> dict[int, tuple[nn.Parameter, str]]:
    """``id(parameter)`` -> (the parameter, its component) for every distinct parameter of the
    whole model, by the rules of the module docstring (`component_params` sums them)."""
    whole = lay.whole
    node = _get(cfg, lay.node_path)
    roots: dict[str, str] = {}  # module path -> component
    wanted = {id(c): _component_name(lay.node_path + p, lay.text_path)
              for p, c in sub_configs(node) if p}
    for path, c in config_modules(whole).items():
        comp = wanted.get(c)
        if comp is None or not path:
            continue
        if any(inside(path, r) for r in roots):
            continue
        roots[path] = comp
    roots[lay.decoder_path] = "language"
    head_ids = {id(lay.lm_head.weight)} if lay.lm_head is not None else set()
    # projector heads inside a tower: children besides its layer stack that take the tower's
    # features (an input at least the tower width) out of its width
    projector: set[str] = set()
    for path, comp in roots.items():
        if comp != "language":
            projector |= {f"{path}.{n}" for n in _tower_heads(whole.get_submodule(path))}
    towers = {w for path, comp in roots.items() if comp != "language"
              and (w := _tower_width(whole.get_submodule(path)))}
    language = _embedding_width(lay.decoder)
    out: dict[int, tuple[nn.Parameter, str]] = {}
    modules = dict(whole.named_modules())
    for name, p in whole.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if id(p) in head_ids:
            comp = "language"
        elif any(inside(owner, q) for q in projector):
            comp = "projector"
        else:
            root = max((r for r in roots if inside(owner, r)),
                       key=len, default=None)
            if root is not None:
                comp = roots[root]
            else:
                top = owner.split(".")
                # the outermost module outside every component that holds this parameter
                comp = "other"
                for i in range(1, len(top) + 1):
                    mod = modules.get(".".join(top[:i]))
                    if mod is not None and not any(r.startswith(".".join(top[:i]) + ".") or
                                                   r == ".".join(top[:i]) for r in roots):
                        comp = "projector" if _projects(mod, towers, language) else "other"
                        break
        out[id(p)] = (p, comp)
    return out


def account(model: nn.Module, config: Any):
    """`count_parameters` of ``model``. For a language model taken from a multimodal one (on
    meta: it holds ``whole_model``): the language model is counted as any causal LM (paths as in
    it, its experts routed), the other parts (towers, projector) are added to the totals as dense
    parameters, by path and category, and ``by_part`` splits the whole by component."""
    from onboarding.load.accounting import count_parameters, path_pattern

    counts = count_parameters(model, config)
    whole = getattr(model, "whole_layout", None)  # a vision tower taken out (load.vision)
    if isinstance(whole, Layout):
        counts.by_part = component_params(whole, config)
        counts.parts_note = "; ".join([f"the vision tower {model.whole_path}: the totals are its "
                                       "own, by_part is the whole model's", *whole.notes])
        return counts
    lay = getattr(model, "whole_model", None)
    if callable(lay):  # a causal LM of a config with towers (`whole_of_causal_lm`), found late
        lay = lay()
    if not isinstance(lay, Layout):
        return counts
    counts.parts_note = "; ".join(lay.notes)
    if lay.notes:  # parts the totals leave out: said on the terminal too, not only in model.json
        warnings.warn(f"parameter totals: the whole model was {counts.parts_note}",
                      ComponentsWarning, stacklevel=2)
    if lay.lm_head is None and lay.decoder is lay.whole:  # a bare decoder: all of it is language
        counts.by_part = {"language": counts.total}
        return counts
    parts = component_params(lay, config)
    if lay.whole is model:  # the causal LM holds the whole: the totals count it already
        counts.by_part = parts
        return counts
    # the language model's parameters: its own (on meta it shares the whole's modules), and the
    # whole's decoder and lm_head where the whole was built beside it
    mine = {id(p) for m in (model, lay.decoder, lay.lm_head) if m is not None
            for p in m.parameters()}
    extra = 0
    for name, p in lay.whole.named_parameters():
        if id(p) in mine:
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        pat = path_pattern(owner)
        counts.by_component[pat] = counts.by_component.get(pat, 0) + p.numel()
        extra += p.numel()
    for part, n in parts.items():
        if part != "language":
            counts.by_category[part] = n
    counts.total += extra
    counts.active += extra
    counts.active_without_embeddings += extra
    counts.by_part = parts
    return counts


class ComponentsWarning(UserWarning):
    """A multimodal model whose root did not build: its totals and ``by_part`` leave the parts
    that were not built out (``parts_note`` in ``model.json`` says the same)."""


# -- proxy ------------------------------------------------------------------------------------

TOWER_WIDTHS = ("hidden_size", "d_model", "embed_dim", "hidden_dim")
TOWER_HEADS = ("num_heads", "num_attention_heads", "encoder_attention_heads", "num_key_value_heads")
TOWER_FFN = ("intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim")
TOWER_LAYERS = ("num_hidden_layers", "depth", "num_layers", "encoder_layers")


def _set_int(c: Any, name: str, v: int) -> None:
    prop = getattr(type(c), name, None)
    if not (isinstance(prop, property) and prop.fset is None):
        setattr(c, name, int(v))


def _follow(c: Any, before: int | None, after: int | None, skip: set[str]) -> None:
    """Int fields of ``c`` equal to ``before`` (a width another part had) become ``after``."""
    if not before or not after or before == after:
        return
    for k, v in list(vars(c).items()):
        if k not in skip and not k.startswith("_") and v == before and not isinstance(v, bool):
            _set_int(c, k, after)
            skip.add(k)


def shrink_towers(full: Any, proxy: Any, s: Any) -> list[str]:
    """Shrink every sub-config of ``proxy`` besides the text one (vision, audio... towers): widths
    to the size's hidden, heads, FFN and layer counts down, layer-index lists rescaled; fields
    anywhere that equal the full text width or vocabulary follow the shrunk text config (a
    tower's output width is the language model's). Returns what was shrunk, for the proxy note."""
    try:
        text_path = text_config_path(full)
    except InputError:
        return []
    t_full, t_proxy = _get(full, text_path), _get(proxy, text_path)
    shrunk = []
    for path, c in sub_configs(proxy):
        if path == text_path[: len(path)]:  # the text config and the configs above it
            if path != text_path:
                done: set[str] = set()
                _follow(c, _int(t_full, "hidden_size"), _int(t_proxy, "hidden_size"), done)
                _follow(c, _int(t_full, "vocab_size"), _int(t_proxy, "vocab_size"), done)
            continue
        if len(path) > len(text_path) and path[: len(text_path)] == text_path:
            continue  # inside the text config: shrink_config's rules own it
        done = set()
        _follow(c, _int(t_full, "hidden_size"), _int(t_proxy, "hidden_size"), done)
        width = next((n for n in TOWER_WIDTHS if n not in done and _int(c, n)), None)
        old_width = _int(c, width) if width else None
        for n in TOWER_WIDTHS:
            if n not in done and _int(c, n):
                _set_int(c, n, min(_int(c, n), s.hidden))
        new_width = _int(c, width) if width else None
        # output widths (the projection into the language model): width-named fields at least
        # the tower's width go to the text width
        for k, v in list(vars(c).items()):
            if k not in done and old_width and isinstance(v, int) and not isinstance(v, bool) \
                    and v >= old_width and k not in TOWER_WIDTHS \
                    and re.search(r"(hidden_size|_dim|d_model)$", k):
                _set_int(c, k, _int(t_proxy, "hidden_size") or new_width)
                done.add(k)
        _cap_heads(c, s.heads, new_width)
        if _int(c, "head_dim"):
            _set_int(c, "head_dim", min(c.head_dim, s.head_dim_cap))
        for n in TOWER_FFN:
            if n not in done and _int(c, n):
                _set_int(c, n, min(_int(c, n), s.ffn))
        for n in TOWER_LAYERS:
            old = _int(c, n)
            if not old or n in done:
                continue
            index_lists = [k for k, v in vars(c).items()
                           if isinstance(v, list) and v and all(
                               isinstance(x, int) and not isinstance(x, bool) and 0 <= x < old
                               for x in v) and len(set(v)) == len(v) and len(v) < old]
            new = min(old, max(2, 2 * max((len(getattr(c, k)) for k in index_lists), default=0)))
            _set_int(c, n, new)
            for k in index_lists:
                setattr(c, k, sorted({x * new // old for x in getattr(c, k)}))
        # the tower's own width, where its parents name it (a projector's input width)
        for p in range(len(path)):
            _follow(_get(proxy, path[:p]), old_width, new_width, set())
        shrunk.append(".".join(path))
    return shrunk


def _cap_heads(c: Any, cap: int, width: int | None) -> None:
    """Cap ``c``'s head counts (`TOWER_HEADS`) at ``cap``, each lowered further until it divides
    ``width`` (when known)."""
    for n in TOWER_HEADS:
        if _int(c, n):
            h = min(_int(c, n), cap)
            while width and width % h:
                h -= 1
            _set_int(c, n, h)


def shrink_nested(text: Any, s: Any) -> list[str]:
    """Shrink the sub-configs nested in the text config ``text`` (BLT's local encoder, decoder,
    global transformer and entropy patcher), which the text rules, reading the text config's own
    fields, never reach. Only sub-configs with a width field (`TOWER_WIDTHS`) are touched, and
    only when some width is above the size's hidden: every int field named ``*size*`` / ``*dim*``
    (not a head dim or an FFN width) equal to one of those widths is scaled by one common factor,
    the largest width becoming the size's hidden, so widths tied across them stay tied (BLT's
    encoder_config.hidden_size_global is the global transformer's width; encoder width x
    cross_attn_k is the global width); heads are capped (dividing the width); a head dim whose
    heads filled the width still does, another is capped; FFN widths capped; layer counts capped
    at 2. On the text config itself, a ``*_vocab`` int field above the size's vocabulary (BLT's
    hash-embedding table, encoder_hash_byte_group_vocab) is capped to it. Returns the shrunk
    sub-configs' dotted paths."""
    subs = [(p, c) for p, c in sub_configs(text) if p]
    widths = {v for _, c in subs for n in TOWER_WIDTHS if (v := _int(c, n))}
    if not widths or max(widths) <= s.hidden:
        return []
    top = max(widths)
    shrunk = []
    for path, c in subs:
        full = {k: v for k, v in vars(c).items() if isinstance(v, int) and not isinstance(v, bool)}
        wname = next((n for n in TOWER_WIDTHS if _int(c, n)), None)
        heads = _int(c, "num_attention_heads")
        for k, v in full.items():
            if v in widths and re.search(r"(size|dim)", k) and not k.endswith("head_dim") \
                    and k not in TOWER_FFN:
                _set_int(c, k, max(1, v * s.hidden // top))
        width = _int(c, wname) if wname else None
        _cap_heads(c, s.heads, width)
        if _int(c, "head_dim"):
            filled = heads and wname and full["head_dim"] * heads == full[wname]
            _set_int(c, "head_dim", width // c.num_attention_heads if filled
                     else min(c.head_dim, s.head_dim_cap))
        for n in TOWER_FFN:
            if _int(c, n):
                _set_int(c, n, min(_int(c, n), s.ffn))
        for n in TOWER_LAYERS:
            if _int(c, n):
                _set_int(c, n, min(_int(c, n), 2))
        if {k: v for k, v in vars(c).items() if k in full} != full:
            shrunk.append(".".join(path))
    for k, v in list(vars(text).items()):
        if isinstance(v, int) and not isinstance(v, bool) and k.endswith("_vocab") and v > s.vocab:
            _set_int(text, k, s.vocab)
    return shrunk


def run_probe(model: nn.Module, cfg: Any) -> None:
    """Run ``model`` (built from ``cfg``) on four tokens (a vision tower: its synthetic pixels);
    raises what it raises."""
    if hasattr(model, "example_inputs"):  # a vision tower: its synthetic pixels
        with torch.no_grad():
            model(*model.example_inputs(1, 16))
        return
    vocab = _int(_get(cfg, text_config_path(cfg)), "vocab_size") or 2
    with torch.no_grad():
        model(torch.arange(4).remainder(vocab)[None], use_cache=False)


def runs(loaded: Any, cfg: Any) -> bool:
    """Whether ``loaded`` builds from ``cfg`` on the CPU and runs four tokens (a vision tower:
    its synthetic pixels)."""
    try:
        run_probe(loaded.build(cfg, device="cpu", seed=0).eval(), cfg)
        return True
    except Exception:  # noqa: BLE001 - the model's own code, whatever it raises
        return False
