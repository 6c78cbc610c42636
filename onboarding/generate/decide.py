"""The decision loop for blocks no family serves: per kernel task (`onboarding.generate.tasks`),
in this order, the first option that passes wins, and every option tried leaves its evidence:

1. **template**: a registered family's `match` accepts the block after all (a family folder added
   since `map`, e.g. with ``--families``);
2. **llm**: only with ``--llm URL``: `onboarding.generate.llm.propose` asks the injected client
   for a family folder and gates it; accepted -> ``generated``;
3. **inductor**: ``torch.compile`` of the block's forward, gated by the block check
   (`onboarding.generate.inductor.check_inductor`);
4. **uncovered**: the block stays in the model's own code, with the reasons the others failed.

Blocks with the same structure key are one problem: the first is decided, the others reuse its
outcome (``same_as``). A block inside a block served by Inductor (Mamba-2's gated norm inside
its mixer) is compiled with it (``inside``) and not decided on its own. ``budget_s``
(``--generate-budget``) bounds the loop's wall time: once spent, the remaining blocks are left
uncovered with that reason. The decisions go to ``decisions.json``, coverage (statuses
``generated`` and ``inductor``), the patches alignment applies (`swaps`), ``events.jsonl`` and the
report's "why this kernel" table.

A decision is keyed by its opgraph block's path (``path``: coverage, alignment, retries and the
report read it so). A task at a block's weightless core module
(`onboarding.generate.tasks.core_path`) records that module too (``core``): the kernel, the
Inductor swap and the block check are the core's, and the block's other entries (its
projections' GEMMs) stay on the torch path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onboarding.coverage import Coverage, CoverageEntry
from onboarding.generate.tasks import KernelTask
from onboarding.load.spec import ModelSpec

DECISIONS_FILE = "decisions.json"
OPTIONS = ("template", "llm", "inductor")


@dataclass(kw_only=True)
class Evidence:
    option: str  # template | llm | inductor
    outcome: str  # accepted | rejected | skipped
    reason: str
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Decision:
    path: str  # the opgraph block's
    core: str | None = None  # the module the kernel replaces, when not the block's own
    kind: str
    op: str
    key: str
    decision: str  # template | generated | inductor | uncovered
    evidence: list[Evidence] = field(default_factory=list)
    family: str | None = None
    variant: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    folder: str | None = None  # an accepted generated family's folder
    code_dir: str | None = None  # Inductor's generated code for review
    verdict: str = ""  # the block check's summary line
    same_as: str | None = None  # decided as this block (same structure key)
    inside: str | None = None  # served as part of this enclosing block
    failed_family: str | None = None  # the block's family failed alignment (a retry's task)

    def why(self) -> str:
        """One line: what was decided and why the earlier options were not taken."""
        if self.inside:
            return f"compiled as part of {self.inside}"
        parts = [f"{e.option}: {e.reason}" for e in self.evidence if e.outcome != "accepted"]
        won = next((e for e in self.evidence if e.outcome == "accepted"), None)
        head = f"{won.option}: {won.reason}" if won else "nothing passed"
        return head + (f" (for {self.core}, the block's recurrence)" if self.core else "") + \
            ("; " + "; ".join(parts) if parts else "") + \
            (f" (as {self.same_as})" if self.same_as else "")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decision:
        d = dict(d)
        d["evidence"] = [Evidence(**e) for e in d.get("evidence", [])]
        return cls(**d)


@dataclass(kw_only=True)
class GenerateOptions:
    """The decision loop's options (`RunConfig` carries them; `--llm`, `--llm-model`,
    `--llm-attempts`, `--generate-budget`)."""

    llm: str | None = None  # URL of an OpenAI-compatible server; None: off
    llm_model: str | None = None
    llm_attempts: int = 3
    budget_s: float | None = None  # the whole loop; None: no limit
    inductor: bool = True
    check_timeout_s: float = 900.0  # one block check (compiles included)
    batch: int = 1
    seq: int = 64
    seed: int = 0


def _template(task: KernelTask, block: Any) -> tuple[Evidence, dict | None]:
    from onboarding.families import families, match_block

    t0 = time.perf_counter()
    # a family that failed this block's alignment is not offered again
    found = [(n, m) for n, m in (match_block(block) if block is not None else [])
             if n != task.failed_family]
    if found:
        name, m = found[0]
        return Evidence(option="template", outcome="accepted",
                        reason=f"{name}/{m['variant']} matches it",
                        seconds=round(time.perf_counter() - t0, 3)), \
            {"family": name, "variant": m["variant"], "params": m["params"]}
    n = len(families())
    why = f"no family's match accepts it ({n} families tried)" if not task.failed_family \
        else f"no family but {task.failed_family}, which failed its alignment, accepts it"
    return Evidence(option="template", outcome="rejected", reason=why,
                    seconds=round(time.perf_counter() - t0, 3)), None


def _llm(task: KernelTask, client: Any, opts: GenerateOptions, run_dir: Path, spec: ModelSpec,
         left: float | None, propose: Callable | None) -> tuple[Evidence, Any]:
    if client is None:
        return Evidence(option="llm", outcome="skipped", reason="--llm off"), None
    if propose is None:
        from onboarding.generate.llm import propose
    t0 = time.perf_counter()
    try:
        out = propose(task, client, attempts=opts.llm_attempts, budget_s=left, run_dir=run_dir,
                      spec=spec)
    except Exception as exc:  # the LLM path failing is evidence, never the run's end
        return Evidence(option="llm", outcome="rejected",
                        reason=f"the LLM path raised {type(exc).__name__}: {exc}"[:300],
                        seconds=round(time.perf_counter() - t0, 1)), None
    n = len(getattr(out, "attempts", []) or [])
    detail = {"attempts": n, "folder": getattr(out, "folder", None),
              "family": getattr(out, "family", None), "summary": getattr(out, "summary", "")}
    if getattr(out, "accepted", False):
        return Evidence(option="llm", outcome="accepted",
                        reason=f"family {out.family} accepted after {n} attempt(s)",
                        seconds=round(time.perf_counter() - t0, 1), detail=detail), out
    return Evidence(option="llm", outcome="rejected",
                    reason=f"{n} attempt(s) rejected: {getattr(out, 'reason', '') or '?'}",
                    seconds=round(time.perf_counter() - t0, 1), detail=detail), out


def _inductor(task: KernelTask, opts: GenerateOptions, run_dir: Path, spec: ModelSpec,
              left: float | None, check: Callable | None) -> tuple[Evidence, Any]:
    from onboarding.generate.inductor import (
        block_dir,
        check_inductor,
        furthest_rung,
        ladder_summary,
    )

    if not opts.inductor:
        return Evidence(option="inductor", outcome="skipped", reason="turned off"), None
    check = check or check_inductor
    timeout = opts.check_timeout_s if left is None else max(1.0, min(opts.check_timeout_s, left))
    t0 = time.perf_counter()
    v = check(spec, task.path, run_dir, kind=task.kind, batch=opts.batch, seq=opts.seq,
              seed=opts.seed, timeout_s=timeout)
    art = next(iter(v.artifacts.values()), {}) if v.artifacts else {}
    graphs = [g for a in v.artifacts.values() for g in (a or {}).get("ladder") or []]
    ladder = ladder_summary(graphs)
    detail = {"backend": art.get("backend"), "graphs": art.get("graphs"),
              "code_dir": str(block_dir(run_dir, task.path)), "verdict": v.summary(),
              "rung": furthest_rung(graphs), "ladder": ladder}
    sec = round(time.perf_counter() - t0, 1)
    if v.passed:
        return Evidence(option="inductor", outcome="accepted",
                        reason=f"torch.compile ({art.get('backend') or 'inductor'}) passed the "
                        "block check: " + v.summary().removeprefix("passed ")
                        + (f"; compile ladder: {ladder}" if ladder else ""),
                        seconds=sec, detail=detail), v
    return Evidence(option="inductor", outcome="rejected", reason=f"block check: {v.reason}",
                    seconds=sec, detail=detail), v


def decide(tasks: list[KernelTask], spec: ModelSpec, run_dir: Path, *, graph: Any = None,
           opts: GenerateOptions | None = None, client: Any = None,
           propose: Callable | None = None, check: Callable | None = None,
           on_step: Callable[[str], None] | None = None,
           on_decision: Callable[[Decision], None] | None = None) -> list[Decision]:
    """Decide every task (module docstring). ``client``: the LLM client built once from the
    options (None: --llm off); ``propose``/``check`` replace the LLM path's entry point and the
    Inductor check (tests)."""
    opts = opts or GenerateOptions()
    run_dir = Path(run_dir)
    blocks = {b.path: b for b in graph.blocks} if graph is not None else {}
    t0 = time.perf_counter()
    decided: dict[str, Decision] = {}  # structure key -> the first decision
    out: list[Decision] = []
    # enclosing blocks first, so a block inside one served by Inductor is compiled with it
    order = sorted(tasks, key=lambda t: (t.path.count("."), t.path))
    for task in order:
        base = dict(path=task.block_path, core=task.path if task.path != task.block_path else None,
                    kind=task.kind, op=task.op, key=task.key, failed_family=task.failed_family)
        parent = next((d for d in out if d.decision == "inductor" and not d.inside
                       and task.path.startswith((d.core or d.path) + ".")), None)
        if parent is not None:
            d = Decision(**base, decision="inductor", inside=parent.path,
                         code_dir=parent.code_dir, verdict=parent.verdict,
                         evidence=[Evidence(option="inductor", outcome="accepted",
                                            reason=f"compiled as part of {parent.path}")])
        elif task.key in decided:
            first = decided[task.key]
            d = Decision(**{**asdict(first), **base, "same_as": first.path, "inside": None})
            d.evidence = first.evidence
        else:
            left = None if opts.budget_s is None else opts.budget_s - (time.perf_counter() - t0)
            d = Decision(**base, decision="uncovered")
            if left is not None and left <= 0:
                d.evidence.append(Evidence(option="budget", outcome="rejected",
                                           reason=f"generate budget of {opts.budget_s:g} s "
                                           "spent before this block"))
            else:
                _decide_one(d, task, blocks.get(task.block_path), spec, run_dir, opts, client,
                            propose, check, t0, on_step)
            decided[task.key] = d
        out.append(d)
        if on_decision:
            on_decision(d)
    rank = {t.block_path: i for i, t in enumerate(tasks)}
    return sorted(out, key=lambda d: rank[d.path])


def _decide_one(d: Decision, task: KernelTask, block: Any, spec: ModelSpec, run_dir: Path,
                opts: GenerateOptions, client: Any, propose: Callable | None,
                check: Callable | None, t0: float,
                on_step: Callable[[str], None] | None) -> None:
    def left() -> float | None:
        return None if opts.budget_s is None else opts.budget_s - (time.perf_counter() - t0)

    ev, m = _template(task, block)
    d.evidence.append(ev)
    if m is not None:
        d.decision, d.family, d.variant, d.params = "template", m["family"], m["variant"], \
            m["params"]
        return
    if on_step and client is not None:
        on_step(f"{task.path}: asking the LLM")
    ev, out = _llm(task, client, opts, run_dir, spec, left(), propose)
    d.evidence.append(ev)
    if ev.outcome == "accepted":
        d.decision, d.family, d.folder = "generated", out.family, out.folder
        d.variant = getattr(out, "variant", None)
        return
    rem = left()
    if rem is not None and rem <= 0:
        d.evidence.append(Evidence(option="inductor", outcome="skipped",
                                   reason=f"generate budget of {opts.budget_s:g} s spent"))
        return
    if block is not None and block.attrs.get("recurrence") == "time_loop":
        # dynamo traces a Python loop over the positions unrolled: the graph, and the compile
        # (minutes for RWKV's 64-step proxy on a CPU), grow with T, and no graph serves
        # training lengths (thousands of steps). The block stays eager, and says why.
        d.evidence.append(Evidence(option="inductor", outcome="skipped", reason=(
            f"a loop over time ({block.attrs.get('steps')} positions one at a time in the proxy): "
            "torch.compile unrolls it, so the graph and its compile grow with the sequence "
            "length; left eager (a scan kernel needs a family, or the LLM path: --llm)")))
        return
    if on_step:
        on_step(f"{task.path}: torch.compile (Inductor) + block check")
    ev, v = _inductor(task, opts, run_dir, spec, rem, check)
    d.evidence.append(ev)
    if ev.outcome == "accepted":
        d.decision, d.code_dir = "inductor", ev.detail.get("code_dir")
        d.verdict = v.summary() if v is not None else ""
    elif v is not None:
        d.verdict = v.summary()


# -- what the decisions change ------------------------------------------------------------------

def apply_to_coverage(coverage: Coverage, decisions: list[Decision]) -> Coverage:
    """The uncovered entries of decided blocks take the decision's status (``template``,
    ``generated``, ``inductor``) with its reason; ``uncovered`` ones get the evidence as reason.
    An LLM-written family's ``block_forward`` runs the whole module: the block's fast-torch-path
    entries (its projections' GEMMs) run inside it now, and are the family's too; not when it
    replaces the block's core module (``core``): the projections run outside it, on the torch
    path. A block decided after its family failed alignment gets an entry of its own beside the
    family's (which alignment then leaves out); the entries a left-out family took from the torch
    path are the torch path's again (Inductor compiles the module's own code, and uncovered runs
    it). ``decisions`` in the order they were made: a block's last decision is the one that
    holds."""
    by_path = {d.path: d for d in decisions}
    for d in decisions:  # a block whose family failed alignment: a new entry beside the family's
        if d.failed_family and d.decision not in ("uncovered", "template") and not any(
                e.path == d.path and (e.status, e.family) == (d.decision, d.family)
                for e in coverage.entries):
            first = next((e for e in coverage.entries if e.path == d.path), None)
            coverage.entries.append(CoverageEntry(
                path=d.path, kind=d.kind, op=d.op, status=d.decision, family=d.family,
                variant=d.variant, params=dict(d.params),
                shapes=first.shapes if first else [], dtype=first.dtype if first else None,
                reason=f"{d.why()} (after {d.failed_family} failed alignment)"))
    for e in coverage.entries:
        d = by_path.get(e.path)
        if d is None or e.status != "uncovered":
            continue
        if d.decision == "uncovered":
            e.reason = d.why()
            continue
        e.status = d.decision
        e.family, e.variant, e.params = d.family, d.variant, dict(d.params)
        e.reason = d.why()
    for e in coverage.entries:
        d = by_path.get(e.path)
        if d is None:
            continue
        if d.failed_family and e.status == "generated" and e.family == d.failed_family and \
                (own := _own_code(e)) is not None:  # the left-out family's, from the torch path
            e.status, e.family, e.variant, e.params, e.reason = "torch_fast", None, None, {}, own
        if d.decision == "generated" and e.status == "torch_fast" and not d.core:
            e.status, e.family, e.variant, e.params = "generated", d.family, d.variant, dict(d.params)
            e.reason = _INSIDE.format(family=d.family) + e.reason + ")"
    return coverage


# the reason of a fast-torch-path entry a whole-module family took over; the torch path's own
# reason closes it, so `_own_code` gives it back when that family is left out
_INSIDE = "inside {family}'s block_forward, which runs the whole module (the module's own code: "


def _own_code(e: CoverageEntry) -> str | None:
    """The torch path's reason of an entry its family took over (`_INSIDE`), else None."""
    head = _INSIDE.format(family=e.family)
    return e.reason[len(head):-1] if e.reason.startswith(head) and e.reason.endswith(")") \
        else None


