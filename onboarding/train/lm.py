"""What training reads of the model it trains, in one place: `lm_facts` (the vocabulary its
token ids are drawn from, its context length, its router loss coefficient, the text config the
FLOPs count reads) and `lm_logits` (how it is called for next-token logits).

A transformers model has the facts in its (text) config. A model given as ``file.py:Name`` or
``module:Name`` may be a plain ``nn.Module`` class or factory with no config (`load_model`'s
MODEL forms, which ``onboard parse`` and ``map`` take): there the facts come from its structure,
the token embedding (`accounting.token_embedding`: the table the output head projects back to)
giving the vocabulary (its rows). What neither gives, no config ``vocab_size`` and no
``nn.Embedding`` (no vocabulary to draw ids from), is bad input, said by `launch.check` before
any directory or worker exists; so is a forward that does not return logits [B, T, V] for ids
[B, T] (`check_logits`, on a meta build there). A config-less model has no
``max_position_embeddings``: where a fixed-size table bounds the positions it reads, the limit
comes from its structure (`position_limit`, on meta), so a longer ``seq_len`` is refused there
too instead of failing inside the workers with an index error.

The call follows the forward's signature, not the model's origin: the ids go as ``input_ids=``
where it names that parameter (transformers' models), else first; ``use_cache=False`` where it
takes ``use_cache`` or ``**kwargs``. The logits are the output itself (a tensor), its
``.logits``, or the first item of a tuple.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onboarding.errors import InputError

CONFIG_VOCAB = "the config's vocab_size"  # `LMFacts.source` when the config gives it
VOCAB_RESIZE = "--set vocab_size=..."  # how a config's vocabulary grows (`vocab_resize`)


@dataclass(frozen=True)
class LMFacts:
    """What training reads of a model's config, from the config or by structure."""

    vocab_size: int  # the ids the model embeds (the tokenizer must stay below it)
    source: str  # where vocab_size came from, for messages
    max_positions: int | None  # the config's max_position_embeddings; None: no limit known
    router_aux_loss_coef: float  # the config's; 0 without one
    text_config: Any | None  # the text config (the FLOPs count's attention widths); None: none


def model_text_config(model: nn.Module) -> Any | None:
    """``model``'s text config (its ``config``'s, for a multimodal one); None without a config."""
    from onboarding.load.proxy import text_config

    config = getattr(model, "config", None)
    return text_config(config) if config is not None else None


def _positive_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def lm_facts(model: nn.Module) -> LMFacts:
    """``model``'s `LMFacts` (any device, meta included); `InputError` when no vocabulary is found."""
    from onboarding.load.accounting import token_embedding

    tc = model_text_config(model)
    vocab, source = _positive_int(getattr(tc, "vocab_size", None)), CONFIG_VOCAB
    if vocab is None:
        emb = token_embedding(model)
        if emb is None:
            raise InputError(
                f"{type(model).__name__}: no vocabulary to train on: the model has no config "
                "with vocab_size and no nn.Embedding of token ids. Training feeds token ids "
                "[B, T] and reads next-token logits [B, T, V]: give the model a token embedding "
                "(nn.Embedding) or a transformers config with vocab_size")
        path = next(p for p, m in model.named_modules() if m is emb)
        vocab = emb.num_embeddings
        source = f"the rows of its token embedding `{path}` ({vocab} x {emb.embedding_dim})"
    coef = getattr(tc, "router_aux_loss_coef", None)
    return LMFacts(vocab_size=vocab, source=source,
                   max_positions=_positive_int(getattr(tc, "max_position_embeddings", None)),
                   router_aux_loss_coef=float(coef) if isinstance(coef, (int, float)) else 0.0,
                   text_config=tc)


