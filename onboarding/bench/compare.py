"""Nightly baselines and noise-aware verdicts: every row of a nightly run against its baseline
row, ok / regression / improvement / suspicious.

The noise comes from the run itself. Each timed row is measured as an A/A pair: the same
implementation timed twice per round, the two interleaved with the case's other rows, over
several rounds (`onboarding.bench.suite`). The per-round log ratio of the two, d = ln(A / A'),
is pure noise; its robust spread gives the row's noise floor, the relative standard deviation
of one sample (`noise_floor`). A change between tonight and the baseline is judged against

    threshold = max(family minimum, K_SIGMA * sqrt(noise_now^2 + noise_baseline^2)),

so a quiet row is judged tightly and a noisy one loosely, never below the family's minimum
(`onboarding.families.NightlySpec.min_threshold`; training rows `TRAIN_MIN_THRESHOLD`). A row
is *suspicious*, not judged, when it has fewer than MIN_ROUNDS A/A rounds on either side, or
when its noise alone would put the threshold above MAX_THRESHOLD (nothing short of a 2x
change could be told from noise). Facts (the example's alignment) are compared exactly or
within `onboarding.regress.TOLERANCES`. A row that passed in the baseline and now fails (an
error, a failed check) is a regression; a row the baseline lacks is suspicious.

The noise is one sample's, not the standard error of the row's median (smaller by ~sqrt(2 x
rounds)), on purpose: two processes differ by more than one process's pairs show (an H200
training step moved 16.6% between two runs of the same commit whose pairs scattered by 2.6-8.3%,
docs/LOG.md), and a nightly that cries wolf gets ignored.

Baselines live in ``reference_runs/bench/<gpu>/nightly.json``: the run's rows plus the metadata
of the run that made them (commit, date, versions, GPU, command), written atomically.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onboarding.errors import InputError
from onboarding.regress import REFERENCE_DIR

FORMAT = 1
K_SIGMA = 4.0  # a change this many (combined) noise sigmas out is not noise
MIN_ROUNDS = 3  # A/A rounds below which a row's noise is unknown
MAX_THRESHOLD = 0.5  # a row whose noise sets a higher threshold cannot be judged
NOISE_MIN = 1e-3  # floor under a measured noise (0.1%): four quiet rounds can agree exactly
VERDICTS = ("ok", "regression", "improvement", "suspicious")


def noise_floor(pairs: list[tuple[float, float]]) -> float | None:
    """Relative standard deviation of one sample, from A/A pairs (a, a') timed in the same round:
    1.4826 * median |ln(a / a')| / sqrt(2) (the MAD of a difference of two samples, scaled to one
    sample's sigma). None without a usable pair."""
    d = [abs(math.log(a / b)) for a, b in pairs if a and b and a > 0 and b > 0]
    if not d:
        return None
    return max(NOISE_MIN, 1.4826 * statistics.median(d) / math.sqrt(2))


def gpu_slug(name: str | None) -> str:
    """A folder name for a GPU: 'NVIDIA H200' -> 'nvidia-h200'; no GPU -> 'cpu'."""
    if not name:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def default_baseline(gpu: str | None, root: Path | None = None) -> Path:
    return (root or REFERENCE_DIR) / "bench" / gpu_slug(gpu) / "nightly.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    key: str
    verdict: str  # one of VERDICTS
    reason: str
    now: Any = None
    baseline: Any = None
    change: float | None = None  # relative, now / baseline - 1
    threshold: float | None = None
    noise: float | None = None  # combined noise of both runs (relative sigma)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def judge(now: dict[str, Any] | None, base: dict[str, Any] | None,
          min_threshold: float) -> Verdict:
    """One row (a nightly row dict, `onboarding.bench.suite.NightlyRow`) against its baseline row."""
    row = now or base
    key = row["key"]
    if now is None:
        return Verdict(key=key, verdict="suspicious", reason="in the baseline, not measured now",
                       baseline=base.get("value"))
    if base is None:
        return Verdict(key=key, verdict="suspicious", reason="no baseline row (new)",
                       now=now.get("value"))
    if now["unit"] == "fact":
        return _judge_fact(now, base)
    if now["status"] != "ok":
        if base["status"] == "ok":
            return Verdict(key=key, verdict="regression", baseline=base.get("value"),
                           reason=f"{now['status']} now ({now['error'][:120]}); ok in the baseline")
        return Verdict(key=key, verdict="suspicious",
                       reason=f"{now['status']} now and in the baseline ({now['error'][:100]})")
    if base["status"] != "ok":
        return Verdict(key=key, verdict="suspicious", now=now["value"],
                       reason=f"the baseline row is '{base['status']}': nothing to compare with")
    rounds = min(len(now.get("pairs") or []), len(base.get("pairs") or []))
    if rounds < MIN_ROUNDS or now.get("noise") is None or base.get("noise") is None:
        return Verdict(key=key, verdict="suspicious", now=now["value"], baseline=base["value"],
                       reason=f"{rounds} A/A rounds (at least {MIN_ROUNDS} needed)")
    noise = math.hypot(now["noise"], base["noise"])
    threshold = max(min_threshold, K_SIGMA * noise)
    change = now["value"] / base["value"] - 1 if base["value"] else math.inf
    common = dict(key=key, now=now["value"], baseline=base["value"], change=change,
                  threshold=threshold, noise=noise)
    if threshold > MAX_THRESHOLD:
        return Verdict(verdict="suspicious", **common,
                       reason=f"noise {100 * noise:.1f}% sets a threshold of "
                              f"{100 * threshold:.0f}%, above {100 * MAX_THRESHOLD:.0f}%")
    worse = change > threshold if now["better"] == "lower" else change < -threshold
    better = change < -threshold if now["better"] == "lower" else change > threshold
    word = "slower" if now["unit"] == "ms" else "higher" if change > 0 else "lower"
    if now["unit"] == "ms" and change < 0:
        word = "faster"
    text = f"{100 * abs(change):.1f}% {word} (threshold {100 * threshold:.1f}%)"
    if worse:
        return Verdict(verdict="regression", reason=text, **common)
    if better:
        return Verdict(verdict="improvement", reason=text, **common)
    return Verdict(verdict="ok", reason=text, **common)


def _judge_fact(now: dict[str, Any], base: dict[str, Any]) -> Verdict:
    from onboarding.regress import compare as compare_facts

    fact = now["metric"]
    found = compare_facts({fact: base["value"]}, {fact: now["value"]})
    if found:
        return Verdict(key=now["key"], verdict="regression", now=now["value"],
                       baseline=base["value"], reason="; ".join(f.message for f in found)[:300])
    return Verdict(key=now["key"], verdict="ok", now=now["value"], baseline=base["value"],
                   reason="same" if now["value"] == base["value"] else "within tolerance")


def compare(now: dict[str, Any], base: dict[str, Any],
            min_thresholds: dict[str, float]) -> list[Verdict]:
    """Every row of the run `now` against the baseline `base` (both nightly results). A row is
    matched by its `baseline_key` (``--against`` rows by the tree's row they stand in for).
    Baseline rows of groups (families, parts) the run did not cover are left out; those it
    covered but did not measure are suspicious. ``min_thresholds``: group -> minimum."""
    base_rows = {r["key"]: r for r in base["rows"]}
    groups = {r["group"] for r in now["rows"]}
    out, matched = [], set()
    for r in now["rows"]:
        b = base_rows.get(r.get("baseline_key") or r["key"])
        if b is not None:
            matched.add(b["key"])
        out.append(judge(r, b, min_thresholds.get(r["group"], DEFAULT_MIN_THRESHOLD)))
    for k, b in base_rows.items():
        if k not in matched and b["group"] in groups:
            out.append(judge(None, b, 0.0))
    return out


DEFAULT_MIN_THRESHOLD = 0.05


def summary(verdicts: list[Verdict]) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for v in verdicts:
        counts[v.verdict] += 1
    return counts


def format_verdicts(verdicts: list[Verdict]) -> str:
    lines = [f"{'row':64s} {'verdict':12s} {'baseline':>10s} {'now':>10s}  why"]
    order = {v: i for i, v in enumerate(("regression", "suspicious", "improvement", "ok"))}
    for v in sorted(verdicts, key=lambda v: order[v.verdict]):
        b = _fmt(v.baseline) if not isinstance(v.baseline, dict) else "{...}"
        n = _fmt(v.now) if not isinstance(v.now, dict) else "{...}"
        lines.append(f"{v.key[:64]:64s} {v.verdict:12s} {b[:10]:>10s} {n[:10]:>10s}  {v.reason}")
    c = summary(verdicts)
    lines.append(", ".join(f"{n} {k}" for k, n in c.items()))
    return "\n".join(lines)


# ---- the baseline file ---------------------------------------------------------------------------

def load_baseline(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"baseline {path}: no such file (write one with --update-baseline)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"baseline {path}: malformed JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) \
            or not isinstance(data.get("metadata"), dict):
        raise InputError(f"baseline {path}: not a nightly baseline (no 'rows' and 'metadata')")
    return data


def write_baseline(path: Path, result: dict[str, Any], meta: dict[str, Any]) -> Path:
    """``{"format", "metadata", "ceilings", "rows"}``, atomically (temp file + rename)."""
    from onboarding.rundir import write_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(path), {"format": FORMAT, "metadata": meta,
                            "ceilings": result.get("ceilings", {}), "rows": result["rows"]})
    return Path(path)


def verdict_dicts(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    return [asdict(v) for v in verdicts]
