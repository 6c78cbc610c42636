"""Kernel tasks: what a kernel writer (the LLM path, a person, the Inductor fallback) gets for a
block that no family serves.

One `KernelTask` per block that `map` left uncovered (the coverage entry of its core op is
``uncovered``; blocks that a fast torch path serves, embeddings and the vocabulary projection,
are not tasks) and per block whose family failed alignment. A task holds the block's structure
from ``opgraph.json`` (kind, attrs, its ATen op histogram, evidence, parameter shapes), the
source of its module class, of the classes of its child modules and of the module-level
functions its forward calls, its boundary tensors at the proxy size and at full size, and one
or two built-in families to show as worked examples. Examples are picked by structure: a
prototype block of the task's structure (a recurrence, a router, else a norm) is offered to every
registered family's `match`, so no family is named here.

Full-size shapes come from a forward of the full-size model on the ``meta`` device (no memory,
no compute) at the capture's batch and sequence length, read by hooks on the block. Where that
forward cannot run (data-dependent routing calls ``.item()``), each dim of the proxy shapes that
a parameter of the block (same name, full-size model), an integer config field or an integer
attribute of the block's module (a head dim it computes from the config) scales unambiguously
is mapped to its full-size value; batch and sequence stay. ``full_note`` says which of the two
it was.

A block whose recurrence is a weightless module of its own (``core_module`` in its attrs: xLSTM's
mLSTM cell inside the layer that holds its projections) gets its task at that module (`core_path`):
a kernel replaces the recurrence, the block's weight projections stay on the torch path (cuBLAS)
and out of the kernel writer's hands. The task's module fields (path, class, source, parameters,
boundary shapes) are the core module's; its structure fields (kind, attrs, op histogram, key) stay
the block's, since the block is what the opgraph lists and what a written family's `match` sees.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from onboarding.coverage import Coverage
from onboarding.graph.opgraph import Block, OpGraph, TensorMeta
from onboarding.load.spec import ModelSpec

MAX_FUNCTIONS = 12  # module-level functions followed from a forward, transitively
MAX_CLASSES = 6  # child module classes whose source is included
STATIC_OPS = ("embedding", "lm_head")  # kinds a fast torch path serves whole: never a task


@dataclass(kw_only=True)
class KernelTask:
    """Everything a kernel writer needs for one block (JSON-serialisable: `to_dict`)."""

    path: str  # the module a kernel replaces: the block's, or its core module's (`core_path`)
    block: str = ""  # the opgraph block the task is for (coverage and decisions are keyed by it)
    kind: str
    reason: str  # why it is a task: the coverage entry's reason, or the failed family's verdict
    op: str  # the uncovered op (coverage's `op`): "selective state-space scan", ...
    attrs: dict[str, Any] = field(default_factory=dict)
    class_name: str = ""
    source: str = ""  # the block's class, child module classes, module-level functions called
    source_note: str = ""  # where the source came from, or why it is unavailable
    functions: list[str] = field(default_factory=list)  # qualified names included in `source`
    op_histogram: dict[str, int] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)
    params: dict[str, list[int]] = field(default_factory=dict)  # proxy shapes
    params_full: dict[str, list[int]] = field(default_factory=dict)
    inputs: list[dict[str, Any]] = field(default_factory=list)  # proxy size: {shape, dtype}
    outputs: list[dict[str, Any]] = field(default_factory=list)
    inputs_full: list[dict[str, Any]] = field(default_factory=list)
    outputs_full: list[dict[str, Any]] = field(default_factory=list)
    full_note: str = ""  # how the full-size shapes were obtained
    batch: int = 1
    seq: int = 0
    examples: list[str] = field(default_factory=list)  # built-in families shown as examples
    examples_note: str = ""
    failed_family: str | None = None  # set for a block whose family failed alignment
    # for such a block: what that alignment measured there (`onboarding.generate.retry`), so the
    # retry's prompt says how the family failed, not only that it did
    alignment_failure: dict[str, Any] = field(default_factory=dict)
    # and, when the LLM path wrote that family, its files as the answer had them
    # (`retry.previous_family`), so the retry can fix that code rather than start over
    previous_family: dict[str, Any] = field(default_factory=dict)
    key: str = ""  # blocks with the same key are the same problem (one check serves them all)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def block_path(self) -> str:
        """The opgraph block's path (``block``; a task saved before it existed: ``path``)."""
        return self.block or self.path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelTask:
        return cls(**d)


