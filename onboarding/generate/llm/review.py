"""What the LLM path leaves for review: ``generated/pr_candidates.json`` (the kernel-PR stage
reads it) and the report's section on LLM-written families.

A generated family is a PR candidate when the gate accepted it and alignment then ran the model
with it patched in and passed each block it serves, forward and backward. Every accepted family
is listed, with its status: ``candidate``, or why not yet (``not aligned``: no alignment ran;
``alignment failed``: a block it serves failed, or was left out after failing and decided
again, named). The decisions come from the generate stage's ``decisions.json``, the gate's record
from the family folder's ``gate.json``, the LLM attempts from
``generated/llm/<block>/summary.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PR_CANDIDATES = Path("generated") / "pr_candidates.json"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def pr_candidates(run_dir: Path) -> list[dict[str, Any]]:
    """One entry per accepted generated family of the run (module docstring)."""
    run_dir = Path(run_dir)
    decisions = _json(run_dir / "decisions.json") or []
    align = _json(run_dir / "alignment.json") or {}
    rows = {b["path"]: b for b in align.get("blocks", [])}
    # the family's own patch at a block: after it failed and was left out, the alignment that
    # followed patched the block with what the retry chose (an Inductor swap), or not at all
    patches = {(p["path"], p["family"]): p for p in align.get("patches", [])}
    out: dict[str, dict[str, Any]] = {}
    for i, d in enumerate(decisions):
        if d.get("decision") != "generated" or not d.get("folder"):
            continue
        folder = Path(d["folder"])
        entry = out.setdefault(str(folder), {
            "family": d.get("family") or folder.name, "variant": d.get("variant"),
            "folder": str(folder.relative_to(run_dir)) if folder.is_relative_to(run_dir) else str(folder),
            "files": sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else [],
            "blocks": [], "gate": {}, "llm": {}})
        gate = _json(folder / "gate.json") or {}
        check = (gate.get("details") or {}).get("check") or {}
        entry["gate"] = {"stage": gate.get("stage"), "seconds": gate.get("seconds"),
                         "check": (gate.get("details") or {}).get("summary") or check.get("reason"),
                         "aot_sm90": [{k: r.get(k) for k in ("kernel", "ok", "n_regs", "n_spills", "shared_bytes")}
                                      for r in (gate.get("details") or {}).get("aot", [])]}
        # the LLM was asked for the first block of this structure, at its task's module
        first = next((x for x in decisions if x["path"] == d["same_as"]), d) if d.get("same_as") else d
        asked = first.get("core") or first["path"]
        summary = _json(run_dir / "generated" / "llm" / _slug(asked) / "summary.json")
        if summary:
            entry["llm"] = {"attempts": len(summary.get("attempts", [])),
                            "accepted_prompt_hash": next((a["prompt_hash"] for a in summary["attempts"]
                                                          if a["verdict"] == "accepted"), None),
                            "summary": str(Path("generated") / "llm" / _slug(asked) / "summary.json")}
        row, patch = rows.get(d["path"]), patches.get((d["path"], d.get("family")))
        left_out = any(later["path"] == d["path"] and later.get("failed_family") == d.get("family")
                       for later in decisions[i + 1:])
        entry["blocks"].append({
            "path": d["path"], "same_as": d.get("same_as"),
            "patched": "left out" if left_out else patch.get("status") if patch else None,
            "fwd": row["fwd"]["verdict"] if row else None, "bwd": row["bwd"]["verdict"] if row else None})
    for e in out.values():
        e["status"] = _status(e, bool(align))
    return list(out.values())


def _slug(path: str) -> str:
    from onboarding.generate.llm.attempts import block_dir

    return block_dir(path)


def _status(entry: dict[str, Any], aligned: bool) -> str:
    if not aligned:
        return "not aligned: no alignment ran"
    bad = [b["path"] for b in entry["blocks"]
           if b["fwd"] != "pass" or b["bwd"] not in ("pass", None) or b["patched"] not in ("active", None)]
    unchecked = [b["path"] for b in entry["blocks"] if b["fwd"] is None]
    if bad and len(bad) > len(unchecked):
        return "alignment failed: " + ", ".join(sorted(set(bad) - set(unchecked)))
    if unchecked:
        return "not aligned: " + ", ".join(unchecked) + " not in the alignment"
    return "candidate"


def write_pr_candidates(run_dir: Path) -> Path | None:
    """Write ``generated/pr_candidates.json`` when the run has generated families; returns it."""
    cands = pr_candidates(run_dir)
    if not cands:
        return None
    path = Path(run_dir) / PR_CANDIDATES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pr_candidates": [c for c in cands if c["status"] == "candidate"],
                                "generated_families": cands}, indent=1) + "\n")
    return path


def report_section(run_dir: Path) -> str | None:
    """The report's "LLM-written kernel families" section (it writes pr_candidates.json too)."""
    from onboarding.formatting import table

    path = write_pr_candidates(run_dir)
    if path is None:
        return None
    cands = json.loads(path.read_text())["generated_families"]
    rows = [[f"`{c['family']}`", ", ".join(f"`{b['path']}`" for b in c["blocks"]),
             str(c["llm"].get("attempts", "-")), c["gate"].get("check") or "-",
             ", ".join(f"{r['kernel']} {'ok' if r['ok'] else 'FAILED'}" for r in c["gate"]["aot_sm90"]) or "-",
             c["status"]] for c in cands]
    n = sum(c["status"] == "candidate" for c in cands)
    return "\n".join([
        "## LLM-written kernel families", "",
        f"{len(cands)} famil{'y' if len(cands) == 1 else 'ies'} written by the LLM passed the gate (render, "
        "static and runtime anti-cheat checks, sm_90 compile, the block check); "
        f"{n} aligned in the model and listed as kernel-PR candidates in `{PR_CANDIDATES}`.", "",
        table(["family", "blocks", "attempts", "block check", "sm_90 compile", "status"], rows)])


def gate_checks(folder: Path) -> list[dict[str, Any]] | None:
    """An LLM-written family folder's gate verdict (``gate.json``) as the generate stage's
    candidate checks (its template rendered at the same parameters is the module the gate
    checked), or None for a folder without one."""
    gate = _json(Path(folder) / "gate.json")
    if gate is None:
        return None
    details = gate.get("details") or {}
    check = details.get("check") or {}
    rows = [{"name": "llm gate", "passed": bool(gate.get("ok")),
             "message": details.get("summary") or gate.get("reason") or gate.get("stage", "")}]
    for size in check.get("sizes", []):
        for e in size.get("errors", []):
            rows.append({"name": f"{size['batch']}x{size['seq']} {size['dtype']} {e['name']}",
                         "passed": bool(e["passed"]), "rel_rms": e.get("rel_rms"),
                         "message": e.get("message", "")})
    return rows
