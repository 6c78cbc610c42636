"""Intercept machinery for `sparse_attention.topk` blocks (indexer + top-k + attention): the
masked attention after the block's top-k, bound to a gathered kernel by the family's binding.

In transformers (DeepSeek-V3.2's DSA and others built the same way) the block scores every key
with its indexer, takes ``topk`` over the key positions, scatters the indices into a -inf mask
and runs *dense* attention with it. Nothing of that is a module we could swap by class, so the
block's own forward runs under a `TorchFunctionMode` that, by structure only:

  - records the last ``topk`` over the last dim of a float ``[B, T, S]`` tensor (the selection);
  - replaces the ``scaled_dot_product_attention`` call whose query rows and key positions fit
    those indices by the gathered attention over the selected positions. Selected positions that
    the block's mask forbids (future keys picked to fill K on early rows, padding) are dropped by
    reading the mask at the selected positions only (O(T K), never O(T S)).

The bindings (how the kernel is called on q/k/v and the selected positions) are the family's;
which fits is left to calibration on the first call, against the original attention call. The
block is given back, and the record says why, when none fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from onboarding.formatting import clip

_SDPA = (F.scaled_dot_product_attention,)
_TOPK = (torch.topk, torch.Tensor.topk)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def _attend_bool(mask: torch.Tensor, B: int, T: int, S: int) -> torch.Tensor:
    """[B, T, S] bool, True = attend, from a mask as SDPA takes it (bool: True = attend; float:
    additive, 0 or a large negative) broadcastable to [B, 1, T, S]."""
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise ValueError(f"per-head attention mask {tuple(mask.shape)} is not supported")
        mask = mask[:, 0]
    mask = mask.expand(B, T, S)
    # additive masks: a finite bias other than 0 is not caught here (calibration catches it)
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def allowed_indices(idx: torch.Tensor, masks: list[torch.Tensor], is_causal: bool, S: int
                    ) -> torch.Tensor:
    """int32 [B, T, K]: the selected positions every mask allows (and, with ``is_causal``, at or
    before the diagonal), others -1. Masks are read only at the selected positions (O(T K))."""
    B, T, _ = idx.shape
    idx = idx.long()
    ok = (idx >= 0) & (idx < S)
    safe = torch.where(ok, idx, 0)
    if is_causal:
        ok &= safe <= torch.arange(T, device=idx.device).view(1, T, 1) + (S - T)
    for mask in masks:
        m = mask[:, 0] if mask.dim() == 4 and mask.shape[1] == 1 else mask
        if m.dim() != 3:
            raise ValueError(f"per-head attention mask {tuple(mask.shape)} is not supported")
        got = m.expand(B, T, S).gather(-1, safe)
        if m.dtype == torch.bool:
            ok &= got
        else:
            keep = got > torch.finfo(m.dtype).min / 2
            if bool((got[keep & ok] != 0).any()):
                raise ValueError("the attention mask carries an additive bias, not only -inf/0")
            ok &= keep
    return torch.where(ok, idx, -1).to(torch.int32)


def mask_indices(masks: list[torch.Tensor], is_causal: bool, B: int, T: int, S: int
                 ) -> torch.Tensor:
    """int32 [B, T, K] (K = the most keys any row keeps; -1 padded): every key the masks keep.

    For blocks whose mask is not exactly the top-k set (a diagonal always kept, say). Reads the
    whole [B, T, S] mask once (O(T S), which the model has already materialised)."""
    keep = torch.ones(B, T, S, dtype=torch.bool, device=masks[0].device if masks else None)
    for mask in masks:
        keep &= _attend_bool(mask, B, T, S)
    if is_causal:
        keep &= torch.ones(T, S, dtype=torch.bool, device=keep.device).tril(S - T)
    counts = keep.sum(-1).flatten()
    b, t, pos = keep.nonzero(as_tuple=True)
    row = b * T + t
    slot = torch.arange(row.numel(), device=keep.device) - (counts.cumsum(0) - counts)[row]
    idx = torch.full((B, T, max(int(counts.max()), 1) if counts.numel() else 1), -1,
                     dtype=torch.int32, device=keep.device)
    idx[b, t, slot] = pos.to(torch.int32)
    return idx


def selects_keys(dims: int, dim: Any, floating: bool, largest: Any) -> bool:
    """Whether a top-k is the selection the intercept reads (`SparseIntercept`): the largest
    entries over the last dim of a float [B, T, S] tensor (each query row's key positions). The
    family's `refusal` asks the same of the top-ks the op graph recorded (attrs ``topk_inputs``)."""
    return bool(floating) and dims == 3 and dim in (-1, 2) and bool(largest)


def selection_refusal(topks: list[dict[str, Any]]) -> str | None:
    """Why the intercept would find no selection among a block's recorded top-ks over key
    positions (each {"shape", "dtype", "dim", "largest"}, `classify._topk_input`), or None."""
    if any(selects_keys(len(t.get("shape") or []), t.get("dim", -1),
                        str(t.get("dtype") or "").startswith(("float", "bfloat")), t.get("largest", True))
           for t in topks):
        return None
    shapes = ", ".join(f"{t.get('shape')} over dim {t.get('dim', -1)}" for t in topks)
    return (f"no top-k over the key positions of a float [B, T, S] tensor (the block's: {shapes}), "
            "so no selection for the gathered kernel to read")


_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_PASS = {"float", "to", "type_as", "contiguous", "dropout", "clone"}
_SCALE = {"mul", "__mul__", "__rmul__", "mul_", "div", "__truediv__", "div_"}
_ADD = {"add", "__add__", "__radd__", "add_"}
_SUB = {"sub", "__sub__", "sub_"}
_ROW_READS = {"max", "amax"}  # read the scores (a row max to shift by) without continuing them


def _sink_kw(sinks: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A binding's ``attend`` takes ``sinks`` (keyword) only where the block has a sink column:
    one written for sink-free attention, ``attend(q, k, v, idx, scale, linears)``, keeps working."""
    return {} if sinks is None else {"sinks": sinks}


def _sink_logits(col: torch.Tensor) -> torch.Tensor | None:
    """[H] from a sink column [B, H, T, 1] that holds one logit per head (the same on every batch
    and query row), or None. Kept in the autograd graph (a view of the column: the sink's
    parameter, expanded, gets its gradient through it)."""
    if col.dim() != 4 or col.shape[-1] != 1 or not col.is_floating_point():
        return None
    head = col[:1, :, :1]
    with torch.no_grad():
        if not bool((col == head).all()):
            return None
    return col[0, :, 0, 0]


def _drops_column(index: Any, width: int) -> int | None:
    """The column a ``t[..., a:b]`` index drops from a last dim of ``width`` (0 or width - 1),
    or None when it is not one slice of the last dim that keeps all but its first or last."""
    if not isinstance(index, tuple):
        index = (index,)
    *lead, last = index
    if not isinstance(last, slice) or any(i is not Ellipsis and i != slice(None) for i in lead):
        return None
    if Ellipsis not in lead:
        return None  # a slice of the first dims
    start, stop, step = last.indices(width)
    if step != 1:
        return None
    return {(0, width - 1): width - 1, (1, width): 0}.get((start, stop))


class SparseIntercept(TorchFunctionMode):
    """One forward of a sparse block: records the top-k, replaces the masked attention.

    The attention is found by structure, after a top-k over key positions, in either form:
    a ``scaled_dot_product_attention`` call, or the eager chain ``q @ k^T`` -> scalar scale /
    additive mask / masked_fill -> softmax (-> casts, dropout) -> ``@ v`` whose final product is
    replaced (the model's code still computes the dense scores in that form: the speed comes
    with SDPA; what eager gains is the kernel's numerics and its backward).

    ``bindings``: name -> (attend, latent width, index source "topk" | "mask"). Unless
    ``calibrated`` (then it holds the one chosen binding), the first attention calibrates: the
    original result and every binding on the same arguments (no grad); the first within
    tolerance is chosen and rerun with autograd for the call's result. Calibrating at the call,
    not by running the block twice, keeps the block's children at one call per forward.
    """

    def __init__(self, bindings: dict[str, tuple[Callable, int | None, str]], calibrated: bool = False,
                 prefer_dense: Callable[..., str | bool | None] | None = None):
        super().__init__()
        self.bindings = bindings
        # prefer_dense(q, k, topk, backward): truthy -> the call runs the block's own attention
        # instead (the family's choice by shape: below its measured crossover the dense one is
        # faster); a str is the reason (the crossover's T), recorded
        self.prefer_dense = prefer_dense
        self.dense = 0  # calls left to the block's own attention by prefer_dense
        self.dense_why = ""  # the last such call's reason
        self.latents = {lat for _, lat, _ in bindings.values() if lat}
        self.chosen: str | None = next(iter(bindings)) if calibrated else None
        self.indices: torch.Tensor | None = None
        self.linears: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        self.chain: dict[str, Any] | None = None  # the eager attention being followed
        self.hits = 0
        self.failures: list[str] = []
        self.declined: list[str] = []  # why a chain over the top-k positions was not followed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TOPK:
            return self._topk(func, args, kwargs)
        if func is F.linear and self.latents:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(x, torch.Tensor) and x.shape[-1] in self.latents:
                self.linears.append((x, w, args[2] if len(args) > 2 else kwargs.get("bias")))
        if self.indices is None:
            return func(*args, **kwargs)
        if func in _SDPA:
            a = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
            q, k, v = a["query"], a["key"], a["value"]
            if q.dim() == 4 and self._fits(q, k) and not a.get("dropout_p"):
                masks = [a["attn_mask"]] if a.get("attn_mask") is not None else []
                out = self._attend(q, k, v, masks, bool(a.get("is_causal")),
                                   a.get("scale") or q.shape[-1] ** -0.5, lambda: func(*args, **kwargs))
                if out is not None:
                    return out
            return func(*args, **kwargs)
        if func in _MATMUL and len(args) == 2:
            return self._matmul(func, args, kwargs)
        if self.chain is not None and func is torch.cat:
            return self._cat(func, args, kwargs)
        if self.chain is not None and any(x is self.chain["t"] for x in args[:2]):
            out = func(*args, **kwargs)
            self._follow(func, args, kwargs, out)
            return out
        return func(*args, **kwargs)

    def _fits(self, q, k) -> bool:
        return self.indices.shape[:2] == (q.shape[0], q.shape[-2]) and k.dim() == 4

    def _matmul(self, func, args, kwargs):
        a, b = args
        c = self.chain
        if c is not None and c["soft"] and a is c["t"] and b.dim() == 4 and b.shape[-2] == a.shape[-1] \
                and c["sink"] is None:
            self.chain = None
            out = self._attend(c["q"], c["k"], b, c["masks"], False, c["scale"], lambda: func(*args, **kwargs),
                               c["sinks"])
            return func(*args, **kwargs) if out is None else out.to(b.dtype)
        out = func(*args, **kwargs)
        if a.dim() == 4 and b.dim() == 4 and self._fits(a, b) and a.shape[-1] == b.shape[-2]:
            # sink: the column appended to the scores, while it is part of them (its position,
            # 0 or -1); sinks: its per-head logits [H]; shifted: a row constant was subtracted
            self.chain = {"t": out, "q": a, "k": b.transpose(-1, -2), "scale": 1.0, "masks": [],
                          "soft": False, "sink": None, "sinks": None, "shifted": False}
        return out

    def _cat(self, func, args, kwargs):
        """A sink column appended to the scores: ``cat([scores, col], -1)`` (or col first), col
        [B, H, T, 1] one logit per head. The softmax then reads it as one more key and the column
        is dropped before ``@ v``: the kernel's sink, a per-head logit in the denominator only."""
        c = self.chain
        out = func(*args, **kwargs)
        parts = args[0] if args else kwargs.get("tensors")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not isinstance(parts, (list, tuple)) or not any(p is c["t"] for p in parts):
            return out
        self.chain = None
        t = c["t"]
        if (len(parts) != 2 or dim not in (-1, t.dim() - 1) or c["soft"] or c["sinks"] is not None
                or c["shifted"]):
            return out  # not one column onto the unnormalised scores (a shift before it moves the sink)
        pos = 0 if parts[1] is t else -1
        col = parts[0] if pos == 0 else parts[1]
        if not isinstance(col, torch.Tensor) or col.shape[:-1] != t.shape[:-1] or col.shape[-1] != 1:
            return out
        sinks = _sink_logits(col)
        if sinks is None:
            self.declined.append("the column appended to the scores is not one logit per head (it varies "
                                 "over batch or query rows); the kernel's sink is a per-head logit")
            return out
        c.update(t=out, sink=pos, sinks=sinks)
        self.chain = c
        return out

    def _follow(self, func, args, kwargs, out) -> None:
        c, name = self.chain, getattr(func, "__name__", "")
        other = args[1] if len(args) > 1 and args[0] is c["t"] else args[0]
        if (name in _ROW_READS or not isinstance(out, torch.Tensor)) and args[0] is c["t"]:
            # reads that leave the scores as they are: the row max a numerically stable softmax
            # subtracts, an attribute (``.dtype`` for softmax's dtype)
            return
        if name == "__getitem__" and c["sink"] is not None and c["soft"] and args[0] is c["t"] \
                and isinstance(out, torch.Tensor) and out.shape[:-1] == c["t"].shape[:-1]:
            width = c["t"].shape[-1]
            if _drops_column(args[1], width) == (width - 1 if c["sink"] == -1 else 0):
                c.update(t=out, sink=None)  # the sink's probability dropped: p over the keys
            else:
                self.chain = None
            return
        if not isinstance(out, torch.Tensor) or out.shape[-2:] != c["t"].shape[-2:]:
            self.chain = None
            return
        if name in _SCALE and not c["soft"] and c["sinks"] is None and (
                not isinstance(other, torch.Tensor) or other.numel() == 1):
            f = float(other)
            c["scale"] = c["scale"] * f if name.startswith(("mul", "__mul", "__rmul")) else c["scale"] / f
        elif name in _ADD and not c["soft"] and isinstance(other, torch.Tensor):
            if c["sinks"] is not None:
                self.chain = None  # a mask over the sink column too: not the kernel's sink
                return
            c["masks"].append(other)
        elif (name in _SUB and not c["soft"] and args[0] is c["t"] and isinstance(other, torch.Tensor)
              and other.dim() == out.dim() and other.shape[-1] == 1):
            c["shifted"] = True  # a row constant (the row max): softmax is unchanged by it
        elif name in ("masked_fill", "masked_fill_") and not c["soft"] and c["sinks"] is None:
            fill = args[2] if len(args) > 2 else kwargs.get("value")
            if float(fill) > -1e30:
                self.chain = None
                return
            c["masks"].append(~args[1])
        elif name in ("softmax", "_softmax") and not c["soft"]:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim not in (-1, out.dim() - 1):
                self.chain = None
                return
            c["soft"] = True
        elif name not in _PASS:
            self.chain = None
            return
        c["t"] = out

    def _attend(self, q, k, v, masks, is_causal, scale, original, sinks=None) -> torch.Tensor | None:
        S = k.shape[-2]
        cache: dict[str, torch.Tensor] = {}

        def indices(source: str) -> torch.Tensor:
            if source not in cache:
                cache[source] = allowed_indices(self.indices, masks, is_causal, S) if source == "topk" \
                    else mask_indices(masks, is_causal, q.shape[0], q.shape[-2], S)
            return cache[source]

        if self.chosen is None:
            self._calibrate(q, k, v, scale, indices, original, sinks)
        if self.chosen is None:
            return None
        backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
        why = self.prefer_dense(q, k, self.indices.shape[-1], backward) if self.prefer_dense else None
        if why:
            self.dense += 1
            self.dense_why = why if isinstance(why, str) else "the shape policy chose dense"
            return None  # the caller runs the original attention call
        attend, _, source = self.bindings[self.chosen]
        self.hits += 1
        return attend(q, k, v, indices(source), scale, self.linears, **_sink_kw(sinks))

    def _calibrate(self, q, k, v, scale, indices, original, sinks=None) -> None:
        from onboarding.patching.core import _matches

        with torch.no_grad():
            ref = original()
            for name, (attend, _, source) in self.bindings.items():
                try:
                    out = attend(q, k, v, indices(source), scale, self.linears, **_sink_kw(sinks))
                except (TypeError, ValueError, RuntimeError) as exc:
                    self.failures.append(clip(f"{name}: {type(exc).__name__}: {exc}", 200))
                    continue
                if _matches(out.to(ref.dtype), ref):
                    self.chosen = name
                    return
                self.failures.append(f"{name}: output differs from the original attention")

    def _topk(self, func, args, kwargs):
        x = args[0]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        out = func(*args, **kwargs)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        if isinstance(x, torch.Tensor) and selects_keys(x.dim(), dim, x.is_floating_point(), largest):
            self.indices = out[1]
        return out


class SparseBlock:
    """Replaces a sparse block's ``forward``: the original, run under the intercept. The first
    call calibrates (see `SparseIntercept`); no binding matching -> the block is given back.

    The record counts the attention calls each path served (``record.calls``: "kernel", and
    "dense" for those the shape policy left to the block's own attention, with its reason in
    ``record.detail``). Its status is ``active`` once the kernel served a call, and
    ``dense_by_shape`` while every call went dense: the kernel calibrated (it matched the
    original once, under no_grad) but never served the block, so the block is not counted as
    kernel-patched and its alignment judges the block's own attention."""

    def __init__(self, module: nn.Module, record: Any, bindings: dict,
                 prefer_dense: Callable[..., str | bool | None] | None = None):
        self.module, self.record, self.bindings = module, record, bindings
        self.original = module.forward
        self.prefer_dense = prefer_dense
        self.calibrated = False
        self.kernel_calls = 0  # attention calls the kernel served
        self.dense_calls = 0  # attention calls the shape policy left to the block's own attention
        self.dense_why = ""

    def __call__(self, *args, **kwargs):
        mode = SparseIntercept(self.bindings, self.calibrated, self.prefer_dense)
        with mode:
            out = self.original(*args, **kwargs)
        self.kernel_calls += mode.hits
        self.dense_calls += mode.dense
        self.dense_why = mode.dense_why or self.dense_why
        if not self.calibrated:
            if mode.chosen is not None and (mode.hits or mode.dense):
                self.calibrated = True
                self.bindings = {mode.chosen: self.bindings[mode.chosen]}
                self.record.binding, self.record.detail = mode.chosen, ""
            else:
                self.record.status = "rejected"
                self.record.detail = clip("; ".join(mode.failures), 400) or (
                    "no attention (SDPA, or q @ k^T -> softmax -> @ v) over the top-k positions"
                    + (f" ({'; '.join(mode.declined)})" if mode.declined else ""))
                self.module.forward = self.original  # give the block back, unpatched
                return out
        if self.record.status != "restored":
            self._record()
        return out

    def _record(self) -> None:
        r, k, d = self.record, self.kernel_calls, self.dense_calls
        r.calls = {"kernel": k, "dense": d}
        r.status = "active" if k else "dense_by_shape"
        if not d:
            r.detail = ""
        elif not k:
            r.detail = (f"all {d} attention call{'s' if d != 1 else ''} ran the block's own dense "
                        f"attention, the kernel none: {self.dense_why}")
        else:
            r.detail = (f"the kernel served {k} of {k + d} attention calls, {d} ran the block's own "
                        f"dense attention: {self.dense_why}")


def patch_sparse_block(module: nn.Module, bindings: dict[str, tuple[Callable, int | None, str]],
                       record: Any, prefer_dense: Callable[..., str | bool | None] | None = None
                       ) -> Callable[[], None]:
    """Run ``module``'s forward under the intercept with ``bindings`` (see `SparseIntercept`);
    ``prefer_dense(q, k, topk, backward)`` sends a calibrated call to the block's own attention
    instead when truthy (the family's choice by shape; a str says why). Returns the undo."""
    from onboarding.patching.core import swap_forward

    return swap_forward(module, SparseBlock(module, record, bindings, prefer_dense))