def _metas(ts: list[TensorMeta]) -> list[dict[str, Any]]:
    return [{"shape": list(t.shape), "dtype": t.dtype} for t in ts]


def structure_key(block: Block) -> str:
    """Equal for blocks that pose the same kernel problem: kind, class, attrs, op histogram,
    parameter and boundary shapes (the 48 Mamba mixers of a hybrid are one problem)."""
    blob = json.dumps([block.kind, block.class_name, block.attrs, block.op_histogram,
                       block.params, _metas(block.inputs), _metas(block.outputs)],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# -- which blocks are tasks --------------------------------------------------------------------

def core_path(block: Block) -> str:
    """The module a kernel for ``block`` replaces: its weightless recurrence's module when the
    classifier recorded one (``core_module``, relative to the block), else the block's own."""
    core = block.attrs.get("core_module")
    return f"{block.path}.{core}" if core else block.path


def task_blocks(graph: OpGraph, coverage: Coverage,
                failed: dict[str, str] | None = None) -> list[tuple[Block, str, str, str | None]]:
    """(block, op, reason, failed family) for each block that is a task, in graph order:
    an ``uncovered`` coverage entry (not an embedding or vocabulary projection), or a path in
    ``failed`` (block path -> "family: why it failed alignment")."""
    by_path = {b.path: b for b in graph.blocks}
    out: list[tuple[Block, str, str, str | None]] = []
    seen: set[str] = set()
    for e in coverage.entries:
        if e.status != "uncovered" or e.kind in STATIC_OPS or e.path in seen:
            continue
        if e.path in by_path:
            seen.add(e.path)
            out.append((by_path[e.path], e.op, e.reason, None))
    for path, why in (failed or {}).items():
        if path in by_path and path not in seen:
            seen.add(path)
            family = why.split(":", 1)[0].strip() or None
            out.append((by_path[path], by_path[path].kind, f"family failed alignment: {why}",
                        family))
    order = {b.path: i for i, b in enumerate(graph.blocks)}
    return sorted(out, key=lambda t: order[t[0].path])


# -- source ------------------------------------------------------------------------------------

def _own_source(obj: Any) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None


def _called_names(fn_source: str) -> list[str]:
    """Bare names called in ``fn_source`` (``f(x)``, not ``self.f(x)``), in order."""
    try:
        tree = ast.parse(fn_source)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id not in names:
            names.append(node.func.id)
    return names


def _is_library(obj: Any) -> bool:
    mod = getattr(obj, "__module__", "") or ""
    return mod.split(".")[0] in ("torch", "builtins", "typing", "math", "functools")


def module_source(module: nn.Module) -> tuple[str, list[str], str]:
    """(source, qualified names included, note): the module's class, the classes of its child
    modules (not torch's), and module-level functions the class calls, transitively (bounded)."""
    cls = type(module)
    parts: list[str] = []
    names: list[str] = []
    src = _own_source(cls)
    if src is None:
        return "", [], f"source of {cls.__module__}.{cls.__qualname__} unavailable " \
            "(defined without a file: built in a REPL or generated)"
    parts.append(f"# {cls.__module__}.{cls.__qualname__}\n{src}")
    names.append(f"{cls.__module__}.{cls.__qualname__}")
    classes = []
    for child in module.modules():
        c = type(child)
        if c is not cls and c not in classes and not _is_library(c):
            classes.append(c)
    missing = []
    for c in classes[:MAX_CLASSES]:
        s = _own_source(c)
        if s is None:
            missing.append(c.__qualname__)
            continue
        parts.append(f"# {c.__module__}.{c.__qualname__}\n{s}")
        names.append(f"{c.__module__}.{c.__qualname__}")
    # module-level functions the class (and child classes) call, followed transitively
    queue = [(cls, src)] + [(c, _own_source(c) or "") for c in classes[:MAX_CLASSES]]
    homes = {c.__module__ for c in (cls, *classes[:MAX_CLASSES])}
    done: set[int] = set()
    while queue and len(names) < MAX_FUNCTIONS + 1 + MAX_CLASSES:
        owner, text = queue.pop(0)
        home = inspect.getmodule(owner)
        glb = getattr(home, "__dict__", {})
        for name in _called_names(text):
            fn = glb.get(name)
            # functions of the model's own file: decorators and helpers imported from the
            # framework (hub kernels, deprecation shims) are not the block's computation
            if not inspect.isfunction(fn) or id(fn) in done or \
                    fn.__module__ not in homes:
                continue
            done.add(id(fn))
            s = _own_source(fn)
            if s is None:
                missing.append(name)
                continue
            parts.append(f"# {fn.__module__}.{fn.__qualname__}\n{s}")
            names.append(f"{fn.__module__}.{fn.__qualname__}")
            queue.append((fn, s))
    note = f"inspect.getsource of {len(names)} definitions"
    if len(classes) > MAX_CLASSES:
        note += f"; {len(classes) - MAX_CLASSES} further child classes left out"
    if missing:
        note += f"; source unavailable for {', '.join(missing)}"
    return "\n\n".join(parts), names, note


# -- full-size shapes --------------------------------------------------------------------------

def _tensor_metas(obj: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append({"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")})
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "to_tuple"):  # transformers ModelOutput
            walk(x.to_tuple())

    walk(obj)
    return out


