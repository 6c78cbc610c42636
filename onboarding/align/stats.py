"""Error statistics for layer-wise alignment (`onboarding.align.core`): percentiles, relative RMS,
cosine, ULP distances, and the tensor-structure helpers both models' captures share.

Private module: import the public names (`ErrorStats`, `error_stats`, `within`)
from `onboarding.align.core`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from onboarding.testing.tolerance import Tolerance, compare_scaled

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


# ---- statistics ----------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class ErrorStats:
    """Error of a candidate tensor set against the reference (flattened and concatenated)."""

    numel: int
    p50: float
    p90: float
    p99: float
    p999: float
    max_abs: float
    rel_rms: float
    cosine: float
    ref_rms: float
    nonfinite: int = 0  # candidate elements that are NaN/Inf where the reference is finite
    ref_nonfinite: int = 0
    discrete_mismatch: float = 0.0  # fraction of integer/bool elements that differ (routing flips)
    exact_fraction: float | None = None  # bitwise mode, in the candidate dtype
    max_ulp: int | None = None
    ulp_histogram: dict[str, int] | None = None


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    """One float64 vector on the first tensor's device (the GPU's, when there is one: moving
    a 500M-parameter model's gradients to the CPU and sorting them there took minutes)."""
    if not ts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).to(ts[0].device, torch.float64) for t in ts])


