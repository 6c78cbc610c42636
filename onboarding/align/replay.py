"""Isolated replay for `onboarding.align.core`: run one block on the reference's recorded inputs
and output gradients, in the candidate dtype, so a block's own error is told apart from error
it inherited. Also the routing helpers that keep a replay's comparison fair when near-equal
top-k choices flip or swap slots in the candidate dtype."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from onboarding.align.stats import _at, _float_slots, _items, _map, _readable, _split, _tensors
from onboarding.align.fp64 import keep_float64
from onboarding.graph.torch_paths import torch_reference_paths

if TYPE_CHECKING:
    from onboarding.align.core import _Call

@dataclass
class _Replay:
    outputs: list[torch.Tensor]
    input_grads: list[torch.Tensor | None]
    param_grads: list[torch.Tensor | None]
    discrete: list[torch.Tensor] = field(default_factory=list)  # integer outputs (selections)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """``t`` as [n, -1] when its leading dims hold ``n`` rows (tokens), else None."""
    if t.dim() >= 1 and t.shape[0] == n:
        return t.reshape(n, -1)
    if t.dim() >= 2 and math.prod(t.shape[:-1]) == n:
        return t.reshape(n, -1)
    return None


def _selection_flips(c: _Replay, r: _Replay) -> tuple[torch.Tensor | None, str]:
    """Rows whose integer selection (top-k indices) differs between two isolated replays.

    A flip is *explained* when the reference's own scores put the two choices closer together
    than rounding can move them: within 8x the median score error of the whole replay (robust to
    a few wrong rows) or 2 ulp of the candidate dtype at that score. Explained rows are masked out
    of the comparison. Returns (keep-mask or None, message);
    an unexplained flip returns a message and no mask, and the block is judged unmasked.
    """
    flipped = None
    for x, y in zip(c.discrete, r.discrete):
        if x.shape != y.shape or x.dim() == 0:
            continue
        xs, ys = x.reshape(x.shape[0], -1).sort(-1).values, y.reshape(y.shape[0], -1).sort(-1).values
        rows = (xs != ys).any(-1)
        flipped = rows if flipped is None else flipped | rows
        sel_c, sel_r = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)
    if flipped is None or not bool(flipped.any()):
        return None, ""
    n = flipped.numel()
    width = int(max(sel_c.max(), sel_r.max())) + 1
    # scores: a [rows, >= width] view of an output, one score per choice (router logits)
    scores = [(a, b) for a, b in zip(c.outputs, r.outputs) if a.shape == b.shape
              and a.dim() >= 1 and _rows(b, n) is not None and _rows(b, n).shape[-1] >= width]
    msg = f"{int(flipped.sum())} of {n} rows select differently in the candidate dtype"
    if not scores:
        return None, msg + " (no scores to tell near ties from errors)"
    eps = torch.finfo(scores[0][0].dtype).eps
    sc, sr = (_rows(t, n).double() for t in scores[0])
    typical = 8 * (sc - sr).abs().median().item()
    for i in flipped.nonzero().flatten().tolist():
        ref_sel, cand_sel = set(sel_r[i].tolist()), set(sel_c[i].tolist())
        boundary = min(sr[i, j].item() for j in ref_sel)
        intruder = max(sr[i, j].item() for j in cand_sel - ref_sel)
        allowed = max(typical, 2 * eps * abs(boundary))
        if boundary - intruder > allowed:
            return None, msg + f"; row {i} is no near tie (score gap {boundary - intruder:.2e}" \
                               f" > {allowed:.2e} that rounding can explain)"
    return ~flipped, msg + " (near ties: masked out)"


def _keep_rows(ts: list[torch.Tensor], keep: torch.Tensor | None) -> list[torch.Tensor]:
    if keep is None:
        return ts
    out = []
    for t in ts:
        rows = _rows(t, keep.numel())
        out.append(rows[keep.to(t.device)] if rows is not None else t)
    return out


def _slot_maps(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot maps between two selections [..., k] (as [rows, k]) that list the same choices per row.

    Returns (to_ref, from_ref, same_set): ``to_ref[r, j]`` is the slot of ``x`` holding the
    choice ``y`` lists in slot j, ``from_ref[r, i]`` the slot of ``y`` holding ``x``'s slot-i
    choice; identity on rows whose set of choices differs (``same_set`` False there).
    """
    xr, yr = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]).to(x.device)
    match = xr.unsqueeze(-1) == yr.unsqueeze(-2)  # [rows, slot in x, slot in y]
    same_set = (match.sum(-1) == 1).all(-1) & (match.sum(-2) == 1).all(-1)
    ident = torch.arange(xr.shape[-1], device=x.device).expand_as(xr)
    to_ref = torch.where(same_set.unsqueeze(-1), match.int().argmax(-2), ident)
    from_ref = torch.where(same_set.unsqueeze(-1), match.int().argmax(-1), ident)
    return to_ref, from_ref, same_set


