"""Swap classified blocks of a model for kernel-backed versions, reversibly, by module path.

Nothing here knows a model class. Each block kind has one generic binding from the block's
structure (its parameters, its input) to a kernel's signature:
  - ``norm.rms``: ``forward(x)`` -> ``rmsnorm(x, w, eps)`` (``unit_offset`` rendered in), or
    ``rmsnorm(x, eps)`` for a kernel rendered without a weight, bound only to a module that has
    no parameters of its own;
  - ``norm.rms_gated``: ``forward(x, z)`` -> ``rmsnorm_gated(x, z, w, eps)``;
  - ``norm.layer`` (written in torch ops; a fused ``F.layer_norm`` is left to torch):
    ``forward(x)`` -> ``layernorm(x, w, [b,] eps)``, weight and bias told apart by calibration;
  - ``mlp.dense`` / ``moe.shared_expert``: ``forward(x)`` -> ``down(swiglu(gate(x), up(x)))``;
  - ``moe.experts`` (packed 3-D weights): ``forward(x, indices, weights)`` -> the grouped-GEMM
    experts kernel, with the weights found by their shapes (gate_up [E, 2F, D] + down [E, D, F]
    for the gated variants, up [E, F, D] + down [E, D, F] for the non-gated `mlp` one). Gated
    blocks stored otherwise (gpt-oss: gate_up [E, D, 2F] with gate/up interleaved, down [E, F, D],
    per-expert biases) are converted to the kernel's layout as the classifier read it off the
    block (see `_ExpertWeights`); identity ("zero") expert slots (attrs `zero_experts`: index >= E)
    go to the kernel with weight 0 and their r * x is added in torch;
  - ``moe.experts`` split by sizes (attrs ``layout: "split_linear"``: one weight [E, N, K],
    ``forward(x, sizes)`` -> a linear per piece): the `grouped_linear` kernel with the sizes as
    a device tensor (`onboarding._patch_grouped_linear`);
  - ``moe.router``: ``forward(x)`` -> the router kernel with the gate weight found by its shape
    [n_experts, hidden] and the score-correction bias (a parameter or buffer [n_experts]) when
    the kernel was rendered with one; scoring, top-k, groups, renormalisation and scaling are
    rendered in from the block's attrs. Routers return different tuples ((logits, weights,
    indices), (indices, weights), dense [N, E] scores, ...): the output structure is read off
    the original's output at calibration (see `_router_adapt`);
  - ``sparse_attention.topk``: the dense masked attention after the block's top-k (SDPA, or the
    eager q k^T -> softmax -> v chain) -> the gathered kernel over the selected keys (MHA/GQA or
    absorbed MLA), intercepted while the block runs (`onboarding._patch_sparse`);
  - ``conv.causal1d``: the depthwise conv call made with the block's weight, intercepted with a
    `TorchFunctionMode` while the owning block runs (the conv is often an inline functional call,
    not a module call).

Where a binding has a choice the structure leaves open (which linear is the gate, which argument
is the gate), the patch *calibrates* on its first call: it runs the original and each candidate
binding on the same input and keeps the one that matches within tolerance. A block with no
matching binding is restored and reported, never silently wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from onboarding.classify import packed_orientation
from onboarding.opgraph import Block, OpGraph
from onboarding.testing.tolerance import compare, tolerance_for


@dataclass(kw_only=True)
class PatchRecord:
    path: str
    kind: str
    family: str
    status: str = "pending"  # pending -> active | rejected | restored
    binding: str = ""
    detail: str = ""


@dataclass(kw_only=True)
class PatchSet:
    records: list[PatchRecord] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for r in self.records:
            if r.status in ("pending", "active"):
                r.status = "restored"

    def __enter__(self) -> PatchSet:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def active(self) -> list[PatchRecord]:
        return [r for r in self.records if r.status == "active"]


def entry_function(mod: ModuleType) -> Callable:
    """The user-facing function of a rendered module (its ``entry``, by the module contract)."""
    if callable(getattr(mod, "entry", None)):
        return mod.entry
    for name in dir(mod):
        if not name.startswith("_") and not name.endswith("_op") and \
                hasattr(mod, f"{name}_op") and callable(getattr(mod, name)):
            return getattr(mod, name)
    raise ValueError(f"{mod.__name__}: no entry function (f with f_op)")


def _same(out: Any, ref: Any) -> tuple[Callable[[Any], Any], str] | None:
    """The default calibration check: the binding's output is the original's, as it stands."""
    return ((lambda o: o), "") if _matches(out, ref) else None


def _matches(out: Any, ref: Any) -> bool:
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return False
    if out.shape != ref.shape:
        return False
    return compare(out.float(), ref.float(), tolerance_for(ref.dtype)).passed


class _Calibrated:
    """Replaces ``module.forward``; picks a binding on the first call by comparing outputs."""

    def __init__(self, module: nn.Module, record: PatchRecord,
                 bindings: dict[str, Callable[..., torch.Tensor]],
                 adapt: Callable[[Any, Any], tuple[Callable[[Any], Any], str] | None] = _same):
        # adapt(out, ref) -> (convert, description) when a binding's raw output, converted,
        # reproduces the original's output ref; None when it does not
        self.module, self.record, self.bindings, self.adapt = module, record, bindings, adapt
        self.original = module.forward
        self.chosen: Callable | None = None

    def __call__(self, *args, **kwargs):
        if self.chosen is None:
            with torch.no_grad():
                ref = self.original(*args, **kwargs)
                for name, fn in self.bindings.items():
                    try:
                        out = fn(*args, **kwargs)
                    except (TypeError, ValueError, RuntimeError) as exc:
                        self.record.detail = f"{name}: {type(exc).__name__}: {exc}"[:200]
                        continue
                    fit = self.adapt(out, ref)
                    if fit is not None:
                        convert, how = fit
                        self.chosen = _converted(fn, convert)
                        self.record.binding = name + (f" -> {how}" if how else "")
                        self.record.status = "active"
                        break
            if self.chosen is None:
                self.record.status = "rejected"
                self.record.detail = self.record.detail or "no binding matched the original"
                self.module.forward = self.original  # give the block back, unpatched
                return self.original(*args, **kwargs)
        out = self.chosen(*args, **kwargs)
        return out


def _converted(fn: Callable, convert: Callable[[Any], Any]) -> Callable:
    return lambda *args, **kwargs: convert(fn(*args, **kwargs))


def _weight_1d(module: nn.Module) -> nn.Parameter | None:
    ps = [p for p in module.parameters(recurse=False) if p.ndim == 1]
    return ps[0] if len(ps) == 1 else None


def _norm_takes_weight(kmod: ModuleType) -> bool:
    """Whether a rendered norm module's entry takes a weight: not `l2norm`, nor `plain` rendered
    with ``has_weight=False`` (read off its render params, not its argument names)."""
    params = getattr(kmod, "PARAMS", None) or {}
    return getattr(kmod, "VARIANT", None) != "l2norm" and bool(params.get("has_weight", True))


def _norm_bindings(block: Block, module: nn.Module, fn: Callable, weighted: bool = True
                   ) -> dict[str, Callable]:
    """Bindings of a norm block to ``fn``; ``weighted``: the kernel takes the module's weight."""
    eps = block.attrs.get("eps") or 1e-6
    if not weighted:
        # A weightless kernel on a module that owns a weight would ignore it, and calibration
        # could not tell while that weight is still all ones (its usual init): refused.
        if block.kind != "norm.rms" or next(module.parameters(recurse=False), None) is not None:
            return {}
        return {"x (no weight)": lambda x, *a, **k: fn(x, eps=eps)}
    if _weight_1d(module) is None:
        return {}
    # The weight is looked up at call time: FSDP2 swaps a sharded module's parameters.
    if block.kind == "norm.rms":
        return {"x": lambda x, *a, **k: fn(x, _weight_1d(module), eps)}

    def gated(i: int, j: int):
        def call(*args, **kwargs):
            tensors = list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            return fn(tensors[i], tensors[j], _weight_1d(module), eps)
        return call

    return {"x=arg0, z=arg1": gated(0, 1), "x=arg1, z=arg0": gated(1, 0)}


