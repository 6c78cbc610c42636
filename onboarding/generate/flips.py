"""Rows whose integer picks flipped, for the block check (`onboarding.generate.blockcheck`).

In 16 bits a router's pick may flip at a near tie (the replacement's logits round differently
from the block's own matmul); the check tolerates a few such flips (`blockcheck._integers`). A
flipped pick changes everything downstream of it in that row (routing weights, the expert's
output, the row's input gradient), so those rows are compared nowhere: the rows of a tensor are
the leading dims whose product is the picks' row count, the finest split of the picks' leading
dims that the block's per-row (floating, 2-D or more) inputs share (``hidden_states`` of
(tokens, hidden) and picks of (tokens, top_k): 16 rows of 16; (batch, seq, hidden) with picks
(batch, seq) or (batch, seq, k): batch * seq rows). Parameter gradients sum over rows: the check
back-propagates cotangents zeroed in the excluded rows through the reference and the
replacement alike, so both sum the same kept rows exactly (for a block whose rows are
independent, as a router's tokens are) and are compared at the usual bar.

A router can also jump without its picks changing: PhiMoE's sparsemixer keeps an expert in its
softmax only while its logit is within a relative threshold of the best one, so a logit that
16-bit rounding moves across the threshold halves or doubles the row's routing weight while the
picks stay (the H200 gate run of the phimoe router, batch 3 seq 13: 0.505 against 1.010). Such
rows are found from the block alone, never from the replacement: the fp32 block is run again on
its inputs and parameters each multiplied by (1 +- eps) (eps: the 16-bit dtype's machine
epsilon, a sign drawn per element, `PROBE_DRAWS` draws), and a row whose picks change, or whose
floating outputs move by more than `JUMP` of the output's RMS, is ill-conditioned at that
precision (a smooth row moves by about eps). Where the replacement (or the 16-bit block's own
forward) jumps against the fp32 block in such a row, the row joins the excluded ones, counted
apart, unless more than `MAX_UNSTABLE` of the rows would be excused so (then none is). A jump in
a row the probe finds stable is never excused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

PROBE_DRAWS = 8
JUMP = 0.1  # a row "jumps" when it moves by more than this fraction of the output's RMS
MAX_UNSTABLE = 0.125  # at most this fraction of the rows is excused by the probe


def _prefixes(shape: tuple[int, ...], upto: int) -> list[int]:
    return [math.prod(shape[:k]) for k in range(1, upto + 1)]


def row_count(picks: torch.Tensor, inputs: list[torch.Tensor]) -> int | None:
    """The picks' row count (module docstring), or None where no per-row input shares one."""
    mine = set(_prefixes(tuple(picks.shape), picks.dim()))
    theirs = {n for x in inputs if x.is_floating_point() and x.dim() >= 2
              for n in _prefixes(tuple(x.shape), x.dim() - 1)}
    common = {n for n in mine & theirs if n > 1}
    return max(common) if common else None


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """``t`` viewed as (n, rest) where its leading dims multiply to ``n``, else None."""
    for k in range(1, t.dim() + 1):
        p = math.prod(t.shape[:k])
        if p == n:
            return t.reshape(n, -1)
        if p > n:
            break
    return None