class _Stop(Exception):
    pass


def meta_boundary(model: nn.Module, path: str, inputs: tuple, kwargs: dict,
                  what: str = "meta forward of the full-size model"
                  ) -> tuple[list[dict], list[dict]] | str:
    """(inputs, outputs) of the module at ``path`` on its first call during a forward of
    ``model`` (on meta; ``what`` names it in the reason), or the reason it could not be read."""
    mod = dict(model.named_modules()).get(path)
    if mod is None:
        return f"no module {path} in the model of the {what}"
    seen: dict[str, list[dict]] = {}

    def pre(m, args, kw):
        seen.setdefault("in", _tensor_metas(args) + _tensor_metas(kw))

    def post(m, args, kw, out):
        if "out" not in seen:
            seen["out"] = _tensor_metas(out)
            raise _Stop

    handles = [mod.register_forward_pre_hook(pre, with_kwargs=True),
               mod.register_forward_hook(post, with_kwargs=True)]
    try:
        model(*inputs, **kwargs)
    except _Stop:
        pass
    except Exception as exc:  # data-dependent ops do not run on meta
        line = (str(exc).strip().splitlines() or [""])[0][:160]
        return f"{what} failed ({type(exc).__name__}: {line})"
    finally:
        for h in handles:
            h.remove()
    if "out" not in seen:
        return f"{path} was not called by the {what}"
    return seen["in"], seen["out"]