def _layer_norm_bindings(block: Block, module: nn.Module, fn: Callable, bias: bool
                         ) -> dict[str, Callable]:
    """``forward(x)`` -> ``fn(x, weight[, bias], eps)`` for a module whose own parameters are
    exactly the 1-D weight, or weight and bias when the kernel was rendered with ``bias`` (which
    is which is left to calibration: with the usual ones / zeros init the swapped binding
    outputs the bias, never the norm). An eps the classifier did not read is left to the
    kernel's rendered default."""
    names = [n for n, p in module.named_parameters(recurse=False) if p.ndim == 1]
    if len(names) != len(list(module.parameters(recurse=False))) or len(names) != 1 + bias:
        return {}
    eps = block.attrs.get("eps")
    extra = () if eps is None else (eps,)

    def bind(*order: str):
        # looked up by name at call time: FSDP2 swaps a sharded module's parameters
        return lambda x, *a, **k: fn(x, *(getattr(module, n) for n in order), *extra)

    if len(names) == 1:
        return {f"x, weight={names[0]}": bind(*names)}
    a, b = names
    return {f"x, weight={a}, bias={b}": bind(a, b), f"x, weight={b}, bias={a}": bind(b, a)}


def _mlp_bindings(module: nn.Module, fn: Callable) -> dict[str, Callable]:
    linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
    if len(linears) == 3:
        # Which linear is down, gate or up is left to calibration: widths can coincide.
        def bind(g: str, u: str, d: str):
            gate, up, down = linears[g], linears[u], linears[d]
            return lambda x, *args, **kw: down(fn(gate(x), up(x)))

        return {f"gate={g}, up={u}, down={d}": bind(g, u, d)
                for g, u, d in itertools.permutations(linears)
                if linears[d].in_features == linears[g].out_features == linears[u].out_features}
    if len(linears) == 2:
        (na, a), (nb, b) = linears.items()
        fused, down = (a, b) if a.out_features == 2 * b.in_features else (b, a)
        if fused.out_features != 2 * down.in_features:
            return {}

        def halves(first_gate: bool):
            def call(x, *args, **kw):
                g, u = fused(x).chunk(2, dim=-1)
                return down(fn(g, u) if first_gate else fn(u, g))
            return call

        return {"gate_up halves (gate first)": halves(True),
                "gate_up halves (up first)": halves(False)}
    return {}