def lm_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``model``'s logits for ``ids`` [B, T] (the call and the output forms: module docstring)."""
    try:
        params = inspect.signature(model.forward).parameters
        by_name = "input_ids" in params
        no_cache = "use_cache" in params or any(p.kind is p.VAR_KEYWORD
                                                for p in params.values())
    except (TypeError, ValueError):  # a forward inspect cannot read: transformers' call
        by_name = no_cache = True
    kwargs = {"use_cache": False} if no_cache else {}
    out = model(input_ids=ids, **kwargs) if by_name else model(ids, **kwargs)
    if isinstance(out, torch.Tensor):
        logits = out
    elif isinstance(getattr(out, "logits", None), torch.Tensor):
        logits = out.logits
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        logits = out[0]
    else:
        logits = None
    if logits is None or logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        got = f"a {type(out).__name__}" if logits is None else f"shape {list(logits.shape)}"
        raise InputError(f"{type(model).__name__}: training reads next-token logits [B, T, V] "
                         f"from the model's output (a tensor, .logits or a tuple's first item); "
                         f"for token ids {list(ids.shape)} it returned {got}")
    return logits


def check_logits(model: nn.Module, facts: LMFacts, seq: int = 8) -> None:
    """`InputError` when ``model`` (built on meta) does not return logits [B, T, V >= vocab] for
    ids [1, ``seq``]. A forward that does not run on meta (data-dependent shapes, ops with no
    meta kernel) is left to the workers: their error names it."""
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            logits = lm_logits(model, ids)
    except InputError:
        raise
    except Exception:  # the model's own code on meta: not evidence of a wrong interface
        return
    if logits.shape[-1] < facts.vocab_size:
        raise InputError(f"{type(model).__name__}: its logits have {logits.shape[-1]} entries "
                         f"per token, fewer than the {facts.vocab_size} token ids it embeds "
                         f"({facts.source}): training needs a logit for every id")


def baseline_label(model: nn.Module) -> str:
    """What ``--baseline`` runs on ``model``, for the report and the run log: the model's own
    forward as it stands (no onboard kernels, no compile) with PEFT's LoRA. That forward is
    transformers' code for a transformers model, the module's own eager code for any other
    (``file.py:Name``, a plain ``nn.Module``)."""
    from transformers import PreTrainedModel

    return "transformers + PEFT" if isinstance(model, PreTrainedModel) else "eager model + PEFT"


def vocab_resize(loaded, facts: LMFacts) -> str:
    """How ``loaded``'s (a `LoadedModel`) vocabulary grows, for the byte tokenizer's refusal:
    the config's ``--set vocab_size=...``; for a config-less factory, where its count came from
    and the arguments ``--set`` can give it."""
    args = loaded.factory_arguments()
    if facts.source == CONFIG_VOCAB or args is None:
        return VOCAB_RESIZE
    return (f"its {facts.vocab_size} are {facts.source}: --set the argument of {loaded.name} "
            f"that sizes it; it takes {', '.join(args) or 'none'}")


# ops that carry positions through unchanged (shape ops, casts, copies) or offset them by a
# scalar or an untracked tensor (a past length, OPT's offset of 2): their integer output is
# still a position where an input is
_POSITION_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "slice", "select",
    "clone", "_to_copy", "to", "alias", "repeat", "contiguous", "detach", "lift_fresh",
    "lift_fresh_copy", "t", "transpose", "permute", "flatten", "add", "sub"})


@dataclass(frozen=True)
class PositionLimit:
    """The longest sequence a model without a config takes, by structure: ``limit`` positions,
    ``what`` bounds them (for the refusal)."""

    limit: int
    what: str


