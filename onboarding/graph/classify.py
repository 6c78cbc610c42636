"""Classify captured modules into blocks by structure: the ops they run and their shapes.

Modules are visited children first. Each module sees its *unclaimed* records: its own ops plus
those of descendants that did not become blocks (plain Linear projections, helper modules). Rules
match on those records; a matched module claims them. Class names are never used to decide;
each decision carries its evidence. Leftover substantive compute that no rule explains becomes
an ``unknown`` block at the module that ran it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from onboarding.graph.split import split_linear
from onboarding.graph.capture import Capture, OpRecord
from onboarding.graph.opgraph import CONV_KINDS, Block, TensorMeta

MATMUL = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "einsum", "_grouped_mm",
          "grouped_mm"}
SDPA_PREFIX = ("scaled_dot_product_attention", "_scaled_dot_product", "_flash_attention",
               "_efficient_attention")
SOFTMAX = {"softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax"}
CONV = {"conv1d", "convolution", "_convolution", "conv2d", "conv3d"}
ACTIVATIONS = {"silu": "silu", "silu_": "silu", "gelu": "gelu", "relu": "relu", "relu_": "relu",
               "sigmoid": "sigmoid", "tanh": "tanh"}
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
    # the inverse root as rsqrt, 1 / sqrt, or pow(., -0.5) (Gemma 4)
    return bool((ops["rsqrt"] or ops["sqrt"] or inv_roots) and ops["mean"] and squares)


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


class Classifier:
    def __init__(self, cap: Capture, ctx: Context):
        self.cap, self.ctx = cap, ctx
        self.by_module: dict[str, list[OpRecord]] = {}
        for r in cap.records:
            self.by_module.setdefault(r.module, []).append(r)
        self.blocks: dict[str, Block] = {}
        self.unclaimed: dict[str, list[OpRecord]] = {}
        self.stranded: dict[str, list[OpRecord]] = {}  # a stream carrier's leftovers (`run`)
        self.origin: dict[int, str] = {r.index: r.module for r in cap.records}
        self._conv_at: dict[str, int] = {}  # a conv.causal1d block -> its conv record's index
        self._carriers: dict[str, tuple[set[int], int, int, list[int]]] | None = None

    # -- rules ----------------------------------------------------------------------------
    def _rule(self, path: str, recs: list[OpRecord], child_kinds: dict[str, str]
              ) -> tuple[str, list[str], dict[str, Any]] | None:
        ctx, ops = self.ctx, _hist(recs)
        mm = _matmul_recs(recs)
        leaf = not ctx.children.get(path)
        if ops["embedding"] and not mm:
            return "embedding", ["aten.embedding lookup"], {}
        if not mm and (patch := self._patch_conv(recs)) is not None:
            return patch
        if leaf and len(mm) == 1 and ctx.vocab and (d := _linear_dims(mm[0], ctx)) \
                and (d[1] == ctx.vocab or d[1] in ctx.vocabs) and sum(n for op, n in ops.items()
                                              if op not in VIEW_OPS and not is_matmul(op)) <= 2 \
                and (why := self._output_head(path, mm[0])):
            return "lm_head", [f"linear {d[0]} -> {d[1]} (vocabulary size)", why], {}
        if not mm and (ops["native_layer_norm"] or ops["layer_norm"]):
            return "norm.layer", ["layer_norm op"], {}
        if not mm and _is_rms(recs) and _gathered_params(recs, ctx):
            # a scale taken row by row from a table (an expert's own norm weight, gathered by
            # expert id): part of the module that routes the rows, no norm of the hidden state
            return None
        if not mm and _is_rms(recs) and _mean_centred(recs):
            attrs = _norm_attrs(recs, ctx)
            # a second parameter beside the weight is the bias (which is which: patch calibration)
            attrs["has_bias"] = len({n for r in recs for n in r.params.values()}) >= 2
            ev = ["mean subtracted, then mean of squares, rsqrt, scale"]
            if attrs["has_bias"]:
                ev.append("bias added")
            return "norm.layer", ev, attrs
        if not mm and _is_rms(recs):
            attrs = _norm_attrs(recs, ctx)
            act = next((r for r in recs if r.op in ACTIVATIONS), None)
            ev = ["mean of squares, rsqrt, scale"]
            if attrs["unit_offset"]:
                ev.append("weight used as (1 + w)")
            if act is not None:
                gate = ACTIVATIONS[act.op]
                attrs["gate_activation"] = attrs["activation"] = gate
                # the gate applied before the mean of squares (Mamba-2's mixer norm) normalises
                # x * act(z), not x: another function than the gated-after form
                first_mean = min((r.index for r in recs if r.op == "mean"), default=act.index)
                if act.index < first_mean:
                    attrs["norm_before_gate"] = False
                    return "norm.rms_gated", ev + [f"input gated by {gate}(z) before the norm"], attrs
                return "norm.rms_gated", ev + [f"output gated by {gate}(z)"], attrs
            return "norm.rms", ev, attrs
        projections = [r for r in mm if any(len(ctx.param_shapes.get(n, ())) == 2
                                            for n in r.params.values())]
        # position x inv_freq may be a matmul (transformers 5.17) but never a weight projection
        if not projections and ops["cos"] and ops["sin"]:
            # one table per layer type when their widths differ (Gemma 4: sliding and full);
            # the model may make them in set order (hash-seeded): the widths sorted, none pinned
            dims = sorted({r.out_shapes[0][-1] for r in recs if r.op == "cos" and r.out_shapes})
            if len(dims) > 1:
                return "rope", ["cos and sin of position x inv_freq",
                                f"tables of {len(dims)} widths {dims} (one per layer type)"], {
                    "rotary_dim": None, "rotary_dims": dims}
            return "rope", ["cos and sin of position x inv_freq"], {
                "rotary_dim": dims[0] if dims else None}
        # Attention scores multiply two activations (q.k^T) or go through fused SDPA; a router's
        # softmax may look the same when n_experts == seq, but its logits come from a weight.
        act_mm = any(not r.params for r in mm) or any(is_sdpa(r.op) for r in recs)
        pooled = _compressed_kv(recs, ctx.seq) if act_mm else None
        attn = _attention_softmax(recs, ctx.seq, pooled["compressed_keys"] if pooled else 0) \
            if act_mm else []
        seq_topk = [t for t in _topks(recs) if t[2] == ctx.seq] if act_mm else []
        if act_mm and (depth := self._depth_attention(path, recs, mm)) is not None:
            return depth
        if attn and mm:
            inline = _inline_mlp(recs, ctx)
            kind, ev, attrs = self._attention(path, inline[0] if inline else recs, attn,
                                              seq_topk, child_kinds, pooled)
            if inline:
                attrs["inline_mlp"] = inline[1]
                ev.append(inline[2])
            return kind, ev, attrs
        if (scan := self._selective_scan(path, recs, child_kinds)) is not None:
            return scan
        decay = _decay_cumsum(recs)
        tri = [op for op in TRIANGULAR if ops[op]]
        if decay is not None and mm and not attn:
            return self._linear_attention(recs, decay, tri)
        exp_topk = [t for t in _topks(recs) if t[2] != ctx.seq or not act_mm]
        n_experts = max((t[2] for t in exp_topk), default=0)
        # a router keeps fewer experts than it scores: a top-k of every position (DeepSeek-V4's
        # compressed-attention indexer on a short proxy sequence) selects, it does not route
        sparse = any(t[2] == n_experts and (t[1] is None or t[1] < n_experts) for t in exp_topk)
        # scores that a product of two per-sequence activations made as wide as the set (an
        # indexer's queries against pooled keys [B, .., d, C]) pick positions, not experts
        if sparse and any(not r.params and len(r.in_shapes) > 1 and r.in_shapes[1]
                          and len(r.in_shapes[1]) >= 3 and r.out_shapes and r.out_shapes[0]
                          and r.out_shapes[0][-1] == n_experts for r in mm):
            sparse = False
        if sparse and any((d := _linear_dims(r, ctx)) and d[1] == n_experts for r in mm):
            return self._router(recs, exp_topk, n_experts)
        if sparse and (extra := _extra_logits(recs, mm, n_experts, ctx)):
            # one linear scores the routed experts and S more (shared experts' weights): the
            # top-k reads a slice of its E + S logits
            kind, ev, attrs = self._router(recs, exp_topk, n_experts)
            ev.insert(0, f"linear to {n_experts + extra} logits: the top-k reads the {n_experts} "
                      f"routed experts' slice; the other {extra} weight experts every token "
                      "goes through (shared)")
            return kind, ev, {**attrs, "shared_logits": extra}
        if sparse and (scorer := [p for p in self._free_blocks(path, ("mlp.dense",))
                                  if (out := self.blocks[p].outputs) and out[0].shape
                                  and out[0].shape[-1] == n_experts]):
            # the logits come out of an MLP below the module (ZAYA's router): the MLP is the
            # router's scorer, no feed-forward of the layer; it is taken into the router
            kind, ev, attrs = self._router(recs, exp_topk, n_experts)
            ev.insert(0, f"logits for {n_experts} experts from an MLP ({scorer[0]}), taken in")
            return kind, ev, {**attrs, "scorer": "mlp", "_absorb": scorer[:1]}
        expert_params, zero = self._expert_params(path), None
        if expert_params and mm and _time_steps(recs, ctx.seq) == ctx.seq \
                and self._weights_used_whole(path, recs):
            # per-head weights around a loop over the positions (Griffin's RG-LRU, Zamba's
            # multi-head Mamba on the CPU): every token meets every slice, nothing routes
            expert_params = None
        if expert_params is None and (split := self._zero_experts(path, recs)) is not None:
            expert_params, zero = split
        if expert_params and (mm or any("grouped_mm" in op for op in ops)):
            if zero is None and (split := split_linear(path, recs, ctx.param_shapes)) is not None:
                return "moe.experts", *split  # one weight, x.split(sizes) -> a linear per piece
            e = expert_params
            names3 = [n for n in self._3d_params(path) if len(self.ctx.param_shapes[n]) == 3]
            mats = [self.ctx.param_shapes[n][1:] for n in names3]
            gated = _expert_gating(mats)
            orient = packed_orientation(mats)
            if gated is None and orient is not None:
                gated = True  # gate_up [E, D, 2F] + down [E, F, D]: gpt-oss's x @ W layout
            ev = [f"{len(self._3d_params(path))} parameters stacked over {e} experts",
                  "matmuls over expert-sorted tokens"]
            if gated is False:
                ev.append("up [E, F, D] and down [E, D, F] only, each the other's transpose: "
                          "no gate half (non-gated experts)")
            attrs = {"n_experts": e, "layout": "packed_3d", "gated": gated,
                     "activation": _expert_activation(recs), "clamp": _clamp(recs),
                     **_clamp_style(recs), "grouped_mm": any("grouped_mm" in op for op in ops)}
            if zero is not None:
                attrs["zero_experts"] = zero[0]
                ev.append(f"3-D weights over {e + zero[0]} and {e} experts; {zero[1]} scatter-adds of "
                          f"a token times its routing weight with no matmul: slots >= {e} are "
                          "identity (zero) experts")
            if (post := self._post_expert_norm(path, recs, e)) is not None:
                attrs["post_norm"], attrs["post_norm_weight"] = "rms", post
                ev.append(f"each routed row RMS-normalised after the down projection and scaled "
                          f"by its expert's own weight {post} [E, D] (gathered by expert id), "
                          "before the routing weights sum them")
            if gated and orient is not None:
                self._packed_gated(path, recs, names3, orient, ev, attrs)
            return "moe.experts", ev, attrs
        if mm and (steps := _time_steps(recs, ctx.seq)) == ctx.seq:
            # projections around a loop over the positions: a recurrent mixer whatever else its
            # ops look like (a sigmoid-gated output reads as a gated MLP's product otherwise)
            return "linear_attention.other", [
                f"a loop over time: each of the {steps} positions taken one at a time "
                "(select along the sequence dim)", f"{len(mm)} projections around it"], {
                "recurrence": "time_loop", "steps": steps}
        if (wrap := self._recurrent_wrapper(path, recs, mm)) is not None:
            return wrap
        if (conv := self._gated_conv(path, recs, mm)) is not None:
            return conv
        if (hyper := self._hyper_connection(path, recs, mm)) is not None:
            return hyper
        if (low := self._low_rank_residual(path, recs, mm)) is not None:
            return low
        if (streams := self._stream_coefficients(path, recs, mm)) is not None:
            return streams
        if (streams := self._stream_projections(path, recs, mm)) is not None:
            return streams
        weight_only = all(r.params for r in mm)  # an MLP multiplies by weights only
        # a conv over the sequence inside the block (causal or not) mixes tokens: no MLP,
        # whatever its projections look like (a mixer no rule explains is left to `unknown`)
        if len(mm) >= 2 and weight_only and not attn and not seq_topk \
                and not self._free_convs(path, causal_only=False) \
                and (act := _activation(recs) or (None if self._gates_an_input(path, mm) else
                                                  _mlp_activation_by_shape(recs, mm, ctx))):
            # act(gate) * up: a product, and a gate beside up (three projections, or the first
            # one twice as wide as the last one's input: gate and up fused). A written-out
            # activation multiplies too (xIELU, x * sigmoid(x)) without gating anything.
            # The product feeds the last projection (down): a product after it gates the output
            # (RWKV's channel mix: sigmoid(r(x)) * v(relu(k(x))^2)), not the MLP's hidden state.
            first, last = _linear_dims(mm[0], ctx), _linear_dims(mm[-1], ctx)
            fused = first is not None and last is not None and first[1] == 2 * last[0]
            act_at = next((r.index for r in recs if r.op in ACTIVATIONS), -1)
            product = any(r.op in ("mul", "mul_") and act_at < r.index < mm[-1].index for r in recs)
            gated = product and (len(mm) >= 3 or fused)
            if act == "relu" and _relu_squared(recs):
                act = "relu2"  # relu(x)^2 (squared ReLU), named as the experts rule names it
            return "mlp.dense", [f"{len(mm)} projections with {act}" +
                                 (" gating (act(gate) * up)" if gated else "")], {
                "activation": act, "gated": gated, "clamp": _clamp(recs), **_clamp_style(recs),
                "hidden": first[0] if first else None, "intermediate": first[1] if first else None}
        return None

    def _depth_attention(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                         ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Attention over depth (block attention residuals): at every position, q learned
        queries (a parameter of the module, [D] or [q, D], the same for every token) score k
        stacked states [.., T, k, D] (what earlier layers, or blocks of layers, wrote, and the
        current partial sum), a softmax over those k, not over the sequence, and the states
        summed by those weights: the input of the next sublayer. No weight projection, no top-k:
        scores [.., T, q, k] written out (two matmuls of activations) or a fused SDPA whose
        query and key lengths are q and k at T "heads"."""
        ctx = self.ctx
        if any(self._weight_2d(r) for r in mm) or any(r.op == "topk" for r in recs):
            return None
        found = None
        for r in recs:
            a = r.in_shapes[0] if r.in_shapes else None
            if r.op in SOFTMAX and a and len(a) >= 3 and a[-3] == ctx.seq and a[-1] != ctx.seq:
                found = (a[-2], a[-1], None)
            elif is_sdpa(r.op) and len(r.in_shapes) > 1 and a and r.in_shapes[1] \
                    and len(a) >= 3 and a[-3] == ctx.seq and r.in_shapes[1][-3] == ctx.seq \
                    and r.in_shapes[1][-2] != ctx.seq:
                found = (a[-2], r.in_shapes[1][-2], a[-1])
            if found:
                break
        if found is None:
            return None
        q, k, width = found
        if width is None:  # the weighted sum's width: [.., q, k] x [.., k, D]
            width = next((r.out_shapes[0][-1] for r in mm if r.in_shapes and r.in_shapes[0]
                          and r.in_shapes[0][-2:] == [q, k] and r.out_shapes and r.out_shapes[0]),
                         None)
        own = [n for n, sh in ctx.param_shapes.items() if n.rsplit(".", 1)[0] == path
               and width and sh in ([width], [q, width])]
        if not width or not own:
            return None
        normed = any(r.op in ("rsqrt", "rms_norm", "_fused_rms_norm") for r in recs) or any(
            b.kind == "norm.rms" and b.inputs and len(b.inputs[0].shape) >= 3
            and b.inputs[0].shape[-2:] == [k, width]
            for b in (self.blocks.get(c) for c in ctx.children.get(path, [])) if b is not None)
        ev = [f"{q} learned quer{'y' if q == 1 else 'ies'} ({own[0][len(path) + 1:]}, the same "
              f"for every token) against {k} stacked states of width {width} at each position",
              f"softmax over the {k} states, not over the sequence: a per-token weighted sum of "
              "what earlier layers wrote (attention over depth)"]
        if normed:
            ev.append("the states RMS-normalised before they are scored")
        return "residual.depth_attention", ev, {"queries": q, "states": k, "width": width,
                                                "normalised": normed}

    def _gates_an_input(self, path: str, mm: list[OpRecord]) -> bool:
        """The module is handed a tensor as wide as its first projection's output beside the one
        that projection reads (D -> F, and an input of width F != D): a sigmoid product there
        gates that input (Inkling 2's gated attention output projection: sigmoid(gate(h)) * o,
        then the out projection), it is no MLP's written-out g * sigmoid(g)."""
        io = self.cap.module_io.get(path)
        first = _linear_dims(mm[0], self.ctx) if mm else None
        if not io or not first or first[0] == first[1]:
            return False
        return any(t.shape and t.shape[-1] == first[1] for t in io[0])

    def _free_blocks(self, path: str, kinds: tuple[str, ...]) -> list[str]:
        """The blocks of a kind starting with one of ``kinds`` below ``path`` with no other block
        between them and it: blocks whose surrounding compute ``path`` now sees (a child's, or
        an unclaimed descendant's)."""
        def free(p: str) -> bool:
            mid = p.rsplit(".", 1)[0]
            while mid != path and mid.startswith(path + "." if path else ""):
                if mid in self.blocks:
                    return False
                mid = mid.rsplit(".", 1)[0] if "." in mid else ""
            return True

        return [p for p, b in self.blocks.items() if b.kind.startswith(kinds)
                and (p.startswith(path + ".") if path else True) and free(p)]

    def _free_convs(self, path: str, causal_only: bool = True) -> list[str]:
        """The conv blocks split out below ``path`` that it sees (`_free_blocks`): causal ones,
        or any depthwise conv over the sequence (``causal_only`` False)."""
        return self._free_blocks(path, ("conv.causal1d",) if causal_only else CONV_KINDS)

    def _weights_used_whole(self, path: str, recs: list[OpRecord]) -> bool:
        """No op takes a part of one of the module's >= 3-D parameters along a dim (a select,
        an index, a narrowed slice): an expert loop takes its experts' weights one by one, a
        recurrence's per-head weights (RG-LRU's gates, Zamba's multi-head Mamba) are used whole."""
        mine = set(self._3d_params(path))
        for r in recs:
            if not mine & set(r.params.values()):
                continue
            if r.op in ("select", "index", "index_select", "unbind", "gather", "embedding",
                        "narrow", "take"):
                return False
            if r.op == "slice" and r.in_shapes and r.in_shapes[0]:
                sc, shape = r.scalars, r.in_shapes[0]
                dim = sc[1] if len(sc) > 1 and isinstance(sc[1], int) else 0
                start = sc[2] if len(sc) > 2 and isinstance(sc[2], int) else 0
                end = sc[3] if len(sc) > 3 and isinstance(sc[3], int) else shape[dim]
                if start > 0 or end < shape[dim]:
                    return False
        return True

    def _recurrent_wrapper(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                           ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Weight projections before a causal conv and after a recurrence below the module that
        the conv feeds (Griffin's recurrent block: x and gate projections, a conv, the RG-LRU
        loop in a module of its own, gate, out projection): one mixer, as a Mamba mixer with its
        scan inside is. The recurrence's block is taken into this one (`_absorb`)."""
        convs, inner = self._free_convs(path), self._free_blocks(path, ("linear_attention.",))
        if len(convs) != 1 or len(inner) != 1 or convs[0] not in self._conv_at or len(mm) < 2 \
                or not all(r.params for r in mm):
            return None
        at = self._conv_at[convs[0]]
        if not mm[0].index < at < mm[-1].index:
            return None
        child = self.blocks[inner[0]]
        ev = [*child.evidence, f"projections around it in {path} ({len(mm)}), a causal conv "
              f"({convs[0]}) before it: one mixer with the recurrence ({inner[0]}) inside"]
        return child.kind, ev, {**child.attrs, "conv": convs[0], "_absorb": [inner[0]]}

    def _gated_conv(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                    ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A gated short convolution token mixer (LFM2's ShortConv, Hyena-style): weight
        projections before and after one child depthwise conv over the sequence (causal, or not:
        a bidirectional mixer's centred conv, then `causal` False), the conv's
        input or output multiplied elementwise by another tensor of its shape (a projected gate:
        B * x before, C * y after), and nothing that recurs, scores or routes (no exp, cumsum,
        softplus, softmax, fused attention or top-k). The conv itself stays its own
        `conv.causal1d` block; this block is the projections and the gates around it."""
        convs = self._free_convs(path, causal_only=False)
        if len(convs) != 1 or convs[0] not in self._conv_at or len(mm) < 2 \
                or self._free_blocks(path, ("attention.", "sparse_attention.", "linear_attention.")) \
                or not all(r.params for r in mm):
            return None
        ops = _hist(recs)
        if any(ops[op] for op in ("exp", "cumsum", "softplus", "topk", "log", "sort")) \
                or any(op in SOFTMAX or is_sdpa(op) for op in ops):
            return None
        at, conv = self._conv_at[convs[0]], self.blocks[convs[0]].attrs
        if not mm[0].index < at < mm[-1].index:
            return None
        ch = conv.get("channels")
        products = [r for r in recs if r.op in ("mul", "mul_") and len(r.in_shapes) > 1
                    and r.in_shapes[0] and r.in_shapes[0] == r.in_shapes[1] and ch in r.in_shapes[0]]
        pre = any(r.index < at for r in products)
        post = any(at < r.index < mm[-1].index for r in products)
        if not (pre or post):
            return None
        first, last = _linear_dims(mm[0], self.ctx), _linear_dims(mm[-1], self.ctx)
        causal = bool(conv.get("causal"))
        ev = [f"{'causal' if causal else 'non-causal'} depthwise conv over the sequence "
              f"({convs[0]}: {ch} channels, kernel {conv.get('kernel_size')})",
              f"{sum(r.index < at for r in mm)} projection(s) before it ({first[0]} -> {first[1]}), "
              f"{sum(r.index > at for r in mm)} after it (-> {last[1]})" if first and last else
              f"{len(mm)} projections around it"]
        if pre:
            ev.append("its input is an elementwise product of two tensors of its shape (gated)")
        if post:
            ev.append("its output is multiplied elementwise by another such tensor (gated)")
        ev.append("no decay, scan, softmax or top-k: a gated short-convolution token mixer" +
                  ("" if causal else " (bidirectional: outputs see later positions)"))
        return "conv.gated", ev, {
            "conv": convs[0], "channels": ch, "kernel_size": conv.get("kernel_size"),
            "input_gate": pre, "output_gate": post,
            "hidden": first[0] if first else None, "projected": first[1] if first else None,
            **({} if causal else {"causal": False})}

    def _low_rank_residual(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                           ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A learned low-rank residual branch (Gemma 3n's LAuReL): two weight projections
        D -> r -> D with r < D and nothing but views between them (no activation anywhere: a
        rank-r linear map, no MLP), then an add of two tensors of the block's [.., D] shape (the
        branch added to the residual)."""
        if len(mm) != 2 or not all(self._weight_2d(r) for r in mm) or _activation(recs) \
                or any(r.op in ACTIVATIONS for r in recs):
            return None
        first, last = _linear_dims(mm[0], self.ctx), _linear_dims(mm[1], self.ctx)
        if not (first and last and first[1] == last[0] and first[0] == last[1]
                and first[1] < first[0]):
            return None
        d, rank = first
        if any(mm[0].index < r.index < mm[1].index and r.op not in VIEW_OPS for r in recs):
            return None
        io = self.cap.module_io.get(path)
        if not io or not io[0] or not io[1] or io[0][0].shape[-1:] != [d] \
                or io[1][0].shape != io[0][0].shape:
            return None
        if not any(r.op in ("add", "add_") and r.index > mm[1].index and len(r.in_shapes) > 1
                   and r.in_shapes[0] and r.in_shapes[0] == r.in_shapes[1]
                   and r.in_shapes[0][-1] == d for r in recs):
            return None
        return "residual.low_rank", [
            f"two projections {d} -> {rank} -> {d}, nothing between them but views and no "
            f"activation: a rank-{rank} linear map, no MLP",
            "added to a tensor of the block's own shape after the second one (a learned "
            "residual branch)"], {"hidden": d, "rank": rank}

    def _weight_2d(self, r: OpRecord) -> bool:
        return any(len(self.ctx.param_shapes.get(n, ())) == 2 for n in r.params.values())

    def _stream_carriers(self) -> dict[str, tuple[set[int], int, int, list[int]]]:
        """Modules that map several residual streams to as many: a 4-D first input, returned
        with its shape, whose last dim is the model width (what the forward's last weight
        projection, the head, reads) and one of whose dims is the sequence, or a 3-D one
        [B * n, T, D] whose batch dim is n >= 2 times the forward's (the streams folded into
        the batch); path -> (the other dims >= 2, candidate stream counts, or n when folded; the
        first and last op index under the module; the shape). Cached."""
        if self._carriers is not None:
            return self._carriers
        out: dict[str, tuple[set[int], int, int, list[int]]] = {}
        head = max((r for r in self.cap.records if is_matmul(r.op) and r.params and r.in_shapes
                    and r.in_shapes[0]), key=lambda r: r.index, default=None)
        width = head.in_shapes[0][-1] if head is not None else self.ctx.hidden
        batch = self._batch()
        for p, (ins, outs) in self.cap.module_io.items():
            shape = ins[0].shape if ins else None
            if not shape or shape[-1] != width or not outs or outs[0].shape != shape:
                continue
            if len(shape) == 4 and self.ctx.seq in shape[:-1]:
                rest = list(shape[:-1])
                rest.remove(self.ctx.seq)
                counts = {n for n in rest if n >= 2}
            elif len(shape) == 3 and batch and shape[1] == self.ctx.seq \
                    and shape[0] > batch and shape[0] % batch == 0:
                # the streams folded into the batch dim, [B * n, T, D] (a common library layout)
                counts = {shape[0] // batch}
            else:
                continue
            idx = [r.index for r in self.cap.records if r.module == p or r.module.startswith(p + ".")]
            if counts and idx:
                out[p] = (counts, min(idx), max(idx), shape)
        self._carriers = out
        return out

    def _batch(self) -> int | None:
        """The forward's batch size: the rows of the first embedding lookup's output [B, T, D]."""
        emb = next((r for r in self.cap.records if r.op == "embedding" and r.out_shapes
                    and r.out_shapes[0] and len(r.out_shapes[0]) == 3), None)
        return emb.out_shapes[0][0] if emb is not None else None

    @staticmethod
    def _stream_reads(shape: list[int], n: int) -> list[list[int]]:
        """The shapes of the n streams of a carrier's ``shape`` read into one: less the stream
        dim ([B, T, n, D] -> [B, T, D]), or the batch dim divided by n when they are folded
        into it ([B * n, T, D] -> [B, T, D])."""
        if len(shape) == 3:
            return [[shape[0] // n, *shape[1:]]] if shape[0] % n == 0 else []
        return [shape[:i] + shape[i + 1:] for i, s in enumerate(shape[:-1]) if s == n]

    def _stream_coefficients(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                             ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Per-token coefficients over n residual streams (Gemma 3n's AltUp):
        a module with children whose weight projections are n and n^2 wide, both (n weights per
        stream and an n x n mixing matrix per token), inside (or at) a module whose input carries n streams of the
        model width (`_stream_carriers`). The mixing may run outside the block, in the layer's
        own forward (AltUp's predict / correct are methods the layer calls)."""
        if not mm or not self.ctx.children.get(path) or not all(self._weight_2d(r) for r in mm):
            return None
        outs = {d[1] for r in mm if (d := _linear_dims(r, self.ctx))}
        for p, (counts, _, _, shape) in self._stream_carriers().items():
            if not (path == p or path.startswith(p + ".")):
                continue
            n = next((c for c in sorted(counts) if outs == {c, c * c}), None)
            if n is None:
                continue
            ev = [f"{len(mm)} projections to per-token coefficients {n} and {n * n} wide: {n} "
                  f"weights and a mixing matrix of {n} x {n}",
                  f"{p} carries {n} residual streams of width {shape[-1]} (its input {shape})"]
            return "residual.streams", ev, {"role": "mix", "streams": n,
                                            "stream_width": shape[-1]}
        return None

    def _hyper_connection(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                          ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A hyper-connection: a module handed the n residual streams (its first input has a
        stream carrier's shape, `_stream_carriers`) that returns, among its outputs, one tensor of
        that shape less the stream dim (the streams read into one: a sublayer's input), with
        coefficients that are its own parameters (static: an [n, n], [n, n + 1] or [n + 1, n]
        matrix) or come from weight projections of each stream (D wide) or of the streams
        flattened (nD wide), nothing wider than n^2 + 2n per token (dynamic). Role `mix` when an
        n x n (or n x (n + 1)) mixing matrix is among them: a parameter of that shape, or an op
        output whose last two dims are, or the module runs inside a carrier; `collapse` for a
        weighted read alone after every carrier
        (the streams' final sum). No attention, conv or top-k. The mixing may run in the
        carrier's own forward (`_claim_stream_mixing`). A module inside a carrier without such
        a matrix is `mix` too, with `matrix` false: it reads the streams into a sublayer and
        writes its output back by per-token weights, the streams never mixed with each other."""
        io = self.cap.module_io.get(path)
        if not io or not io[0] or not io[1] or not io[0][0].shape:
            return None
        shape = io[0][0].shape
        carriers = [(c, a, b) for c, a, b, sh in self._stream_carriers().values() if sh == shape]
        ops = _hist(recs)
        if not carriers or ops["topk"] or any(is_sdpa(op) or op in CONV for op in ops):
            return None
        d = shape[-1]
        own = [tuple(s) for name, s in self.ctx.param_shapes.items()
               if name.rsplit(".", 1)[0] == path and len(s) in (1, 2)]
        inside = any(path.startswith(p + ".") for p, (_, _, _, sh) in
                     self._stream_carriers().items() if sh == shape)
        after_all = min(r.index for r in recs) > max(b for _, _, b in carriers)
        for n in sorted(set().union(*(c for c, _, _ in carriers))):
            reads = self._stream_reads(shape, n)
            square = _mixing_shapes(n)
            # a matmul by the static matrix itself (a dispatch capture records the einsum as a
            # bmm with it) mixes the streams: it is no coefficient projection
            proj = [r for r in mm if self._weight_2d(r) and not all(
                tuple(self.ctx.param_shapes.get(w, ())) in square for w in r.params.values())]
            dims = [_linear_dims(r, self.ctx) for r in proj]
            if not any(o.shape in reads for o in io[1]) or any(
                    dd is None or dd[0] not in (d, n * d) or dd[1] > n * n + 2 * n for dd in dims):
                continue
            static = [s for s in own if s in square]
            matrix = bool(static) or any(len(o) >= 3 and tuple(o[-2:]) in square
                                         for r in recs for o in r.out_shapes)
            if not (proj or static or (n,) in own):
                continue  # a plain mean of the streams: no coefficients
            role = "mix" if matrix or inside else "collapse" if after_all else None
            if role is None:
                continue
            ev = [f"its input {shape} is the {n} residual streams of width {d} that the layers "
                  "carry; it returns them read into one (" + "x".join(map(str, reads[0])) + ")"]
            attrs: dict[str, Any] = {"role": role, "streams": n, "stream_width": d,
                                     "coefficients": "dynamic" if proj else "static"}
            if proj:
                flat = all(dd[0] == n * d for dd in dims)
                attrs["projection"] = "flattened" if flat else "per_stream"
                widths = [dd[1] for dd in dims]
                ev.append(f"{len(proj)} projection(s) of the {'flattened streams (' + str(n * d) if flat else 'each stream (' + str(d)} wide) "
                          f"to per-token coefficients {widths} wide" +
                          (f": one fused projection, n^2 + 2n = {n * n + 2 * n} (n input weights, "
                           f"n output weights, the {n} x {n} matrix)" if widths == [n * n + 2 * n] else ""))
            if static:
                ev.append(f"a learned {'x'.join(map(str, static[0]))} parameter: the same "
                          "coefficients for every token" + (" (plus the per-token ones)" if proj else ""))
            if role == "mix" and not matrix:
                attrs["matrix"] = False
                ev.append(f"no {n} x {n} matrix: inside a layer, the streams read into its "
                          "sublayer and its output written back, by per-token weights "
                          "(hyper-connection without residual mixing)")
            elif role == "mix":
                ev.append(f"an {n} x {n} matrix mixes the streams (hyper-connection)")
                if (rounds := self._sinkhorn_rounds(recs, n)):
                    attrs["normalisation"] = "sinkhorn"
                    ev.append(f"its rows and columns normalised in turn ({rounds} divisions): "
                              "Sinkhorn iterations towards a doubly stochastic matrix")
            else:
                ev.append(f"after every carrier, no {n} x {n} matrix: the streams' final weighted sum")
            return "residual.streams", ev, attrs
        return None

    @staticmethod
    def _sinkhorn_rounds(recs: list[OpRecord], n: int) -> int:
        """How many divisions of an [.., n, n] tensor by its sums over the last dim ([.., n, 1])
        or the one before ([.., 1, n]) run, when both kinds do (rows and columns normalised in
        turn); 0 otherwise."""
        rows = cols = 0
        for r in recs:
            if r.op in ("div", "div_") and len(r.in_shapes) > 1 and r.in_shapes[0] \
                    and r.in_shapes[1] and r.in_shapes[0][-2:] == [n, n]:
                rows += r.in_shapes[1][-2:] == [n, 1]
                cols += r.in_shapes[1][-2:] == [1, n]
        return rows + cols if rows and cols else 0

    def _claim_stream_mixing(self, path: str, recs: list[OpRecord]) -> list[OpRecord]:
        """The matmuls in a stream carrier's own forward (a layer with no rule of its own) that
        multiply the n streams by an n x n matrix (or n x (n + 1)): hyper-connections and AltUp
        compute the matrix in a module of their own (a `residual.streams` mix block below the
        carrier) and may mix in the layer. Each is counted in the last mix block below ``path``
        that ran before it; the rest is returned (left unclaimed, as before)."""
        if path not in self._stream_carriers():
            return recs
        mixes = {p: min((r.index for r in self.cap.records if r.module == p
                         or r.module.startswith(p + ".")), default=-1)
                 for p, b in self.blocks.items() if p.startswith(path + ".")
                 and b.kind == "residual.streams" and b.attrs.get("role") == "mix"}
        if not mixes:
            return recs
        kept = []
        for r in recs:
            owner = max((p for p, at in mixes.items() if 0 <= at < r.index),
                        key=lambda p: mixes[p], default=None)
            b = self.blocks[owner] if owner is not None else None
            n, d = (b.attrs.get("streams"), b.attrs.get("stream_width")) if b else (None, None)
            shapes = [s for s in r.in_shapes[:2] if s]
            if b is None or r.module != path or not is_matmul(r.op) or r.params \
                    or len(shapes) != 2 or not any(
                        tuple(s[-2:]) in _mixing_shapes(n)
                        and n in (o := shapes[1 - i]) and d in o for i, s in enumerate(shapes)):
                kept.append(r)
                continue
            hist = Counter(b.op_histogram)
            hist[r.op] += 1
            b.op_histogram = dict(sorted(hist.items()))
            flops, nbytes = estimate_cost([r])
            b.flops += flops
            b.bytes += nbytes
            note = f"the streams mixed by its matrix in {path}'s own forward: counted here"
            if note not in b.evidence:
                b.evidence.append(note)
        return kept

    def _claim_input_gates(self, path: str, recs: list[OpRecord]) -> list[OpRecord]:
        """A second input of the module gated into its residual (Gemma 3n's per-layer input: each
        layer is handed an embedding of its own, P wide): in the module's own forward, past
        views, a child projection D -> P, an activation (not a sigmoid: a sigmoid product is a
        gate on the tensor, as on an attention's output), a product with a tensor of that shape
        (the module has an input P wide beside its first), and a child projection P -> D. The
        four ops become one `residual.input_gate` block named after the first projection's
        module (each projection a single linear: no rule of its own sees them together), split
        out before the module's own rules run (they would read the two projections and the
        activation as an MLP); the rest is returned."""
        io = self.cap.module_io.get(path)
        widths = {t.shape[-1] for t in (io[0][1:] if io else []) if t.shape}
        if not widths:
            return recs
        ops = [r for r in recs if r.op not in VIEW_OPS]
        taken: set[int] = set()
        for i in range(len(ops) - 3):
            l1, act, mul, l2 = ops[i:i + 4]
            if not (is_matmul(l1.op) and is_matmul(l2.op)):
                continue
            d1, d2 = _linear_dims(l1, self.ctx), _linear_dims(l2, self.ctx)
            # the widths, not whole shapes: a dispatch capture's mm runs on [B*T, D] views
            out = l1.out_shapes[0][-1:] if l1.out_shapes and l1.out_shapes[0] else None
            if not (self._weight_2d(l1)
                    and self._weight_2d(l2) and d1 and d2 and d1[1] in widths
                    and d2 == (d1[1], d1[0]) and d1[0] != d1[1]
                    and l1.module != l2.module and path not in (l1.module, l2.module)
                    and all(m.rsplit(".", 1)[0] == path and not self.ctx.children.get(m)
                            for m in (l1.module, l2.module))
                    and ACTIVATIONS.get(act.op, "sigmoid") != "sigmoid"
                    and act.out_shapes and act.out_shapes[0][-1:] == out
                    and mul.op in ("mul", "mul_", "multiply") and len(mul.in_shapes) > 1
                    and mul.in_shapes[0] and mul.in_shapes[0] == mul.in_shapes[1]
                    and mul.in_shapes[0][-1:] == out):
                continue
            d, p = d1
            name = _expert_activation([act]) or ACTIVATIONS[act.op]  # gelu's tanh form named
            self._add(l1.module, "residual.input_gate", [
                f"a projection {d} -> {p} ({l1.module}), {name}, times a tensor of that shape: "
                f"{path} is handed an input {p} wide beside its first",
                f"then a projection {p} -> {d} ({l2.module}): the gated input goes back to the "
                "residual width"], {"hidden": d, "input_width": p, "activation": name,
                                    "projection": l2.module}, [l1, act, mul, l2])
            if (o := self.cap.module_io.get(l2.module)) and o[1]:
                self.blocks[l1.module].outputs = list(o[1])
            taken.update(r.index for r in (l1, act, mul, l2))
        return [r for r in recs if r.index not in taken] if taken else recs

    def _stream_projections(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                            ) -> tuple[str, list[str], dict[str, Any]] | None:
        """n-1 width-preserving projections, one per child module, no activation, run before
        every module that carries n residual streams (they make streams 1..n-1 from the
        embedding: role "expand") or after them all (they fold those streams back: "collapse")."""
        if not mm or any(r.op in ACTIVATIONS for r in recs) \
                or not all(self._weight_2d(r) for r in mm):
            return None
        mods = {r.module for r in mm}
        if len(mods) != len(mm) or path in mods or not all(
                m.rsplit(".", 1)[0] == path for m in mods):
            return None
        dims = {_linear_dims(r, self.ctx) for r in mm}
        carriers = self._stream_carriers()
        if len(dims) != 1 or not carriers:
            return None
        d_in, d_out = dims.pop() or (None, None)
        k = len(mm)
        inside = [p for p in carriers if path == p or path.startswith(p + ".")]
        if inside or d_in != d_out or any(sh[-1] != d_in for _, _, _, sh in carriers.values()) \
                or not all(k + 1 in c for c, _, _, _ in carriers.values()):
            return None
        first = min(a for _, a, _, _ in carriers.values())
        last = max(b for _, _, b, _ in carriers.values())
        lo, hi = min(r.index for r in recs), max(r.index for r in recs)
        role = "expand" if hi < first else "collapse" if lo > last else None
        if role is None:
            return None
        return "residual.streams", [
            f"{k} projections {d_in} -> {d_in}, one per child, no activation",
            f"{'before' if role == 'expand' else 'after'} every module that carries {k + 1} "
            f"residual streams: they {'make streams 1..' + str(k) if role == 'expand' else 'fold streams 1..' + str(k) + ' back'}"
        ], {"role": role, "streams": k + 1, "stream_width": d_in}

    def _packed_gated(self, path: str, recs: list[OpRecord], names3: list[str],
                      orient: tuple[str, int], ev: list[str], attrs: dict[str, Any]) -> None:
        """Into `attrs`, what the kernel binding needs of gated packed experts: the weights' orientation
        (`weight_layout`), how the gate/up product is split (`gate_up_split`, None when the ops
        do not say), the per-expert biases (`gate_up_bias` [E, 2F] / `down_bias` [E, D]: 2-D
        parameters of the block used by its ops, by name relative to the block), and the
        activation of a written-out sigmoid gate g * sigmoid(alpha g) (SiLU with slope alpha)."""
        layout, i = orient
        e = attrs["n_experts"]  # the real experts (a zero-expert block's gate_up may hold more)
        gu = self.ctx.param_shapes[names3[i]]
        two_f, d = (gu[1], gu[2]) if layout == "out_in" else (gu[2], gu[1])
        split = _gate_up_split(recs, two_f)
        attrs.update(weight_layout=layout, gate_up_split=split, gate_up_bias=None, down_bias=None)
        ev.append(f"gate_up [E, {'2F, D' if layout == 'out_in' else 'D, 2F'}] and down "
                  f"[E, {'D, F' if layout == 'out_in' else 'F, D'}] ({layout})")
        ev.append(f"gate/up split: {split}" if split else
                  "gate/up split not read off the ops (neither halves nor interleaved)")
        # the split (else the first activation) separates the gate_up bias from the down bias
        pivot = next((r.index for r in recs if r.op in ("slice", "chunk", "split", "split_with_sizes",
                                                        "narrow") and r.in_shapes and r.in_shapes[0]
                      and r.in_shapes[0][-1] == two_f), None)
        if pivot is None:
            pivot = next((r.index for r in recs if r.op in ACTIVATIONS), None)
        first_use: dict[str, int] = {}
        for r in recs:
            for n in r.params.values():
                shape = self.ctx.param_shapes.get(n, [])
                if n.rsplit(".", 1)[0] == path and len(shape) == 2 and shape[0] == e \
                        and n[len(path) + 1:] != attrs.get("post_norm_weight"):
                    first_use.setdefault(n, r.index)
        for key, width, before in (("gate_up_bias", two_f, True), ("down_bias", d, False)):
            fits = [n for n, at in first_use.items() if self.ctx.param_shapes[n] == [e, width]
                    and (pivot is None or (at < pivot) == before)]
            if len(fits) == 1:
                attrs[key] = fits[0][len(path) + 1:]
                ev.append(f"{key.replace('_', ' ')} {fits[0][len(path) + 1:]} [E, {width}]")
        if _activation(recs) is None and (alpha := _sigmoid_glu(recs)) is not None:
            attrs["activation"] = "silu"
            attrs.setdefault("alpha", alpha)  # the clamp style's reading, when it made one
            ev.append(f"gate written out as g * sigmoid({alpha:g} g)")

    def _patch_conv(self, recs: list[OpRecord]) -> tuple[str, list[str], dict[str, Any]] | None:
        """A patch embedding: one 2-D or 3-D convolution whose stride is its kernel
        (non-overlapping patches), ungrouped, and the first such convolution of the forward (the
        one on the pixels; a later one, such as a patch-merging downsample, takes features)."""
        convs = [r for r in recs if r.op in CONV]
        if len(convs) != 1:
            return None
        r = convs[0]
        w = r.in_shapes[1] if len(r.in_shapes) > 1 else None
        stride = r.scalars[3] if len(r.scalars) > 3 else None
        groups = r.scalars[-1] if r.scalars and isinstance(r.scalars[-1], int) else 1
        if not w or len(w) not in (4, 5) or groups != 1 or not isinstance(stride, list) \
                or stride != w[2:] or max(stride) < 2:
            return None
        first = min(x.index for x in self.cap.records if x.op in CONV
                    and len(x.in_shapes) > 1 and x.in_shapes[1] and len(x.in_shapes[1]) in (4, 5))
        if r.index != first:
            return None
        return "embedding.patch", [
            f"convolution {w[1]} -> {w[0]} channels, kernel {'x'.join(map(str, w[2:]))} = stride "
            "(non-overlapping patches)", "the first such convolution of the forward (on the input)"
        ], {"in_channels": w[1], "dim": w[0], "patch": w[2:]}

    def _post_expert_norm(self, path: str, recs: list[OpRecord], e: int) -> str | None:
        """The [E, D] weight (its name under ``path``) of an RMS norm that runs on the expert
        outputs after the last matmul and whose scale is gathered row by row from that table
        (each routed row normalised with its expert's own weight); None without one."""
        last = max((r.index for r in recs if is_matmul(r.op)), default=None)
        after = [r for r in recs if last is not None and r.index > last]
        if not after or not _is_rms(after):
            return None
        names = [n for n in _gathered_params(after, self.ctx)
                 if len(self.ctx.param_shapes[n]) == 2 and self.ctx.param_shapes[n][0] == e
                 and n.startswith(path + ".")]
        return names[0][len(path) + 1:] if len(names) == 1 else None

    def _3d_params(self, path: str) -> list[str]:
        return [n for n, s in self.ctx.param_shapes.items()
                if n.rsplit(".", 1)[0] == path and len(s) >= 3]

    def _expert_params(self, path: str) -> int | None:
        if self.ctx.module_types.get(path, "").startswith("Conv"):
            return None
        leads = {self.ctx.param_shapes[n][0] for n in self._3d_params(path)}
        return leads.pop() if len(leads) == 1 and min(leads | {2}) >= 2 else None

    def _zero_experts(self, path: str, recs: list[OpRecord]) -> tuple[int, tuple[int, int]] | None:
        """(E, (Z, n)) for packed experts with identity ("zero") experts (LongCat-Flash): 3-D
        weights over two expert counts E + Z > E (gate_up over every routing slot, down over the
        E real experts only), and in the op order `n` > 0 scatter-adds into the output
        (``index_add_``) of a token multiplied by its routing weight with no matmul since the
        previous one. None otherwise: without seeing such a slot the zero experts' op is not
        guessed."""
        if self.ctx.module_types.get(path, "").startswith("Conv"):
            return None
        leads = sorted({self.ctx.param_shapes[n][0] for n in self._3d_params(path)})
        if len(leads) != 2 or leads[0] < 2:
            return None
        n, seg = 0, []
        for r in recs:
            if r.op in ("index_add_", "index_add"):
                if not any(is_matmul(x.op) for x in seg) and any(x.op in ("mul", "mul_") for x in seg):
                    n += 1
                seg = []
            else:
                seg.append(r)
        return (leads[0], (leads[1] - leads[0], n)) if n else None

    def _output_head(self, path: str, rec: OpRecord) -> str | None:
        """Why the vocabulary-wide linear at ``path`` is the model's output head, or None: its
        weight is the embedding's (tied), or no other module's weight projection runs after its
        last call (the logits are what the forward ends with). Width alone is no evidence: an
        MLP as wide as the vocabulary has linears of the same shape that feed more compute."""
        weights = set(rec.params.values())
        if any(r.op == "embedding" and weights & set(r.params.values()) for r in self.cap.records):
            return "its weight is the embedding's (tied)"
        last = max(r.index for r in self.by_module.get(path, [rec]))
        if not any(r.index > last and r.module != path and r.params and is_matmul(r.op)
                   for r in self.cap.records):
            return "no weight projection runs after it: the model's output head"
        return None

    def _attention(self, path, recs, attn, seq_topk, child_kinds, pooled=None):
        ctx, ev, attrs = self.ctx, list(attn), {}
        mm = _matmul_recs(recs)
        # attention over pooled keys: the scores softmax reads T + C (or C) keys, not T
        keys = {r.in_shapes[0][-1] for r in recs if r.op in SOFTMAX and r.in_shapes
                and r.in_shapes[0] and len(r.in_shapes[0]) >= 2 and r.in_shapes[0][-2] == ctx.seq}
        if pooled and not any(is_sdpa(r.op) for r in recs) and not keys & {ctx.seq, ctx.seq + 1}:
            return self._compressed_attention(path, recs, ev, pooled, keys, child_kinds)
        if not seq_topk and not any(is_sdpa(r.op) for r in recs):
            # softmax(Q K^T) V written out: the scores are a tensor in memory, O(T^2) per head
            scores = next((r.in_shapes[0] for r in recs if r.op in SOFTMAX and r.in_shapes
                           and r.in_shapes[0] and r.in_shapes[0][-2:] in ([ctx.seq, ctx.seq],
                                                                          [ctx.seq, ctx.seq + 1])),
                          None)
            attrs["unfused_core"] = {"scores": scores, "score_gemms": sum(
                1 for r in mm if not r.params and r.op in ("mm", "bmm"))}
            ev.append(f"unfused: the scores {scores} are materialised, O(T^2) memory and traffic")
        # MLA: a low-rank latent that a child norm normalises and a projection expands again.
        # Per-head q/k norms see [B, T, H, D]; a latent norm sees [B, T, r] straight from a
        # projection.
        latent_dims = {self.blocks[c].attrs.get("dim") for c in child_kinds
                       if child_kinds[c] == "norm.rms" and self.blocks[c].inputs
                       and len(self.blocks[c].inputs[0].shape) == 3}
        in_dims = {d[0] for r in mm if (d := _linear_dims(r, ctx))}
        latent = sorted(d for d in latent_dims & in_dims if d and d != ctx.hidden)
        if latent:
            ev.append(f"low-rank latent of width {latent} normalised then expanded (MLA)")
            attrs["layout"] = "mla"
            attrs["kv_latent"] = latent
        if any(r.op == "slice" and len(r.scalars) > 4 and r.scalars[4] == 2 for r in recs):
            attrs["rope_layout"] = "interleaved"
        elif any(r.op == "neg" for r in recs):
            attrs["rope_layout"] = "half"
        if seq_topk:
            r, k, n = seq_topk[0]
            relu = any(x.op in ("relu", "relu_") for x in recs)
            ev.append(f"topk k={k} over {n} key positions" + (" of ReLU indexer scores"
                                                               if relu else ""))
            attrs.update(topk=k, indexer_relu=relu, topk_inputs=[_topk_input(t) for t, _, _ in seq_topk])
            return "sparse_attention.topk", ev, attrs
        if latent:
            return "attention.mla", ev, attrs
        # a sigmoid of logsumexp(scores) less a per-head parameter, scaling the output, is one
        # more softmax-denominator logit (a sink), no gate: its input is the scores' [.., T]
        # log-normaliser, not a projection of the hidden state
        lse = [r for r in recs if r.op == "logsumexp" and r.in_shapes and r.in_shapes[0]
               and len(r.in_shapes[0]) >= 2 and r.in_shapes[0][-2] == ctx.seq and r.out_shapes]
        sink = [r for r in recs if r.op == "sigmoid" and r.in_shapes and any(
            lo.index < r.index and r.in_shapes[0] == lo.out_shapes[0] for lo in lse)]
        if sink:
            attrs["sink"] = True
            ev.append(f"output scaled by sigmoid(logsumexp(scores) - s): a sink (one more "
                      f"softmax-denominator logit), no gate; the sigmoid reads the scores' "
                      f"{sink[0].in_shapes[0]} log-normaliser")
        hint = ctx.layer_hints.get(layer_of(path) if layer_of(path) is not None else -1, "")
        if "sliding" in hint or "chunked" in hint or "local" in hint:
            ev.append(f"hint: config layer type {hint!r} (the mask is built outside the block)")
            return "attention.sliding", ev, attrs
        last_mm = mm[-1].index
        gate = [r for r in recs if r.op == "sigmoid" and r.index < last_mm and r not in sink]
        if gate:
            ev.append("attention output multiplied by sigmoid(gate) before the out projection")
            return "attention.gated", ev, attrs
        return "attention.full", ev, attrs

    def _compressed_attention(self, path, recs, ev, pooled, keys, child_kinds):
        """`attention.compressed`: softmax attention whose keys/values include C pooled entries
        (`_compressed_kv`), each one window of r tokens; a top-k over those C entries (an
        indexer's, scored apart from the attention) picks the ones a query reads."""
        ctx, c = self.ctx, pooled["compressed_keys"]
        attrs = dict(pooled)
        width = max(keys)
        sink = width - 1 in (ctx.seq + c, c)
        attrs["local_keys"] = width - sink == ctx.seq + c
        attrs["sink"] = sink
        ev.append(f"{c} key/value entries pooled from windows of {pooled['window']} positions "
                  f"(stride {pooled['compress_ratio']}" +
                  (", overlapping" if pooled["overlap"] else "") + f"; {pooled['pooling']})")
        ev.append("scores over the " + (f"{ctx.seq} local keys and " if attrs["local_keys"] else "")
                  + f"{c} pooled entries" + (" and a sink column" if sink else ""))
        sel = [t for t in _topks(recs) if t[2] == c]
        attrs["topk"] = sel[0][1] if sel else None
        if sel:
            relu = any(x.op in ("relu", "relu_") for x in recs)
            attrs["indexer_relu"] = relu
            ev.append(f"topk k={sel[0][1]} over the {c} pooled entries" +
                      (" of ReLU indexer scores" if relu else ""))
        # the same layout facts as the other attention kinds (MLA latent, RoPE layout)
        _, _, extra = self._attention(path, recs, [], [], child_kinds)
        extra.pop("unfused_core", None)
        attrs.update(extra)
        return "attention.compressed", ev, attrs

    def _selective_scan(self, path: str, recs: list[OpRecord], child_kinds: dict[str, str]
                        ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A Mamba-1 mixer (a per-channel selective scan), read off its weights and ops: a
        [I, N] parameter exponentiated (A = -exp(A_log), one decay per channel and state), a
        softplus time step, a depthwise causal conv over I channels, and weight projections
        I -> R + 2N (x_proj: dt, B, C), R -> I (dt_proj), width -> 2I (in_proj: x and the gate)
        and I -> width (out_proj). None otherwise (Mamba-2's A is one scalar per head)."""
        ops, shapes = _hist(recs), self.ctx.param_shapes
        if not ops["softplus"] or not ops["exp"]:
            return None
        a_shapes = [shapes[n] for r in recs if r.op == "exp" for n in r.params.values()
                    if len(shapes.get(n, ())) == 2]
        if not a_shapes or len({tuple(s) for s in a_shapes}) != 1:
            return None
        inner, state = a_shapes[0]
        # weights [out, in] of the matmuls (nn.Linear, or W @ x)
        mats = [shapes[n] for r in recs if is_matmul(r.op) for n in r.params.values()
                if len(shapes.get(n, ())) == 2]
        # x_proj [R + 2N, I] beside dt_proj [I, R] (out_proj [width, I] also reads I)
        x_proj = [m for m in mats if m[1] == inner and m[0] > 2 * state
                  and [inner, m[0] - 2 * state] in mats]
        rank = x_proj[0][0] - 2 * state if x_proj else None
        dt_proj = rank is not None
        in_proj = [m for m in mats if m[0] == 2 * inner]
        out_proj = [m for m in mats if m[1] == inner and in_proj and m[0] == in_proj[0][1]]
        convs = [self.blocks[c].attrs for c, k in child_kinds.items()
                 if k == "conv.causal1d" and self.blocks[c].attrs.get("channels") == inner]
        if not (x_proj and dt_proj and in_proj and out_proj and convs):
            return None
        norms = {self.blocks[c].attrs.get("dim") for c, k in child_kinds.items()
                 if k == "norm.rms"}
        norm_dt, norm_bc = rank in norms, state in norms
        has_d = any(r.op in ("mul", "mul_") and shapes.get(n) == [inner]
                    for r in recs for n in r.params.values())
        gate = next((ACTIVATIONS[r.op] for r in reversed(recs) if r.op in ACTIVATIONS), None)
        ev = [f"A: a [{inner}, {state}] parameter exponentiated (one decay per channel and state)",
              "softplus time step", f"depthwise causal conv over {inner} channels",
              (f"projections {in_proj[0][1]} -> {2 * inner} (x and gate), {inner} -> {rank} + "
               f"2x{state} (dt, B, C), {rank} -> {inner} (dt), {inner} -> {out_proj[0][0]}"),
              "per-channel selective scan (Mamba-1)"]
        if norm_dt or norm_bc:
            ev.append("RMS-normed " + " and ".join(n for n, on in (("dt", norm_dt), ("B/C", norm_bc))
                                                    if on))
        return "linear_attention.mamba", ev, {
            "scan": "selective", "per_channel_decay": True, "inner": inner, "state": state,
            "dt_rank": rank, "conv_width": convs[0].get("kernel_size"), "norm_dt": norm_dt,
            "norm_bc": norm_bc, "has_d": has_d, "gate": gate}

    def _linear_attention(self, recs, decay, tri):
        ops = _hist(recs)
        ev = ["exp + cumsum: cumulative decay in log space"]
        if tri:
            ev.append(f"triangular masks/solves ({', '.join(sorted(tri))})")
        loop = ops["copy_"] + ops["index_put"] + ops["index_put_"]
        if loop >= 8:
            ev.append(f"{loop} in-place row updates (forward substitution / chunk loop)")
        shape = decay.in_shapes[0] or []
        dim = decay.scalars[1] if len(decay.scalars) > 1 and isinstance(decay.scalars[1],
                                                                         int) else -1
        per_channel = dim % max(len(shape), 1) != len(shape) - 1
        beta = ops["sigmoid"] > 0
        l2 = any(r.op in ("rsqrt", "sqrt", "norm", "linalg_vector_norm") for r in recs)
        attrs = {"decay_shape": shape, "cumsum_dim": dim, "per_channel_decay": per_channel,
                 "chunk": shape[dim] if shape else None}
        if tri and beta and (loop >= 8 or "linalg_solve_triangular" in tri):
            ev.append("sigmoid beta with a triangular delta-rule correction")
            if l2:
                ev.append("q/k normalised (l2)")
            if per_channel:
                ev.append(f"decay cumsum over dim {dim} of {shape}: per-channel gate")
                return "linear_attention.kimi_delta", ev, attrs
            ev.append(f"decay cumsum over the last dim of {shape}: scalar gate per head")
            return "linear_attention.gated_delta", ev, attrs
        if ops["softplus"] and not beta:
            ev.append("softplus time step without a delta-rule beta (selective state space)")
            return "linear_attention.mamba", ev, attrs
        return "linear_attention.other", ev, attrs

    def _router(self, recs, exp_topk, n_experts):
        ops = _hist(recs)
        k = exp_topk[-1][1]
        scoring = "sigmoid" if ops["sigmoid"] else ("softmax" if any(
            op in ops for op in SOFTMAX) else "other")
        if scoring == "other" and ops["softplus"] and ops["sqrt"]:
            scoring = "sqrtsoftplus"  # DeepSeek-V4
        ev = [f"linear to {n_experts} expert logits", f"{scoring} scoring",
              f"topk k={k} over {n_experts} experts"]
        grouped = any(t[2] != n_experts and t[2] > 1 for t in exp_topk)
        if grouped:
            groups = min(t[2] for t in exp_topk if t[2] > 1)
            ev.append(f"group-limited: topk over {groups} groups first")
        bias = any(r.op == "add" and r.params for r in recs)
        renorm = ops["sum"] > 0 and (ops["div"] + ops["div_"]) > 0
        last_topk = max(t[0].index for t in exp_topk)
        if scoring == "softmax" and any(r.op in SOFTMAX and r.index > last_topk for r in recs):
            # softmax over the k selected logits (Cohere2-MoE, gpt-oss) is the softmax over all
            # experts renormalised over the selection, which picks the same top-k
            renorm = True
            ev.append("softmax over the top-k logits: renormalised softmax")
        attrs = {"n_experts": n_experts, "top_k": k, "scoring": scoring,
                 "group_limited": grouped, "score_bias": bias, "renormalize": renorm}
        # a bias of the logits' linear itself (gpt-oss), by its parameter name
        gate_bias = next((n for r in _matmul_recs(recs) for n in r.params.values()
                          if self.ctx.param_shapes.get(n) == [n_experts]), None)
        if gate_bias is not None:
            attrs["gate_bias"] = gate_bias
            ev.append("the logits' linear has a bias")
        if grouped:
            # The group pass picks topk_group of n_group group scores: the last top-k before
            # the final one (an earlier one may rank experts within each group).
            group_sel = [t for t in exp_topk if t[2] not in (n_experts, 1)][-1]
            attrs.update(n_group=group_sel[2], topk_group=group_sel[1])
            ev.append(f"keeps {group_sel[1]} of {group_sel[2]} groups")
        # A scalar multiply after the final top-k scales the routed weights.
        final = exp_topk[-1][0].index
        scale = next((r.scalars[1] for r in recs if r.index > final and r.op in ("mul", "mul_")
                      and len(r.scalars) > 1 and isinstance(r.scalars[1], float)), None)
        if scale is not None:
            attrs["routed_scaling_factor"] = scale
            ev.append(f"routed weights scaled by {scale:g}")
        elif grouped or bias:
            attrs["routed_scaling_factor"] = 1.0
        return "moe.router", ev, attrs

    # -- traversal ------------------------------------------------------------------------
    def _post_order(self) -> list[str]:
        order: list[str] = []

        def visit(p: str) -> None:
            for c in self.ctx.children.get(p, []):
                visit(c)
            order.append(p)

        visit("")
        return order

    def _conv_blocks(self, path: str, recs: list[OpRecord]) -> list[OpRecord]:
        """Split depthwise convs over the sequence out as blocks named after their weight's
        module: `conv.causal1d` when no output sees a later input, else `conv.noncausal1d`."""
        kept = []
        for r in recs:
            w = r.in_shapes[1] if len(r.in_shapes) > 1 else None
            groups = r.scalars[-1] if r.scalars and isinstance(r.scalars[-1], int) else 1
            pad = r.scalars[4] if len(r.scalars) > 4 else None
            if r.op in CONV and w and len(w) == 3 and groups == w[0] and w[1] == 1:
                wname = r.params.get(1, f"{path}.conv")
                owner = wname.rsplit(".", 1)[0]
                k = w[-1]
                causal = pad in ([k - 1], k - 1)
                sides = self._seq_pad(r) if pad in ([0], 0) else None
                left = sides[0] if sides is not None and sides[1] == 0 else None
                after = [x for x in recs if x.index > r.index][:4]
                act = next((ACTIVATIONS[x.op] for x in after if x.op in ACTIVATIONS), None)
                ev = [f"depthwise conv1d: groups = channels = {w[0]}, kernel {k}"]
                extra: dict[str, Any] = {}
                if left is not None and left >= k - 1:
                    # the caller pads the sequence on the left only: no output sees a later
                    # input. More than K-1 (ZAYA's CCA: the pad of two chained convs) leaves
                    # the surplus to a conv after it: the output is longer than T.
                    causal = True
                    extra["left_pad"] = left
                    ev.append(f"unpadded, after a left pad of {left} by the caller"
                              f"{' (K-1)' if left == k - 1 else f' (K-1 = {k - 1}: longer output)'}"
                              ": causal")
                elif causal:
                    ev.append(f"padding {k - 1} then trimmed: causal")
                else:
                    # padding on both sides (centred, "same"), or too little on the left: an
                    # output sees later inputs. It still mixes tokens over the sequence.
                    extra["padding"] = list(sides) if sides is not None else _conv_padding(r, k)
                    ev.append(f"padding {extra['padding'] or pad}" +
                              (" by the caller" if sides is not None else "") +
                              f": each output sees {self._lookahead(extra['padding'], k)} later "
                              "position(s) (not causal)")
                if act:
                    ev.append(f"followed by {act}")
                # The activation after the conv is the caller's: the block itself is the plain
                # conv (so a kernel for it is a drop-in); `followed_by` records the fusion chance.
                self._conv_at[owner] = r.index
                self._add(owner, "conv.causal1d" if causal else "conv.noncausal1d", ev,
                          {"channels": w[0], "kernel_size": k, "activation": None,
                           "followed_by": act, "causal": causal, **extra}, [r], r)
            else:
                kept.append(r)
        return kept

    @staticmethod
    def _lookahead(padding: list[int] | None, k: int) -> str:
        """How many later positions an output sees: K-1 minus the left padding ('?': unknown)."""
        return "?" if not padding else str(max(k - 1 - padding[0], 0))

    def _seq_pad(self, conv: OpRecord) -> tuple[int, int] | None:
        """(left, right) when the op just before ``conv`` (past views) pads its input's last dim
        (the sequence of a [B, C, T] conv input) and nothing else: ``pad`` / ``constant_pad_nd``
        with [left, right]; None otherwise."""
        prev = next((x for x in reversed(self.cap.records[:conv.index])
                     if x.op not in VIEW_OPS), None)
        spec = prev.scalars[1] if prev is not None and prev.op in ("pad", "constant_pad_nd") \
            and len(prev.scalars) > 1 else None
        if not (isinstance(spec, list) and len(spec) >= 2 and all(isinstance(v, int) for v in spec)
                and not any(spec[2:]) and (spec[0] > 0 or spec[1] > 0) and min(spec[:2]) >= 0
                and prev.out_shapes and conv.in_shapes and prev.out_shapes[0] == conv.in_shapes[0]):
            return None
        return spec[0], spec[1]

    def _add(self, path, kind, evidence, attrs, recs, first=None) -> None:
        io = self.cap.module_io.get(path)
        if io:
            ins, outs = io
        elif first is not None:
            ins = [TensorMeta(shape=s, dtype=d or "") for s, d in
                   zip(first.in_shapes, first.in_dtypes) if s is not None]
            outs = [TensorMeta(shape=s, dtype=d) for s, d in
                    zip(first.out_shapes, first.out_dtypes)]
        else:
            ins, outs = [], []
        params = {n[len(path) + 1:]: s for n, s in self.ctx.param_shapes.items()
                  if n.startswith(path + ".")}
        flops, nbytes = estimate_cost(recs)
        if n := self._weight_matmuls(recs):
            attrs = {**attrs, "weight_matmuls": n}
        self.blocks[path] = Block(
            path=path, kind=kind, layer=layer_of(path),
            class_name=self.ctx.module_types.get(path, ""), evidence=evidence,
            op_histogram=dict(sorted(_hist(recs).items())), inputs=ins, outputs=outs,
            params=params, attrs=attrs, flops=flops, bytes=nbytes)

    def _weight_matmuls(self, recs: list[OpRecord]) -> int:
        """How many ``matmul`` ops take a 2-D parameter as an operand: a projection written
        ``x @ W.T`` (Falcon's) or ``x @ W``, a GEMM like ``linear`` though ATen names it
        ``matmul`` (coverage counts them with the linears)."""
        return sum(1 for r in recs if r.op == "matmul" and any(
            len(self.ctx.param_shapes.get(n, ())) == 2 and i < len(r.in_shapes)
            and r.in_shapes[i] is not None and len(r.in_shapes[i]) == 2
            for i, n in r.params.items()))

    def run(self) -> list[Block]:
        for path in self._post_order():
            kids = self.ctx.children.get(path, [])
            recs = list(self.by_module.get(path, []))
            recs = self._conv_blocks(path, recs)
            for c in kids:
                recs.extend(self.unclaimed.pop(c, []))
            recs.sort(key=lambda r: r.index)
            recs = self._claim_input_gates(path, recs)
            child_kinds = {c: self.blocks[c].kind for c in kids if c in self.blocks}
            found = self._rule(path, recs, child_kinds) if recs else None
            if found is None and recs:
                found = self._per_call(path, recs, child_kinds)
            if found is None:
                left = self._claim_stream_mixing(path, recs)
                if path in self._stream_carriers():
                    # a layer of n streams is a unit: its leftovers go to the leftover pass, never
                    # pooled with other layers' into a rule further up (a list or the root)
                    self.stranded[path] = left
                else:
                    self.unclaimed[path] = left
                continue
            kind, ev, attrs = found
            absorbed = [self.blocks.pop(p) for p in attrs.pop("_absorb", [])]
            self._add(path, kind, ev, attrs, recs)
            for b in absorbed:  # a block taken into this one: its ops and cost count here
                mine = self.blocks[path]
                hist = Counter(mine.op_histogram)
                hist.update(b.op_histogram)
                mine.op_histogram = dict(sorted(hist.items()))
                mine.flops += b.flops
                mine.bytes += b.bytes
                if n := b.attrs.get("weight_matmuls"):
                    mine.attrs["weight_matmuls"] = mine.attrs.get("weight_matmuls", 0) + n
        self._merge_expert_lists()
        self._leftovers()
        self._shared_experts()
        self._inline_routers()
        return sorted(self.blocks.values(), key=lambda b: _path_key(b.path))

    def _per_call(self, path: str, recs: list[OpRecord], child_kinds: dict[str, str]
                  ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A module called more than once in one forward (an lm_head shared with a
        multi-token-prediction head): its calls' ops classified call by call; one kind when
        every call is that kind (the first call's attrs), else None."""
        calls = sorted({r.call for r in self.by_module.get(path, [])})
        if len(calls) < 2:
            return None
        found = [self._rule(path, [r for r in recs if r.call == c], child_kinds) for c in calls]
        if any(f is None for f in found) or len({f[0] for f in found}) != 1:
            return None
        kind, ev, attrs = found[0]
        return kind, [*ev, f"called {len(calls)} times in one forward, each call {kind}"], attrs

    def _inline_routers(self) -> None:
        """A router whose module holds the experts (or a shared expert) routes inline:
        its gate is a child linear, its softmax / top-k run in the MoE block's own forward, so
        the router is no module of its own (``inline``: a module patch would replace the block)."""
        for b in self.blocks.values():
            inner = [p for p, c in self.blocks.items() if b.kind == "moe.router"
                     and p.startswith(b.path + ".") and c.kind in EXPERT_KINDS]
            if inner:
                b.attrs["inline"] = True
                b.evidence.append(f"routing runs in this module's own forward, around {', '.join(inner)}"
                                  " (the router is no module of its own)")

    def _merge_expert_lists(self) -> None:
        """A list of identical MLPs beside a router is one experts block."""
        for lst, n in self.ctx.identical_lists.items():
            members = [p for p in self.blocks if p.startswith(lst + ".")
                       and p[len(lst) + 1:].split(".")[0].isdigit()]
            parent = lst.rsplit(".", 1)[0] if "." in lst else ""
            routers = [b for p, b in self.blocks.items() if b.kind == "moe.router" and
                       (p == parent or p.startswith(parent + ".")) and
                       b.attrs.get("n_experts") == n]
            if not members or not routers:
                continue
            first = self.blocks[members[0]]
            # the first expert's own records and 2-D weights: its activation and gating
            first_recs = [r for r in self.cap.records
                          if r.module == members[0] or r.module.startswith(members[0] + ".")]
            gated = _expert_gating([s for n2, s in self.ctx.param_shapes.items()
                                    if n2.startswith(members[0] + ".") and len(s) == 2])
            flops = sum(self.blocks[m].flops for m in members)
            nbytes = sum(self.blocks[m].bytes for m in members)
            hist: Counter = Counter()
            for m in members:
                hist.update(self.blocks.pop(m).op_histogram)
            params = {n2[len(lst) + 1:]: s for n2, s in self.ctx.param_shapes.items()
                      if n2.startswith(lst + ".")}
            self.blocks[lst] = Block(
                path=lst, kind="moe.experts", layer=layer_of(lst), class_name="ModuleList",
                evidence=[f"{n} identical MLPs in a list", f"router beside it selects among {n}",
                          f"{len(members)} of them ran on this input"],
                op_histogram=dict(sorted(hist.items())), inputs=first.inputs,
                outputs=first.outputs, params=params,
                attrs={"n_experts": n, "layout": "module_list", "gated": gated,
                       "activation": _expert_activation(first_recs) or first.attrs.get("activation"),
                       "clamp": first.attrs.get("clamp"), "grouped_mm": False,
                       **{k: first.attrs[k] for k in ("clamp_style", "alpha", "up_offset")
                          if k in first.attrs}},
                flops=flops, bytes=nbytes)

    def _leftovers(self) -> None:
        """Substantive compute nobody explained becomes `unknown` at the module that ran it."""
        for container, recs in [*self.unclaimed.items(), *self.stranded.items()]:
            by_origin: dict[str, list[OpRecord]] = {}
            for r in recs:
                origin = self._origin(r.module)
                by_origin.setdefault(origin, []).append(r)
            for origin, group in by_origin.items():
                ops = _hist(group)
                n_mm = len(_matmul_recs(group))
                heavy = [op for op in ("topk", "cumsum", "sort") if ops[op]] + \
                    [op for op in ops if op in SOFTMAX or op in CONV or is_sdpa(op)]
                if origin == container and container in self.blocks:
                    continue
                if n_mm >= 2 or (heavy and n_mm >= 1):
                    self._add(origin, "unknown", [
                        f"{n_mm} matmuls" + (f", {', '.join(sorted(set(heavy)))}" if heavy
                                             else "") + " that no rule explains"], {}, group)

    def _origin(self, module: str) -> str:
        """The largest subtree around ``module`` that holds no block: where leftovers came from.
        A conv split out of a module's own ops (`conv.causal1d`, `conv.noncausal1d`) does not
        count: the compute around it (a mixer that no rule explains) is one leftover, not one
        per projection."""
        def has_block(p: str) -> bool:
            return any((b == p or b.startswith(p + ".") if p else True)
                       and self.blocks[b].kind not in CONV_KINDS for b in self.blocks)

        while module and not has_block(parent := module.rsplit(".", 1)[0] if "." in module
                                       else ""):
            module = parent
        return module

    def _shared_experts(self) -> None:
        moe_parents = {b.path.rsplit(".", 1)[0] for b in self.blocks.values()
                       if b.kind in ("moe.router", "moe.experts")}
        for b in self.blocks.values():
            parent = b.path.rsplit(".", 1)[0]
            if b.kind == "mlp.dense" and parent in moe_parents:
                b.kind = "moe.shared_expert"
                b.evidence.append("a dense MLP beside a router and experts: shared expert")


def _path_key(path: str) -> list:
    return [int(p) if p.isdigit() else p for p in path.split(".")]


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
