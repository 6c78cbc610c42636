"""The Inductor fallback: a block no family serves runs as ``torch.compile`` of its own forward
(the backward comes from AOTAutograd's joint graph), gated by the block check
(`onboarding.generate.blockcheck`) like any kernel.

Backend: Inductor's default for the device, C++/OpenMP on a CPU (`torch._inductor.config.
cpu_backend`), Triton on a GPU (`cuda_backend`); `backend_name()` says which. Shapes are
static (``dynamic=False``): each new size recompiles (the check's three distinct sizes: three
forward and three backward graphs per dtype). Automatic-dynamic shapes would compile fewer
graphs, but Inductor failed to compile Mamba-2's chunked scan with a symbolic sequence length
(docs/LOG.md), and static graphs are what the GPU benchmark times. `compiled(...).finish()`
reports how many graphs were compiled. Inductor's generated code (the Python wrapper with the
C++ or Triton kernels in it) is copied beside the verdict for review:
``<run_dir>/generated/inductor/<block>/`` holds ``code/*.py``, ``verdict.json`` and
``README.md``.

Robustness (a ladder per graph, `LadderBackend`): Inductor can fail to compile a graph that runs
fine eagerly (torch 2.11 on the H200: the split-scan codegen of Mamba-2's chunked cumsum, a
Triton compile of the mLSTM backend in a compile worker). Each graph dynamo hands over is tried
with Inductor's defaults, then with a safer configuration (`SAFE_CONFIG`: no split reductions or
scans, no persistent, mix-order or cooperative reductions, small fusions), then regionally: the
nodes Inductor's error names as the origins of the buffer it could not generate run eagerly and
the runs between them are compiled on their own (safe configuration); without such names the
graph is cut into halves; a segment that fails is halved until the failing nodes run eagerly,
one at a time. The backward is lowered
when the forward is (``force_non_lazy_backward_lowering``), so a backward that cannot compile
fails inside the ladder too. ``finish()`` records per graph the rung that served it, each
failure with its traceback (``compile_errors.txt`` beside the code), the regions compiled and the
nodes left eager with their source lines.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from onboarding.generate.blockcheck import BlockVerdict, Replacement, check_block
from onboarding.load.spec import ModelSpec

TARGET = "onboarding.generate.inductor:compiled"
GENERATED = Path("generated") / "inductor"


def backend_name(device: str | None = None) -> str:
    """Inductor's code generator for ``device`` (default: where kernels run)."""
    import torch._inductor.config as cfg

    if device is None:
        from onboarding.backend import kernel_device

        device = str(kernel_device())
    if device.startswith("cuda"):
        return f"inductor ({getattr(cfg, 'cuda_backend', 'triton')})"
    return f"inductor ({getattr(cfg, 'cpu_backend', 'cpp')}, OpenMP)"


def _code_files() -> dict[str, Path]:
    from torch._inductor.codecache import PyCodeCache

    out = {}
    for mod in list(PyCodeCache.modules):
        f = getattr(mod, "__file__", None)
        if f:
            out[f] = Path(f)
    return out


RUNGS = ("default", "safe", "regional")
# Inductor options off the beaten path turned off; names a torch version lacks are skipped
SAFE_CONFIG: dict[str, Any] = {
    "split_reductions": False, "max_fusion_size": 16, "triton.persistent_reductions": False,
    "triton.mix_order_reduction": False, "triton.cooperative_reductions": False,
    "triton.multi_kernel": 0}
MAX_TRIES = 40  # compiles one graph's regional rung may spend before leaving the rest eager


def _config_patch(rung: str) -> contextlib.ExitStack:
    """Inductor's configuration for ``rung`` (a context): the backward lowered with the forward;
    "safe"/"regional": `SAFE_CONFIG` and no split scans (`_NoSplit`)."""
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg
    from torch._inductor.virtualized import V

    stack = contextlib.ExitStack()
    if hasattr(fcfg, "force_non_lazy_backward_lowering"):
        stack.enter_context(fcfg.patch(force_non_lazy_backward_lowering=True))
    if rung != "default":
        known = {k: v for k, v in SAFE_CONFIG.items() if _has_option(icfg, k)}
        stack.enter_context(icfg.patch(known))
        if hasattr(V, "set_choices_handler"):  # absent in old torch: split reductions only
            stack.enter_context(V.set_choices_handler(_no_split_choices()))
    return stack