def position_limit(model: nn.Module, seq: int) -> PositionLimit | None:
    """The positions a fixed-size table of ``model`` (built on meta) bounds, read in one forward
    of ids [1, ``seq``] on meta (no memory, and no index check: it runs past the table's end),
    or None where no table bounds them at ``seq``. Detected, among the model's parameters and
    buffers (the smallest bound wins):
      - a table looked up with positions (``nn.Embedding`` / ``F.embedding``, indexing or
        ``index_select``): the integer ``arange`` and what shape ops, casts or an offset by a
        scalar or another tensor make of it; its rows bound T;
      - a table sliced to the sequence (``table[:T]``, ``mask[:, :, :T, :T]``, ``narrow``)
        along a dim shorter than T: a learned position table, a causal-mask or rotary buffer
        sized to the maximum length (read at the Python call: past the end ATen runs no slice).
    Not detected: positions computed from the ids' values (a cumsum over a padding mask),
    relative positions (a difference of two ranges, bucketed or clamped: no absolute limit),
    tables built inside the forward, and any bound the meta forward does not reach (code that
    does not run on meta stops it: what it saw before counts)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    tables = {id(t): (n, t) for n, t in (*model.named_parameters(), *model.named_buffers())}
    positions: dict[int, torch.Tensor] = {}  # id -> the tensor itself (its id stays its own)
    found: list[PositionLimit] = []

    def table(x: Any) -> tuple[str, torch.Tensor] | None:
        return tables.get(id(x)) if isinstance(x, torch.Tensor) else None

    def is_position(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and id(x) in positions

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name == "embedding" and len(args) > 1 and is_position(args[1]) \
                    and (t := table(args[0])):
                found.append(PositionLimit(t[1].shape[0], f"position table `{t[0]}` "
                                           f"({t[1].shape[0]} rows, looked up with positions)"))
            elif name in ("index", "index_select") and (t := table(args[0])):
                dim = args[1] if name == "index_select" else 0
                idx = args[2] if name == "index_select" else (args[1][0] if args[1] else None)
                if isinstance(dim, int) and is_position(idx):
                    found.append(PositionLimit(t[1].shape[dim], f"position table `{t[0]}` "
                                               f"({t[1].shape[dim]} entries along dim {dim}, "
                                               "indexed with positions)"))
            if name == "arange" or (name in _POSITION_OPS and any(
                    is_position(a) for a in args if not isinstance(a, (list, tuple)))
                    and not (name == "sub" and all(is_position(a) for a in args[:2]))):
                for o in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(o, torch.Tensor) and not o.is_floating_point() \
                            and not o.is_complex():
                        positions[id(o)] = o
            return out

    def short(t: tuple[str, torch.Tensor], dim: int) -> None:
        n = t[1].shape[dim]
        found.append(PositionLimit(n, f"`{t[0]}` {list(t[1].shape)}, sliced to the sequence "
                                   f"along dim {dim} ({n} long)"))

    class Slices(TorchFunctionMode):
        """A table sliced to the sequence along a shorter dim: read where Python indexes it
        (``table[:, :T]``, ``narrow``), since past the end ATen sees no slice, only an alias."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            t = table(args[0]) if args else None
            if t is not None and func is torch.Tensor.__getitem__:
                dim = 0
                for item in args[1] if isinstance(args[1], tuple) else (args[1],):
                    if item is Ellipsis or dim >= t[1].ndim:
                        break  # dims after an ellipsis count from the end: not read
                    if item is None:
                        continue
                    if isinstance(item, slice) and (item.start is None or (
                            isinstance(item.start, int) and item.start == 0)) \
                            and isinstance(item.stop, int) and item.stop == seq \
                            and t[1].shape[dim] < seq:
                        short(t, dim)
                    dim += 1
            elif t is not None and func in (torch.narrow, torch.Tensor.narrow) \
                    and len(args) > 3 and args[2] == 0 and args[3] == seq \
                    and isinstance(args[1], int) and t[1].shape[args[1]] < seq:
                short(t, args[1])
            return func(*args, **(kwargs or {}))

    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), Slices(), Probe():
            lm_logits(model, ids)
    except Exception:  # past a table's end a later op may fail on meta: what was seen counts
        pass
    return min(found, key=lambda f: f.limit) if found else None
