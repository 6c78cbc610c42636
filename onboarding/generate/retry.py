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

A family the LLM path wrote left out this way is in the run (``generated/families/<name>/``, as
`onboarding.generate.llm.folder.write_folder` wrote the answer): `previous_family` reads its
template, reference and spec fields, so the model asked again sees the code it sent and can fix
it instead of writing from nothing. `local_errors` says where the numbers put the error in that
code (its block, replayed alone on the reference's inputs, misses a bar): only then does the
prompt ask for a fix rather than a new start (`code_lines`). Bounded: each file cut at its cap
(`MAX_TEMPLATE`, `MAX_FILE`), the cut said in the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onboarding.align._results import FAILING
from onboarding.modpath import inside, related

MAX_BLOCKS = 4  # failing blocks listed, culprit first; the others are counted
MAX_MESSAGE = 300  # characters of one verdict message or patch error
MAX_TEMPLATE = 30_000  # characters of the left-out family's template shown (as the block's source)
MAX_FILE = 6_000  # characters of its reference, and of its spec fields

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
    bad = sorted((b for b in alignment.get("blocks", []) if related(b["path"], path) and any(
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
                m = {"of": what, "quantity": field, "metric": "rel_rms",
                     "value": _num(s.get("rel_rms")),
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


# -- the left-out family's own code -----------------------------------------------------------

# what onboard adds to the answer's spec fields in spec.json (`folder.spec_dict`): not the model's
_OURS = ("serves", "written_for")


def _capped(name: str, text: str, cap: int, lang: str) -> dict[str, Any]:
    return {"name": name, "lang": lang, "text": text[:cap], "chars": len(text)}


def previous_family(folder: Path) -> dict[str, Any]:
    """The left-out LLM-written family at ``folder`` as its answer had it (module docstring):
    ``{"family", "folder", "files": [{name, lang, text, chars}]}``, each file's ``text`` cut at its
    cap and ``chars`` its whole length. Empty where ``folder`` holds no answer's spec.json naming
    it (a registered family's folder: the model did not write it)."""
    folder = Path(folder)
    try:
        spec = json.loads((folder / "spec.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    name = spec.get("family") if isinstance(spec, dict) else None
    template = folder / f"{name}.py.j2"
    if name != folder.name or not template.is_file():
        return {}
    files = [_capped(template.name, template.read_text(), MAX_TEMPLATE, "jinja")]
    if (folder / "reference.py").is_file():
        files.append(_capped("reference.py", (folder / "reference.py").read_text(), MAX_FILE,
                             "python"))
    fields = {k: v for k, v in spec.items() if k not in _OURS}
    files.append(_capped("spec.json", json.dumps(fields), MAX_FILE, "json"))
    return {"family": name, "folder": str(folder), "files": files}


def local_errors(failure: dict[str, Any], path: str) -> list[str]:
    """Where ``failure`` (`alignment_failure`) puts the error in the code of the family that
    served the block ``path``: each failing direction of a block at or inside it whose replay
    alone, on the reference's inputs, misses its bar or has non-finite elements (the family's
    code computes those from correct inputs; an error only in what reaches the block is not
    shown to be the code's)."""
    out = []
    for f in (failure or {}).get("failing", []):
        if not inside(f["block"], path):
            continue
        for d in f.get("directions", []):
            bad = [m["of"] for m in d.get("measured", [])
                   if str(m.get("quantity", "")).startswith("local") and (m.get("nonfinite") or (
                       m.get("value") is not None and m.get("bar") is not None
                       and m["value"] > m["bar"]))]
            if bad:
                out.append(f"`{f['block']}` {d['direction']} ({'; '.join(bad)})")
    return out


def code_lines(previous: dict[str, Any], failure: dict[str, Any], path: str) -> list[str]:
    """The retry prompt's section with the left-out family's code (`previous_family`): what to
    do with it (fix it only where `local_errors` finds the error in it), then each file, a cut
    one saying how much of it is shown."""
    if not previous:
        return []
    name = previous["family"]
    where = local_errors(failure, path)
    if where:
        what = ("The numbers above put the error in this code: replayed alone on the reference's "
                f"inputs, its block misses a bar at {', '.join(where)}. Fix the code where it "
                "goes wrong rather than starting over, and keep what holds.")
    else:
        what = ("The numbers above do not put the error in this code (no block of it, replayed "
                "alone on the reference's inputs, misses a bar); it is what was tried.")
    lines = [f"The earlier answer for this block, the family `{name}` that alignment left out "
             f"(its folder {name}/ as it was sent). {what} Send a whole answer under a new family "
             f"name: alignment leaves `{name}` out at this block."]
    for f in previous["files"]:
        cut = (f" (the first {len(f['text'])} of its {f['chars']} characters; the rest is cut)"
               if f["chars"] > len(f["text"]) else "")
        lines += [f"--- {f['name']}{cut}", f"```{f['lang']}", f["text"].rstrip("\n"), "```"]
    return lines