def _experts_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, topk_indices, topk_weights) of an experts call, in any argument order: the one integer
    tensor, and of the two float ones the wider (x [N, D] beside weights [N, K])."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    idx = [t for t in tensors if not t.is_floating_point()]
    flt = [t for t in tensors if t.is_floating_point()]
    if len(idx) != 1 or len(flt) != 2:
        raise ValueError("expected one index tensor and two float tensors")
    x, w = sorted(flt, key=lambda t: -t.shape[-1]) if flt[0].shape[-1] != \
        flt[1].shape[-1] else flt
    return x, idx[0], w


class _ExpertWeights:
    """A gated packed experts block's weights (and biases) in the kernel's layout: gate_up
    [E, 2F, D] as [gate | up] halves, down [E, D, F], gate_up_bias [E, 2F] as halves, down_bias
    [E, D].

    ``layout`` "in_out" (the block computes x @ W: gate_up [E, D, 2F], down [E, F, D]) transposes
    the last two dims; ``split`` "interleaved" (gate at even, up at odd columns) regroups them into
    halves. The kernels take contiguous weights at fixed strides, and interleaved rows are no
    strided view of halves, so a converted copy is made: for a weight that needs no gradient here
    (frozen, or under no_grad) once, cached on the parameter's data_ptr, ``_version``, shape,
    stride, dtype and device (an in-place update or a swapped tensor converts again); for one
    that does, on every call with differentiable ops, so autograd takes each gradient back to the
    original parameter's layout. Parameters are looked up by name at call time (FSDP2 swaps a
    sharded module's parameters). The same conversion runs in both cases, so the patch's
    first-call check against the block's own output covers it.
    """

    def __init__(self, module: nn.Module, names: dict[str, str], layout: str, split: str):
        self.module, self.names, self.layout, self.split = module, names, layout, split
        self._cache: dict[str, tuple[tuple, torch.Tensor]] = {}

    def _needs_conversion(self, role: str) -> bool:
        if role in ("gate_up", "down") and self.layout == "in_out":
            return True
        return role in ("gate_up", "gate_up_bias") and self.split == "interleaved"

    def _convert(self, role: str, p: torch.Tensor) -> torch.Tensor:
        if role in ("gate_up", "down") and self.layout == "in_out":
            p = p.transpose(1, 2)  # [E, in, out] -> [E, out, in]
        if role in ("gate_up", "gate_up_bias") and self.split == "interleaved":
            # rows (gate 0, up 0, gate 1, up 1, ...) -> (gate 0, gate 1, ..., up 0, up 1, ...)
            e, two_f = p.shape[0], p.shape[1]
            p = p.unflatten(1, (two_f // 2, 2)).transpose(1, 2).reshape(e, two_f, *p.shape[2:])
        return p.contiguous()

    def get(self, role: str) -> torch.Tensor:
        p = getattr(self.module, self.names[role])
        if not self._needs_conversion(role):
            return p
        if torch.is_grad_enabled() and p.requires_grad:
            return self._convert(role, p)
        key = (p.data_ptr(), p._version, tuple(p.shape), p.stride(), p.dtype, p.device)
        hit = self._cache.get(role)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, self._convert(role, p))
            self._cache[role] = hit
        return hit[1]


def _gated_experts_roles(module: nn.Module, a: torch.Tensor, b: torch.Tensor, zero: int = 0
                         ) -> tuple[str, dict[str, str]] | None:
    """(layout, {"gate_up": name, "down": name}) of two packed gated weights by their shapes
    (`classify.packed_orientation` past the expert dim): "out_in" gate_up [E, 2F, D] + down
    [E, D, F], or "in_out" gate_up [E, D, 2F] + down [E, F, D]; None when neither fits. With
    `zero` identity experts gate_up may hold E + zero experts (down: E)."""
    if a.shape[0] != b.shape[0] and not (zero and abs(a.shape[0] - b.shape[0]) == zero):
        return None
    orient = packed_orientation([list(a.shape[1:]), list(b.shape[1:])])
    if orient is None:
        return None
    layout, i = orient
    g, d = (a, b) if i == 0 else (b, a)
    if g.shape[0] not in (d.shape[0], d.shape[0] + zero):
        return None
    names = {id(p): n for n, p in module.named_parameters(recurse=False)}
    return layout, {"gate_up": names[id(g)], "down": names[id(d)]}


def _experts_bindings(module: nn.Module, fn: Callable, block: Block | None = None,
                      kernel_bias: bool = False) -> dict[str, Callable]:
    """Packed experts: ``forward(x, topk_indices, topk_weights)`` in any argument order, weights
    found by their shapes: ``[E, 2F, D]`` (gate/up) and ``[E, D, F]`` (down) for a gated block,
    or ``[E, D, 2F]`` and ``[E, F, D]`` (used as x @ W); ``[E, F, D]`` (up) and ``[E, D, F]``
    (down), each the other's transpose, for a non-gated one (the kernel then is the `mlp`
    variant's). Which of a non-gated pair is up is x's width: up ends in D. With F == D the
    shapes cannot tell, so both assignments are offered and the first-call calibration keeps the
    one that reproduces the block.

    A gated block's gate/up split and biases come from the classifier (``block.attrs``:
    ``gate_up_split``, ``gate_up_bias``, ``down_bias``; ``weight_layout`` must agree with the
    shapes); a graph classified before they were recorded means [gate | up] halves, no biases.
    An unread split, or biases the kernel was not rendered with (``kernel_bias``, the `bias`
    render parameter), give no binding. Weights in another layout are converted by
    `_ExpertWeights`."""
    packed = [p for p in module.parameters(recurse=False) if p.ndim == 3]
    if len(packed) != 2:
        return {}
    a, b = packed
    zero = int((block.attrs.get("zero_experts") or 0) if block is not None else 0)
    roles = _gated_experts_roles(module, a, b, zero)
    if roles is None:
        if a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2] and a.shape[2] == b.shape[1]:
            return _mlp_experts_bindings(module, fn, a, b)
        return {}
    layout, names = roles
    attrs = block.attrs if block is not None else {}
    split = attrs.get("gate_up_split", "halves")
    if attrs.get("weight_layout", layout) != layout or split not in ("halves", "interleaved"):
        return {}
    biases = {k: attrs.get(k) for k in ("gate_up_bias", "down_bias")}
    has_bias = all(biases.values())
    if has_bias != kernel_bias or (any(biases.values()) and not has_bias):
        return {}
    if has_bias:
        own = dict(module.named_parameters())
        if any(n not in own for n in biases.values()):
            return {}
        names.update(biases)
    weights = _ExpertWeights(module, names, layout, split)
    roles_used = ("gate_up", "down", "gate_up_bias", "down_bias") if has_bias else ("gate_up", "down")

    def call(*args, **kwargs):
        x, idx, w = _experts_args(args, kwargs)
        ws = [weights.get(r) for r in roles_used]
        if not zero:
            return fn(x, idx, w, *ws)
        # Identity ("zero") experts: slots >= E return r * x. The kernel gets the E real experts
        # (gate_up's first E) and those slots as expert 0 with weight 0 (masked_fill: no gradient
        # through the kernel's slot); their r * x is added here, with its gradient to r and x.
        e = ws[1].shape[0]
        ws = [t[:e] if t.shape[0] != e else t for t in ws]
        slot = idx >= e
        y = fn(x, idx.masked_fill(slot, 0), w.masked_fill(slot, 0), *ws)
        return y + (x * (w * slot).sum(-1, keepdim=True)).to(y.dtype)

    how = "" if (layout, split, has_bias) == ("out_in", "halves", False) else \
        f"; {names['gate_up']} {layout} {split}" + (" + biases" if has_bias else "") + " -> kernel layout"
    if zero:
        how += f"; {zero} identity (zero) experts added in torch"
    return {f"x, topk_indices, topk_weights (by dtype and width){how}": call}


