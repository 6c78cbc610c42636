"""Log levels of the command line: ``-v`` / ``-q`` and ``ONBOARD_LOG_LEVEL``, set up once by main.

Progress lines go through the ``onboarding`` logger: on a terminal a rich handler on stderr, else
plain ``HH:MM:SS message`` lines (a pipe, a log file, CI). INFO is the default; ``-q`` (WARNING)
also silences the tables and summaries the commands print (their console is quiet), leaving
errors and ``--json`` output; ``-v`` (DEBUG) adds detail. The flags win over the variable: an
environment variable never overrides what the command line says.
"""

from __future__ import annotations

import argparse
import logging
import sys

from onboarding.errors import InputError

LOGGER = "onboarding"
ENV = "ONBOARD_LOG_LEVEL"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}

log = logging.getLogger(LOGGER)


def verbosity_options(p: argparse.ArgumentParser, default=0) -> None:
    """-v / -q, counted (`level_from`)."""
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="debug log level: the progress steps as timed lines on a terminal too")
    p.add_argument("-q", "--quiet", action="count", default=default,
                   help="errors only: no progress, tables or summaries (--json still prints)")


def level_from(verbose: int, quiet: int, env: str | None) -> int:
    """The level the flags ask for (each -v one step down from INFO, each -q one up), else the
    environment's (a name from `LEVELS`, any case), else INFO."""
    if verbose or quiet:
        steps = [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR]
        return steps[max(0, min(len(steps) - 1, 1 - verbose + quiet))]
    if env is None or not env.strip():
        return logging.INFO
    level = LEVELS.get(env.strip().lower())
    if level is None:
        raise InputError(f"{ENV}={env!r}: expected one of {', '.join(LEVELS)}")
    return level


def setup(level: int) -> None:
    """Point the ``onboarding`` logger at stderr at ``level`` (again on each call: tests run
    main many times in one process)."""
    from rich.console import Console

    err = Console(stderr=True, emoji=False)  # as cli.common's error console (which imports us)
    log.setLevel(level)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
    if err.is_terminal:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=err, show_path=False, markup=False,
                                               rich_tracebacks=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)


def reset() -> None:
    """Back to the library's default (no level, no handler): main calls this when a command
    ends, so a process that runs several commands (tests, the agent) carries no -q over."""
    log.setLevel(logging.NOTSET)
    for h in list(log.handlers):
        log.removeHandler(h)


def quiet(level: int) -> bool:
    """Whether the commands' own console output (tables, summaries, progress) is off."""
    return level > logging.INFO
