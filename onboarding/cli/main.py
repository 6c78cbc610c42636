"""The `onboard` command line.

Exit codes: 0 success, 1 internal failure, 2 bad input, 3 a check failed (alignment, or a
regression against a golden reference).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from rich.console import Console
from rich.markup import escape

from onboarding import __version__
from onboarding.backend import ensure_triton_backend
from onboarding.cli import analyse, bench, plan, pr, regress, run, train, tune
from onboarding.cli import logs
from onboarding.cli.common import FAMILIES_HELP, Parser, err, verbosity_options
from onboarding.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, InputError
from onboarding.load.modules_cache import use_private_modules_cache
from onboarding.optional_kernels import hide as hide_kernel_packages


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="onboard", description=__doc__)
    ap.add_argument("--debug", action="store_true", help="print tracebacks")
    ap.add_argument("--version", action="version", version=f"onboard {__version__}")
    ap.add_argument("--families", action="append", default=[], metavar="DIR", help=FAMILIES_HELP)
    verbosity_options(ap)
    sub = ap.add_subparsers(dest="command", required=True)
    for command in (analyse, plan, tune, bench, run, pr, regress, train):  # the order --help lists
        command.add_parser(sub)
    return ap


def _load_families(dirs: list[str]) -> None:
    """Register `--families` folders and load every family now, so that a folder skipped as
    broken is reported once, here, with its path and reason (the run goes on without it)."""
    import warnings

    from onboarding.families import FamilyWarning, add_dirs, registry

    add_dirs(dirs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FamilyWarning)
        registry()
    for w in caught:
        if issubclass(w.category, FamilyWarning):
            err.print(f"[yellow]warning:[/yellow] {escape(str(w.message))}", highlight=False,
                      soft_wrap=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad option (said in one line)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        level = logs.level_from(args.verbose, args.quiet, os.environ.get(logs.ENV))
    except InputError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_BAD_INPUT
    logs.setup(level)
    # --json: stdout holds the JSON alone, so what the command says goes to stderr
    console = Console(stderr=bool(getattr(args, "json", False)), quiet=logs.quiet(level),
                      emoji=False)  # `hf:llama:` in a line is text, never an emoji
    ensure_triton_backend()
    if args.command != "bench":  # bench imports some by name, as comparison rows only
        hide_kernel_packages()
    use_private_modules_cache()  # a model's code is not copied into the user's HF cache
    old_term = _sigterm_interrupts()
    try:
        _load_families(args.families)
        return args.func(args, console)
    except InputError as exc:
        # the message as written (no markup: "[E, out, in]" is text), one line the terminal wraps
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        if args.debug:
            traceback.print_exc()
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # from code onboard ran (a model's import, build or forward)
        err.print(f"[red]error:[/red] {escape(_exit_line(exc))}", highlight=False, soft_wrap=True)
        if args.debug:
            traceback.print_exc()
        return EXIT_BAD_INPUT
    except Exception as exc:  # internal failure: a bug in onboard, not the user's input
        err.print(f"[red]internal error:[/red] {type(exc).__name__}: {escape(str(exc))}", highlight=False,
                  soft_wrap=True)
        if args.debug:
            traceback.print_exc()
        return EXIT_INTERNAL
    finally:
        logs.reset()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _sigterm_interrupts():
    """SIGTERM ends a command as Ctrl-C does (what it created is cleaned up, a run stays
    resumable) instead of killing it mid-write; returns the handler it replaced."""
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        return None


def _exit_line(exc: SystemExit) -> str:
    """Where code onboard ran called sys.exit: the deepest frame of the exit."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return (f"the model's code called sys.exit({exc.code!r})"
            + (f" at {where}" if where else "") + "; a model must raise, not exit")


if __name__ == "__main__":
    sys.exit(main())