def _has_option(cfg: Any, key: str) -> bool:
    obj = cfg
    for part in key.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _no_split_choices() -> Any:
    """Inductor's heuristics with every reduction and scan in one program per row (a split
    scan is what failed on Mamba-2's chunked cumsum under torch 2.11's Triton codegen)."""
    from torch._inductor.choices import InductorChoices

    class _NoSplit(InductorChoices):
        @staticmethod
        def reduction_split_factor(*args: Any, **kwargs: Any) -> int:
            return 1

    return _NoSplit()


def _error(exc: BaseException) -> dict[str, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # Inductor wraps the cause: keep its type and message line and the last line
    head = next((ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)), "")
    short = f"{type(exc).__name__}: " + (lines[0][:200] if lines else "")
    if head and head not in short:
        short += f" ({head[:200]})"
    return {"error": short, "traceback": text}


def _where(node: Any) -> str:
    """An FX node as "target @ file:line" (its last source frame in the model's code)."""
    target = getattr(node.target, "__name__", None) or str(node.target)
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    loc = ""
    if frames:
        m = re.match(r'File "([^"]+)", line (\d+)', frames[-1])
        loc = f" @ {Path(m.group(1)).name}:{m.group(2)}" if m else ""
    return f"{node.op}:{target}{loc}"


@dataclass(kw_only=True)
class _Segment:
    nodes: list[Any]
    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    fn: Callable | None = None
    compiled: bool = False
    gm: Any = None


