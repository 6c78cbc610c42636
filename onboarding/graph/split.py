"""Split-by-size per-expert linears (ScatterMoE / Megablocks experts), recognised by structure.

Such a module owns one 3-D weight [E, N, K] and, given rows x [S, K] already sorted by expert and
the per-expert row counts, splits x by those sizes along the rows and runs one linear per piece
against the matching slice of the weight (F.linear(x_e, W[e]), recorded as select + t + mm or as
linear), concatenating the results into [S, N]. There is no routing, no activation and no
combine inside: those belong to the caller. The classifier labels it `moe.experts` with
`layout: "split_linear"` so that only a family built for this call (`grouped_linear`) matches it,
never the routed-MLP experts kernels.
"""

from __future__ import annotations

from typing import Any

from onboarding.graph.capture import OpRecord

_SPLITS = ("split_with_sizes", "split")
# Ops that move or regroup data without computing: the slices, the transposes of F.linear's
# decomposition and the final concatenation.
_PLUMBING = {"view", "reshape", "_unsafe_view", "slice", "select", "t", "transpose", "permute", "alias",
             "getitem", "contiguous", "clone", "detach", "_assert_tensor_metadata", "to", "_to_copy",
             "unsqueeze", "squeeze", "expand", "cat", "split", "split_with_sizes", "unbind"}
_LINEARS = ("mm", "linear", "matmul")


def _own_params(path: str, param_shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    return {n: s for n, s in param_shapes.items() if n.rsplit(".", 1)[0] == path}


def _split_sizes(r: OpRecord, k: int) -> list[int] | None:
    """The sizes of a split by a list of sizes along dim 0 of a [S, K] input, else None."""
    if r.op not in _SPLITS or not r.in_shapes or not r.in_shapes[0] or len(r.in_shapes[0]) != 2 \
            or r.in_shapes[0][1] != k:
        return None
    scalars = list(r.scalars or []) + [None, None, None]
    sizes, dim = scalars[1], scalars[2] if scalars[2] is not None else r.kwargs.get("dim", 0)
    if not isinstance(sizes, (list, tuple)) or dim not in (0, -2):
        return None
    return [int(s) for s in sizes]


def split_linear(path: str, recs: list[OpRecord], param_shapes: dict[str, list[int]]
                 ) -> tuple[list[str], dict[str, Any]] | None:
    """(evidence, attrs) when the module at `path` is a split-by-size per-expert linear, else None.

    Needs: the module's own parameters are exactly one 3-D weight [E, N, K]; its records hold one
    split of an input [S, K] by a list of at most E sizes along the rows, between 1 and E matmuls
    (mm / linear / matmul) each taking a piece of that split ([rows, K], rows one of the sizes)
    and the weight (a slice of it) to [rows, N], and nothing else but data movement (slices,
    transposes, the concatenation).
    """
    own = _own_params(path, param_shapes)
    if len(own) != 1:
        return None
    (wname, shape), = own.items()
    if len(shape) != 3 or shape[0] < 2:
        return None
    e, n, k = shape
    splits = [(r, s) for r in recs if (s := _split_sizes(r, k)) is not None]
    if len(splits) != 1 or not 1 <= len(splits[0][1]) <= e:
        return None
    split, sizes = splits[0]
    if sum(sizes) != split.in_shapes[0][0]:
        return None
    linears = [r for r in recs if r.op in _LINEARS]
    if not 1 <= len(linears) <= e:
        return None
    pieces = list(sizes)
    for r in linears:
        rows = r.in_shapes[0][0] if r.in_shapes and r.in_shapes[0] and len(r.in_shapes[0]) == 2 else None
        if (wname not in r.params.values() or r.index < split.index or r.in_shapes[0][1] != k
                or r.out_shapes[:1] != [[rows, n]] or rows not in pieces):
            return None
        pieces.remove(rows)  # each piece feeds at most one linear
    if any(r.op not in _PLUMBING and r.op not in _LINEARS for r in recs):
        return None
    rel = wname[len(path) + 1:]
    evidence = [f"one 3-D weight {rel} [E={e}, N={n}, K={k}], no other parameter",
                (f"input [S, {k}] split by {len(sizes)} sizes along the rows, then {len(linears)} "
                 f"linears of the pieces against slices of {rel}: a per-expert linear over rows sorted "
                 "by expert (no routing or activation inside)")]
    attrs = {"n_experts": e, "layout": "split_linear", "gated": None, "activation": None, "clamp": None,
             "grouped_mm": False, "weight": rel, "in_features": k, "out_features": n}
    return evidence, attrs
