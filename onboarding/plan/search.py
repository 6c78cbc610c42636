"""The plan: every FSDP x EP x recompute x offload layout of a GPU count, checked against the GPU's
memory, the ones that fit ranked by estimated step time (those within 1% of the fastest: the
lightest memory savers first, `rank`), the others with the reason and numbers.

A layout the user fixed (``--ep``, ``--fsdp``, ``--recompute``, ``--offload``) narrows the search;
a model that fits no layout is a plan that says so, not an error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from onboarding.errors import InputError
from onboarding.formatting import count
from onboarding.plan.config import GIB, OFFLOAD, RECOMPUTE, ClusterConfig, PlanConfig
from onboarding.plan.estimate import Comm, StepTime, communication, step_time
from onboarding.plan.memory import Layout, Memory, block_heads, memory
from onboarding.plan.shapes import BlockShape, ModelShape
from onboarding.train.flops import Chunk

PLAN_FILE = "plan.json"


def size(nbytes: float) -> str:
    """Decimal size of a whole (``1.26 TB``): what a model weighs."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= div:
            return f"{nbytes / div:.3g} {unit}"
    return f"{nbytes / 1e3:.3g} kB"


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def gib(nbytes: float) -> str:
    if nbytes >= 1000 * GIB:
        return f"{nbytes / GIB:,.0f} GiB"
    return f"{nbytes / GIB:.3g} GiB" if nbytes >= 0.1 * GIB else f"{nbytes / 2**20:.3g} MiB"


@dataclass(kw_only=True, slots=True)
class Candidate:
    layout: Layout
    memory: Memory
    comm: Comm
    time: StepTime
    fits: bool
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"layout": asdict(self.layout), "name": self.layout.name, "fits": self.fits,
             "reason": self.reason,
             "memory": {"components": self.memory.components(),
                        "allocated": self.memory.allocated, "total": self.memory.total,
                        "host_weights": self.memory.host_weights,
                        "host_optimizer": self.memory.host_optimizer,
                        "notes": self.memory.notes},
             "comm": asdict(self.comm), "time": asdict(self.time)}
        return d


@dataclass(kw_only=True, slots=True)
class Plan:
    model: str
    config: PlanConfig
    cluster: ClusterConfig
    shape: dict[str, Any]
    chosen: Candidate | None
    fitting: list[Candidate]
    rejected: list[Candidate]
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        cap = f"{self.cluster.gpu_mem_gib:.4g} GiB"
        n = count(self.config.gpus, "GPU")
        if self.chosen is None:
            return f"does not fit on {n} of {cap} in any layout searched"
        c = self.chosen
        if not c.fits:
            return f"{c.layout.name} does not fit on {n} of {cap}: {c.reason}"
        return (f"fits on {n} of {cap}: {c.layout.name}, {gib(c.memory.total)} per GPU, "
                f"step {_secs(c.time.overlap_s)} with overlap "
                f"({_secs(c.time.serial_s)} without), MFU {c.time.mfu:.1%}")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "config": asdict(self.config),
                "cluster": asdict(self.cluster), "assumptions": self.cluster.assumptions(),
                "shape": self.shape, "verdict": self.verdict,
                "chosen": self.chosen.to_dict() if self.chosen else None,
                "fitting": [c.to_dict() for c in self.fitting],
                "rejected": [c.to_dict() for c in self.rejected], "notes": self.notes}