def _mlp_experts_bindings(module: nn.Module, fn: Callable, a: torch.Tensor, b: torch.Tensor
                          ) -> dict[str, Callable]:
    """Non-gated packed experts: up [E, F, D] and down [E, D, F] (see `_experts_bindings`). The
    weights are looked up by name at call time: FSDP2 swaps a sharded module's parameters."""
    names = {id(p): n for n, p in module.named_parameters(recurse=False)}
    na, nb = names[id(a)], names[id(b)]

    def bind(up_name: str | None, down_name: str | None):
        def call(*args, **kwargs):
            x, idx, w = _experts_args(args, kwargs)
            wa, wb = getattr(module, na), getattr(module, nb)
            if up_name is None:  # F != D: up is the weight whose last dim is x's width
                up, down = (wa, wb) if wa.shape[-1] == x.shape[-1] else (wb, wa)
            else:
                up, down = getattr(module, up_name), getattr(module, down_name)
            return fn(x, idx, w, up, down)
        return call

    if a.shape[1] != a.shape[2]:
        return {f"x, topk_indices, topk_weights; up/down = {na}/{nb} by x's width": bind(None, None)}
    return {f"x, topk_indices, topk_weights; up={na}, down={nb}": bind(na, nb),
            f"x, topk_indices, topk_weights; up={nb}, down={na}": bind(nb, na)}