class LadderBackend:
    """A dynamo backend: each graph through `RUNGS` (module docstring), starting at ``start``.
    ``eager``: node names known to fail (from an earlier check): the regional rung leaves them
    eager at once instead of searching. ``compile_graph(gm, inputs, rung)`` is the one place
    Inductor is called (tests replace it)."""

    def __init__(self, start: str = "default", eager: list[str] | None = None,
                 max_tries: int = MAX_TRIES,
                 on_failure: Callable[[dict[str, Any]], None] | None = None):
        if start not in RUNGS:
            raise ValueError(f"inductor rung {start!r}: expected one of {', '.join(RUNGS)}")
        self.start, self.eager, self.max_tries = start, set(eager or ()), max_tries
        self.on_failure = on_failure  # called with the graph's record after each failed rung
        self.graphs: list[dict[str, Any]] = []

    def compile_graph(self, gm: Any, inputs: list[Any], rung: str) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        with _config_patch(rung):
            return compile_fx(gm, inputs)

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Callable:
        t0 = time.perf_counter()
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        rec: dict[str, Any] = {"graph": len(self.graphs), "nodes": len(nodes), "rung": None,
                               "failures": []}
        self.graphs.append(rec)
        for rung in RUNGS[RUNGS.index(self.start):]:
            try:
                if rung == "regional":
                    fn = self._regional(gm, nodes, rec)
                else:
                    fn = self.compile_graph(gm, list(example_inputs), rung)
            except Exception as exc:
                rec["failures"].append({"rung": rung, **_error(exc)})
                if self.on_failure is not None:
                    self.on_failure(rec)
                continue
            rec["rung"], rec["seconds"] = rung, round(time.perf_counter() - t0, 1)
            return fn
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        raise RuntimeError(f"Inductor failed on graph {rec['graph']} at every rung: "
                           + "; ".join(f"{f['rung']}: {f['error']}" for f in rec["failures"]))

    # -- the regional rung ---------------------------------------------------------------------

    def _regional(self, gm: Any, nodes: list[Any], rec: dict[str, Any]) -> Callable:
        tries = [0]
        segs: list[_Segment] = []
        run: list[Any] = []
        eager, why = set(self.eager), "known to fail"
        if not eager:  # the nodes Inductor's own error names (its IR's origins), eager first
            eager = _named_in_errors(nodes, rec["failures"])
            why = "named in Inductor's error"
            if eager:
                rec["hinted"] = sorted(eager)
        for n in nodes:  # the known-failing nodes eager, the runs between them compiled
            if n.name in eager:
                segs += self._place(gm, run, rec, tries) if run else []
                segs.append(self._eager(gm, [n], rec, why))
                run = []
            else:
                run.append(n)
        if run:
            if not segs:  # the whole graph already failed: start from its halves
                mid = len(run) // 2
                segs += self._place(gm, run[:mid], rec, tries) if mid else []
                segs += self._place(gm, run[mid:], rec, tries)
            else:
                segs += self._place(gm, run, rec, tries)
        rec["regions"] = sum(s.compiled for s in segs)
        rec["eager_nodes"] = [n.name for s in segs if not s.compiled for n in s.nodes]
        rec["eager"] = [_where(n) for s in segs if not s.compiled for n in s.nodes
                        if _computes([n])]
        rec["compiled_nodes"] = sum(len(s.nodes) for s in segs if s.compiled)
        rec["tries"] = tries[0]
        if not rec["regions"]:
            raise RuntimeError("no region of the graph compiled")
        return _runner(gm, segs)

    def _place(self, gm: Any, nodes: list[Any], rec: dict[str, Any], tries: list[int]
               ) -> list[_Segment]:
        seg = _segment(gm, nodes)
        if not _computes(nodes):
            return [self._eager(gm, nodes, rec, None, seg)]
        if tries[0] >= self.max_tries:
            return [self._eager(gm, nodes, rec, f"compile budget of {self.max_tries} spent", seg)]
        tries[0] += 1
        try:
            seg.fn = self.compile_graph(seg.gm, [_example(n) for n in seg.inputs], "regional")
            seg.compiled = True
            return [seg]
        except Exception as exc:
            if len(nodes) == 1:
                return [self._eager(gm, nodes, rec, _error(exc)["error"], seg)]
            mid = len(nodes) // 2
            return (self._place(gm, nodes[:mid], rec, tries)
                    + self._place(gm, nodes[mid:], rec, tries))

    @staticmethod
    def _eager(gm: Any, nodes: list[Any], rec: dict[str, Any], why: str | None,
               seg: _Segment | None = None) -> _Segment:
        seg = seg or _segment(gm, nodes)
        seg.fn, seg.compiled = seg.gm, False
        if why:
            rec.setdefault("eager_why", []).append(
                {"nodes": [_where(n) for n in nodes][:8], "why": why[:300]})
        return seg


_ORIGINS = re.compile(r"origin_node=([A-Za-z_]\w*)|origins=OrderedSet\(\[([^\]]*)\]\)")
MAX_HINTS = 8


def _named_in_errors(nodes: list[Any], failures: list[dict[str, Any]]) -> set[str]:
    """Compute nodes of this graph that Inductor's failure messages name as the origins of the
    buffer it could not generate (``origin_node=cumsum``, ``origins=OrderedSet([cumsum])``):
    names of its own ATen graph, often the FX node's; empty when none match or too many do."""
    text = "\n".join(f.get("traceback", "") + f.get("error", "") for f in failures)
    named: set[str] = set()
    for one, many in _ORIGINS.findall(text):
        named |= {one} if one else {x.strip() for x in many.split(",") if x.strip()}
    hits = {n.name for n in nodes if n.name in named and _computes([n])}
    return hits if len(hits) <= MAX_HINTS else set()


def _computes(nodes: list[Any]) -> bool:
    """Whether any node does tensor work (a run of getitem/get_attr is not worth a compile)."""
    import operator

    return any(n.op in ("call_function", "call_method", "call_module")
               and n.target is not operator.getitem for n in nodes)


