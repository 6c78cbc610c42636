"""`propose`: ask the model for a family for one kernel task, gate each answer, feed a failure
back, within a bound of attempts and seconds; record every attempt.

Files, under ``<run_dir>/generated/``:
- ``llm/<block>/attempt-N/``: ``prompt.json`` (the messages sent, their hash), ``answer.txt`` (the
  raw reply), ``family/<name>/`` and ``rendered/`` (the parsed files), ``blockcheck.json`` (the
  subprocess check), ``verdict.json``;
- ``llm/<block>/summary.json``: every attempt's prompt hash, verdict and reason, and the outcome;
- ``families/<name>/``: the accepted family folder (plugin layout, loads with ``--families``),
  with ``gate.json`` (what it passed).

A failure of the request itself goes back as a retry only where another request can help (an
HTTP 5xx, a timeout, an empty or unparsable answer); a wrong model name, a 4xx or a server that
cannot be reached ends the attempts at once.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onboarding.generate.llm.client import LLMClient, LLMError
from onboarding.generate.llm.contract import AnswerError, parse_answer, response_format
from onboarding.generate.llm.gate import gate
from onboarding.generate.llm.prompt import feedback, initial_messages, prompt_hash

_FINAL = ("model_not_found", "connection")


@dataclass(kw_only=True)
class Attempt:
    n: int
    prompt_hash: str
    verdict: str  # accepted | rejected | error
    stage: str  # request kind (timeout, http, ...), parse, or the gate's stage
    reason: str = ""
    seconds: float = 0.0
    mode: str = ""  # how the answer was asked for: json_schema | json_object | text
    family: str | None = None
    dir: str = ""


@dataclass(kw_only=True)
class LLMOutcome:
    """What the LLM path did for one task: accepted (with the family folder) or why not."""

    path: str
    accepted: bool
    family: str | None = None
    variant: str | None = None
    folder: str | None = None  # the accepted family folder (under generated/families/)
    reason: str = ""  # why nothing was accepted (the last attempt's reason)
    attempts: list[Attempt] = field(default_factory=list)
    seconds: float = 0.0
    summary: str = ""  # the summary.json path

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def block_dir(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", path) or "block"


def propose(task: Any, client: LLMClient, *, attempts: int = 3, budget_s: float | None = None,
            run_dir: Path, spec: Any = None, gate_timeout_s: float = 900.0,
            sizes: list[list[int]] | None = None, check_in_process: bool = False) -> LLMOutcome:
    """Ask `client` for a family for `task` (a `KernelTask`) and gate each answer; see the module
    docstring. `spec` is the run's ModelSpec (default: read from ``run_dir/model.json``); `sizes`
    and `check_in_process` go to the gate (`gate.gate`)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    if spec is None:
        from onboarding.generate.tasks import spec_from_run

        spec = spec_from_run(run_dir)
    root = run_dir / "generated" / "llm" / block_dir(task.path)
    if root.exists():
        shutil.rmtree(root)  # a re-run of the stage replaces this block's record
    root.mkdir(parents=True)
    out = LLMOutcome(path=task.path, accepted=False)
    messages = initial_messages(task)
    for n in range(1, attempts + 1):
        left = None if budget_s is None else budget_s - (time.perf_counter() - t0)
        if left is not None and left <= 0:
            out.reason = f"generate budget of {budget_s:g} s spent after {n - 1} attempt(s)"
            break
        adir = root / f"attempt-{n}"
        adir.mkdir()
        h = prompt_hash(messages)
        (adir / "prompt.json").write_text(json.dumps({"hash": h, "messages": messages}, indent=1) + "\n")
        a0 = time.perf_counter()
        att = Attempt(n=n, prompt_hash=h, verdict="error", stage="", dir=str(adir))
        out.attempts.append(att)
        try:
            reply = client.complete(messages, response_format())
        except LLMError as exc:
            att.stage, att.reason = exc.kind, exc.reason
            _finish(att, adir, a0)
            if exc.kind in _FINAL or (exc.kind == "http" and exc.status and exc.status < 500):
                break
            continue
        att.mode = reply.mode
        (adir / "answer.txt").write_text(reply.text)
        try:
            answer = parse_answer(reply.text)
        except AnswerError as exc:
            att.verdict, att.stage, att.reason = "rejected", "parse", str(exc)
            _finish(att, adir, a0)
            messages = messages + [{"role": "assistant", "content": reply.text[:20000]},
                                   {"role": "user", "content": feedback(str(exc))}]
            continue
        att.family = answer.family
        other = _taken_by(run_dir / "generated" / "families" / answer.family, task)
        if other or answer.family == getattr(task, "failed_family", None):
            # alignment's exclusions go by (block, family name): the left-out name stays out
            why = (f"family name {answer.family!r} is taken by the generated family for {other}"
                   if other else f"family name {answer.family!r} is the family alignment left "
                   "out at this block") + ": choose another"
            att.verdict, att.stage, att.reason = "rejected", "folder", why
            _finish(att, adir, a0)
            messages = messages + [{"role": "assistant", "content": reply.text[:20000]},
                                   {"role": "user", "content": feedback(why)}]
            continue
        timeout = gate_timeout_s if left is None else max(30.0, min(gate_timeout_s, left))
        verdict = gate(answer, task, spec=spec, out_dir=adir, timeout_s=timeout, sizes=sizes,
                       in_process=check_in_process)
        (adir / "verdict.json").write_text(json.dumps(verdict.as_dict(), indent=1, default=str) + "\n")
        att.stage, att.reason = verdict.stage, verdict.reason
        if verdict.ok:
            att.verdict = "accepted"
            _finish(att, adir, a0)
            dest = run_dir / "generated" / "families" / answer.family
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(adir / "family" / answer.family, dest)
            (dest / "gate.json").write_text(json.dumps(verdict.as_dict(), indent=1, default=str) + "\n")
            out.accepted, out.family, out.folder = True, answer.family, str(dest)
            out.variant, out.reason = answer.variants[0].name, ""
            break
        att.verdict = "rejected"
        _finish(att, adir, a0)
        messages = messages + [{"role": "assistant", "content": reply.text[:20000]},
                               {"role": "user", "content": feedback(verdict.reason)}]
    if not out.accepted and not out.reason:
        last = out.attempts[-1] if out.attempts else None
        out.reason = f"attempt {last.n}: {last.reason}" if last else "no attempt made"
    out.seconds = round(time.perf_counter() - t0, 2)
    out.summary = str(root / "summary.json")
    (root / "summary.json").write_text(json.dumps(out.as_dict(), indent=1, default=str) + "\n")
    return out


def _taken_by(dest: Path, task: Any) -> str:
    """The block another task's accepted family of this name was written for, or ""."""
    try:
        written = json.loads((dest / "spec.json").read_text()).get("written_for", {})
    except (OSError, json.JSONDecodeError):
        return ""
    same = written.get("key") == getattr(task, "key", "") and written.get("kind") == task.kind
    return "" if same or not written else str(written.get("path", "another block"))


def _finish(att: Attempt, adir: Path, a0: float) -> None:
    att.seconds = round(time.perf_counter() - a0, 2)
    (adir / "attempt.json").write_text(json.dumps(asdict(att), indent=1) + "\n")
