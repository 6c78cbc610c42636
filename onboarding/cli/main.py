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

from onboarding import __version__
from onboarding.cli import logs
from onboarding.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, InputError

# The commands (and through them torch, ~2 s) are imported by `build_parser` and `main`, not
# here: `onboard --version` answers without them (`_version_only`).


def _top_level_options(ap: argparse.ArgumentParser, families_help: str | None = None) -> None:
    """The options before a command: the full parser's and `_version_only`'s (the same option
    strings, so that an abbreviation such as ``--vers`` means the same in both)."""
    ap.add_argument("--debug", action="store_true", help="print tracebacks")
    ap.add_argument("--version", action="version", version=f"onboard {__version__}")
    ap.add_argument("--families", action="append", default=[], metavar="DIR", help=families_help)
    logs.verbosity_options(ap)


def build_parser() -> argparse.ArgumentParser:
    from onboarding.cli import analyse, bench, plan, pr, regress, run, train, tune
    from onboarding.cli.common import FAMILIES_HELP, Parser

    ap = Parser(prog="onboard", description=__doc__)
    _top_level_options(ap, FAMILIES_HELP)
    sub = ap.add_subparsers(dest="command", required=True)
    for command in (analyse, plan, tune, bench, run, pr, regress, train):  # the order --help lists
        command.add_parser(sub)
    return ap


def _load_families(dirs: list[str]) -> None:
    """Register `--families` folders and load every family now, so that a folder skipped as
    broken is reported once, here, with its path and reason (the run goes on without it)."""
    import warnings

    from rich.markup import escape

    from onboarding.cli.common import err
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


class _FullParserAnswers(Exception):
    """`_version_only` met what only the full parser answers: --help, a bad option."""


class _VersionParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _FullParserAnswers


class _Help(argparse.Action):
    def __call__(self, *args, **kwargs):
        raise _FullParserAnswers


def _version_only(argv: list[str]) -> None:
    """Print the version and exit (SystemExit 0, as argparse's version action does) where the
    options before the command ask it, without importing the commands; return otherwise.
    Parsed by argparse with the full parser's top-level options, so it fires exactly where that
    one would: `--version` (or an abbreviation) before any command, unless `--help` or an
    option error comes first."""
    if not any(len(a) > 3 and "--version".startswith(a) for a in argv):
        return
    ap = _VersionParser(prog="onboard", add_help=False)
    ap.add_argument("-h", "--help", nargs=0, action=_Help)
    _top_level_options(ap)
    ap.add_argument("rest", nargs=argparse.REMAINDER)  # the command and its arguments
    try:
        ap.parse_known_args(argv)
    except _FullParserAnswers:
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        _version_only(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad option (said in one line)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    from rich.console import Console
    from rich.markup import escape

    from onboarding.backend import ensure_triton_backend
    from onboarding.cli.common import err
    from onboarding.load.modules_cache import use_private_modules_cache
    from onboarding.optional_kernels import hide as hide_kernel_packages

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