def _reason(shape: ModelShape, cand: Candidate, cluster: ClusterConfig, cfg: PlanConfig) -> str:
    m, lay, cap = cand.memory, cand.layout, cluster.gpu_bytes
    wb = 4 if cfg.dtype == "fp32" else 2
    if m.host > cluster.host_mem_gib * GIB:
        return (f"offload {lay.offload}: {gib(m.host)} of host memory per GPU > "
                f"{cluster.host_mem_gib:g} GiB")
    capt = f"{cluster.gpu_mem_gib:.4g} GiB"
    if m.weights_experts > cap:
        return (f"experts {size(wb * shape.routed)} / EP {lay.ep} = {gib(m.weights_experts)} "
                f"per GPU > {capt}")
    weights = m.weights_dense + m.weights_experts + sum(m.weights_towers.values()) \
        + m.weights_root
    if weights > cap:
        towers = "".join(f" + {k} {gib(v)}" for k, v in m.weights_towers.items())
        root = f" + root group unsharded {gib(m.weights_root)}" if m.weights_root else ""
        return (f"weights {gib(weights)} per GPU (dense {size(wb * shape.dense)} / {lay.world} + "
                f"experts {size(wb * shape.routed)} / EP {lay.ep}{root}{towers}) > {capt}")
    static = weights + m.fsdp_buffers + sum(m.trainable.values())
    if static > cap:
        return (f"weights + trainable state {gib(static)} per GPU (state "
                f"{gib(sum(m.trainable.values()))}) > {capt}")
    return (f"{gib(m.total)} per GPU > {capt}: activations {gib(sum(m.activations.values()))} "
            f"+ workspace {gib(m.workspace)} over weights and state {gib(static)}")


def _savers(c: Candidate) -> tuple[int, int]:
    """How heavy its memory savers are: recompute, then offload, each in its order of cost."""
    return RECOMPUTE.index(c.layout.recompute), OFFLOAD.index(c.layout.offload)


def rank(cands: list[Candidate], tolerance: float) -> list[Candidate]:
    """Fitting layouts best first. Those whose step time is within ``tolerance`` of the fastest
    one's (`PlanConfig.time_tolerance`, 1%) count as equally fast and come first, the lighter
    memory savers first (recompute, then offload, each in its order of cost), then the less
    memory, then the faster; the rest follow by step time. A saver that buys less than the
    tolerance is not chosen.

    Why 1%: that is about what the estimate can tell apart between two layouts of one model.
    Their rates and host model are shared, so those errors mostly cancel, but the terms a saver
    changes are coarse: a recompute's re-run is a third of its blocks' step time plus their
    forward's launches (`estimate.rerun`). Layouts further apart (all-to-all and FSDP traffic)
    keep their order by time, as under the 1% steps this replaced. (Before the re-run was
    charged, selective recompute only lowered the memory-bound term and looked 0.8% faster
    than none for hf:kimi_linear; charged, it is 3.4% slower: `onboard plan hf:kimi_linear
    --all`, EP 8.)

    Against the fastest, not fixed steps: two times 0.3% apart fell in one step or in two
    depending on where a step's edge fell, so a small change anywhere in the estimate flipped
    the choice. A common factor on every time now changes no order."""
    if not cands:
        return []
    bound = min(c.time.overlap_s for c in cands) * (1 + tolerance)

    def key(c: Candidate) -> tuple:
        if c.time.overlap_s <= bound:
            return (0, *_savers(c), c.memory.total, c.time.overlap_s)
        return (1, c.time.overlap_s, *_savers(c), c.memory.total)

    return sorted(cands, key=key)


def tolerance_note(fitting: list[Candidate], tolerance: float) -> list[str]:
    """One line where the first layout is not the fastest: which is, by how much, and why."""
    if not fitting:
        return []
    first, fastest = fitting[0], min(fitting, key=lambda c: c.time.overlap_s)
    gain = 1 - fastest.time.overlap_s / first.time.overlap_s
    if gain <= 0:
        return []
    why = "lighter memory savers" if _savers(first) < _savers(fastest) else "less memory per GPU"
    return [f"layout: {fastest.layout.name} is {gain:.2%} faster by the estimate, within the "
            f"{tolerance * 100:g}% it cannot tell apart (PlanConfig.time_tolerance): "
            f"{first.layout.name} is chosen for its {why}"]


