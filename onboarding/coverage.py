"""Coverage: for every block of an op graph, how each of its operators gets a fast path.

Each entry is one of:
  - ``kernel``: a reviewed rendered module in ``kernels/`` with exactly the parameters the block
    needs;
  - ``template``: a family template can render one (``onboard generate`` does);
  - ``torch_fast``: a fast torch path already serves it (flash SDPA, cuBLAS GEMMs, embedding
    gathers) and no kernel is needed;
  - ``uncovered``: no kernel, no template, no fast path yet;
  - ``generated``, ``inductor``: set by the generate stage's decision loop for a block that was
    uncovered (`onboarding.generate.decide`): an LLM-written family that passed its gate, or
    ``torch.compile`` of the block that passed the block check.

Which families serve a block comes from each family's ``match(block)`` (structure and attrs
only); the rules below add the fast torch paths and the known-uncovered cores.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onboarding.errors import InputError
from onboarding.graph.opgraph import Block, OpGraph
from onboarding.families import get_family, match_block, refused_by

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
# more folders of reviewed modules, os.pathsep-separated (searched after KERNELS_DIR)
KERNELS_ENV = "ONBOARD_KERNELS"
STATUSES = ("kernel", "template", "generated", "inductor", "torch_fast", "uncovered")

# The compute cores of these kinds need families that do not exist yet: they stay `uncovered`
# (with the reason) until a family's `match` accepts them.
CORE_OPS = {
    "linear_attention.gated_delta": "chunked gated delta rule",
    "linear_attention.kimi_delta": "chunked Kimi delta attention",
    "linear_attention.mamba": "selective state-space scan",
    "linear_attention.other": "linear-attention recurrence",
    "sparse_attention.topk": "indexer + top-k + gathered attention",
    "attention.compressed": "attention over pooled (compressed) key/value windows",
    "moe.router": "router scoring + top-k",
    "moe.experts": "permute -> grouped GEMM (SwiGLU or non-gated activation) -> unpermute",
    "conv.noncausal1d": "depthwise conv over the sequence (not causal)",
    "unknown": "unclassified compute",
}


@dataclass(kw_only=True, slots=True)
class CoverageEntry:
    path: str
    kind: str
    op: str  # what is covered: "rmsnorm", "projections (GEMM)", "attention core", ...
    status: str
    family: str | None = None
    variant: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    module: str | None = None  # the reviewed module's path for status "kernel"
    shapes: list[list[int]] = field(default_factory=list)
    dtype: str | None = None
    reason: str = ""


@dataclass(kw_only=True, slots=True)
class Coverage:
    model: str
    entries: list[CoverageEntry]

    def by_status(self, status: str) -> list[CoverageEntry]:
        return [e for e in self.entries if e.status == status]

    def served(self) -> list[CoverageEntry]:
        """The entries that bind a family to a block, the first of each (path, family, variant,
        params): a family that runs a block's whole module (an LLM-written family's
        ``block_forward``) has an entry for each op of the block it serves, and is one kernel
        for the block."""
        out: dict[tuple[str, str, str, str], CoverageEntry] = {}
        for e in self.entries:
            if e.family:
                key = (e.path, e.family, e.variant or "", json.dumps(e.params, sort_keys=True))
                out.setdefault(key, e)
        return list(out.values())

    def candidates(self) -> dict[tuple[str, str, str], CoverageEntry]:
        """Distinct (family, variant, params) that a template can render, first entry each."""
        out: dict[tuple[str, str, str], CoverageEntry] = {}
        for e in self.entries:
            if e.status in ("template", "kernel", "generated") and e.family:
                key = (e.family, e.variant or "", json.dumps(e.params, sort_keys=True))
                out.setdefault(key, e)
        return out

    def to_dict(self) -> dict[str, Any]:
        # the decision loop's statuses are counted where they occur (a run without uncovered
        # blocks keeps the counts it always had)
        counts = {s: n for s in STATUSES
                  if (n := len(self.by_status(s))) or s not in ("generated", "inductor")}
        return {"model": self.model, "counts": counts,
                "entries": [asdict(e) for e in self.entries]}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Coverage:
        d = json.loads(Path(path).read_text())
        return cls(model=d["model"], entries=[CoverageEntry(**e) for e in d["entries"]])


_HEADER = re.compile(r"^# family: (\S+)\s+variant: (\S+)\n# params: (.*)$", re.M)
_VERSION = re.compile(r"\(template version (\d+)\)")


def _template_version(family: str) -> int | None:
    try:
        return get_family(family).template_version
    except InputError:  # a family not loaded here: its modules count as they are
        return None


def kernel_roots() -> list[Path]:
    """Where reviewed modules are looked up: this checkout's kernels/, then the folders of
    `ONBOARD_KERNELS` (a team's kernel repository that `onboard pr` merges into)."""
    extra = [Path(p).expanduser() for p in os.environ.get(KERNELS_ENV, "").split(os.pathsep) if p]
    return [KERNELS_DIR, *extra]


def reviewed_kernels(root: Path | None = None) -> dict[tuple[str, str, str], Path]:
    """Reviewed rendered modules by (family, variant, params JSON), read from their headers; the
    first folder (`kernel_roots`) holding a key wins. A module rendered from an older version of
    its family's template is stale and left out: the new version needs its own review."""
    found: dict[tuple[str, str, str], Path] = {}
    for folder in [root] if root is not None else kernel_roots():
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*/*.py")):
            head = path.read_text()[:2000]
            m, v = _HEADER.search(head), _VERSION.search(head)
            if not m:
                continue
            current = _template_version(m.group(1))
            if v and current is not None and int(v.group(1)) != current:
                continue
            params = json.dumps(json.loads(m.group(3)), sort_keys=True)
            found.setdefault((m.group(1), m.group(2), params), path)
    return found


def _shapes(b: Block) -> tuple[list[list[int]], str | None]:
    metas = b.inputs or b.outputs
    return [t.shape for t in metas[:3]], (metas[0].dtype if metas else None)


def _fast_paths(b: Block) -> list[tuple[str, str]]:
    """(op, reason) for the parts of ``b`` that a fast torch path already serves."""
    ops = b.op_histogram
    out = []
    gemms = sum(n for op, n in ops.items() if op in ("linear", "mm", "addmm", "bmm"))
    # a weight used through `matmul` (x @ W.T, recorded so by export capture) is a GEMM too; a
    # matmul of two activations (attention scores written with torch.matmul) is not counted
    gemms += b.attrs.get("weight_matmuls", 0)
    if b.kind == "embedding":
        return [("embedding gather", "memory-bound gather; torch is at bandwidth")]
    if b.kind == "embedding.patch":
        if ops.get("im2col"):  # an unfold and a linear (`classify._patch_unfold`)
            return [("patch convolution", "an unfold (im2col) and one GEMM: cuBLAS")]
        return [("patch convolution", "one strided convolution: cuDNN")]
    if b.kind == "lm_head":
        return [("vocabulary projection", "one large GEMM: cuBLAS")]
    gemms -= (b.attrs.get("unfused_core") or {}).get("score_gemms", 0)  # listed as the core
    if gemms and b.kind not in ("moe.experts",):
        out.append(("projections (GEMM)", f"{gemms} dense GEMMs: cuBLAS"))
    if any(op.startswith(("scaled_dot_product", "_scaled_dot_product")) for op in ops) and \
            b.kind != "sparse_attention.topk":
        out.append(("attention core", "fused SDPA (flash)"))
    if b.kind == "rope":
        out.append(("cos/sin table", "computed once per step; negligible"))
    if ops.get("layer_norm") or ops.get("native_layer_norm"):
        # unlike the RMSNorms the models write out in torch ops, F.layer_norm is one fused kernel
        out.append(("layer norm", "one fused torch kernel (native_layer_norm)"))
    return out


def _unserved_parts(b: Block) -> list[tuple[str, str]]:
    """(op, reason) for parts of ``b`` that neither a family nor a fast path serves, though the
    block's kind is otherwise served: an attention core written out, an MLP inside another
    block's module."""
    out = []
    if (core := b.attrs.get("unfused_core")) is not None:
        out.append(("attention core", f"unfused softmax(QK^T)V: the scores {core.get('scores')} "
                    "are materialised, O(T^2) memory and traffic (fused SDPA would not)"))
    if b.kind == "residual.streams" and b.attrs.get("role") == "mix":
        n = b.attrs.get("streams")
        out.append(("residual stream mixing", f"the per-token {n} x {n} mixing of the {n} "
                    "residual streams by these coefficients: unfused torch ops, no family"))
    if b.kind == "residual.input_gate":
        out.append((f"gated input ({b.attrs.get('activation')} x input)", "the activation and "
                    "its product with the module's extra input: unfused torch ops, no family"))
    if b.kind == "norm.rms_gated" and b.attrs.get("gate") == "mlp":
        out.append(("gate (sigmoid(mlp(y)) x y)", "the gate's activation and its product with "
                    "the normalised output (the norm and the MLP's GEMMs listed apart): unfused "
                    "torch ops, no family"))
    if (mlp := b.attrs.get("inline_mlp")) is not None:
        out.append((f"inline MLP ({mlp.get('activation')})", "an MLP in the same module as the "
                    "attention: no module of its own for an MLP kernel to replace"))
    return out


def _unbound(family: str) -> str:
    """What coverage adds for a family with no patch binding: generate renders and checks its
    kernel, nothing patches it into the model (alignment lists the block as not checked)."""
    try:
        bound = get_family(family).binding is not None
    except InputError:
        return ""
    return "" if bound else ("; no patch binding: generate renders and checks the kernel, "
                             "the model keeps its own code (alignment does not check the block)")


def _refused(family: str, refusal: dict[str, Any]) -> str:
    """Coverage's reason for a part a family's kind serves but its binding would not take
    (`FamilySpec.refusal`): what patching would do instead."""
    return (f"{family} serves this kind but its binding would leave this block unpatched "
            f"({refusal['reason']}): the block's own code runs it unless the generate stage's "
            "fallback (an LLM-written family, torch.compile) passes its check")


def build_coverage(graph: OpGraph, kernels_root: Path | None = None) -> Coverage:
    reviewed = reviewed_kernels(kernels_root)
    entries: list[CoverageEntry] = []
    for b in graph.blocks:
        shapes, dtype = _shapes(b)
        base = {"path": b.path, "kind": b.kind, "shapes": shapes, "dtype": dtype}
        matched = match_block(b)
        for family, m in matched:
            key = (family, m["variant"], json.dumps(m["params"], sort_keys=True))
            module = reviewed.get(key)
            entries.append(CoverageEntry(
                **base, op=m.get("serves") or family, status="kernel" if module else "template",
                family=family,
                variant=m["variant"], params=m["params"],
                module=str(module) if module else None,
                reason=("reviewed kernel" if module else f"template {family}/{m['variant']}")
                + (f"; {m['note']}" if m.get("note") else "") + _unbound(family)))
        for op, reason in _fast_paths(b):
            entries.append(CoverageEntry(**base, op=op, status="torch_fast", reason=reason))
        served = {m["serves"] for _, m in matched if m.get("serves")}
        refused = refused_by(b)
        for op, reason in _unserved_parts(b):
            if op in served:  # a family serves this part (its entry above)
                continue
            why = [_refused(f, r) for f, r in refused if r["serves"] == op]
            entries.append(CoverageEntry(**base, op=op, status="uncovered",
                                         reason="; ".join([reason, *why])))
        if b.kind in CORE_OPS and not any(e.path == b.path and e.status in ("kernel", "template")
                                          for e in entries):
            why = [_refused(f, r) for f, r in refused if not r["serves"]]
            entries.append(CoverageEntry(**base, op=CORE_OPS[b.kind], status="uncovered",
                                         reason="; ".join(why) or b.attrs.get("not_run")
                                         or "no family matches this block yet"))
        if not any(e.path == b.path and e.status in ("kernel", "template") for e in entries) \
                and b.kind not in CORE_OPS and (why := [_refused(f, r) for f, r in refused
                                                        if not r["serves"]]):
            entries.append(CoverageEntry(**base, op=b.kind, status="uncovered", reason="; ".join(why)))
        if not any(e.path == b.path for e in entries):
            entries.append(CoverageEntry(**base, op=b.kind, status="uncovered",
                                         reason="no family, template or fast path matches"))
    return Coverage(model=graph.model, entries=entries)
