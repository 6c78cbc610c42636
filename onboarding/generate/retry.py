"""What a retry after a failed alignment tells the kernel writer: how the left-out family failed.

A family that passed its own checks can still fail alignment (the whole model, patched, against
the eager model in a wider dtype): alignment then leaves it out and the block is a kernel task
again (`onboarding.generate.decide.retry_blocks`). A model asked to write a fix needs the numbers,
not only "it failed": `alignment_failure` reads them off the failed alignment's results
(``alignment.json``, `onboarding.align._results.AlignmentResult.to_dict`) for the family's block:
per failing block at, inside or around it (culprit first) and per failing direction, each
measured quantity's relative RMS error against its bar, the block's shapes, the dtypes, the
verdict's message and any error the patch recorded; `prompt_lines` writes them into the retry's
prompt (`onboarding.generate.llm.prompt.task_prompt`). Bounded: `MAX_BLOCKS` blocks, messages cut
at `MAX_MESSAGE` characters.
"""

from __future__ import annotations

from typing import Any

from onboarding.align._results import FAILING

MAX_BLOCKS = 4  # failing blocks listed, culprit first; the others are counted
MAX_MESSAGE = 300  # characters of one verdict message or patch error

# per direction: (the `Direction` field, what it measures, the key of its bar in the block's
# ``bounds``); a backward's "output" is the gradient w.r.t. the block's inputs
_QUANTITIES = {
    "fwd": (("output", "outputs", "output"),
            ("local", "outputs, block replayed alone on the reference's inputs", "local_output"),
            ("input", "inputs, from the blocks before it", "input")),
    "bwd": (("output", "gradients w.r.t. its inputs", "grad_in"),
            ("params", "gradients of its parameters", "params"),
            ("local", "gradients w.r.t. its inputs, block replayed alone", "local_grad_in"),
            ("local_params", "gradients of its parameters, block replayed alone", "local_params"),
            ("input", "gradients reaching its outputs, from the blocks after it", "grad_out")),
}
_NAMES = {"fwd": "forward", "bwd": "backward"}


def _num(v: Any) -> float | None:
    return None if v is None else float(f"{float(v):.3g}")


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def alignment_failure(alignment: dict[str, Any] | None, path: str, family: str | None = None,
                      shapes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """What the failed alignment ``alignment`` (``alignment.json``'s content) measured at the
    block ``path`` whose ``family`` it left out (module docstring); ``shapes``: block path ->
    its ``{"inputs", "outputs"}`` ({shape, dtype} each, the op graph's, which alignment ran at).
    Empty without an alignment."""
    if not alignment:
        return {}
    shapes = shapes or {}
    rank = {p: i for i, p in enumerate(alignment.get("forward_order") or [])}
    bad = sorted((b for b in alignment.get("blocks", []) if _related(b["path"], path) and any(
        (b.get(d) or {}).get("verdict") in FAILING for d in _QUANTITIES)),
        key=lambda b: rank.get(b["path"], len(rank)))
    blocks = []
    for b in bad[:MAX_BLOCKS]:
        bounds, tol = b.get("bounds") or {}, (b.get("tolerance") or {}).get("max_rel_rms")
        directions = []
        for d, quantities in _QUANTITIES.items():
            row = b.get(d) or {}
            if row.get("verdict") not in FAILING:
                continue
            measured = []
            for field, what, q in quantities:
                s = row.get(field)
                if not s:
                    continue
                m = {"of": what, "metric": "rel_rms", "value": _num(s.get("rel_rms")),
                     "bar": _num(bounds.get(q, tol)), "max_abs": _num(s.get("max_abs"))}
                if s.get("nonfinite"):
                    m["nonfinite"] = int(s["nonfinite"])
                measured.append(m)
            directions.append({"direction": _NAMES[d], "verdict": row["verdict"],
                               "measured": measured,
                               "message": (row.get("message") or "")[:MAX_MESSAGE]})
        blocks.append({"block": b["path"], "kind": b.get("kind"), "directions": directions,
                       **({"shapes": shapes[b["path"]]} if b["path"] in shapes else {})})
    out: dict[str, Any] = {"dtype": alignment.get("candidate_dtype"),
                           "reference_dtype": alignment.get("reference_dtype"),
                           "model_inputs": alignment.get("input_shapes"), "failing": blocks}
    if len(bad) > MAX_BLOCKS:
        out["more_failing_blocks"] = len(bad) - MAX_BLOCKS
    logits = alignment.get("logits") or {}
    if logits.get("stats"):
        out["logits"] = {"metric": "rel_rms", "value": _num(logits["stats"].get("rel_rms")),
                         "bar": _num(logits.get("max_rel_rms")), "passed": logits.get("passed")}
    patch = next((p for p in alignment.get("patches", [])
                  if p.get("path") == path and (family is None or p.get("family") == family)), None)
    if patch and patch.get("detail"):
        out["patch_error"] = f"{patch.get('status')}: {patch['detail']}"[:MAX_MESSAGE]
    return out


def _shape(metas: list[dict[str, Any]]) -> str:
    return ", ".join(f"{m.get('shape')} {m.get('dtype')}" for m in metas) or "-"


def _measure(m: dict[str, Any]) -> str:
    v, bar = m.get("value"), m.get("bar")
    cmp = "" if v is None or bar is None else (" > " if v > bar else " <= ")
    return (f"{m['of']}: {m['metric']} {_fmt(v)}{cmp}{'bar ' + _fmt(bar) if cmp else ''}"
            f" (max_abs {_fmt(m.get('max_abs'))}"
            + (f", {m['nonfinite']} non-finite elements" if m.get("nonfinite") else "") + ")")


def _fmt(v: float | None) -> str:
    return "?" if v is None else f"{v:.2e}"


def prompt_lines(failure: dict[str, Any], family: str | None) -> list[str]:
    """The retry prompt's section on ``failure`` (`alignment_failure`), one line per block,
    direction and quantity."""
    if not failure:
        return []
    lines = [f"The family `{family or '?'}` passed its own checks here, but alignment (the whole "
             f"model patched with it, {failure.get('dtype')}, against the eager model in "
             f"{failure.get('reference_dtype')}, model inputs {failure.get('model_inputs')}) "
             "failed it and left it out. Relative RMS error (||candidate - reference|| / "
             "||reference||) per quantity against its bar; a new family must stay within every "
             "bar at these shapes and dtypes:"]
    for f in failure.get("failing", []):
        at = f.get("shapes") or {}
        lines.append(f"- `{f['block']}` ({f.get('kind')})" + (
            f", inputs {_shape(at.get('inputs', []))} -> outputs {_shape(at.get('outputs', []))}"
            if at else ""))
        for d in f.get("directions", []):
            lines.append(f"  - {d['direction']}: {d['verdict']}")
            lines += [f"    - {_measure(m)}" for m in d.get("measured", [])]
            if d.get("message"):
                lines.append(f"    - alignment's message: {d['message']}")
    if not failure.get("failing"):
        lines.append("- no block at or around it failed in the recorded alignment")
    if failure.get("more_failing_blocks"):
        lines.append(f"- and {failure['more_failing_blocks']} more failing blocks at or around it")
    lg = failure.get("logits")
    if lg:
        lines.append(f"- the model's logits: rel_rms {_fmt(lg.get('value'))} against bar "
                     f"{_fmt(lg.get('bar'))} ({'passed' if lg.get('passed') else 'failed'})")
    if failure.get("patch_error"):
        lines.append(f"- its patch recorded: {failure['patch_error']}")
    return lines