# Percentiles of larger tensors are read from an evenly strided sample of about this many
# elements (p99.9 then still rests on ~4000 elements above it); max and norms stay exact.
PERCENTILE_SAMPLE = 1 << 22


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bits as int64 on a monotonic scale, so that |a - b| is the distance in ULPs."""
    itype = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype]
    i = t.contiguous().view(itype).to(torch.int64)
    bits = torch.finfo(t.dtype).bits
    # Sign-magnitude to two's complement: negative floats count down from -0 (== +0).
    return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)


def _ulp_stats(cand: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype
               ) -> tuple[float, int, dict[str, int]]:
    if not cand:
        return 1.0, 0, {"0": 0}
    a = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in cand])
    b = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in ref])
    d = (_ordered_bits(a) - _ordered_bits(b)).abs()
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.where(both_nan, torch.zeros_like(d), d)
    hist: dict[str, int] = {"0": int((d == 0).sum())}
    lo = 1
    while lo <= 2 ** 20:
        hi = lo * 2
        n = int(((d >= lo) & (d < hi)).sum())
        if n:
            hist[f"{lo}-{hi - 1}" if hi - 1 > lo else str(lo)] = n
        lo = hi
    if int((d >= lo).sum()):
        hist[f">={lo}"] = int((d >= lo).sum())
    return hist["0"] / d.numel(), int(d.max()), hist


def error_stats(cand: list[torch.Tensor], ref: list[torch.Tensor], *,
                bitwise_dtype: torch.dtype | None = None,
                cand_discrete: list[torch.Tensor] = (), ref_discrete: list[torch.Tensor] = ()
                ) -> ErrorStats:
    """Percentiles of |a - b|, ||a - b|| / ||b||, cosine; ULPs in `bitwise_dtype` if given."""
    a, b = _flat(cand), _flat(ref)
    if a.shape != b.shape:
        raise ValueError(f"candidate has {a.numel()} elements, reference {b.numel()}")
    fin_b = torch.isfinite(b)
    nonfinite = int((~torch.isfinite(a) & fin_b).sum())
    ok = fin_b & torch.isfinite(a)
    d = (a - b).abs()[ok]
    bb, aa = b[ok], a[ok]
    if d.numel():
        stride = -(-d.numel() // PERCENTILE_SAMPLE)
        s = (d[::stride] if stride > 1 else d).sort().values
        pct = [s[max(0, min(s.numel() - 1, int(round(q / 100 * (s.numel() - 1)))))].item()
               for q in PERCENTILES]
        nb, nd = bb.norm().item(), d.norm().item()
        rel = nd / nb if nb > 0 else (0.0 if nd == 0 else math.inf)
        na = aa.norm().item()
        cos = (aa @ bb).item() / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
        max_abs, ref_rms = d.max().item(), nb / math.sqrt(bb.numel())
    else:
        pct, rel, cos, max_abs, ref_rms = [0.0] * 4, 0.0, 1.0, 0.0, 0.0
    if nonfinite:
        rel, cos, max_abs = math.inf, math.nan, math.inf
    mism = 0.0
    if ref_discrete:
        x, y = _flat(list(cand_discrete)), _flat(list(ref_discrete))
        mism = float((x != y).double().mean()) if x.shape == y.shape and x.numel() else \
            (1.0 if x.shape != y.shape else 0.0)
    st = ErrorStats(numel=b.numel(), p50=pct[0], p90=pct[1], p99=pct[2], p999=pct[3],
                    max_abs=max_abs, rel_rms=rel, cosine=cos, ref_rms=ref_rms,
                    nonfinite=nonfinite, ref_nonfinite=int((~fin_b).sum()),
                    discrete_mismatch=mism)
    if bitwise_dtype is not None:
        st.exact_fraction, st.max_ulp, st.ulp_histogram = _ulp_stats(cand, ref, bitwise_dtype)
    return st


def within(cand: list[torch.Tensor], ref: list[torch.Tensor], tol: Tolerance, name: str
           ) -> tuple[bool, str]:
    """`compare` under `tol`, with atol in units of the reference's RMS.

    Layer activations and gradients have arbitrary scales (massive activations, gradient norms
    that grow with depth), so an absolute atol means nothing across blocks; scaling both tensors
    by the reference RMS keeps rel_rms and rtol unchanged and makes atol scale-free.
    """
    a, b = _flat(cand), _flat(ref)
    if a.numel() == 0 and b.numel() == 0:
        return True, f"{name}: empty"
    c = compare_scaled(a, b, tol, name)
    return c.passed, c.message


# ---- tensor structures ---------------------------------------------------------------------------

def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in an output or argument structure, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):  # also transformers' ModelOutput
        for o in obj.values():
            yield from _tensors(o)


def _float_slots(obj: Any) -> tuple[list[int], frozenset[int]]:
    """For a block's output: the top-level slot of each floating tensor of `_tensors(obj)` (the
    index in a tuple or list output; 0 for any other output), and the slots that hold None."""
    if not isinstance(obj, (list, tuple)):
        return [0 for t in _tensors(obj) if t.is_floating_point()], frozenset()
    return ([i for i, o in enumerate(obj) for t in _tensors(o) if t.is_floating_point()],
            frozenset(i for i, o in enumerate(obj) if o is None))


def _map(obj: Any, fn: Callable[[torch.Tensor], Any],
         inner: Callable[[torch.Tensor], Any] | None = None) -> Any:
    """``obj`` with each tensor of `_tensors(obj)` (same order) replaced by ``fn(tensor)``.

    A mapping that is no plain dict (transformers' ``KVSharingDict``, a ``UserDict`` the model
    hands its attention layers and *writes* into: Gemma-3n's KV-sharing layers store their keys
    and values there, later layers read them) is passed through as the same object unless
    ``inner`` is given: then it is copied, its tensors through ``inner`` (they are none of
    `_tensors`'s, so a counter in ``fn`` stays aligned). The capture snapshots such a mapping
    that way and the replay runs on a private copy in the replay's dtype: kept live, a replay
    wrote its own keys and values into the reference run's mapping, and the next layer's replay
    met fp32 keys beside fp64 queries (Gemma-3n: every attention replay failed)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(o, fn, inner) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn, inner) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _map(v, fn, inner) for k, v in obj.items()}
    if inner is not None and _is_mapping(obj):
        try:
            new = copy.copy(obj)
            for k in list(obj.keys()):
                new[k] = _map(obj[k], inner, inner)
            return new
        except Exception:  # noqa: BLE001 - a mapping that cannot be copied stays as it is
            return obj
    return obj


def _is_shared(obj: Any) -> bool:
    """A mutable container a block may write into for later blocks to read: a list, a plain
    dict, or any other mutable mapping (transformers' ``KVSharingDict``, a ``UserDict``)."""
    return isinstance(obj, list) or type(obj) is dict or _is_mapping(obj)