def flipped(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """Bool (n,): the rows where integer tensors ``a`` and ``b`` differ."""
    return (a.cpu() != b.cpu()).reshape(n, -1).any(-1)


@dataclass
class RowExclusion:
    """Rows excluded from a size's comparisons: ``rows`` (bool, n) of ``n``; ``by_replacement``
    and ``by_block``: how many the replacement's picks and the 16-bit block's own flipped."""

    n: int
    rows: torch.Tensor
    by_replacement: int = 0
    by_block: int = 0
    by_probe: int = 0  # rows the block itself jumps in under its dtype's rounding

    @property
    def count(self) -> int:
        return int(self.rows.sum())

    def keep(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The kept rows of ``t`` (n, rest), or None where ``t`` has no rows (no leading dims
        multiplying to n)."""
        if t is None:
            return None
        v = as_rows(t, self.n)
        return None if v is None else v[~self.rows.to(v.device)]

    def zero(self, cot: torch.Tensor) -> torch.Tensor:
        """``cot`` with the excluded rows zeroed (unchanged where it has no rows)."""
        v = as_rows(cot, self.n)
        if v is None:
            return cot
        v = v.clone()
        v[self.rows.to(v.device)] = 0
        return v.reshape(cot.shape)

    def describe(self, dtype: str) -> str:
        probe = (f"; the fp32 block itself jumps in {self.by_probe} under {dtype}-sized "
                 "perturbations of its inputs and parameters") if self.by_probe else ""
        return (f"{self.count} of {self.n} rows excluded from the output and input-gradient "
                f"comparisons (integer picks flipped within the tolerance: the "
                f"replacement's in {self.by_replacement}, the {dtype} block's own in "
                f"{self.by_block}{probe}); parameter gradients compared with those rows' "
                "cotangents zeroed in both")


def _pick_rows(r_out: list, inputs: list[torch.Tensor], tolerated: list[bool]) -> int | None:
    """The row count of the first tolerated integer output (``tolerated[i]``) that has rows,
    or None."""
    n = None
    for i, r in enumerate(r_out):
        if not tolerated[i] or not isinstance(r, torch.Tensor) or r.is_floating_point():
            continue
        rn = row_count(r, inputs)
        if rn is not None and n is None:
            n = rn
    return n


def jumped(outs: list, ref: list, n: int) -> torch.Tensor:
    """Bool (n,): rows where ``outs`` (the fp32 block at perturbed inputs) differ from ``ref``
    (it at the inputs): any integer element, or a floating one by more than JUMP of the output's
    RMS. Outputs without rows are ignored."""
    rows = torch.zeros(n, dtype=torch.bool)
    for o, r in zip(outs, ref):
        if not isinstance(r, torch.Tensor) or not isinstance(o, torch.Tensor) \
                or o.shape != r.shape or as_rows(r, n) is None:
            continue
        if not r.is_floating_point():
            rows |= flipped(o, r, n)
            continue
        scale = float(r.detach().float().pow(2).mean().sqrt()) or 1.0
        d = (as_rows(o.detach().float(), n) - as_rows(r.detach().float(), n)).abs().amax(-1)
        rows |= (~torch.isfinite(d) | (d > JUMP * scale)).cpu()
    return rows


def perturb(tensors: list[torch.Tensor], eps: float, gen: torch.Generator) -> None:
    """Multiply each floating tensor in place by (1 +- eps), a sign drawn per element."""
    for t in tensors:
        if t.is_floating_point():
            s = torch.randint(0, 2, t.shape, generator=gen).to(t.device, t.dtype) * 2 - 1
            t.mul_(1 + eps * s)


def probe(run: Callable[[torch.Generator, float], list], ref: list, n: int, seed: int,
          eps: float, draws: int = PROBE_DRAWS) -> torch.Tensor:
    """Bool (n,): the rows the block jumps in (module docstring). ``run(gen, eps)`` runs the
    fp32 block on its inputs and parameters times (1 +- eps), the signs drawn from ``gen``."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.zeros(n, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(draws):
            rows |= jumped(run(gen, eps), ref, n)
    return rows


def exclusion(c_out: list, r_out: list, f_out: list | None, inputs: list[torch.Tensor],
              tolerated: list[bool], unstable: Callable[[int], torch.Tensor] | None = None
              ) -> RowExclusion | None:
    """The rows to exclude: where a tolerated integer output (``tolerated[i]``) of the
    replacement (``c_out``) or of the 16-bit block (``f_out``) differs from the reference's
    (``r_out``), and the rows where either of them `jumped` that ``unstable(n)`` (bool over the
    picks' n rows: `probe`, called only when something jumped) marks, when those are at most
    MAX_UNSTABLE of the rows. None where nothing is excluded or the picks have no rows."""
    n = _pick_rows(r_out, inputs, tolerated)
    if n is None:
        return None
    by_c = torch.zeros(n, dtype=torch.bool)
    by_f = torch.zeros(n, dtype=torch.bool)
    for i, r in enumerate(r_out):
        if not tolerated[i] or not isinstance(r, torch.Tensor) or r.is_floating_point() \
                or row_count(r, inputs) != n:
            continue
        f = f_out[i] if f_out is not None and i < len(f_out) else None
        by_c |= flipped(c_out[i], r, n)
        if isinstance(f, torch.Tensor) and f.shape == r.shape:
            by_f |= flipped(f, r, n)
    by_p = torch.zeros(n, dtype=torch.bool)
    if unstable is not None:
        moved = jumped(c_out, r_out, n)
        if f_out is not None:
            moved |= jumped(f_out, r_out, n)
        if moved.any():
            excused = unstable(n).cpu() & moved
            if int(excused.sum()) <= MAX_UNSTABLE * n:
                by_p = excused
    rows = by_c | by_f | by_p
    if not rows.any():
        return None
    return RowExclusion(n=n, rows=rows, by_replacement=int(by_c.sum()),
                        by_block=int(by_f.sum()), by_probe=int((by_p & ~(by_c | by_f)).sum()))