def dim_map(proxy_params: dict[str, list[int]], full_params: dict[str, list[int]],
            proxy_cfg: dict[str, Any] | None, full_cfg: dict[str, Any] | None,
            proxy_attrs: dict[str, Any] | None = None, full_attrs: dict[str, Any] | None = None
            ) -> tuple[dict[int, int], set[int]]:
    """(proxy dim -> full dim, ambiguous proxy dims): from the block's parameter shapes, name by
    name, then, for dims no parameter decides, integer config fields and the integer attributes
    of the block's module (``vars``, name by name): a head dim the module computes from the
    config has no field of its own (hf:minimax's lightning attention: hidden_size /
    num_attention_heads, kept at the proxy's 32 in the full-size shapes, 128 there)."""
    pairs: dict[int, set[int]] = {}
    for name, ps in proxy_params.items():
        fs = full_params.get(name)
        if fs is not None and len(fs) == len(ps):
            for p, f in zip(ps, fs):
                pairs.setdefault(p, set()).add(f)
    from_params = set(pairs)
    for proxy, full in ((proxy_cfg, full_cfg), (proxy_attrs, full_attrs)):
        for k, p in (proxy or {}).items():
            f = (full or {}).get(k)
            if isinstance(p, int) and isinstance(f, int) and not isinstance(p, bool) \
                    and p > 1 and p not in from_params:
                pairs.setdefault(p, set()).add(f)
    mapping = {p: next(iter(fs)) for p, fs in pairs.items() if len(fs) == 1}
    return mapping, {p for p, fs in pairs.items() if len(fs) > 1}


def scale_shapes(metas: list[dict[str, Any]], mapping: dict[int, int], keep: set[int]
                 ) -> list[dict[str, Any]]:
    return [{"shape": [d if d in keep else mapping.get(d, d) for d in m["shape"]],
             "dtype": m["dtype"]} for m in metas]


# -- worked examples ---------------------------------------------------------------------------

def _prototypes(block: Block) -> list[tuple[str, Block]]:
    """(structure, a block of that structure in the classifier's vocabulary) to offer to the
    families' `match`: the closest structure first, a norm (the simplest family) last."""
    ops = block.op_histogram
    out: list[tuple[str, Block]] = []
    recurrent = block.kind.startswith("linear_attention") or ("cumsum" in ops and "exp" in ops)
    selects = any(op in ops for op in ("topk", "max", "argmax", "sort"))
    scores = any(op in ops for op in ("softmax", "sigmoid"))
    indices = any(t.dtype.startswith(("int", "uint")) for t in block.outputs)
    routed = block.kind == "moe.router" or "topk" in ops or (selects and scores and indices)
    if recurrent:
        out.append(("a recurrence (decay cumsum over a chunked state)", Block(
            path="prototype", kind="linear_attention.gated_delta", layer=None, class_name="",
            attrs={"decay_shape": [1, 4, 64], "cumsum_dim": -1, "per_channel_decay": False,
                   "chunk": 64})))
    if routed:
        out.append(("a router (scores + top-k)", Block(
            path="prototype", kind="moe.router", layer=None, class_name="",
            attrs={"n_experts": 8, "top_k": 2, "scoring": "softmax", "group_limited": False,
                   "score_bias": False, "renormalize": True})))
    out.append(("a row-wise norm (the simplest family)", Block(
        path="prototype", kind="norm.rms", layer=None, class_name="",
        attrs={"dim": 128, "eps": 1e-6, "unit_offset": False, "has_weight": True})))
    return out


def worked_examples(block: Block, limit: int = 2) -> tuple[list[str], str]:
    """Names of up to ``limit`` registered families to show as examples, and why."""
    from onboarding.families import match_block

    names: list[str] = []
    why: list[str] = []
    for what, proto in _prototypes(block):
        for name, _ in match_block(proto):
            if name not in names:
                names.append(name)
                why.append(f"{name}: serves {what}")
                break
        if len(names) >= limit:
            break
    return names, "; ".join(why) or "no registered family matched a prototype"


# -- building tasks ----------------------------------------------------------------------------

def spec_from_run(run_dir: Path) -> ModelSpec:
    """The ModelSpec a run directory's ``model.json`` was made from."""
    m = json.loads((Path(run_dir) / "model.json").read_text())
    return ModelSpec(ref=m.get("ref"), overrides=m.get("overrides") or {},
                     trust_remote_code=bool(m.get("trust_remote_code")),
                     proxy=m.get("proxy") or "tiny", part=m.get("part") or "language")