def _example(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _segment(gm: Any, nodes: list[Any]) -> _Segment:
    """``nodes`` (contiguous in ``gm``'s order) as a GraphModule of their own: the values they
    read from outside become placeholders (in graph order), the values read after them (or
    returned) its outputs."""
    from torch import fx

    inside = set(nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = sorted({a for n in nodes for a in n.all_input_nodes if a not in inside},
                    key=order.__getitem__)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    g = fx.Graph()
    env: dict[Any, Any] = {}
    for a in inputs:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[n] for n in outputs))
    seg = _Segment(nodes=list(nodes), inputs=inputs, outputs=outputs)
    seg.gm = fx.GraphModule(gm, g)
    return seg


def _runner(gm: Any, segs: list[_Segment]) -> Callable:
    """The graph run segment by segment, compiled or eager, in its own order."""
    from torch import fx

    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")

    def run(*args: Any) -> Any:
        env = dict(zip(places, args))
        for s in segs:
            vals = s.fn(*[env[a] for a in s.inputs])
            env.update(zip(s.outputs, vals))
        return fx.node.map_arg(out_node.args[0], env.__getitem__)

    return run


# dynamo cache entries allowed per code object while a compiled block runs (`compiled`)
RECOMPILE_LIMIT = 4096


def _limit(name: str) -> int:
    return int(getattr(torch._dynamo.config, f"{name}_limit"))


def compiled(module: nn.Module, *, code_dir: str | None = None, dynamic: bool | None = False,
             forward: Callable | None = None, start: str = "default",
             eager: list[str] | None = None,
             on_failure: Callable[[dict[str, Any]], None] | None = None) -> Callable:
    """``torch.compile`` of ``module``'s forward (``forward``: another function to compile in
    its place) through `LadderBackend` (``start``, ``eager``: where an earlier check ended). The
    returned function has ``finish()``: copies the generated code written since into
    ``code_dir`` and returns {backend, graphs, files, rung, ladder}."""
    before = set(_code_files())
    ladder = LadderBackend(start=start, eager=eager, on_failure=on_failure)
    fn = torch.compile(forward or module.forward, dynamic=dynamic, backend=ladder)

    def call(*args, **kwargs):
        # past the recompile limit dynamo would quietly run the block's own code instead: a
        # block recorded as served by Inductor must raise then, never fall back unseen. Every
        # block of one class compiled here is one more entry of its forward's code (its own
        # backend, a guard no other entry passes), besides a check's sizes and dtypes: dynamo's
        # limit of 8 entries ended a run whose proxy had more such blocks (hy_v4_vl)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True,
                                        recompile_limit=max(RECOMPILE_LIMIT, _limit("recompile")),
                                        accumulated_recompile_limit=max(
                                            RECOMPILE_LIMIT, _limit("accumulated_recompile"))):
            return fn(*args, **kwargs)

    def finish() -> dict[str, Any]:
        new = {k: p for k, p in _code_files().items() if k not in before}
        files = []
        graphs = [{k: v for k, v in g.items() if k != "failures"}
                  | {"failures": [{"rung": f["rung"], "error": f["error"]}
                                  for f in g["failures"]]} for g in ladder.graphs]
        if code_dir is not None:
            dest = Path(code_dir) / "code"
            dest.mkdir(parents=True, exist_ok=True)
            for i, p in enumerate(sorted(new.values(), key=lambda p: p.stat().st_mtime)):
                if p.is_file():
                    target = dest / f"graph{i:02d}_{p.stem[:12]}.py"
                    shutil.copyfile(p, target)
                    files.append(str(target))
            errs = [f"== graph {g['graph']}, rung {f['rung']}: {f['error']}\n{f['traceback']}"
                    for g in ladder.graphs for f in g["failures"]]
            if errs:  # appended: the check calls finish() once per dtype
                with open(Path(code_dir) / "compile_errors.txt", "a") as fh:
                    fh.write("\n".join(errs) + "\n")
        return {"backend": backend_name(), "graphs": len(new), "files": files,
                "rung": furthest_rung(ladder.graphs), "ladder": graphs}

    call.finish = finish  # type: ignore[attr-defined]
    call.compiled = fn  # type: ignore[attr-defined]
    call.ladder = ladder  # type: ignore[attr-defined]
    return call