class _ConvIntercept(TorchFunctionMode):
    """Routes ``conv1d(x, w, b, padding=K-1, groups=C)`` with our weight to the kernel."""

    def __init__(self, weight: torch.Tensor, fn: Callable, record: PatchRecord):
        super().__init__()
        self.ptr, self.fn, self.record = weight.untyped_storage().data_ptr(), fn, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.conv1d, torch.conv1d):
            a = {**dict(zip(_CONV_ARGS, args)), **kwargs}
            x, w = a.get("input"), a.get("weight")
            if isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() == self.ptr \
                    and isinstance(x, torch.Tensor) and x.dim() == 3:
                k = w.shape[-1]
                pad = a.get("padding", 0)
                pad = pad[0] if isinstance(pad, (list, tuple)) else pad
                ones = all((v[0] if isinstance(v, (list, tuple)) else v) == 1
                           for v in (a.get("stride", 1), a.get("dilation", 1)))
                if pad == k - 1 and ones and a.get("groups", 1) == w.shape[0] and \
                        x.shape[-1] >= k - 1:
                    y = self.fn(x.transpose(1, 2), w.reshape(w.shape[0], k), a.get("bias"))
                    self.record.status = "active"
                    # conv1d with padding K-1 returns T + K - 1 steps; callers keep the first T
                    # (that is what makes it causal). The K - 1 trailing steps only see the last
                    # K - 1 inputs: computed exactly here, so the patch is a true drop-in.
                    tail = func(x[..., x.shape[-1] - (k - 1):], w, a.get("bias"),
                                padding=k - 1, groups=w.shape[0])[..., k - 1:]
                    return torch.cat([y.transpose(1, 2), tail], dim=-1)
        return func(*args, **kwargs)


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _patch_conv(model: nn.Module, block: Block, fn: Callable, record: PatchRecord,
                patches: PatchSet) -> None:
    weight = dict(model.named_parameters()).get(block.path + ".weight")
    modules = dict(model.named_modules())
    if weight is None:
        record.status, record.detail = "rejected", "no weight parameter at the block path"
        return
    # The conv runs inside the nearest ancestor that is a module call: intercept there.
    owner_path = block.path.rsplit(".", 1)[0] if "." in block.path else ""
    owner = modules[owner_path]
    original = owner.forward
    intercept = _ConvIntercept(weight, fn, record)

    def forward(*args, **kwargs):
        # FSDP2 swaps parameters (sharded outside, unsharded inside forward): match the weight
        # the conv module holds now.
        w = modules[block.path].weight if block.path in modules else weight
        intercept.ptr = w.untyped_storage().data_ptr()
        with intercept:
            return original(*args, **kwargs)

    had_own, previous = "forward" in owner.__dict__, owner.__dict__.get("forward")
    owner.forward = forward
    record.binding = f"conv1d calls with {block.path}.weight inside {owner_path or 'model'}"

    def undo() -> None:
        if had_own:
            owner.forward = previous
        else:
            owner.__dict__.pop("forward", None)

    patches._undo.append(undo)


