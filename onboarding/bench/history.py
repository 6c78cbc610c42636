"""The nightly history: every run's rows in one SQL table (SQLite by default, any SQLAlchemy URL
for a team, e.g. ``postgresql://host/db``), and change-point detection over each row's series.

One nightly's threshold (`onboarding.bench.compare`) catches a step larger than that night's
noise. A smaller step that persists (3% on a row whose nights scatter by 1%) passes every
night; over the history it is plain. `change_points` finds such steps by binary segmentation:
the split of a series whose two sides' means differ most, in units of the series' own robust
scatter (and never less than the rows' stored A/A noise), kept when that score is at least
Z_MIN and the step at least REL_MIN of the level; then the same within each side. Each change
point names the first run (commit, date) of the new level.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onboarding.errors import InputError

ENV_VAR = "ONBOARD_BENCH_HISTORY"
DEFAULT_URL = "sqlite:///runs/bench-history.sqlite"
Z_MIN, REL_MIN, MIN_SEGMENT = 4.0, 0.01, 3


def default_url() -> str:
    """``$ONBOARD_BENCH_HISTORY``, else a SQLite file under ./runs/."""
    return os.environ.get(ENV_VAR) or DEFAULT_URL


def check_url(url: str | None) -> str:
    """The history URL (default `default_url`), parsed: a malformed one is an InputError."""
    url = url or default_url()
    try:
        from sqlalchemy.engine import make_url
    except ImportError:
        raise InputError("the bench history needs sqlalchemy (pip install sqlalchemy)") from None
    try:
        make_url(url)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"--history {url}: not a SQLAlchemy URL ({exc})") from None
    return url


@dataclass(frozen=True, slots=True)
class ChangePoint:
    index: int  # first point of the new level
    before: float  # median level before
    after: float
    rel: float  # after / before - 1
    z: float  # step in robust sigmas of the series
    commit: str | None = None
    date: str | None = None


def _robust_sigma(xs: list[float]) -> float:
    med = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - med) for x in xs)


def _score(xs: list[float], k: int, noise: float) -> tuple[float, float]:
    """(z, rel) of splitting `xs` before index k."""
    a, b = xs[:k], xs[k:]
    # the step between means (a misplaced split moves a mean, hardly a median); the scatter
    # robustly, from the residuals around each side's median
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    da, db = statistics.median(a), statistics.median(b)
    resid = [x - da for x in a] + [x - db for x in b]
    sigma = max(1.4826 * statistics.median(abs(r) for r in resid), noise * abs(ma), 1e-12)
    z = abs(mb - ma) / (sigma * math.sqrt(1 / len(a) + 1 / len(b)))
    return z, (mb / ma - 1) if ma else math.inf


def change_points(values: list[float], *, noise: float = 0.0, z_min: float = Z_MIN,
                  rel_min: float = REL_MIN, min_segment: int = MIN_SEGMENT) -> list[ChangePoint]:
    """Level shifts of a series (oldest first), by binary segmentation; ``noise`` is a relative
    sigma floor (the rows' A/A noise). Indices refer to `values`."""
    out: list[ChangePoint] = []

    def split(lo: int, hi: int) -> None:
        xs = values[lo:hi]
        best = None
        for k in range(min_segment, len(xs) - min_segment + 1):
            z, rel = _score(xs, k, noise)
            if z >= z_min and abs(rel) >= rel_min and (best is None or z > best[1]):
                best = (k, z, rel)
        if best is None:
            return
        k, z, rel = best
        out.append(ChangePoint(index=lo + k, before=statistics.median(xs[:k]),
                               after=statistics.median(xs[k:]), rel=rel, z=z))
        split(lo, lo + k)
        split(lo + k, hi)

    split(0, len(values))
    return sorted(out, key=lambda c: c.index)


class History:
    """The ``bench_rows`` table behind a SQLAlchemy URL: one row per (run, nightly row)."""

    def __init__(self, url: str | None = None):
        try:
            import sqlalchemy as sa
        except ImportError:
            raise InputError("the bench history needs sqlalchemy (pip install sqlalchemy)") from None
        self.url = url or default_url()
        if self.url.startswith("sqlite:///") and not self.url.startswith("sqlite:///:memory:"):
            Path(self.url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.engine = sa.create_engine(self.url)
        except Exception as exc:  # noqa: BLE001 - a bad URL or a missing driver: say which
            raise InputError(f"--history {self.url}: {type(exc).__name__}: {exc}") from None
        self.sa = sa
        meta = sa.MetaData()
        self.table = sa.Table(
            "bench_rows", meta,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.String(64), index=True, nullable=False),
            sa.Column("date", sa.String(32), index=True),
            sa.Column("commit", sa.String(64)),
            sa.Column("gpu", sa.String(128), index=True),
            sa.Column("key", sa.String(400), index=True, nullable=False),
            sa.Column("grp", sa.String(64)),
            sa.Column("unit", sa.String(16)),
            sa.Column("better", sa.String(8)),
            sa.Column("value", sa.Float, nullable=True),
            sa.Column("noise", sa.Float, nullable=True),
            sa.Column("status", sa.String(32)),
            sa.Column("verdict", sa.String(16), nullable=True),
            sa.Column("versions", sa.Text),
        )
        try:
            meta.create_all(self.engine)
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"--history {self.url}: cannot open ({type(exc).__name__}: "
                             f"{str(exc)[:160]})") from None

    def append(self, result: dict[str, Any], verdicts: dict[str, str] | None = None) -> str:
        """Add a nightly result's numeric rows (facts stay in the JSON); returns its run id."""
        env = result["environment"]
        run_id = f"{env.get('date', '')}|{env.get('commit') or '-'}|{os.getpid()}"
        versions = json.dumps({k: env.get(k) for k in ("torch", "triton", "transformers", "onboard")})
        rows = [{"run_id": run_id, "date": env.get("date"), "commit": env.get("commit"),
                 "gpu": env.get("gpu"), "key": r["key"], "grp": r["group"], "unit": r["unit"],
                 "better": r["better"],
                 "value": r["value"] if isinstance(r["value"], (int, float)) else None,
                 "noise": r.get("noise"), "status": r["status"],
                 "verdict": (verdicts or {}).get(r["key"]), "versions": versions}
                for r in result["rows"] if r["unit"] != "fact"]
        if rows:
            with self.engine.begin() as con:
                con.execute(self.table.insert(), rows)
        return run_id

    def rows(self, key: str | None = None, gpu: str | None = None) -> list[dict[str, Any]]:
        """Stored rows, oldest first; ``key`` a substring of the row key."""
        t = self.table
        q = self.sa.select(t).order_by(t.c.date, t.c.id)
        if key:
            q = q.where(t.c.key.contains(key))
        if gpu:
            q = q.where(t.c.gpu == gpu)
        with self.engine.connect() as con:
            return [dict(r._mapping) for r in con.execute(q)]

    def series(self, key: str | None = None, gpu: str | None = None
               ) -> dict[str, list[dict[str, Any]]]:
        """Rows grouped by key (and GPU, when several): each key's points oldest first."""
        out: dict[str, list[dict[str, Any]]] = {}
        rows = self.rows(key, gpu)
        gpus = {r["gpu"] for r in rows}
        for r in rows:
            name = r["key"] if len(gpus) <= 1 else f"{r['key']} [{r['gpu']}]"
            out.setdefault(name, []).append(r)
        return out


