"""Error types and the CLI exit codes they map to.

`InputError` is the user's fault (bad path, bad JSON, unknown key): exit code 2.
Everything else that escapes is an internal failure: exit code 1.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_CHECK_FAILED = 3  # the run worked and its verdict is "no": e.g. alignment failed
EXIT_ALERT = 4  # `onboard train`: a step stalled or the loss went NaN/inf (docs/training.md)
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM (`onboard run`: 128 + the signal, resumable)


class OnboardError(Exception):
    """Base class of errors raised on purpose by onboard."""

    exit_code = EXIT_INTERNAL


class InputError(OnboardError):
    """The input (model reference, config, CLI option) is wrong; the message names the problem."""

    exit_code = EXIT_BAD_INPUT


class ModelRunError(InputError):
    """The user's model failed while running (its forward raised)."""


def read_toml(path: str | Path, option: str) -> dict[str, Any]:
    """The TOML file the user named with `option`, or an InputError that names it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{option} {path}: no such file")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: malformed TOML: {exc}") from exc