def _patch_sparse(model: nn.Module, block: Block, kernels: dict, record: PatchRecord,
                  patches: PatchSet) -> None:
    """`sparse_attention.topk`: the gathered-attention module (under the family, or under
    ``family:gathered`` when another variant took that key) bound inside the block's forward by
    a top-k + attention intercept (`onboarding._patch_sparse`)."""
    from onboarding._patch_sparse import patch_sparse_block

    module = dict(model.named_modules()).get(block.path)
    if module is None:
        record.status, record.detail = "rejected", "no module at this path"
        return
    fam = "sparse_attention"
    kmods = [kernels.get((block.path, key)) for key in (fam, f"{fam}:gathered")]
    undo = patch_sparse_block(module, kmods, record)
    if undo is not None:
        record.binding = "calibrating: top-k + attention intercept"
        patches._undo.append(undo)


PATCHABLE = {"norm.rms": "rmsnorm", "norm.rms_gated": "rmsnorm", "norm.layer": "layernorm",
             "mlp.dense": "swiglu",
             "moe.shared_expert": "swiglu", "conv.causal1d": "conv1d",
             "moe.experts": "moe_experts", "moe.router": "moe_router",
             "sparse_attention.topk": "sparse_attention",
             "linear_attention.gated_delta": "gated_delta",
             "linear_attention.kimi_delta": "kimi_delta"}
