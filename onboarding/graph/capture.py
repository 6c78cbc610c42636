"""Capture a model's ATen ops per module: torch.export first, a dispatch-mode recording as fallback.

Both paths produce the same `OpRecord` list, so classification does not care which one ran:
  - ``export``: `torch.export.export(..., strict=False)` with ``use_cache=False``; module paths
    come from each node's ``nn_module_stack``.
  - ``dispatch``: a real eager forward under a `TorchDispatchMode`, with forward hooks keeping
    the module stack. It needs no whole-graph trace, so data-dependent shapes are fine.

An eager forward with hooks always runs first: it checks the model runs at all and records every
module's input/output shapes. One more forward, with autograd on, finds the modules whose outputs
carry no gradient back to their own parameters (`no_gradient_probe`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from onboarding.graph.torch_paths import torch_reference_paths
from onboarding.errors import ModelRunError
from onboarding.graph.opgraph import TensorMeta


@dataclass(kw_only=True, slots=True)
class OpRecord:
    index: int
    module: str  # innermost module path ("" is the root)
    op: str  # canonical name: "topk", "linear", "transformers.grouped_mm_fallback"
    in_shapes: list[list[int] | None]  # one per positional arg, None for non-tensors
    in_dtypes: list[str | None]
    out_shapes: list[list[int]]
    out_dtypes: list[str]
    scalars: list[Any]  # non-tensor positional args (ints, floats, int lists), else None
    params: dict[int, str] = field(default_factory=dict)  # arg position -> parameter name
    # arg position -> the parameter whose copy the arg holds (`COPY_OPS`: a clone, a cast, a
    # gather of its rows, and views of those), in an eager recording only (`sliced_tables`)
    copies: dict[int, str] = field(default_factory=dict)
    # keyword args that are scalars or strings (gelu's approximate="tanh", softmax's dim=...)
    kwargs: dict[str, Any] = field(default_factory=dict)
    # which call of ``module`` in the forward ran the op (0: the first; a module called more than
    # once, like an lm_head shared with a multi-token-prediction head, has 1, 2, ...)
    call: int = 0


@dataclass(kw_only=True)
class Capture:
    method: str  # "export" | "dispatch"
    note: str
    records: list[OpRecord]
    module_io: dict[str, tuple[list[TensorMeta], list[TensorMeta]]]
    module_types: dict[str, str]
    exported: Any = None  # the ExportedProgram when export worked
    # modules whose outputs reach none of their own parameters (`no_gradient_probe`); None when
    # that forward was not run or failed (`no_gradient_note` then says why)
    no_gradient: set[str] | None = None
    no_gradient_note: str = ""
    # parameters of two or more dims read by slices and by no matmul or conv (`sliced_tables`)
    sliced_tables: list[str] = field(default_factory=list)


def canonical_op(target: Any) -> str:
    """``aten.topk.default`` -> ``topk``; other namespaces keep theirs (``transformers.x``)."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        ns, _, name = schema.name.partition("::")
        return name if ns == "aten" else f"{ns}.{name}"
    return getattr(target, "__name__", str(target))


def _meta(x: Any) -> TensorMeta | None:
    if isinstance(x, torch.Tensor):
        return TensorMeta(shape=[int(s) for s in x.shape], dtype=str(x.dtype).replace("torch.", ""))
    return None


def _scalar(x: Any) -> Any:
    if isinstance(x, (bool, int, float)) or x is None:
        return x
    if isinstance(x, (list, tuple)) and all(isinstance(v, (int, float, bool)) for v in x):
        return list(x)
    if isinstance(x, torch.SymInt):
        return int(x)
    return None


def _scalar_kwargs(kwargs: dict | None) -> dict[str, Any]:
    """The keyword arguments of one op that `_scalar` keeps, plus strings (enum-like options)."""
    out = {}
    for k, v in (kwargs or {}).items():
        if isinstance(v, str):
            out[k] = v
        elif (s := _scalar(v)) is not None:
            out[k] = s
    return out


