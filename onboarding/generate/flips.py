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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
        return (f"{self.count} of {self.n} rows excluded from the output and input-gradient "
                f"comparisons (their integer picks flipped within the tolerance: the "
                f"replacement's in {self.by_replacement}, the {dtype} block's own in "
                f"{self.by_block}); parameter gradients compared with those rows' cotangents "
                "zeroed in both")


def exclusion(c_out: list, r_out: list, f_out: list | None, inputs: list[torch.Tensor],
              tolerated: list[bool]) -> RowExclusion | None:
    """The rows to exclude: where a tolerated integer output (``tolerated[i]``) of the
    replacement (``c_out``) or of the 16-bit block (``f_out``) differs from the reference's
    (``r_out``). None where nothing flipped or the picks have no rows."""
    n, by_c, by_f = None, None, None
    for i, r in enumerate(r_out):
        if not tolerated[i] or not isinstance(r, torch.Tensor) or r.is_floating_point():
            continue
        rn = row_count(r, inputs)
        if rn is None or (n is not None and rn != n):
            continue
        n = rn
        f = f_out[i] if f_out is not None and i < len(f_out) else None
        c_rows = flipped(c_out[i], r, n)
        f_rows = flipped(f, r, n) if isinstance(f, torch.Tensor) and f.shape == r.shape \
            else torch.zeros(n, dtype=torch.bool)
        by_c = c_rows if by_c is None else by_c | c_rows
        by_f = f_rows if by_f is None else by_f | f_rows
    if n is None or not (by_c | by_f).any():
        return None
    return RowExclusion(n=n, rows=by_c | by_f, by_replacement=int(by_c.sum()),
                        by_block=int(by_f.sum()))
