"""Whether an attention mask adds anything to the band the kernel computes by index (causal, a
sliding window), so that the binding may leave it out: on the H100 the kernel reading
transformers' additive [1, 1, T, T] mask cost 1.6-2.1x the band alone (gpt-oss layout, bf16,
fwd + bwd: T 8192 window 128 2.783 against 1.772 ms, causal 32.83 against 15.28 ms).

The kernel hides key j from query i outside the band (`implied_seen`); inside it, it adds the
mask's value. So the mask adds nothing exactly when every in-band entry is 0 (additive) or True
(bool): then the kernel's scores with and without it are the same numbers. Anything else keeps
the mask: padding (a hidden key inside the band), a bias (a finite non-zero value), NaN, a
narrower window than the band's. The verdict is read off the mask's values (`adds_nothing`),
never assumed from its shape or from who built it.

`MaskGuard.needed(mask, q, k, causal, window)` returns the mask, or None when it adds nothing.
A verdict is kept for the mask object it was computed on (a weak reference, its `_version`, which
every in-place write bumps, and the shapes, dtype, band it was judged against) and reused only on
that same unchanged object; any change re-reads the values. transformers builds one mask per
forward per layer kind and hands it to every layer of that kind, so the values are read once per
forward and kind (one host sync). An inference tensor (made under `torch.inference_mode`) has
no version counter, so an in-place write could not be seen: its values are read on every call.
While a CUDA graph is captured or torch.compile traces, no values can be read: a kept verdict
still applies, anything else keeps the mask (always exact).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

ROWS_PER_CHUNK = 2048  # query rows compared per step (bounds the temporaries at long T)


def implied_seen(tq: int, tk: int, causal: bool, window: int, device: Any, rows: slice | None = None
                 ) -> torch.Tensor:
    """[Tq, Tk] bool (or the rows ``rows`` of it): query i sees key j by the kernel's own band,
    bottom-right aligned as the kernel's `_seen` (j <= i + Tk - Tq when causal; j > i + Tk - Tq
    - window with a window > 0)."""
    r = rows or slice(0, tq)
    i = torch.arange(r.start, min(r.stop, tq), device=device)[:, None] + (tk - tq)
    j = torch.arange(tk, device=device)[None, :]
    seen = torch.ones(i.shape[0], tk, dtype=torch.bool, device=device)
    if causal:
        seen &= j <= i
    if window > 0:
        seen &= j > i - window
    return seen


def adds_nothing(mask: torch.Tensor, tq: int, tk: int, causal: bool, window: int) -> bool:
    """True when ``mask`` (broadcastable to [..., Tq, Tk]; additive float or bool, True = seen)
    is 0 / True at every (query, key) the band lets through, so that the kernel's output is the
    same without it. One host sync. A causal band reads only its own entries (a causal window
    W: Tq x W gathered entries; full causal: the lower triangle), anything else the whole mask."""
    if mask.dim() < 2 or mask.shape[-1] not in (1, tk) or mask.shape[-2] not in (1, tq):
        return False
    if causal and 0 < window < tk:
        return not bool(_window_band_info(mask, tq, tk, window).any())
    bad = torch.zeros((), dtype=torch.bool, device=mask.device)
    for r0 in range(0, tq, ROWS_PER_CHUNK):
        rows = slice(r0, min(r0 + ROWS_PER_CHUNK, tq))
        part = mask if mask.shape[-2] == 1 else mask[..., rows, :]
        if causal:  # the lower triangle of these rows, bottom-right aligned (`implied_seen`)
            part = part.expand(*part.shape[:-2], rows.stop - r0, tk)
            bad |= torch.tril(_info(part), diagonal=tk - tq + r0).any()
        else:
            seen = implied_seen(tq, tk, causal, window, mask.device, rows)
            bad |= (_info(part) & seen).any()
    return not bool(bad)


def _info(part: torch.Tensor) -> torch.Tensor:
    """Where the mask says something the band does not: a hidden key (bool False), a non-zero
    additive value (NaN != 0 counts)."""
    return ~part if part.dtype == torch.bool else part != 0


def _window_band_info(mask: torch.Tensor, tq: int, tk: int, window: int) -> torch.Tensor:
    """`_info` at the causal window's own entries only: query i's keys i' - window + 1 .. i'
    (i' = i + Tk - Tq), gathered as [..., Tq, window]; entries left of key 0 are not in the band."""
    full = mask.expand(*mask.shape[:-2], tq, tk)
    top = torch.arange(tq, device=mask.device)[:, None] + (tk - tq)
    cols = top - window + 1 + torch.arange(window, device=mask.device)[None, :]
    valid = (cols >= 0) & (cols <= top)
    idx = cols.clamp(0, tk - 1).expand(*full.shape[:-2], tq, window)
    return _info(full.gather(-1, idx)) & valid


def _tracing(mask: torch.Tensor) -> bool:
    """torch.compile traces (fake tensors: no values, no data pointer) or the mask has no data."""
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return (compiling is not None and compiling()) or mask.device.type == "meta"


def _capturing(mask: torch.Tensor) -> bool:
    """A CUDA graph is being captured (a host sync would break it)."""
    return mask.is_cuda and torch.cuda.is_current_stream_capturing()


class MaskGuard:
    """Per-binding verdicts on the masks a block's calls hand over (module docstring). ``slots``:
    how many distinct masks' verdicts are kept (one per layer kind suffices: the sliding and the
    full layers' masks alternate)."""

    def __init__(self, slots: int = 4) -> None:
        self.slots = slots
        self._kept: list[tuple[weakref.ref, int, tuple, bool]] = []
        self.reads = 0  # how many times the values were read (tests, diagnostics)

    @staticmethod
    def _key(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, causal: bool, window: int) -> tuple:
        return (tuple(mask.shape), mask.stride(), mask.dtype, mask.device, mask.data_ptr(),
                tuple(q.shape), tuple(k.shape), bool(causal), int(window))

    def _lookup(self, mask: torch.Tensor, key: tuple) -> bool | None:
        if mask.is_inference():  # no version counter: never reused
            return None
        for ref, version, k, verdict in self._kept:
            if ref() is mask and version == mask._version and k == key:
                return verdict
        return None

    def needed(self, mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, causal: bool,
               window: int) -> torch.Tensor | None:
        """``mask``, or None when it adds nothing to the band (causal, ``window``) for q
        [B, H, Tq, D] and k [B, Hk, Tk, D]."""
        if mask is None:
            return None
        if _tracing(mask):
            return mask
        key = self._key(mask, q, k, causal, window)
        verdict = self._lookup(mask, key)
        if verdict is None:
            if _capturing(mask):
                return mask
            self.reads += 1
            verdict = adds_nothing(mask, q.shape[2], k.shape[2], bool(causal), int(window))
            if mask.is_inference():
                return None if verdict else mask
            alive = [e for e in self._kept if e[0]() is not None]
            self._kept = alive[max(0, len(alive) - self.slots + 1):] if self.slots > 1 else []
            self._kept.append((weakref.ref(mask), mask._version, key, verdict))
        return None if verdict else mask