def build_tasks(run_dir: Path | None = None, *, graph: OpGraph | None = None,
                coverage: Coverage | None = None, spec: ModelSpec | None = None,
                failed: dict[str, str] | None = None, full_size: bool = True,
                alignment: dict[str, Any] | None = None,
                generated: Path | None = None) -> list[KernelTask]:
    """The kernel tasks of a run directory (``opgraph.json``, ``coverage.json``, ``model.json``)
    or of (graph, coverage, spec). ``failed``: block path -> "family: reason" for blocks whose
    family failed alignment; ``alignment``: that alignment's results (``alignment.json``), whose
    measurements at each such block its task carries (`retry.alignment_failure`);
    ``generated``: the folder of the run's LLM-written families (default with a run directory:
    its ``generated/families``), where such a block's family, when the LLM path wrote it, gives
    its task its code (`retry.previous_family`). ``full_size`` False skips the full-size shapes
    (no full build)."""
    from onboarding.generate.retry import alignment_failure, previous_family

    if run_dir is not None:
        run_dir = Path(run_dir)
        generated = generated or run_dir / "generated" / "families"
        graph = graph or OpGraph.load(run_dir / "opgraph.json")
        coverage = coverage or Coverage.load(run_dir / "coverage.json")
        spec = spec or spec_from_run(run_dir)
    if graph is None or coverage is None:
        raise ValueError("build_tasks needs a run directory or (graph, coverage)")
    picked = task_blocks(graph, coverage, failed)
    if not picked:
        return []
    proxy_mods: dict[str, nn.Module] = {}
    run_proxy = None  # (proxy on the CPU, its inputs, kwargs): a core module's proxy shapes
    full_model = None
    full_inputs: tuple = ()
    full_kwargs: dict = {}
    proxy_cfg = full_cfg = None
    note_model = ""
    if spec is not None:
        from onboarding.graph.parse import example_inputs, load_stage

        info = load_stage(spec.load(), spec.proxy)
        proxy = info.loaded.build(info.proxy_config, device="meta", seed=None)
        proxy_mods = dict(proxy.named_modules())
        if any(core_path(b) != b.path for b, *_ in picked):
            # the opgraph has the block's boundary, not its core module's: read by hooks during a
            # forward of the proxy (small by design) on the CPU; meta fails where the model's code
            # makes CPU tensors (a causal mask)
            cpu = info.loaded.build(info.proxy_config, seed=0).eval()
            run_proxy = (cpu, *example_inputs(cpu, info.proxy_config, graph.batch, graph.seq, 0))
        if full_size:
            full_model = info.loaded.build(device="meta", seed=None)
            args, full_kwargs = example_inputs(full_model, info.loaded.config, graph.batch,
                                               graph.seq, 0)
            full_inputs = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
            proxy_cfg, full_cfg = _cfg_dict(info.proxy_config), _cfg_dict(info.loaded.config)
    else:
        note_model = "no model spec given: source and full-size shapes unavailable"
    block_shapes = {b.path: {"inputs": _metas(b.inputs), "outputs": _metas(b.outputs)}
                    for b in graph.blocks} if alignment else {}
    tasks: list[KernelTask] = []
    for block, op, reason, failed_family in picked:
        t = KernelTask(path=core_path(block), block=block.path, kind=block.kind, reason=reason,
                       op=op, attrs=dict(block.attrs), class_name=block.class_name,
                       op_histogram=dict(block.op_histogram), evidence=list(block.evidence),
                       params=dict(block.params), inputs=_metas(block.inputs),
                       outputs=_metas(block.outputs), batch=graph.batch, seq=graph.seq,
                       failed_family=failed_family, key=structure_key(block))
        if failed_family:
            t.alignment_failure = alignment_failure(alignment, block.path, failed_family,
                                                    block_shapes)
            if generated is not None:
                t.previous_family = previous_family(Path(generated) / failed_family)
        mod = proxy_mods.get(t.path)
        if mod is not None:
            t.source, t.functions, t.source_note = module_source(mod)
        else:
            t.source_note = note_model or f"no module at {t.path} (an op group): " \
                "the source of its owner is not included"
        if t.path != block.path:
            _core_fields(t, mod, run_proxy)
        if full_model is not None:
            _full_shapes(t, full_model, full_inputs, full_kwargs, proxy_cfg, full_cfg, graph,
                         mod)
        elif not t.full_note:
            t.full_note = note_model or "full-size shapes not asked for"
        t.examples, t.examples_note = worked_examples(block)
        tasks.append(t)
    return tasks


