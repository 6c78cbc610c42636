"""Asking git about a checkout (onboard's own by default) without ever failing a run over it:
provenance (a run's or a golden's commit, whether its tracked files were modified) is recorded
where git can say it, and left out where git is missing, fails or does not answer in time."""

from __future__ import annotations

import subprocess
from pathlib import Path

# the folder of onboard's own code: inside its checkout when installed from one
HERE = Path(__file__).resolve().parent


def git(*args: str, cwd: Path = HERE, timeout: float = 10) -> str | None:
    """``git ARGS`` run in ``cwd``: its stdout as printed (unstripped: `status --porcelain`'s
    first column may be a space), or None when git is missing, exits non-zero or times out."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd,
                             timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None
