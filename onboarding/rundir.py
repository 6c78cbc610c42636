"""Run directories: ``runs/<model>-<timestamp>/`` holding every artifact and the checkpoint."""

from __future__ import annotations

import json
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from onboarding.errors import InputError


def new_run_dir(model_name: str, out: str | None) -> Path:
    """A fresh run directory path (not created): ``out`` if given, else ``runs/<name>-<ts>``."""
    if out:
        path = Path(out)
        if path.exists() and any(path.iterdir()):
            raise InputError(f"--out {out}: directory exists and is not empty; "
                             "choose another or remove it")
        return path
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name).strip("_") or "model"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{safe}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{safe}-{stamp}-{n}"
    return path


@contextmanager
def owned_dir(path: Path, *, created_here: bool) -> Iterator[Path]:
    """Create ``path``; if the block fails on bad input, remove it again (no partial artifacts)."""
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except InputError:
        if created_here and not existed:
            shutil.rmtree(path, ignore_errors=True)
        raise


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so a kill never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")