# Further families a kind's blocks may be served by, tried after its PATCHABLE one: split-by-size
# per-expert linears (`moe.experts` with layout "split_linear") take `grouped_linear`.
ALSO_PATCHABLE = {"moe.experts": ("grouped_linear",)}


def patch_model(model: nn.Module, graph: OpGraph,
                kernels: dict[tuple[str, str], ModuleType],
                kinds: set[str] | None = None) -> PatchSet:
    """Patch every block of ``graph`` whose (path, family) has a module in ``kernels``.

    ``kernels`` maps (block path, family) to a loaded rendered module (see
    `onboarding.generate.kernels_for`). Returns a `PatchSet`; ``restore()`` undoes everything.
    """
    modules = dict(model.named_modules())
    patches = PatchSet()
    for block in graph.blocks:
        if block.kind not in PATCHABLE or (kinds and block.kind not in kinds):
            continue
        family, kmod = next(((f, kernels[(block.path, f)])
                             for f in (PATCHABLE[block.kind], *ALSO_PATCHABLE.get(block.kind, ()))
                             if (block.path, f) in kernels), (None, None))
        if kmod is None:
            continue
        record = PatchRecord(path=block.path, kind=block.kind, family=family)
        patches.records.append(record)
        if block.kind == "sparse_attention.topk":
            _patch_sparse(model, block, kernels, record, patches)
            continue
        fn = entry_function(kmod)
        if block.kind.startswith("linear_attention."):
            from onboarding._patch_linear_attention import patch_linear_attention

            module = modules.get(block.path)
            undo = patch_linear_attention(module, fn, record) if module is not None else None
            if undo is not None:
                patches._undo.append(undo)
            continue
        if block.kind == "conv.causal1d":
            _patch_conv(model, block, fn, record, patches)
            continue
        module = modules.get(block.path)
        if module is None:
            record.status, record.detail = "rejected", "no module at this path"
            continue
        adapt = _same
        if block.kind == "norm.layer":
            bindings = _layer_norm_bindings(block, module, fn,
                                            bool(getattr(kmod, "PARAMS", {}).get("has_bias")))
        elif block.kind.startswith("norm."):
            bindings = _norm_bindings(block, module, fn, _norm_takes_weight(kmod))
        elif family == "grouped_linear":
            from onboarding._patch_grouped_linear import grouped_linear_bindings

            bindings = grouped_linear_bindings(block, module, fn)
        elif block.kind == "moe.experts":
            bindings = _experts_bindings(module, fn, block, bool(getattr(kmod, "PARAMS", {}).get("bias")))
        elif block.kind == "moe.router":
            from onboarding._patch_router import router_adapt, router_bindings

            bindings, adapt = router_bindings(block, module, fn, kmod), router_adapt
        else:
            bindings = _mlp_bindings(module, fn)
        if not bindings:
            record.status, record.detail = "rejected", "structure does not fit the kernel"
            continue
        had_own = "forward" in module.__dict__
        module.forward = _Calibrated(module, record, bindings, adapt)

        def undo(module=module, had_own=had_own):
            if not had_own:
                module.__dict__.pop("forward", None)

        patches._undo.append(undo)
    return patches
