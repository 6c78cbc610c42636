"""What an alignment did not check: coverable blocks left unpatched, patched blocks whose backward
was never exercised, and the verdict line that says so.

A block is *coverable* when coverage says a kernel or a template serves it (status ``kernel`` or
``template``), or the generate stage's decision loop served it (``generated``, ``inductor``). An alignment checks a coverable block's kernel only when that kernel was patched in
and ran: a block whose patch was rejected (its structure does not fit the kernel, calibration
matched no binding), never ran (installed, never called), or was never made (no passing candidate,
the family not selected, left out after a failed attempt, a family that cannot patch) is *not
checked*, and the verdict says so by path and reason (`unchecked_blocks`, `checked_line`). A block
inside an active patch's block runs that patch's kernel: it counts as checked there.

``--strict`` (`AlignmentResult.strict`) turns any unchecked coverable block into a failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from onboarding.modpath import inside

# how many paths one reason lists on the verdict line before "and N more"
_LINE_PATHS = 4


def unchecked_blocks(coverage: Any, records: Iterable[Any], *, available: Iterable[tuple[str, str]],
                     bindable: Iterable[str], families: list[str] | None = None,
                     exclude: Iterable[tuple[str, str]] = ()) -> tuple[int, list[dict[str, Any]]]:
    """(number of coverable blocks, the coverable blocks not checked: ``{path, kind, family,
    reason}`` each, in coverage order).

    ``coverage`` the run's `Coverage`; ``records`` the `PatchRecord`s as they stand while the model
    is patched (after the alignment ran: ``pending`` then means installed but never called);
    ``available`` the (block path, family) pairs that have a loaded kernel before any selection;
    ``bindable`` the families that can patch a block; ``families`` the families selected (None:
    all); ``exclude`` the (path, family) pairs left out.
    """
    recs: dict[str, list[Any]] = {}
    for r in records:
        recs.setdefault(r.path, []).append(r)
    active = {p for p, rs in recs.items() if any(r.status == "active" for r in rs)}
    available, bindable, exclude = set(available), set(bindable), {tuple(x) for x in exclude}
    served: dict[str, dict[str, Any]] = {}  # path -> {kind, families}
    for e in coverage.entries:
        # a block the generate stage served with Inductor is coverable too: its "family" is
        # the swap's label (`onboarding.patching.core.BlockSwap`)
        if e.status in ("kernel", "template", "generated", "inductor") and \
                (e.family or e.status == "inductor"):
            fam = e.family or e.status
            s = served.setdefault(e.path, {"kind": e.kind, "families": []})
            if fam not in s["families"]:
                s["families"].append(fam)
    out = []
    for path, s in served.items():
        if any(inside(path, p) for p in active):
            continue
        fams = s["families"]
        fam, reason = _reason(path, fams, recs.get(path, []), available, bindable, families,
                              exclude)
        out.append({"path": path, "kind": s["kind"], "family": fam, "reason": reason})
    return len(served), out


def _reason(path: str, fams: list[str], recs: list[Any], available: set, bindable: set,
            selected: list[str] | None, exclude: set) -> tuple[str, str]:
    for r in recs:  # a patch was attempted
        if r.status == "rejected":
            return r.family, f"patch rejected: {r.detail or 'no reason given'}"
        if r.status == "dense_by_shape":  # installed and calibrated, but never served a call
            return r.family, "dense by shape: " + (r.detail or "every call ran the block's own attention")
        if r.status == "pending":
            return r.family, "patched, but never called on these inputs"
    can = [f for f in fams if f in bindable]
    if not can:
        return fams[0], (f"the {'/'.join(fams)} famil{'ies have' if len(fams) > 1 else 'y has'} "
                         "no patch binding: its kernel is generated, never patched in")
    chosen = [f for f in can if selected is None or f in selected]
    if not chosen:
        return can[0], f"{'/'.join(can)} not selected (--kernels)" + (
            " (name 'inductor' to keep the swaps)" if can == ["inductor"] else "")
    left = [f for f in chosen if (path, f) in exclude]
    if left and len(left) == len(chosen):
        return left[0], "kernel left out after a failed alignment attempt"
    missing = [f for f in chosen if (path, f) not in available]
    if missing:
        return missing[0], "no kernel: no candidate passed its checks in generate"
    return chosen[0], "not patched"


def backward_unchecked(result: Any, records: Iterable[Any], modules: dict[str, Any],
                       param_grads: dict[str, Any]) -> list[dict[str, Any]]:
    """Patched (active) blocks whose backward the alignment did not exercise: no gradient flows
    through them, or their trainable parameters got none (an expert path under no_grad)."""
    by_path = {b.path: b for b in result.blocks}
    out = []
    for r in records:
        sites = [by_path[p] for p in getattr(r, "sites", ()) if p in by_path]
        if r.status == "active" and sites:
            # the kernel ran in other blocks (a rope block's, in the attention that rotates q/k
            # with its tables): its backward is checked where a gradient flowed through them
            if all(s.bwd.verdict in ("no_grad", "not_called", "skipped") for s in sites):
                out.append({"path": r.path, "kind": r.kind, "family": r.family,
                            "reason": "no gradient flows through the blocks it runs in ("
                                      + ", ".join(s.path for s in sites) + ")"})
            continue
        b = by_path.get(r.path)
        if r.status != "active" or b is None or b.bwd.verdict in ("not_called", "skipped"):
            continue
        mod = modules.get(r.path)
        names = [f"{r.path}.{n}" for n, p in mod.named_parameters() if p.requires_grad] \
            if mod is not None else []
        if b.bwd.verdict == "no_grad":
            reason = "no gradient flows through it"
        elif names and all(param_grads.get(n) is None for n in names):
            reason = "its parameters got no gradient"
        else:
            continue
        out.append({"path": r.path, "kind": r.kind, "family": r.family, "reason": reason})
    return out


def _grouped(items: list[dict[str, Any]], limit: int | None) -> str:
    by_reason: dict[str, list[str]] = {}
    for x in items:
        by_reason.setdefault(x["reason"], []).append(x["path"])
    parts = []
    for reason, paths in by_reason.items():
        shown = paths if limit is None or len(paths) <= limit else paths[:limit]
        more = f" and {len(paths) - len(shown)} more" if len(shown) < len(paths) else ""
        parts.append(f"{', '.join(shown)}{more} ({reason})")
    return "; ".join(parts)


def partly_dense(patches: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Active patches (as `AlignmentResult.patches` holds them) that a shape policy sent some
    calls to the block's own attention: ``{path, kind, family, reason}`` with the counts and why.
    Their verdict judged the kernel's calls and the block's own together."""
    out = []
    for p in patches:
        calls = p.get("calls") or {}
        if p.get("status") == "active" and calls.get("dense"):
            out.append({"path": p["path"], "kind": p.get("kind"), "family": p.get("family"),
                        "reason": p.get("detail") or f"kernel {calls.get('kernel', 0)} calls, "
                                                     f"dense {calls['dense']}"})
    return out