def _ep_choices(shape: ModelShape, cfg: PlanConfig) -> list[int]:
    e = shape.n_experts
    if cfg.fsdp is not None and cfg.ep is None:
        ep = cfg.gpus // cfg.fsdp
        wanted = [ep]
    elif cfg.ep is not None:
        wanted = [cfg.ep]
    else:
        wanted = [d for d in range(1, cfg.gpus + 1) if cfg.gpus % d == 0
                  and (d == 1 or (e and e % d == 0))]
    for ep in wanted:
        if ep > 1 and not e:
            raise InputError(f"--ep {ep}: the model has no routed experts, so expert "
                             "parallelism needs EP 1")
        if ep > 1 and e % ep:
            raise InputError(f"--ep {ep}: does not divide the model's {e} routed experts")
        if cfg.gpus % ep:
            raise InputError(f"EP {ep}: does not divide --gpus {cfg.gpus}")
    return wanted


def build_plan(shape: ModelShape, cfg: PlanConfig, cluster: ClusterConfig) -> Plan:
    """Every layout allowed by ``cfg`` on ``cfg.gpus`` GPUs of ``cluster``; fitting ones ranked."""
    cfg.validate()
    cluster.validate()
    cands: list[Candidate] = []
    for ep in _ep_choices(shape, cfg):
        for rc in ([cfg.recompute] if cfg.recompute else RECOMPUTE):
            for off in ([cfg.offload] if cfg.offload else OFFLOAD):
                lay = Layout(ep=ep, fsdp=cfg.gpus // ep, recompute=rc, offload=off)
                mem = memory(shape, cfg, lay, cluster)
                comm = communication(shape, cfg, lay, mem, cluster)
                t = step_time(shape, cfg, lay, mem, comm, cluster)
                c = Candidate(layout=lay, memory=mem, comm=comm, time=t,
                              fits=mem.total <= cluster.gpu_bytes
                              and mem.host <= cluster.host_mem_gib * GIB)
                if not c.fits:
                    c.reason = _reason(shape, c, cluster, cfg)
                cands.append(c)
    fitting = rank([c for c in cands if c.fits], cfg.time_tolerance)
    rejected = [c for c in cands if not c.fits]
    fixed = cfg.ep is not None or cfg.fsdp is not None
    if fitting:
        chosen = fitting[0]
    elif fixed and cfg.recompute and cfg.offload:
        chosen = cands[0]  # the one layout asked for: shown with why it does not fit
    else:
        chosen = None
    notes = tolerance_note(fitting, cfg.time_tolerance)
    if shape.unmatched:
        notes.append("op-graph blocks not found in the full model (not in the activation "
                     "estimate): " + ", ".join(shape.unmatched[:6]))
    unknown = [b.pattern for b in shape.blocks if b.kind == "unknown"]
    if unknown:
        notes.append("unknown blocks (their activations are not modelled): "
                     + ", ".join(unknown[:6]))
    alt = [e for e in shape.experts if e.alternative_to]
    if alt:
        notes.append("MoE blocks a token takes one of (siblings of one class; the proxy's "
                     "forward ran one): the all-to-all and the expert GEMMs count "
                     + ", ".join(sorted({e.alternative_to for e in alt}))
                     + " in each layer, not " + ", ".join(e.pattern for e in alt)
                     + "; the weights count both")
    notes += tower_notes(shape)
    notes += window_notes(shape, cfg.seq)
    notes += head_notes(shape)
    families = sorted({f for b in shape.blocks for f in b.kernels})
    if cfg.kernels and families:
        notes.append("activations: onboard's kernels (" + ", ".join(families) + ") keep what "
                     "they keep in the blocks they match, as `onboard train` patches them on a "
                     "GPU where each passes its check there (--no-kernels: the torch paths)")
    return Plan(model=shape.name, config=cfg, cluster=cluster, shape=shape_summary(shape),
                chosen=chosen, fitting=fitting, rejected=rejected, notes=notes)


def shape_summary(shape: ModelShape) -> dict[str, Any]:
    return {"total_params": shape.total, "routed_expert_params": shape.routed,
            "dense_params": shape.dense, "dense_matmul_params": shape.dense_matmul,
            "root_params": shape.root,
            "tower_params": shape.tower_params(), "towers_run": shape.towers_run,
            "hidden": shape.hidden, "vocab": shape.vocab, "layers": shape.n_layers,
            "experts": [{"pattern": e.pattern, "layers": e.count, "n_experts": e.n_experts,
                         "top_k": e.top_k, "width": e.width, "per_expert": e.per_expert,
                         "alternative_to": e.alternative_to}
                        for e in shape.experts],
            "blocks": [_block_summary(b) for b in shape.blocks]}


def _windowed(b: BlockShape) -> bool:
    return any(w is not None for w, _, _ in b.windows)


def _block_summary(b: BlockShape) -> dict[str, Any]:
    d: dict[str, Any] = {"pattern": b.pattern, "kind": b.kind, "count": b.count,
                         "params": b.params, "ops": b.ops}
    if b.tied:  # parameters shared with these blocks, counted there (a tied head's table)
        d["tied_to"] = b.tied
    if b.kernels:  # the onboard kernel families `onboard train` patches into it on a GPU
        d["kernels"] = sorted(b.kernels)
    if _windowed(b):  # the local window of each instance, and where it came from
        d["windows"] = [{"window": w, "count": n, "from": src,
                         **({"chunked": True} if isinstance(w, Chunk) else {})}
                        for w, n, src in b.windows]
    return d


def tower_notes(shape: ModelShape) -> list[str]:
    """What the plan counts of the parts besides the language model that the trained model holds
    (`ModelShape.towers`, `memory.tower_weights`)."""
    if not shape.towers:
        return []
    from onboarding.formatting import human

    n = shape.tower_params()
    ran = [k for k in n if k in shape.towers_run]
    idle = [k for k in n if k not in ran]
    acts = []
    if ran:
        acts.append("the captured forward ran " + ", ".join(ran) + ": their blocks' "
                    "activations are counted as the op graph's")
    if idle:
        acts.append("no activations of " + ", ".join(idle) + ": the captured forward on token "
                    "ids, the batches `onboard train` feeds, ran no op in them")
    return ["the model `onboard train` builds holds "
            + ", ".join(f"the {k} part ({human(v)} parameters)" for k, v in n.items())
            + " beside the language model: each a line of the memory table, frozen (no "
            "adapter), in the weights' dtype, in the root's FSDP2 group: its shard and, from the "
            "root's forward to the end of the backward, the whole part on every GPU (all-gathered "
            "once a step; one GPU: the part once); " + "; ".join(acts)]


def window_notes(shape: ModelShape, seq: int) -> list[str]:
    """One line per attention pattern some of whose layers have a local window."""
    out = []
    for b in shape.blocks:
        if _windowed(b):
            parts = [f"{n} x " + ("full causal" if w is None else f"chunks of {w}"
                                  if isinstance(w, Chunk) else f"window {w}")
                     + (f" ({src})" if src else "")
                     + (f", >= the {seq}-token sequence: no cap" if w and w >= seq else "")
                     for w, n, src in b.windows]
            r = b.attrs.get("compress_ratio")
            what = b.kind + (f", pooled windows of r = {r}" if r else "")
            out.append(f"attention keys of {b.pattern} ({what}): " + "; ".join(parts))
    return out


def head_notes(shape: ModelShape) -> list[str]:
    """One line per attention pattern with a per-head output gate (one value per head) whose
    head count the config does not give: the count read off the gate's projection, or, where
    none could be, the one head its activations are then counted with (`memory.block_heads`)."""
    out = []
    for b in shape.blocks:
        if not b.attrs.get("gate_per_head") or b.kind.startswith("linear_attention."):
            continue
        h, _, _, src = block_heads(b, shape)
        if src == "config":
            continue
        what = f"attention heads of {b.pattern} ({b.kind}, a per-head output gate): none in " \
               "the config; "
        if src:
            out.append(what + f"{h}, the full-size output width of its gate's projection "
                       f"{b.attrs.get('gate_projection')}")
        else:
            out.append(what + "none read off its gate's projection either: counted as one "
                       "head, so its gate and log-sum-exp are undercounted")
    return out