def series_change_points(points: list[dict[str, Any]]) -> list[ChangePoint]:
    """Change points of one key's stored points (rows with a value and status ok), each with the
    commit and date of the first run at the new level."""
    good = [p for p in points if p["value"] is not None and p["status"] == "ok"]
    noises = [p["noise"] for p in good if p.get("noise")]
    found = change_points([p["value"] for p in good],
                          noise=statistics.median(noises) if noises else 0.0)
    return [ChangePoint(index=c.index, before=c.before, after=c.after, rel=c.rel, z=c.z,
                        commit=good[c.index]["commit"], date=good[c.index]["date"])
            for c in found]


def format_history(series: dict[str, list[dict[str, Any]]], last: int = 6) -> str:
    """One line per key: its last values, then its change points."""
    lines = []
    for key, pts in series.items():
        vals = " ".join(f"{p['value']:.4g}" if p["value"] is not None else p["status"]
                        for p in pts[-last:])
        lines.append(f"{key}  ({len(pts)} runs, {pts[-1]['unit']}): ... {vals}")
        for c in series_change_points(pts):
            lines.append(f"    change point at {c.commit or '?'} ({c.date}): {c.before:.4g} -> "
                         f"{c.after:.4g} ({100 * c.rel:+.1f}%, z={c.z:.1f})")
    return "\n".join(lines) if lines else "no history rows"
