"""Alignment's results: per block and direction (`Direction`, `BlockAlignment`) and for the whole
model (`AlignmentResult`: verdicts, tables, JSON, the report and its plot)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onboarding.align.report import plot_errors, render_markdown
from onboarding.align.stats import ErrorStats, _json_safe
from onboarding.align.verdicts import checked_line

FAILING = ("fail", "nonfinite", "amplified")


class AlignmentError(RuntimeError):
    """Raised by `AlignmentResult.check()` (and for a reference that is itself non-finite)."""



@dataclass(kw_only=True, slots=True)
class Direction:
    """One direction (forward or backward) of one block."""

    verdict: str = "pass"
    output: ErrorStats | None = None  # fwd: block outputs; bwd: gradients w.r.t. its inputs
    input: ErrorStats | None = None  # fwd: block inputs; bwd: gradients reaching its outputs
    params: ErrorStats | None = None  # bwd only: gradients of the block's parameters
    local: ErrorStats | None = None  # the isolated replay on the reference's inputs
    local_params: ErrorStats | None = None
    output_ok: bool = True
    input_ok: bool = True
    local_ok: bool | None = None
    source: str | None = None  # for "propagated" from a contained culprit
    message: str = ""


@dataclass(kw_only=True, slots=True)
class BlockAlignment:
    path: str
    kind: str
    layer: int | None
    calls: int
    tolerance: dict[str, float]
    fwd: Direction
    bwd: Direction
    # with a noise floor: the floor's rel_rms and the max_rel_rms derived from it, per quantity
    floor: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    # top-level output slots (never the first) the candidate returned as None where the
    # reference returned a tensor: not judged (`_judge`)
    unjudged_outputs: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class AlignmentResult:
    model: str
    mode: str
    reference_dtype: str
    candidate_dtype: str
    seed: int
    input_shapes: list[list[int]]
    blocks: list[BlockAlignment]
    forward_order: list[str]
    backward_order: list[str]
    logits: dict[str, Any]
    patches: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    floor_dtype: str | None = None  # the unpatched model's dtype when bounds come from it
    # what was not checked (`onboarding.align.verdicts`): the coverable blocks (None: not known,
    # no coverage given), those left unpatched {path, kind, family, reason}, patched blocks whose
    # backward was not exercised; ``strict``: an unpatched coverable block fails the verdict
    coverable: int | None = None
    not_checked: list[dict[str, Any]] = field(default_factory=list)
    backward_not_checked: list[dict[str, Any]] = field(default_factory=list)
    strict: bool = False

    def block(self, path: str) -> BlockAlignment:
        for b in self.blocks:
            if b.path == path:
                return b
        raise KeyError(path)

    def culprits(self, direction: str = "fwd") -> list[BlockAlignment]:
        """Failing blocks in that direction's execution order (first = the culprit)."""
        order = self.forward_order if direction == "fwd" else self.backward_order
        rank = {p: i for i, p in enumerate(order)}
        bad = [b for b in self.blocks if getattr(b, direction).verdict in FAILING]
        return sorted(bad, key=lambda b: rank.get(b.path, len(rank)))

    @property
    def culprit(self) -> BlockAlignment | None:
        """The first failing block, forward first, else backward."""
        c = self.culprits("fwd") or self.culprits("bwd")
        return c[0] if c else None

    @property
    def passed(self) -> bool:
        return (not self.culprits("fwd") and not self.culprits("bwd")
                and self.logits.get("passed", True))

    @property
    def strict_failed(self) -> bool:
        """Under ``strict``, a coverable block was left unpatched (not checked)."""
        return self.strict and bool(self.not_checked)

    @property
    def verdict_passed(self) -> bool:
        """The checks passed and, under ``strict``, every coverable block was patched."""
        return self.passed and not self.strict_failed

    def checked(self) -> str:
        """What was checked: "18 of 20 coverable blocks patched; not checked: ..." ("" when the
        coverable blocks are not known)."""
        return checked_line(self)

    def summary(self) -> str:
        floor = " (bounds from the unpatched model's own error)" if self.floor_dtype else ""
        what = self.checked()
        if self.passed:
            stats = (f"{len(self.blocks)} blocks, {self.candidate_dtype} vs "
                     f"{self.reference_dtype}{floor}, logits rel_rms "
                     f"{self.logits['stats']['rel_rms']:.2e}, KL {self.logits['kl']:.2e}, top-1 "
                     f"{self.logits['top1_agreement']:.3f}")
            if self.strict_failed:
                return f"alignment FAILED under --strict \u2014 {what}. {stats}"
            if self.not_checked or self.backward_not_checked:
                # never a plain pass when something coverable was not checked
                return f"alignment PASS \u2014 {what}. {stats}"
            return f"alignment passed: {what + '; ' if what else ''}{stats}"
        lines = []
        for d, name in (("fwd", "forward"), ("bwd", "backward")):
            for b in self.culprits(d):
                lines.append(f"{name}: {b.path} ({b.kind}) {getattr(b, d).verdict}: "
                             f"{getattr(b, d).message}")
        if not self.logits.get("passed", True):
            lines.append(f"logits: {self.logits.get('message', '')}")
        if what:
            lines.append(what)
        return f"alignment FAILED{floor}\n  " + "\n  ".join(lines)

    def check(self) -> AlignmentResult:
        """Raise `AlignmentError` naming the culprit blocks unless the alignment passed (and,
        under ``strict``, every coverable block was patched)."""
        if not self.verdict_passed:
            raise AlignmentError(self.summary())
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["verdict_passed"] = self.verdict_passed
        d["culprit"] = {k: [b.path for b in self.culprits(k)] for k in ("fwd", "bwd")}
        return _json_safe(d)

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def to_markdown(self, *, only_failing: bool = False) -> str:
        return render_markdown(self, only_failing=only_failing)

    def plot(self, path: Path | str) -> Path:
        return plot_errors(self, Path(path))