def _is_mapping(obj: Any) -> bool:
    """A mutable mapping that is no plain dict (transformers' ``KVSharingDict``, a ``UserDict``):
    `_tensors` does not look inside it and `_map` passes it through as the same object."""
    return isinstance(obj, MutableMapping) and not isinstance(obj, dict)


def _readable(obj: Any) -> Iterator[tuple[tuple, Any, Any, Any]]:
    """(path, mapping, key, value) for each entry of each `_is_mapping` container of a call's
    ``(args, kwargs)`` (found as `_containers` finds them). Its tensors are inputs of the block
    beside `_tensors`'s: a block reads what an earlier block stored there (Gemma-3n's KV-reuse
    attention reads the store layer's keys and values from ``KVSharingDict``), and its gradient
    with respect to them is one the block computes. The capture taps them and the replay makes
    them leaves, after `_tensors`'s, in this order (each value's tensors as `_map` visits them)."""
    for path, c in _containers(obj):
        if _is_mapping(c):
            for key, value in list(_items(c).items()):
                yield path, c, key, value


def _containers(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, container) for each `_is_shared` container in a call's ``(args, kwargs)``, the path
    as `_at` follows it; the call's own kwargs dict (path ``(1,)``) is none. `_map` keeps the
    structure, so the same path finds a snapshot's (or a replay's) copy of the container."""
    if _is_shared(obj) and path != (1,):
        yield path, obj
    if isinstance(obj, (list, tuple)):
        for i, o in enumerate(obj):
            yield from _containers(o, (*path, i))
    elif type(obj) is dict:
        for k, o in obj.items():
            yield from _containers(o, (*path, k))


def _at(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _items(container: Any) -> dict[Any, Any]:
    """A container's entries as they are now, by key (a list's by index)."""
    return dict(enumerate(container)) if isinstance(container, list) else dict(container.items())


def _put(container: Any, key: Any, value: Any) -> None:
    if isinstance(container, list) and key >= len(container):
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def _same_containers(orig: Any, new: Any) -> Any:
    """``new`` (``orig`` through `_map`) with each `_is_shared` container that `_map` copied but
    left unchanged (no tensor in it replaced) put back as the very object of ``orig``: a block
    that writes into a dict or list it was handed must write into the model's, not a copy."""
    if isinstance(orig, tuple) and type(new) is type(orig) and len(new) == len(orig):
        items = [_same_containers(o, n) for o, n in zip(orig, new)]
        if all(i is n for i, n in zip(items, new)):
            return new
        return type(orig)(*items) if hasattr(orig, "_fields") else type(orig)(items)
    if (isinstance(orig, list) or type(orig) is dict) and type(new) is type(orig) \
            and len(new) == len(orig):
        keys = range(len(orig)) if isinstance(orig, list) else list(orig)
        items = {k: _same_containers(orig[k], new[k]) for k in keys}
        if all(items[k] is orig[k] for k in keys):
            return orig
        for k in keys:
            new[k] = items[k]
    return new


def _split(ts: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ts = list(ts)
    return [t for t in ts if t.is_floating_point()], [t for t in ts if not t.is_floating_point()]


def _pair_grads(a: list[torch.Tensor | None], b: list[torch.Tensor | None]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients that never arrived are zero; a missing one on one side only is an error."""
    xs, ys = [], []
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        xs.append(x if x is not None else torch.zeros_like(y))
        ys.append(y if y is not None else torch.zeros_like(x))
    return xs, ys


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _logit_stats(cand: torch.Tensor, ref: torch.Tensor, bitwise: torch.dtype | None
                 ) -> dict[str, Any]:
    """KL(p_ref || p_cand) per token (mean, max) and top-1 agreement, in float64."""
    a = cand.detach().to("cpu", torch.float64).reshape(-1, cand.shape[-1])
    b = ref.detach().to("cpu", torch.float64).reshape(-1, ref.shape[-1])
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (lb.exp() * (lb - la)).sum(-1)
    st = error_stats([cand], [ref], bitwise_dtype=bitwise)
    return {"kl": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).double().mean().item(),
            "tokens": a.shape[0], "stats": asdict(st)}