def _io_hooks(model: nn.Module, io: dict, stack: list[str] | None = None,
              calls: dict[str, int] | None = None) -> list:
    handles = []
    for path, mod in model.named_modules():
        def pre(m, args, kwargs, path=path):
            if stack is not None:
                stack.append(path)
            if calls is not None:
                calls[path] = calls.get(path, -1) + 1
            if path not in io:
                flat, _ = tree_flatten((args, kwargs))
                io[path] = ([t for t in map(_meta, flat) if t is not None], [])

        def post(m, args, kwargs, out, path=path):
            if stack is not None and stack and stack[-1] == path:
                stack.pop()
            if not io[path][1]:
                flat, _ = tree_flatten(out)
                io[path][1].extend(t for t in map(_meta, flat) if t is not None)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


class _Recorder(TorchDispatchMode):
    def __init__(self, stack: list[str], param_ptrs: dict[int, str],
                 calls: dict[str, int] | None = None):
        super().__init__()
        self.stack, self.param_ptrs, self.records = stack, param_ptrs, []
        self.calls = calls if calls is not None else {}
        # storage -> the parameter a `COPY_OPS` output copied, while that output lives (a view
        # keeps its base alive, so a storage is forgotten only when nothing can read it)
        self.copy_ptrs: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        params, copies = {}, {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.device.type != "meta":
                ptr = a.untyped_storage().data_ptr()
                if (name := self.param_ptrs.get(ptr)) is not None:
                    params[i] = name
                elif (name := self.copy_ptrs.get(ptr)) is not None:
                    copies[i] = name
        op = canonical_op(func)
        if op in COPY_OPS and (read := params.get(0) or copies.get(0)) is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
                    ptr = t.untyped_storage().data_ptr()
                    self.copy_ptrs[ptr] = read
                    weakref.finalize(t, self.copy_ptrs.pop, ptr, None)
        outs = [t for t in map(_meta, tree_flatten(out)[0]) if t is not None]
        metas = [_meta(a) for a in args]
        self.records.append(OpRecord(
            index=len(self.records), module=self.stack[-1] if self.stack else "",
            op=op, in_shapes=[m.shape if m else None for m in metas],
            in_dtypes=[m.dtype if m else None for m in metas],
            out_shapes=[o.shape for o in outs], out_dtypes=[o.dtype for o in outs],
            scalars=[None if isinstance(a, torch.Tensor) else _scalar(a) for a in args],
            params=params, copies=copies, kwargs=_scalar_kwargs(kwargs),
            call=self.calls.get(self.stack[-1], 0) if self.stack else 0))
        return out


def _call(model: nn.Module, inputs: tuple, kwargs: dict) -> Any:
    try:
        # the model's own torch formulation, as torch.export records it (`_torch_paths`)
        with torch.no_grad(), torch_reference_paths():
            return model(*inputs, **kwargs)
    except Exception as exc:
        from onboarding.load.compat import describe_failure

        remote = describe_failure(exc, what="in forward", config=getattr(model, "config", None))
        if remote is not None:
            raise ModelRunError(remote + _gpu_kernel_hint(exc)) from exc
        from onboarding.load.model import model_code_site

        lines = str(exc).strip().splitlines()
        site = model_code_site(exc)
        raise ModelRunError(f"the model's forward raised {type(exc).__name__}: "
                            f"{lines[0] if lines else ''}{f' at {site}' if site else ''}"
                            f"{_gpu_kernel_hint(exc)}") from exc


# installed packages whose frames say nothing about which kernel library the model code picked
_PLUMBING = frozenset({"torch", "transformers", "triton", "onboarding"})


def _gpu_kernel_hint(exc: BaseException) -> str:
    """When the failure came out of Triton's launcher: the model code called a GPU kernel
    library (its own choice, e.g. because that package is importable) on the CPU tensors that
    parsing uses. Names the first such package in the traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    parts = [f.filename.replace("\\", "/").split("/") for f in frames]
    if not any("triton" in p[:-1] for p in parts):
        return ""
    for p in parts:
        if "site-packages" in p or "dist-packages" in p:
            i = max(i for i, x in enumerate(p) if x in ("site-packages", "dist-packages"))
            top = p[i + 1].removesuffix(".py") if i + 1 < len(p) else ""
            if top and top not in _PLUMBING:
                return (f" (the model code ran a Triton kernel of {top!r} on the CPU tensors that "
                        f"parsing uses: parse in an environment without {top!r})")
    return " (the model code ran a Triton kernel on the CPU tensors that parsing uses)"


def record_eager(model: nn.Module, inputs: tuple, kwargs: dict) -> Capture:
    """Run one eager forward, recording every ATen op with its module (the fallback capture)."""
    io: dict = {}
    stack: list[str] = []
    # parameters and buffers, as torch.export's signature names them (a router's selection bias
    # held as a buffer, DeepSeek-V3's e_score_correction_bias, is read as a bias either way)
    ptrs = {p.untyped_storage().data_ptr(): n for n, p in model.named_buffers()
            if p.device.type != "meta"}
    ptrs.update({p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()
                 if p.device.type != "meta"})
    calls: dict[str, int] = {}
    handles = _io_hooks(model, io, stack, calls)
    recorder = _Recorder(stack, ptrs, calls)
    try:
        with recorder:
            _call(model, inputs, kwargs)
    finally:
        for h in handles:
            h.remove()
    types = {p: type(m).__name__ for p, m in model.named_modules()}
    return Capture(method="dispatch", note="", records=recorder.records, module_io=io,
                   module_types=types, sliced_tables=sliced_tables(model, recorder.records))


# ops that read part of a tensor in place: a slice of it is a view (the same storage)
SLICE_OPS = {"slice", "select", "narrow"}
# ops that read a tensor's rows by a tensor of indices (into a new tensor: a copy of those rows);
# ``embedding``'s tables are the embedding blocks' and nn.Embedding's (`lookup_tables`)
INDEX_OPS = {"index", "index_select", "gather"}
# ops whose output holds (some of) their first argument's values in a storage of its own: what
# reads the output reads a copy of the parameter (`_Recorder.copy_ptrs`)
COPY_OPS = INDEX_OPS | {"clone", "_to_copy", "repeat", "expand_copy", "_reshape_copy"}
# what else a table's reads may be: other views of it, and sums and products with activations
_TABLE_READS = SLICE_OPS | COPY_OPS | {
    "view", "_reshape_alias", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze",
    "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "add", "sub", "rsub",
    "mul", "div"}


def sliced_tables(model: nn.Module, records: list[OpRecord]) -> list[str]:
    """The parameters of two or more dims that ``records`` (an eager forward's, `_Recorder`:
    an op reads a parameter when it reads its storage, so a view of it too, and a copy of it
    when it reads one that `COPY_OPS` made) read by a slice or a tensor index and otherwise only
    by views, copies, sums and products: a learned position table ``pos[:T]`` or
    ``pos[position_ids]`` added to the embeddings, copied on its way or not, is read, not
    multiplied (`onboarding.train.flops.lookup_tables`). A weight sliced or gathered into a
    matmul (a packed projection's rows, an expert's ``W[e]``, a weight per token ``W[ids]``)
    has the matmul among the readers of it or of its copy (an einsum copies a strided slice
    before its bmm); one read by any other op is no table here either. The export's records
    cannot tell: its matmul reads the slice's node, not the parameter."""
    dims = {n: p.ndim for n, p in model.named_parameters()}

    def reads(r: OpRecord) -> set[str]:
        return {*r.params.values(), *r.copies.values()}

    indexed = {n for r in records if r.op in SLICE_OPS | INDEX_OPS for n in reads(r)}
    other = {n for r in records if r.op not in _TABLE_READS for n in reads(r)}
    return sorted(n for n in indexed - other if dims.get(n, 0) >= 2)


def no_gradient_probe(model: nn.Module, inputs: tuple, kwargs: dict) -> set[str] | None:
    """Modules holding floating-point parameters whose outputs, in every call, reach none of
    those parameters in autograd's graph: one forward with autograd on (every such parameter
    requiring a gradient meanwhile), and at each module's return a walk back from its outputs
    that stops at the graph nodes of its inputs. An integer output (top-k positions), a float
    made only by ops with no gradient path (a mask scattered or filled with constants at those
    positions, a comparison), a ``.detach()`` or a ``no_grad`` region all leave the walk short
    of the parameters: a loss on the model's output can never train them. A module that handed
    out no element (empty tensors: a compressor with no full window at this length) shows
    nothing and is not listed. Raises what that forward raised (a model that needs autograd off):
    `capture` notes it and goes on without the probe."""
    owned = {path: {id(p) for p in m.parameters() if p.is_floating_point()}
             for path, m in model.named_modules()}
    owned = {path: ids for path, ids in owned.items() if ids}
    frontiers: dict[str, list[set]] = {}
    shown: set[str] = set()  # handed out a non-empty tensor
    reached: set[str] = set()

    def pre(m, args, kw, path):
        frontiers.setdefault(path, []).append(
            {t.grad_fn for t in tree_flatten((args, kw))[0]
             if isinstance(t, torch.Tensor) and t.grad_fn is not None})

    def post(m, args, kw, out, path):
        stop = frontiers[path].pop()
        if any(isinstance(t, torch.Tensor) and t.numel() for t in tree_flatten(out)[0]):
            shown.add(path)
        if path not in reached and _reaches(out, owned[path], stop):
            reached.add(path)

    modules = dict(model.named_modules())
    handles = [h for path in owned for h in (
        modules[path].register_forward_pre_hook(
            lambda m, a, k, path=path: pre(m, a, k, path), with_kwargs=True),
        modules[path].register_forward_hook(
            lambda m, a, k, o, path=path: post(m, a, k, o, path), with_kwargs=True))]
    frozen = [p for p in model.parameters() if p.is_floating_point() and not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        with torch.enable_grad(), torch_reference_paths():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(False)
    return shown - reached


def _reaches(out: Any, params: set[int], stop: set) -> bool:
    """Whether autograd's graph leads from a tensor in ``out`` to a parameter whose id is in
    ``params`` without passing a node in ``stop`` (the module's inputs: what came before)."""
    todo, seen = [], set()
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if t.grad_fn is None and id(t) in params:  # a parameter handed out as it is
                return True
            if t.grad_fn is not None:
                todo.append(t.grad_fn)
    while todo:
        node = todo.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in params:  # AccumulateGrad of a parameter
            return True
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return False


def records_from_export(ep: Any) -> list[OpRecord]:
    sig = ep.graph_signature
    param_of = dict(sig.inputs_to_parameters)
    param_of.update(sig.inputs_to_buffers)
    records: list[OpRecord] = []
    _walk_graph(ep.graph_module, param_of, records)
    return records


# Parameters reach ops through casts and views (`weight.to(dtype)`): follow those.
_PASSTHROUGH = {"to", "_to_copy", "alias", "view", "reshape", "squeeze", "unsqueeze", "t",
                "numpy_T", "transpose", "contiguous", "detach", "type_as",
                "_assert_tensor_metadata"}  # numpy_T: `weight.T` (Falcon's x @ W.T)


def _walk_graph(gm: Any, param_of: dict[str, str], records: list[OpRecord]) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            # e.g. wrap_with_set_grad_enabled around a @torch.no_grad() region: walk the
            # subgraph, mapping its placeholders to the operands that follow it.
            for i, a in enumerate(node.args):
                sub = getattr(gm, a.target, None) if isinstance(a, torch.fx.Node) and \
                    a.op == "get_attr" else None
                if isinstance(sub, torch.fx.GraphModule):
                    operands = node.args[i + 1:]
                    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
                    inner = {h.name: param_of[o.name] for h, o in zip(holders, operands)
                             if isinstance(o, torch.fx.Node) and o.name in param_of}
                    _walk_graph(sub, inner, records)
            continue
        first = node.args[0] if node.args else None
        if canonical_op(node.target) in _PASSTHROUGH and isinstance(first, torch.fx.Node) \
                and first.name in param_of:
            param_of[node.name] = param_of[first.name]
        stack = node.meta.get("nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        # a module's second call is keyed "<name>@1" (the third "@2", ...)
        key = list(stack)[-1] if stack else ""
        call = int(key.rsplit("@", 1)[1]) if "@" in key and key.rsplit("@", 1)[1].isdigit() else 0
        in_shapes, in_dtypes, scalars, params = [], [], [], {}
        for i, a in enumerate(node.args):
            val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
            m = _meta(val)
            in_shapes.append(m.shape if m else None)
            in_dtypes.append(m.dtype if m else None)
            scalars.append(None if isinstance(a, torch.fx.Node) else _scalar(a))
            if isinstance(a, torch.fx.Node) and a.name in param_of:
                params[i] = param_of[a.name]
        outs = [t for t in map(_meta, tree_flatten(node.meta.get("val"))[0]) if t is not None]
        records.append(OpRecord(index=len(records), module=module, op=canonical_op(node.target),
                                in_shapes=in_shapes, in_dtypes=in_dtypes,
                                out_shapes=[o.shape for o in outs],
                                out_dtypes=[o.dtype for o in outs], scalars=scalars,
                                params=params, kwargs=_scalar_kwargs(node.kwargs), call=call))


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch.export",
                                              "torch._export", "torch.fx", "torch._subclasses")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def capture(model: nn.Module, inputs: tuple, kwargs: dict, *, try_export: bool = True,
            on_step: Callable[[str], None] | None = None) -> Capture:
    """Capture ``model`` on ``inputs``: export when it works, the dispatch recording otherwise."""
    step = on_step or (lambda s: None)
    step("eager forward (module shapes, dispatch record)")
    eager = record_eager(model, inputs, kwargs)
    step("forward with autograd (modules that pass no gradient to their parameters)")
    try:
        eager.no_gradient = no_gradient_probe(model, inputs, kwargs)
    except Exception as exc:  # noqa: BLE001 - the capture stands without it, said in its note
        lines = str(exc).strip().splitlines()
        eager.no_gradient_note = (
            f"the forward with autograd raised {type(exc).__name__}: {lines[0][:200] if lines else ''}; "
            "modules passing no gradient are found by integer outputs only")
    if not try_export:
        eager.note = "export not attempted"
        return eager
    step("torch.export (non-strict)")
    try:
        # A failing export dumps the whole graph to the terminal: keep it quiet.
        with _quiet():
            ep = torch.export.export(model, inputs, kwargs=kwargs, strict=False)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        eager.note = (f"torch.export failed ({type(exc).__name__}: "
                      f"{lines[0][:200] if lines else ''}); used the dispatch-mode recording")
        return eager
    try:
        records = records_from_export(ep)
    except Exception as exc:  # e.g. a data-dependent (unbacked) size no shape can be read from
        lines = str(exc).strip().splitlines()
        eager.note = (f"torch.export's graph could not be read ({type(exc).__name__}: "
                      f"{lines[0][:200] if lines else ''}); used the dispatch-mode recording")
        return eager
    return Capture(method="export", note="torch.export.export(strict=False) succeeded",
                   records=records, module_io=eager.module_io,
                   module_types=eager.module_types, exported=ep, no_gradient=eager.no_gradient,
                   no_gradient_note=eager.no_gradient_note, sliced_tables=eager.sliced_tables)