def checked_line(result: Any, *, limit: int | None = _LINE_PATHS) -> str:
    """"18 of 20 coverable blocks patched; not checked: a, b (reason); backward not checked: c
    (reason); partly dense by shape: d (the kernel served 1 of 2 calls ...)", or "" when the
    coverable blocks are not known (`align` called without coverage) and nothing else applies."""
    parts = []
    if result.coverable is not None:
        n = result.coverable - len(result.not_checked)
        parts.append(f"{n} of {result.coverable} coverable blocks patched")
        if result.not_checked:
            parts.append("not checked: " + _grouped(result.not_checked, limit))
    if result.backward_not_checked:
        parts.append("backward not checked: " + _grouped(result.backward_not_checked, limit))
    partly = partly_dense(getattr(result, "patches", None) or [])
    if partly:
        parts.append("partly dense by shape: " + _grouped(partly, limit))
    return "; ".join(parts)


def strict_line(not_checked: list[dict[str, Any]]) -> str:
    """The failure line of ``--strict``: the unpatched coverable blocks (``not_checked``), every
    one named with its reason."""
    n = len(not_checked)
    return (f"{n} coverable block{'s' if n != 1 else ''} not patched: "
            + _grouped(not_checked, None))


def markdown_lines(result: Any) -> list[str]:
    """The report's list: one line per block not checked, by path, kind, family and reason."""
    lines = []
    for x in result.not_checked:
        lines.append(f"- not checked: `{x['path']}` ({x['kind']}, {x['family']}): {x['reason']}")
    for x in result.backward_not_checked:
        lines.append(f"- backward not checked: `{x['path']}` ({x['kind']}, {x['family']}): "
                     f"{x['reason']}")
    for x in partly_dense(getattr(result, "patches", None) or []):
        lines.append(f"- partly dense by shape: `{x['path']}` ({x['kind']}, {x['family']}): "
                     f"{x['reason']}")
    return lines
