"""The human review gate: after the report, a run started with ``--review`` opens its kernel PR
(`onboarding.pr`) and stops the graph with LangGraph's `interrupt` before the pr node; the pause
lives in the SQLite checkpoint, so the answer may come from another process, days later
(`onboard pr approve RUN_DIR`, `onboard run --resume RUN_DIR --approve | --reject`). The pr
node then merges the branch or deletes it."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END
from langgraph.types import interrupt

from agents.nodes import node_run_dir
from agents.state import RunConfig, RunState
from onboarding.errors import InputError
from onboarding.rundir import append_event

DECISIONS = ("approve", "reject")


def after_report(state: RunState) -> str:
    """On to the review gate only when the run asked for review."""
    return "review" if state.config.review else END


def reproduce_command(cfg: RunConfig) -> str:
    """`onboard run ...` that re-creates a run from its config (PR.md's "Reproduce")."""
    m = cfg.model
    parts = ["onboard", "run", *([m.ref] if m.ref else [])]
    for k, v in (m.overrides or {}).items():
        parts += ["--set", f"{k}={json.dumps(v)}"]
    if m.trust_remote_code:
        parts.append("--trust-remote-code")
    if m.proxy != "tiny":
        parts += ["--proxy", m.proxy]
    for flag, value, default in (("--seq", cfg.seq, 64), ("--batch", cfg.batch, 1),
                                 ("--seed", cfg.seed, 0)):
        if value != default:
            parts += [flag, str(value)]
    if cfg.align_kernels is not None:
        parts += ["--kernels", ",".join(cfg.align_kernels) or "none"]
    return shlex.join(parts)


def _record(run_dir: Path) -> dict[str, Any] | None:
    """The PR this run opened already (a resumed gate re-runs its node from the top)."""
    f = run_dir / "pr.json"
    return json.loads(f.read_text()) if f.is_file() else None


def review_payload(rec: dict[str, Any]) -> dict[str, Any]:
    """What the paused run shows: the branch, where PR.md is, and how to answer."""
    run_dir = rec["run_dir"]
    return {"branch": rec["branch"], "repo": rec["repo"], "base": rec["base"],
            "body": rec["body_path"], "families": [c["family"] for c in rec.get("commits", [])],
            "show": f"onboard pr show {run_dir}", "diff": f"onboard pr diff {run_dir}",
            "approve": f"onboard pr approve {run_dir}   (or: onboard run --resume {run_dir} "
                       "--approve)",
            "reject": f"onboard pr reject {run_dir} --why \"...\"   (or: onboard run --resume "
                      f"{run_dir} --reject --why \"...\")"}


def review_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    """Open the PR (once), then wait for the human's answer."""
    from onboarding.pr import create_pr, default_repo

    run_dir = node_run_dir(state, config)
    c = state.config
    rec = _record(run_dir)
    if rec is None:
        append_event(run_dir, {"node": "review", "event": "start"})
        try:
            rec = asdict(create_pr(run_dir, c.review_repo or default_repo(),
                                   base=c.review_base, run_command=reproduce_command(c)))
        except InputError as exc:  # nothing to review (or the repo refused): said, not fatal
            append_event(run_dir, {"node": "review", "event": "done"})
            return {"completed": [*state.completed, "review"],
                    "review": {"status": "not opened", "error": str(exc)}}
    answer = interrupt(review_payload(rec))
    decision = (answer or {}).get("decision") if isinstance(answer, dict) else answer
    if decision not in DECISIONS:
        raise InputError(f"review answer {answer!r}: expected one of {DECISIONS}")
    append_event(run_dir, {"node": "review", "event": "done"})
    return {"completed": [*state.completed, "review"],
            "review": {"status": "answered", "branch": rec["branch"], "repo": rec["repo"],
                       "decision": decision, "why": (answer or {}).get("why")
                       if isinstance(answer, dict) else None}}


def pr_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    """Merge the approved branch into its base, or delete the rejected one."""
    from onboarding.pr import approve, reject, resolve

    run_dir = node_run_dir(state, config)
    append_event(run_dir, {"node": "pr", "event": "start"})
    r = dict(state.review)
    if r.get("status") == "answered":
        git, rec = resolve(str(run_dir))
        if rec.status == "open":  # a re-run after a crash may find it answered already
            rec = (approve(git, rec) if r["decision"] == "approve"
                   else reject(git, rec, r.get("why")))
        r.update(status=rec.status, merged_commit=rec.merged_commit, why=rec.why)
    append_event(run_dir, {"node": "pr", "event": "done"})
    return {"completed": [*state.completed, "pr"], "review": r}