def _core_fields(t: KernelTask, mod: nn.Module | None, run_proxy: tuple | None) -> None:
    """A core module's task: its class, parameters and proxy boundary shapes (``run_proxy``:
    the proxy on the CPU, its inputs and kwargs), not the enclosing block's."""
    t.evidence.append(f"the task is {t.path}, the weightless recurrence of {t.block} (its "
                      "core_module): the block's projections stay on the torch path")
    t.inputs, t.outputs, t.params, t.class_name = [], [], {}, ""
    if mod is None or run_proxy is None:
        return
    t.class_name = type(mod).__name__
    t.params = {n: list(p.shape) for n, p in mod.named_parameters()}
    model, args, kwargs = run_proxy
    with torch.no_grad():
        got = meta_boundary(model, t.path, args, kwargs, what="forward of the proxy")
    if isinstance(got, str):
        t.source_note += f"; proxy boundary shapes unavailable ({got})"
    else:
        t.inputs, t.outputs = got


def _cfg_dict(cfg: Any) -> dict[str, Any] | None:
    from onboarding.load.proxy import text_config

    if cfg is None:
        return None
    tc = text_config(cfg)
    return tc.to_dict() if hasattr(tc, "to_dict") else None


def _full_shapes(t: KernelTask, full: nn.Module, inputs: tuple, kwargs: dict,
                 proxy_cfg: dict | None, full_cfg: dict | None, graph: OpGraph,
                 proxy_mod: nn.Module | None = None) -> None:
    """The task's full-size shapes: read during a meta forward of ``full``, else the proxy's
    mapped (`dim_map`) through ``proxy_mod`` (the block's proxy module) and its full-size twin."""
    fmod = dict(full.named_modules()).get(t.path)
    if fmod is not None:
        prefix = t.path + "."
        t.params_full = {n[len(prefix):]: list(p.shape) for n, p in full.named_parameters()
                         if n.startswith(prefix) and n[len(prefix):] in t.params}
    got = meta_boundary(full, t.path, inputs, kwargs)
    if not isinstance(got, str):
        t.inputs_full, t.outputs_full = got
        t.full_note = (f"read by hooks on {t.path} during a forward of the full-size model on "
                       f"meta at batch {graph.batch}, seq {graph.seq}")
        return
    mapping, ambiguous = dim_map(t.params, t.params_full, proxy_cfg, full_cfg,
                                 vars(proxy_mod) if proxy_mod is not None else None,
                                 vars(fmod) if fmod is not None else None)
    keep = {graph.batch, graph.seq}
    t.inputs_full = scale_shapes(t.inputs, mapping, keep | ambiguous)
    t.outputs_full = scale_shapes(t.outputs, mapping, keep | ambiguous)
    scaled = sorted(f"{p}->{f}" for p, f in mapping.items() if p not in keep and p != f)
    t.full_note = (f"{got}; proxy dims mapped through the block's parameter shapes, integer "
                   f"config fields and its module's integer attributes "
                   f"({', '.join(scaled[:8]) or 'none changed'}); batch "
                   f"{graph.batch} and seq {graph.seq} kept")
    if ambiguous:
        t.full_note += f"; ambiguous dims left at proxy size: {sorted(ambiguous)}"


def save_tasks(tasks: list[KernelTask], path: Path) -> None:
    path.write_text(json.dumps([t.to_dict() for t in tasks], indent=1, default=str) + "\n")


def load_tasks(path: Path) -> list[KernelTask]:
    return [KernelTask.from_dict(d) for d in json.loads(Path(path).read_text())]