def retry_blocks(decisions: list[Decision], excluded: list[list[str]], attempt: int
                 ) -> dict[str, str]:
    """The blocks a retry after failed alignment ``attempt`` decides again (block path ->
    "family: why", `tasks.build_tasks`'s ``failed``): those whose family ``excluded`` left out
    and that were not decided since, or whose last decision was that family, written by the LLM
    (the LLM is asked again, then Inductor). A left-out swap is not decided again."""
    last = {d.path: d for d in decisions}
    return {p: f"{fam}: left out after alignment attempt {attempt}" for p, fam in excluded
            if fam not in ("inductor", "generated") and (
                p not in last or (last[p].decision == "generated" and last[p].family == fam))}


def swaps(decisions: list[Decision]) -> list[Any]:
    """The block swaps alignment installs: every block Inductor serves on its own (not those
    compiled as part of an enclosing block), at its core module when it has one."""
    from onboarding.generate.blockcheck import Replacement
    from onboarding.generate.inductor import TARGET, ladder_kwargs
    from onboarding.patching.core import BlockSwap

    out = []
    for d in decisions:
        if d.decision == "inductor" and not d.inside:  # from where the check's ladder ended
            make = Replacement(target=TARGET, kwargs=ladder_kwargs(d.code_dir)).load()
            out.append(BlockSwap(path=d.path, module=d.core or "", kind=d.kind, label="inductor",
                                 make=make, detail=d.verdict))
    return out


def save_decisions(decisions: list[Decision], path: Path) -> None:
    path.write_text(json.dumps([asdict(d) for d in decisions], indent=1, default=str) + "\n")


def load_decisions(path: Path) -> list[Decision]:
    p = Path(path)
    return [Decision.from_dict(d) for d in json.loads(p.read_text())] if p.exists() else []

