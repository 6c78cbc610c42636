"""Predicates over captured op records, shared by the classifier's rules: which ops a module ran,
with which shapes (matmul widths, top-k, softmax over time, norms, activations, gating, convs),
the classifier's `Context`, and module-path helpers (`layer_of`, `stack_of`)."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from onboarding.graph.capture import OpRecord

MATMUL = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "einsum", "_grouped_mm",
          "grouped_mm"}
SDPA_PREFIX = ("scaled_dot_product_attention", "_scaled_dot_product", "_flash_attention",
               "_efficient_attention")
SOFTMAX = {"softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax"}
CONV = {"conv1d", "convolution", "_convolution", "conv2d", "conv3d"}
ACTIVATIONS = {"silu": "silu", "silu_": "silu", "gelu": "gelu", "relu": "relu", "relu_": "relu",
               "sigmoid": "sigmoid", "tanh": "tanh"}
# what an attention output gate may apply to its projection: the MLP activations and softplus
# (Laguna's per-head gate), which no MLP rule reads as an activation
GATE_ACTIVATIONS = {**ACTIVATIONS, "softplus": "softplus"}
VIEW_OPS = {"view", "reshape", "_unsafe_view", "expand", "slice", "select", "transpose", "t",
            "permute", "unsqueeze", "squeeze", "alias", "getitem", "contiguous", "clone",
            "split", "split_with_sizes", "chunk", "unbind", "detach", "_assert_tensor_metadata",
            "to", "_to_copy", "type_as", "lift_fresh_copy", "flatten", "unflatten", "lift_fresh"}
TRIANGULAR = {"tril", "triu", "linalg_solve_triangular", "triangular_solve"}
EXPERT_KINDS = ("moe.experts", "moe.shared_expert", "mlp.dense")  # what a router routes to

_NUM = re.compile(r"\.(\d+)(?=\.|$)")


def is_matmul(op: str) -> bool:
    return op in MATMUL or "grouped_mm" in op


def is_sdpa(op: str) -> bool:
    return op.startswith(SDPA_PREFIX)


def layer_of(path: str) -> int | None:
    """The layer index: the first numeric component of the path (its index in the layer list
    that holds it; `stack_of` names that list's owner)."""
    m = _NUM.search(path)
    return int(m.group(1)) if m else None


def stack_of(path: str) -> str | None:
    """The layer stack that holds the block: the module that owns the list whose index is
    `layer_of` (``model`` for ``model.layers.3.mlp``, ``model.local_encoder`` for both
    ``model.local_encoder.layers.0`` and ``model.local_encoder.cross_attn_layers.0``, "" for a
    list at the root); None without a numeric component. Several lists of one owner are one
    stack, their layers matched by index (a layer's self- and cross-attention lists)."""
    m = _NUM.search(path)
    if not m:
        return None
    lst = path[:m.start()]
    return lst.rsplit(".", 1)[0] if "." in lst else ""


@dataclass(kw_only=True)
class Context:
    seq: int
    vocab: int | None
    hidden: int | None
    layer_hints: dict[int, str]  # layer -> config layer type, a weak hint
    param_shapes: dict[str, list[int]]
    children: dict[str, list[str]]
    module_types: dict[str, str]
    identical_lists: dict[str, int]  # ModuleList path -> length, when children are identical
    # every embedding table's size: the output head's width is one of them (Gemma 3n's per-layer
    # embedding table is larger than the token vocabulary, so `vocab` is not the head's)
    vocabs: tuple[int, ...] = ()


def _hist(recs: list[OpRecord]) -> Counter:
    return Counter(r.op for r in recs)


def _matmul_recs(recs: list[OpRecord]) -> list[OpRecord]:
    return [r for r in recs if is_matmul(r.op)]


def _linear_dims(r: OpRecord, ctx: Context) -> tuple[int, int] | None:
    """(in, out) features of a linear-like record, from its weight or shapes."""
    if r.op == "linear" and len(r.in_shapes) > 1 and r.in_shapes[1]:
        w = r.in_shapes[1]
        return (w[1], w[0]) if len(w) == 2 else None
    if r.op == "addmm" and len(r.in_shapes) > 2 and r.in_shapes[1] and r.in_shapes[2]:
        return r.in_shapes[1][-1], r.in_shapes[2][-1]  # addmm(bias, x, W^T): arg 0 is the bias
    if r.in_shapes and r.in_shapes[0] and r.out_shapes:
        return r.in_shapes[0][-1], r.out_shapes[0][-1]
    return None


def _topks(recs: list[OpRecord]) -> list[tuple[OpRecord, int, int]]:
    """(record, k, size of the dim it selects over) for every topk."""
    out = []
    for r in recs:
        if r.op == "topk" and r.in_shapes and r.in_shapes[0]:
            k = r.scalars[1] if len(r.scalars) > 1 and isinstance(r.scalars[1], int) else None
            dim = r.scalars[2] if len(r.scalars) > 2 and isinstance(r.scalars[2], int) else -1
            out.append((r, k, r.in_shapes[0][dim]))
    return out


def _topk_input(r: OpRecord) -> dict[str, Any]:
    """What a top-k selects over: its input's shape and dtype, the dim, and whether it takes the
    largest (a binding that reads the selection tests these: `patching.sparse.selects_keys`)."""
    def arg(i: int, name: str, default: Any) -> Any:
        v = r.scalars[i] if len(r.scalars) > i and r.scalars[i] is not None else r.kwargs.get(name)
        return default if v is None else v
    return {"shape": r.in_shapes[0], "dtype": r.in_dtypes[0] if r.in_dtypes else None,
            "dim": arg(2, "dim", -1), "largest": bool(arg(3, "largest", True))}


def _attention_softmax(recs: list[OpRecord], seq: int, pooled: int = 0) -> list[str]:
    """Evidence of softmax attention: fused SDPA, or a softmax over [.., T, T] scores (one more
    column: a sink). With ``pooled`` = C compressed entries (`_compressed_kv`), scores over the
    T local keys and the C entries, or over the C entries alone, count too."""
    ev = []
    keys = {seq} | ({seq + pooled, pooled} if pooled else set())
    for r in recs:
        if is_sdpa(r.op):
            ev.append(f"{r.op} (fused attention)")
        elif r.op in SOFTMAX and r.in_shapes and r.in_shapes[0] and len(r.in_shapes[0]) >= 2 \
                and r.in_shapes[0][-2] == seq and (r.in_shapes[0][-1] in keys
                                                   or r.in_shapes[0][-1] - 1 in keys):
            sink = r.in_shapes[0][-1] not in keys  # one extra column: an attention sink
            ev.append(f"{r.op} over [.., {seq}, {r.in_shapes[0][-1]}] scores" +
                      (" (with a sink column)" if sink else ""))
    return ev


def _core_widths(recs: list[OpRecord], seq: int) -> dict[str, int] | None:
    """The widths of a softmax-attention core, read off its ops: ``heads`` (query heads),
    ``d_qk`` (a query's and key's width), ``d_v`` (a value's), or None where they cannot be
    read. A fused SDPA's q [.., H, T, d_qk] and v [.., S, d_v]; else the score GEMM (a matmul of
    two activations with a [.., T, S] output) whose S keys a later matmul of two activations
    reads as [.., T, S] probabilities (a softmax over rows of T queries between them): the
    query's last dim is d_qk, that product's output's is d_v, the scores' leading dims the batch
    times H (per-head, or folded into one dim as a dispatch capture's bmm has them). The batch:
    the token rows of the first weight projection's input ([B, T, D], or [B T, D] as a dispatch
    capture's mm reads it; addmm's second operand, after its bias) over T. Config-free, so a
    model without a config still has its attention FLOPs counted (`onboarding.train.flops`)."""
    xs = [r.in_shapes[r.op in ("addmm", "baddbmm")] for r in recs if is_matmul(r.op) and r.params
          and len(r.in_shapes) > 1]
    rows = next((math.prod(x[:-1]) for x in xs if x and len(x) >= 2), 0)
    batch = rows // seq if rows and seq and rows % seq == 0 else None

    def widths(lead: list[int], d_qk: int, d_v: int) -> dict[str, int] | None:
        if not batch or not math.prod(lead) or math.prod(lead) % batch:
            return None
        return {"heads": math.prod(lead) // batch, "d_qk": d_qk, "d_v": d_v}

    for r in recs:
        if r.op.startswith(("scaled_dot_product_attention", "_scaled_dot_product")) \
                and len(r.in_shapes) >= 3 and all(s and len(s) >= 3 for s in r.in_shapes[:3]) \
                and r.in_shapes[0][-2] == seq:
            q, _, v = r.in_shapes[:3]
            return widths(q[:-2], q[-1], v[-1])
    pair = [r for r in recs if r.op in ("matmul", "bmm") and not r.params and len(r.in_shapes) >= 2
            and r.in_shapes[0] and r.out_shapes and len(r.out_shapes[0]) >= 3]
    for s in pair:
        scores = s.out_shapes[0]
        if scores[-2] != seq:
            continue
        soft = next((x.index for x in recs if x.op in SOFTMAX and x.index > s.index
                     and x.in_shapes and x.in_shapes[0] and x.in_shapes[0][-2] == seq), None)
        pv = next((x for x in pair if soft is not None and x.index > soft
                   and x.in_shapes[0][-2:] == scores[-2:]), None)
        if pv is not None:
            return widths(scores[:-2], s.in_shapes[0][-1], pv.out_shapes[0][-1])
    return None


def _compressed_kv(recs: list[OpRecord], seq: int) -> dict[str, Any] | None:
    """Windows of the sequence pooled into fewer key/value entries, or None: a reduction (sum or
    mean) over dim 2 of a [B, C, w, d] tensor with 2 <= w and C = T // r for a window stride
    r = w (disjoint windows) or r = w / 2 (each entry pools 2r slots: overlapping windows,
    stride r). The weights are a softmax over that window dim when one ran on that shape. The
    first such reduction counts (an indexer's own pooling comes after the attention's in a
    module written keys-first; both pool the same windows)."""
    for r in recs:
        if r.op not in ("sum", "mean") or not r.in_shapes or not r.in_shapes[0] \
                or len(r.in_shapes[0]) != 4 or len(r.scalars) < 2 \
                or r.scalars[1] not in ([2], [-2], 2, -2):
            continue
        _, c, w, _ = r.in_shapes[0]
        if not 1 <= c < seq or w < 2:
            continue
        ratio = next((x for x in (w, w // 2) if x >= 2 and seq // x == c), None)
        if ratio is None:
            continue
        soft = any(x.op in SOFTMAX and x.index < r.index and x.in_shapes
                   and x.in_shapes[0] == r.in_shapes[0] and len(x.scalars) > 1
                   and x.scalars[1] in (2, -2) for x in recs)
        return {"compress_ratio": ratio, "window": w, "overlap": w == 2 * ratio,
                "compressed_keys": c, "pooling": "softmax_weighted" if soft else r.op}
    return None


def _decay_cumsum(recs: list[OpRecord]) -> OpRecord | None:
    ops = _hist(recs)
    if not ops["exp"]:
        return None
    # a decay sums floats: an integer cumsum (positions from a mask, expert offsets) is no decay
    return next((r for r in recs if r.op == "cumsum" and not (
        r.out_dtypes and str(r.out_dtypes[0] or "").startswith(("int", "uint", "bool")))), None)


def _time_steps(recs: list[OpRecord], seq: int) -> int:
    """How many positions of the sequence the block takes one at a time: the most distinct
    indices that ``select`` takes along one dim of size ``seq`` of one tensor shape, or ``seq``
    when an ``unbind`` splits such a dim. A block that takes every position (``seq``) runs a loop
    over time: a sequential recurrence written in Python (RWKV's WKV, a decode-style cell)."""
    if seq < 2:
        return 0
    seen: dict[tuple, set[int]] = {}
    for r in recs:
        shape = r.in_shapes[0] if r.in_shapes else None
        if not shape or len(r.scalars) < 2 or not isinstance(r.scalars[1], int):
            continue
        dim = r.scalars[1] % len(shape)
        if shape[dim] != seq:
            continue
        if r.op == "unbind" and len(r.out_shapes) == seq:
            return seq
        if r.op == "select" and len(r.scalars) > 2 and isinstance(r.scalars[2], int):
            seen.setdefault((tuple(shape), dim), set()).add(r.scalars[2] % seq)
    return max((len(v) for v in seen.values()), default=0)


def _is_rms(recs: list[OpRecord]) -> bool:
    ops = _hist(recs)
    if ops.get("rms_norm") or ops.get("_fused_rms_norm"):
        return True
    inv_roots = [r for r in recs if r.op in ("pow", "pow_") and len(r.scalars) > 1 and r.scalars[1] == -0.5]
    squares = ops["pow"] - len(inv_roots) + ops["square"] + sum(1 for r in recs if r.op == "mul" and len(r.in_shapes) > 1
                                                and r.in_shapes[0] is not None and r.in_shapes[0] == r.in_shapes[1])
    # the inverse root as rsqrt, 1 / sqrt, or pow(., -0.5) (Gemma 4); the squares averaged, or
    # summed over the row (an L2 norm: Dory's nGPT norms, x * rsqrt(sum(x^2) + eps))
    return bool((ops["rsqrt"] or ops["sqrt"] or inv_roots) and (ops["mean"] or _row_sums(recs))
                and squares)


def _row_sums(recs: list[OpRecord]) -> list[OpRecord]:
    """`sum` ops that reduce the last dim to 1 (keepdim): a sum over each row."""
    return [r for r in recs if r.op == "sum" and r.in_shapes and r.in_shapes[0] and r.out_shapes
            and r.out_shapes[0] and len(r.out_shapes[0]) == len(r.in_shapes[0])
            and r.out_shapes[0][-1] == 1 and r.in_shapes[0][-1] > 1]


def _mean_centred(recs: list[OpRecord]) -> bool:
    """A mean subtracted before the mean of squares: a LayerNorm written in torch ops (Cohere)."""
    ops = _hist(recs)
    return ops["mean"] >= 2 and ops["sub"] >= 1


def _norm_attrs(recs: list[OpRecord], ctx: Context) -> dict[str, Any]:
    eps = None
    for r in recs:
        if r.op == "add" and len(r.scalars) > 1 and isinstance(r.scalars[1], float) \
                and 0 < r.scalars[1] < 1e-2:
            eps = r.scalars[1]
            break
    if eps is None:  # the fused op's own eps argument (F.rms_norm(x, shape, w, eps))
        eps = next((x for r in recs if r.op in ("rms_norm", "_fused_rms_norm")
                    for x in r.scalars[2:] if isinstance(x, float) and 0 < x < 1e-2), None)
    weighted = [name for r in recs for name in r.params.values()]
    unit_offset = any(r.op == "add" and r.params and len(r.scalars) > 1
                      and r.scalars[1] in (1, 1.0) for r in recs)
    first = next((r for r in recs if r.in_shapes and r.in_shapes[0]), None)
    dim = first.in_shapes[0][-1] if first else None
    attrs = {"dim": dim, "eps": eps, "unit_offset": unit_offset, "has_weight": bool(weighted)}
    if not any(r.op == "mean" for r in recs) and _row_sums(recs) and not any(
            r.op in ("rms_norm", "_fused_rms_norm") for r in recs):
        attrs["reduction"] = "sum"  # squares summed, not averaged: an L2 norm of the row
    # a mean of squares over a narrower last dim than the row: normalised per group of the row
    # (Mamba-2's gated norm with n_groups > 1), another function than one norm over the row
    mean = next((r for r in recs if r.op == "mean" and r.in_shapes and r.in_shapes[0]), None)
    width = mean.in_shapes[0][-1] if mean else None
    if dim and width and width < dim and dim % width == 0:
        attrs["group_size"] = width
    return attrs


def _mlp_activation_by_shape(recs: list[OpRecord], mm: list[OpRecord], ctx: Context) -> str | None:
    """The activation of a weight-only block (no attention, no top-k: the caller's conditions)
    whose projections go out from the model width and back (D -> F ... F' -> D), where no named
    activation op says which: "silu" for a written-out sigmoid gate g * sigmoid(g) (MiniMax-M3's
    clamped gate), else "other" (Apertus' xIELU, written in softplus / expm1 / where; no family
    serves it, its projections stay torch's); None when the projections do not return to the
    width they started from."""
    first, last = _linear_dims(mm[0], ctx), _linear_dims(mm[-1], ctx)
    if not (first and last and first[0] == last[1] and first[1] != first[0]):
        return None
    return "silu" if _hist(recs)["sigmoid"] else "other"


def _linear_chain(recs: list[OpRecord], mm: list[OpRecord]) -> bool:
    """Nothing but views, weight projections and affine steps (a parameter or a number added or
    multiplied: a bias, a scale) runs between the first and the last of the projections ``mm``
    (a low-rank projection D -> r -> N, the second linear reading the first's output): a linear
    map, whatever runs after it (Kimi Delta Attention's forget gate: a softplus decay of
    f_b(f_a(x)); a low-rank output gate: a sigmoid of it). An MLP's hidden state goes through its
    activation (or a written-out one, or a product of two activations) before the last
    projection."""
    def linear(r: OpRecord) -> bool:
        if r.op in VIEW_OPS or (is_matmul(r.op) and r.params):
            return True
        return r.op in ("add", "add_", "sub", "mul", "mul_", "div") and (
            bool(r.params) or len(r.in_shapes) < 2 or r.in_shapes[1] is None)
    return len(mm) >= 2 and all(linear(r) for r in recs if mm[0].index < r.index < mm[-1].index)


def _activation(recs: list[OpRecord]) -> str | None:
    for r in recs:
        if r.op in ACTIVATIONS and ACTIVATIONS[r.op] != "sigmoid":
            return ACTIVATIONS[r.op]
    return None


def _relu_squared(recs: list[OpRecord]) -> bool:
    """The first relu's next op (past views) squares it (``square``, or ``pow`` by 2): relu(x)^2."""
    i = next((j for j, r in enumerate(recs) if r.op in ("relu", "relu_")), None)
    if i is None:
        return False
    nxt = next((r for r in recs[i + 1:] if r.op not in VIEW_OPS), None)
    return nxt is not None and (nxt.op == "square" or (nxt.op in ("pow", "pow_") and len(nxt.scalars) > 1
                                                       and nxt.scalars[1] == 2))


def _expert_activation(recs: list[OpRecord]) -> str | None:
    """The routed experts' activation, naming the composite forms transformers' ACT2FN writes out.

    relu whose next op squares it (``square``, or ``pow`` by 2) is "relu2" (relu(x)^2); tanh of
    the tanh-GELU polynomial (a 0.044715 factor: gelu_new, gelu_fast) is "gelu_tanh"; erf with no
    other activation (gelu_python) is "gelu". ``aten.gelu`` is "gelu" (exact erf), or "gelu_tanh"
    with its ``approximate="tanh"`` keyword (gelu_pytorch_tanh).
    """
    act = _activation(recs)
    if act == "gelu" and any(r.op == "gelu" and r.kwargs.get("approximate") == "tanh" for r in recs):
        return "gelu_tanh"
    if act == "relu" and _relu_squared(recs):
        return "relu2"
    if act == "tanh" and any(r.op in ("mul", "mul_") and any(isinstance(v, float) and abs(v - 0.044715) < 1e-9
                                                             for v in r.scalars) for r in recs):
        return "gelu_tanh"
    if act is None and any(r.op == "erf" for r in recs):
        return "gelu"
    return act


def _gathered_params(recs: list[OpRecord], ctx: Context) -> list[str]:
    """Parameters of two or more dims taken row by row through an index op (a table read per
    row: an expert's own scale gathered by expert id)."""
    return sorted({n for r in recs if r.op in ("index", "index_select", "gather", "take")
                   for n in r.params.values() if len(ctx.param_shapes.get(n, ())) >= 2})


def _extra_logits(recs: list[OpRecord], mm: list[OpRecord], n_experts: int, ctx: Context
                  ) -> int:
    """S when a weight projection writes n_experts + S logits and a slice along their last dim
    keeps n_experts of them (the routed experts' scores, the rest for shared experts); else 0."""
    widths = {d[1] for r in mm if r.params and (d := _linear_dims(r, ctx)) and d[1] > n_experts}
    for r in recs:
        if r.op == "slice" and r.in_shapes and r.in_shapes[0] and r.out_shapes \
                and r.out_shapes[0] and r.in_shapes[0][-1] in widths \
                and r.out_shapes[0][-1] == n_experts \
                and r.out_shapes[0][:-1] == r.in_shapes[0][:-1]:
            return r.in_shapes[0][-1] - n_experts
    return 0


def _mixing_shapes(n: int) -> set[tuple[int, int]]:
    """The shapes of a hyper-connection's matrix over n residual streams: n x n, or with the
    sublayer's input or output as an extra row or column."""
    return {(n, n), (n, n + 1), (n + 1, n)}


def _conv_padding(r: OpRecord, k: int) -> list[int] | None:
    """[left, right] of a conv op's own padding over the sequence: an int or a one-item list pads
    both sides. A string ("same", "valid") is not kept among the recorded scalars: at stride 1
    and dilation 1, an output as long as the input is "same" (K-1 in all, the smaller half on the
    left: torch's rule), one K-1 shorter is "valid" (none). None when it cannot be read."""
    pad = r.scalars[4] if len(r.scalars) > 4 else None
    if isinstance(pad, list) and len(pad) == 1:
        pad = pad[0]
    if isinstance(pad, int) and not isinstance(pad, bool):
        return [pad, pad]
    stride = r.scalars[3] if len(r.scalars) > 3 else None
    dilation = r.scalars[5] if len(r.scalars) > 5 else None
    t_in = r.in_shapes[0][-1] if r.in_shapes and r.in_shapes[0] else None
    t_out = r.out_shapes[0][-1] if r.out_shapes and r.out_shapes[0] else None
    if pad is None and stride in (1, [1]) and dilation in (1, [1]) and t_in and t_out:
        if t_out == t_in:
            return [(k - 1) // 2, k - 1 - (k - 1) // 2]
        if t_out == t_in - (k - 1):
            return [0, 0]
    return None


def _expert_gating(mats: list[list[int]]) -> bool | None:
    """Whether one expert's weights [out, in] hold a gate: gate and up [F, D] beside down [D, F],
    or a packed gate_up [2F, D] beside down [D, F] (True); only up [F, D] and down [D, F], each
    the other's transpose (False); None when the shapes say neither. The two cases never overlap:
    a packed [2F, D] is never the transpose of [D, F]."""
    if len(mats) == 3:
        return True if any(mats.count(m) >= 2 and [m[1], m[0]] in mats for m in mats) else None
    if len(mats) == 2:
        orient = packed_orientation(mats)
        if orient is not None and orient[0] == "out_in":
            return True
        a, b = mats
        if a[0] == b[1] and a[1] == b[0]:
            return False
    return None


def packed_orientation(mats: list[list[int]]) -> tuple[str, int] | None:
    """How two packed gated expert weights (each [out, in] or [in, out] past the expert dim) are
    stored, from their shapes: ("out_in", i) for gate_up [2F, D] + down [D, F] (used as x W^T),
    ("in_out", i) for gate_up [D, 2F] + down [F, D] (used as x W: gpt-oss), with i the index of
    gate_up in `mats`; None when neither fits. The two never both fit positive dims (that would
    need F = 0), so the shapes decide."""
    if len(mats) != 2:
        return None
    for i, (g, d) in enumerate((mats, mats[::-1])):
        if g[0] == 2 * d[1] and g[1] == d[0]:
            return "out_in", i
        if g[1] == 2 * d[0] and g[0] == d[1]:
            return "in_out", i
    return None


def _is_last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool) and ndim > 0 and dim % ndim == ndim - 1


def _gate_up_split(recs: list[OpRecord], two_f: int) -> str | None:
    """How the gate/up product [.., 2F] is split, read off the recorded ops: "interleaved" (gate
    at even, up at odd columns: slices with step 2 from 0 and 1, or a view to [.., F, 2]) or
    "halves" ([gate | up]: chunk(2), split(F) / split_with_sizes([F, F]), step-1 slices or a
    narrow at F, or a view to [.., 2, F]), each over the last dim of a tensor that ends in 2F.
    None when neither is seen, or both are: the split cannot be read, and is never guessed."""
    f = two_f // 2
    seen: set[str] = set()
    for r in recs:
        shape = r.in_shapes[0] if r.in_shapes else None
        if not shape or shape[-1] != two_f or two_f % 2:
            continue
        nd, sc = len(shape), r.scalars
        if r.op == "slice" and len(sc) > 1 and _is_last_dim(sc[1], nd):
            start = sc[2] if len(sc) > 2 and sc[2] is not None else 0
            end = sc[3] if len(sc) > 3 and sc[3] is not None else two_f
            step = sc[4] if len(sc) > 4 and sc[4] is not None else 1
            if step == 2 and start in (0, 1) and end >= two_f:
                seen.add("interleaved")
            elif step == 1 and ((start == 0 and end == f) or (start == f and end >= two_f)):
                seen.add("halves")
        elif r.op == "chunk" and len(sc) > 2 and sc[1] == 2 and _is_last_dim(sc[2], nd):
            seen.add("halves")
        elif r.op in ("split", "split_with_sizes") and len(sc) > 2 and _is_last_dim(sc[2], nd) \
                and sc[1] in (f, [f, f]):
            seen.add("halves")
        elif r.op == "narrow" and len(sc) > 3 and _is_last_dim(sc[1], nd) and sc[3] == f \
                and sc[2] in (0, f):
            seen.add("halves")
        elif r.op in ("view", "reshape", "_unsafe_view", "unflatten") and r.out_shapes \
                and len(r.out_shapes[0]) == nd + 1 and r.out_shapes[0][:-2] == shape[:-1]:
            tail = r.out_shapes[0][-2:]
            if tail == [f, 2]:
                seen.add("interleaved")
            elif tail == [2, f]:
                seen.add("halves")
    return seen.pop() if len(seen) == 1 else None


def _sigmoid_glu(recs: list[OpRecord]) -> float | None:
    """The slope alpha of a gate written out as g * sigmoid(alpha g) (gpt-oss's experts): a
    sigmoid whose next op multiplies its output by a tensor of the same shape; alpha is the scalar
    multiply feeding the sigmoid (1 without one). None when there is no such gate."""
    for i, r in enumerate(recs):
        if r.op != "sigmoid" or not r.out_shapes:
            continue
        nxt = next((x for x in recs[i + 1:] if x.op not in VIEW_OPS), None)
        if nxt is None or nxt.op not in ("mul", "mul_") or len(nxt.in_shapes) < 2 \
                or nxt.in_shapes[0] != r.out_shapes[0] or nxt.in_shapes[1] != r.out_shapes[0]:
            continue
        prev = next((x for x in reversed(recs[:i]) if x.op not in VIEW_OPS), None)
        if prev is not None and prev.op in ("mul", "mul_") and prev.out_shapes \
                and prev.out_shapes[0] == (r.in_shapes[0] if r.in_shapes else None):
            scal = [v for v in prev.scalars or [] if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if scal:
                return float(scal[-1])
        return 1.0
    return None


def _clamp(recs: list[OpRecord]) -> float | None:
    for r in recs:
        if r.op in ("clamp", "clamp_max", "clamp_min") and len(r.scalars) > 1:
            vals = [v for v in r.scalars[1:] if isinstance(v, (int, float))]
            if vals:
                return float(max(abs(v) for v in vals))
    return None


def _clamp_style(recs: list[OpRecord]) -> dict[str, Any]:
    """How a gated MLP's clamp sits, read off the op order (empty without a clamp): "pre_act"
    when a clamp runs before the activation (gpt-oss, DeepSeek-V4: gate clamped from above, up
    on both sides), else "post_act"; `alpha`, the scalar that scales the gate inside a sigmoid
    GLU g * sigmoid(alpha g) (1 for SiLU); `up_offset`, a scalar added after the clamps (gpt-oss's
    up + 1). A guess from structure: patching checks the kernel against the block's own output
    on its first call and leaves the block unpatched when they differ."""
    clamps = [r.index for r in recs if r.op in ("clamp", "clamp_max", "clamp_min")]
    acts = [r for r in recs if r.op in ACTIVATIONS]
    if not clamps or not acts:
        return {}
    act = acts[0]
    style: dict[str, Any] = {"clamp_style": "pre_act" if clamps[0] < act.index else "post_act"}
    if ACTIVATIONS[act.op] == "sigmoid":
        scales = [v for r in recs if r.op == "mul" and r.index < act.index
                  for v in (r.scalars or []) if isinstance(v, (int, float)) and not isinstance(v, bool)]
        style["alpha"] = float(scales[-1]) if scales else 1.0
    offsets = [v for r in recs if r.op == "add" and r.index > clamps[-1]
               for v in (r.scalars or []) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if offsets:
        style["up_offset"] = float(offsets[0])
    return style


def _inline_mlp(recs: list[OpRecord], ctx: Context
                ) -> tuple[list[OpRecord], dict[str, Any], str] | None:
    """An MLP that runs in an attention module's own forward after the attention (a decoder
    block written as one module): (the attention's records, the MLP's attrs, evidence), or None.

    After the last attention core op (fused SDPA, or the activation x activation matmul of
    softmax(QK^T) V) the first weight projection is the output projection; an MLP follows when
    at least two more weight projections and an activation run after it and go out from the
    model width and back (D -> F ... F -> D)."""
    core = [r.index for r in recs if is_sdpa(r.op) or (is_matmul(r.op) and not r.params)]
    if not core:
        return None
    after = [r for r in recs if r.index > max(core)]
    proj = [r for r in after if is_matmul(r.op) and r.params]
    if len(proj) < 3:
        return None
    rest = [r for r in after if r.index > proj[0].index]
    mlp_mm = proj[1:]
    first, last = _linear_dims(mlp_mm[0], ctx), _linear_dims(mlp_mm[-1], ctx)
    act = _activation(rest)
    if not (act and first and last and first[0] == last[1] and first[1] != first[0]):
        return None
    fused = first[1] == 2 * last[0]
    gated = any(r.op in ("mul", "mul_") for r in rest) and (len(mlp_mm) >= 3 or fused)
    attrs = {"activation": act, "gated": gated, "hidden": first[0], "intermediate": first[1],
             "projections": sorted({r.module for r in mlp_mm})}
    ev = (f"then an MLP in the same module: {len(mlp_mm)} projections {first[0]} -> "
          f"{first[1]} ... -> {last[1]} with {act}" + (" gating" if gated else "") +
          " (inline_mlp: it has no module of its own to patch)")
    return [r for r in recs if r.index <= proj[0].index], attrs, ev


def estimate_cost(recs: list[OpRecord]) -> tuple[int, int]:
    """FLOPs and unfused bytes moved, from op shapes (views move nothing)."""
    flops = nbytes = 0
    size = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
            "bool": 1}

    def numel(s: list[int] | None) -> int:
        n = 1
        for d in s or []:
            n *= d
        return n

    for r in recs:
        if r.op in VIEW_OPS:
            continue
        out = numel(r.out_shapes[0]) if r.out_shapes else 0
        if is_matmul(r.op) and r.in_shapes and r.in_shapes[0]:
            k = r.in_shapes[0][-1]
            flops += 2 * out * k
        elif is_sdpa(r.op) and len(r.in_shapes) >= 3 and r.in_shapes[1]:
            q, kk, v = r.in_shapes[:3]
            flops += 2 * numel(q) * kk[-2] + 2 * numel(q[:-1]) * kk[-2] * v[-1]
        elif r.op in CONV and len(r.in_shapes) > 1 and r.in_shapes[1]:
            w = r.in_shapes[1]
            flops += 2 * out * numel(w[1:])
        else:
            flops += out
        for s, d in zip(r.in_shapes, r.in_dtypes):
            if s is not None:
                nbytes += numel(s) * size.get(d or "", 4)
        for s, d in zip(r.out_shapes, r.out_dtypes):
            nbytes += numel(s) * size.get(d, 4)
    return flops, nbytes