def _permute(ts: list, x: torch.Tensor, src: torch.Tensor) -> list:
    """Each tensor of ``x``'s shape (slot-aligned with it) with its slots gathered by ``src``."""
    return [t.reshape(src.shape).gather(-1, src.to(t.device)).reshape(t.shape)
            if t is not None and t.shape == x.shape else t for t in ts]


def _follow_selection(grads: list[torch.Tensor | None], sel: list[torch.Tensor],
                      ref_sel: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Reorder slot-aligned output grads when a replay picks the reference's choices in another order.

    A router returns its top-k weights in slot order next to the indices; two near-equal
    choices may swap slots in the candidate dtype. The reference's grad for slot j belongs to
    the choice the reference put there, so each row's grads follow their choice to the slot the
    replay put it in. Rows whose set of choices differs are left as they are (`_selection_flips`
    judges those).
    """
    for x, y in zip(sel, ref_sel):
        if x.shape != y.shape or x.dim() < 1 or torch.equal(x, y):
            continue
        grads = _permute(grads, x, _slot_maps(x, y)[1])
    return grads


def _in_reference_order(floats: list[torch.Tensor], sel: list[torch.Tensor],
                        ref_sel: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Slot-aligned outputs (and the selection itself) put in the reference's slot order.

    A kernel may list a row's top-k choices in another order than the original (ours sorted by
    score, transformers' DeepSeek-V3 / Kimi routers `topk(sorted=False)`); every consumer sums
    over the slots, so only the pairing of choice and weight matters. Comparing slot j with slot j
    would compare one expert's weight with another's (rel_rms 5e-2 on the DeepSeek-V3.2 router at
    top-8, its own error 2e-4). Rows whose set of choices differs are left as they are
    (`_selection_flips` judges those), and so are 1-D integer outputs (counts, not slots).
    """
    sel = list(sel)
    for n, y in enumerate(ref_sel[:len(sel)]):
        x = sel[n]
        if x.shape != y.shape or x.dim() < 2 or torch.equal(x, y.to(x.device)):
            continue
        to_ref = _slot_maps(x, y)[0]
        floats = _permute(floats, x, to_ref)
        sel[n] = _permute([x], x, to_ref)[0]
    return floats, sel


def _calls_in_reference_order(calls: list[_Call], ref_calls: list[_Call]) -> list[_Call]:
    """Copies of one block's recorded calls (the candidate's or the floor's) with their
    slot-aligned tensors in the reference calls' slot order, for the end-to-end comparison.

    Outputs and their grads follow the block's integer outputs (a router's top-k indices);
    inputs and their taps follow its integer inputs (the experts' indices, next to their
    weights). Only for comparing: `args` is kept as recorded, and the faithfulness check must
    compare a replay with the calls as recorded, not with these copies.
    """
    out = []
    for c, r in zip(calls, ref_calls):
        c = dataclasses.replace(c)
        n = len(c.outputs)
        ts, c.discrete_out = _in_reference_order([*c.outputs, *c.out_grads], c.discrete_out,
                                                 r.discrete_out)
        c.outputs, c.out_grads = ts[:n], ts[n:]
        n = len(c.inputs)
        ts, c.discrete_in = _in_reference_order([*c.inputs, *c.taps], c.discrete_in, r.discrete_in)
        c.inputs, c.taps = ts[:n], ts[n:]
        out.append(c)
    return out


def _replay(module: nn.Module, ref: _Call, own: _Call | None, dtype: torch.dtype,
            source: str = "reference", drop: frozenset[int] = frozenset()) -> _Replay:
    """Run ``module`` on one recorded call's inputs, then backprop the reference's output grads.

    ``source="reference"``: every input tensor comes from the reference call ``ref`` (floating
    ones cast to ``dtype``; integer ones such as routing indices as they are);
    ``source="own"``: from ``own``, the model's own call (the faithfulness check).
    ``drop``: top-level output slots whose floating outputs are left out (`_judge`: those the
    candidate returns as None).
    """
    base = own if source == "own" else ref
    leaves: list[torch.Tensor] = []
    i = iter(range(len(base.grad_flags)))
    finfo = torch.finfo(dtype)

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        # Masks hold finfo(fp64).min, which would round to -inf in fp32/bf16: clamp finite
        # values into the target range first (as the model itself does in its own dtype).
        if torch.finfo(t.dtype).max > finfo.max:
            t = torch.where(torch.isfinite(t), t.clamp(finfo.min, finfo.max), t)
        return t.to(dtype)

    def build(t: torch.Tensor) -> torch.Tensor:
        k = next(i)
        if not t.is_floating_point():
            return t
        x = cast(t)
        if base.grad_flags[k]:
            x = x.detach().requires_grad_(True)
            leaves.append(x)
        return x

    # a shared mapping's tensors (`_map`): a private copy in this dtype; those that required
    # grad in the recorded call are leaves after `_tensors`'s (`stats._readable`), as its taps
    built = _map(base.args, build, inner=lambda t: cast(t).detach())
    flags = iter(base.read_flags)

    def read(t: torch.Tensor, private: bool) -> torch.Tensor:
        if not (next(flags, False) and private):
            return t
        x = t.detach().requires_grad_(True)
        leaves.append(x)
        return x

    for path, mapping, key, value in _readable(built):
        # a mapping `_map` could not copy is the recorded one: read, never written into
        private = mapping is not _at(base.args, path)
        new = _map(value, lambda t: read(t, private))
        if private:
            mapping[key] = new
    args, kwargs = built
    params = [p for p in module.parameters() if p.requires_grad]
    with torch.enable_grad(), torch_reference_paths(), keep_float64(dtype):
        out = module(*args, **kwargs)
        floats, discrete = _split(_tensors(out))
        if drop:
            floats = [t for t, slot in zip(floats, _float_slots(out)[0]) if slot not in drop]
        # what the block wrote into its private copies of the containers it was handed: the
        # last outputs, their recorded gradients those later blocks sent back (`WRITTEN`)
        floats += _written(built, ref.written)
        out_grads = ref.out_grads
        if source == "reference":
            out_grads = _follow_selection(out_grads, discrete, ref.discrete_out)
        pairs = [(o, g.to(o.dtype)) for o, g, need in
                 zip(floats, out_grads, ref.out_needs_grad) if need and g is not None
                 and o.requires_grad and o.shape == g.shape]
        grads: list[torch.Tensor | None] = [None] * (len(leaves) + len(params))
        if pairs and (leaves or params):
            grads = list(torch.autograd.grad([o for o, _ in pairs], leaves + params,
                                             [g for _, g in pairs], allow_unused=True))
    floats, discrete = [o.detach() for o in floats], [d.detach() for d in discrete]
    if source == "reference":  # compared with the reference's outputs, slot by slot
        floats, discrete = _in_reference_order(floats, discrete, ref.discrete_out)
    return _Replay(outputs=floats, discrete=discrete,
                   input_grads=[g.detach() if g is not None else None for g in grads[:len(leaves)]],
                   param_grads=[g.detach() if g is not None else None
                                for g in grads[len(leaves):]])


def _written(built, written: list[tuple[tuple, object, int]]) -> list[torch.Tensor]:
    """The tensors a replay wrote where the recorded call wrote its (`_Call.written`)."""
    out = []
    for path, key, j in written:
        value = _items(_at(built, path)).get(key)
        floats = [t for t in _tensors(value) if t.is_floating_point()]
        if j >= len(floats):
            raise ValueError(f"the replay wrote no tensor {j} at {key!r} of the container "
                             f"at {path}, where the recorded call did")
        out.append(floats[j])
    return out
