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
[B, T] (`check_logits`, on a meta build there).

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


def vocab_resize(loaded, facts: LMFacts) -> str:
    """How ``loaded``'s (a `LoadedModel`) vocabulary grows, for the byte tokenizer's refusal:
    the config's ``--set vocab_size=...``; for a config-less factory, where its count came from
    and the arguments ``--set`` can give it."""
    args = loaded.factory_arguments()
    if facts.source == CONFIG_VOCAB or args is None:
        return VOCAB_RESIZE
    return (f"its {facts.vocab_size} are {facts.source}: --set the argument of {loaded.name} "
            f"that sizes it; it takes {', '.join(args) or 'none'}")