def furthest_rung(graphs: list[dict[str, Any]]) -> str:
    """The furthest rung any graph needed ("default" when none was compiled)."""
    used = [g.get("rung") or RUNGS[-1] for g in graphs]
    return max(used, key=RUNGS.index, default="default")


def ladder_summary(graphs: list[dict[str, Any]]) -> str:
    """One line: what the ladder did (empty when every graph compiled whole by default)."""
    bad = [g for g in graphs if g.get("rung") != "default"]
    if not bad:
        return ""
    parts = []
    for g in bad:
        fails = "; ".join(f"{f['rung']} failed: {f['error'][:160]}" for f in g["failures"])
        if g.get("rung") == "regional":
            eager = ", ".join(g.get("eager") or []) or "none"
            what = f"compiled in {g.get('regions')} regions, eager: {eager[:300]}"
        else:
            what = f"served by the {g.get('rung') or 'no'} rung"
        parts.append(f"graph {g['graph']}: {what}" + (f" ({fails})" if fails else ""))
    return " | ".join(parts)


def ladder_kwargs(code_dir: str | Path | None) -> dict[str, Any]:
    """`compiled`'s ``start`` and ``eager`` from the check's ``verdict.json`` in ``code_dir``:
    alignment's swap starts where the check ended instead of failing the same compiles again."""
    f = Path(code_dir) / "verdict.json" if code_dir else None
    if f is None or not f.exists():
        return {}
    arts = json.loads(f.read_text()).get("artifacts") or {}
    graphs = [g for a in arts.values() for g in (a or {}).get("ladder") or []]
    if not graphs:
        return {}
    eager = sorted({n for g in graphs for n in g.get("eager_nodes") or []})
    return {"start": furthest_rung(graphs), **({"eager": eager} if eager else {})}


def block_dir(run_dir: Path, path: str) -> Path:
    return Path(run_dir) / GENERATED / re.sub(r"[^A-Za-z0-9_.-]+", "_", path or "model")


def check_inductor(spec: ModelSpec, path: str, run_dir: Path, *, kind: str = "",
                   batch: int = 1, seq: int = 64, seed: int = 0, timeout_s: float = 600.0,
                   dtypes: list[str] | None = None,
                   sizes: list[tuple[int, int]] | None = None) -> BlockVerdict:
    """Compile the block at ``path`` with Inductor and gate it with the block check (in a
    subprocess); writes the generated code, ``verdict.json`` and a README into
    `block_dir(run_dir, path)`."""
    out = block_dir(run_dir, path)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    verdict = check_block(spec, path, Replacement(target=TARGET, kwargs={"code_dir": str(out)},
                                                  label="torch.compile (Inductor)"),
                          batch=batch, seq=seq, sizes=sizes, dtypes=dtypes, seed=seed,
                          kind=kind, timeout_s=timeout_s)
    verdict.notes.append(f"wall time of compile + check: {time.perf_counter() - t0:.1f} s")
    (out / "verdict.json").write_text(json.dumps(verdict.to_dict(), indent=1, default=str)
                                      + "\n")
    art = next(iter(verdict.artifacts.values()), {}) if verdict.artifacts else {}
    graphs = [g for a in verdict.artifacts.values() for g in (a or {}).get("ladder") or []]
    ladder = ladder_summary(graphs)
    (out / "README.md").write_text(
        f"# {path}: torch.compile (Inductor)\n\n"
        f"Backend: {art.get('backend', backend_name())}; graphs compiled in the check: "
        f"{art.get('graphs', '?')} (forward and backward, per dtype and dynamic recompile).\n"
        + (f"Compile ladder: rung {furthest_rung(graphs)}; {ladder} (tracebacks in "
           "compile_errors.txt).\n" if ladder else "")
        + f"Block check: {verdict.summary()}\n\n"
        "`code/` holds Inductor's generated modules as written by the check's process (the "
        "Python wrapper with the C++/OpenMP or Triton kernels inside), for review.\n")
    return verdict
