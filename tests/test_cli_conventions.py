"""Command-line conventions (issue 30 item 5): -v/-q and ONBOARD_LOG_LEVEL, --json on every
command that prints a table (JSON alone on stdout), help that matches what the options do."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from onboarding.cli import logs
from onboarding.cli.main import build_parser, main
from onboarding.errors import InputError

TINY = "tests/fixtures/user_models.py:CancellingLM"  # exports in about a second, no template
# every command that prints a table or a summary screen
TABLES = ("parse", "map", "generate", "align", "plan", "tune", "bench", "run", "regress",
          "train", "scale")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_levels_flags_win_over_the_environment():
    assert logs.level_from(0, 0, None) == logging.INFO
    assert logs.level_from(1, 0, "error") == logging.DEBUG
    assert logs.level_from(0, 1, "debug") == logging.WARNING
    assert logs.level_from(0, 2, None) == logging.ERROR
    assert logs.level_from(0, 0, "Warning") == logging.WARNING
    with pytest.raises(InputError, match="ONBOARD_LOG_LEVEL='loud'"):
        logs.level_from(0, 0, "loud")


def test_bad_log_level_variable_is_bad_input(monkeypatch, capsys):
    monkeypatch.setenv(logs.ENV, "loud")
    assert main(["parse", TINY]) == 2
    assert "expected one of debug, info, warning, error" in capsys.readouterr().err


def test_every_table_command_has_json_and_verbosity():
    subs = _subparsers(build_parser())
    for name in TABLES:
        opts = {o for a in subs[name]._actions for o in a.option_strings}
        assert {"--json", "-v", "-q"} <= opts, (name, sorted(opts))


def test_quiet_prints_nothing_and_progress_is_timed_log_lines(capsys):
    assert main(["parse", TINY, "-q"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert logs.log.level == logging.NOTSET and not logs.log.handlers  # nothing carried over
    assert main(["parse", TINY]) == 0  # not a terminal: progress as "HH:MM:SS parse: ..." lines
    out = capsys.readouterr()
    assert "blocks (" in out.out
    lines = [ln for ln in out.err.splitlines() if "parse: " in ln]
    assert lines and all(ln[2] == ":" and ln[5] == ":" and ln[8] == " " for ln in lines), lines


@pytest.mark.parametrize("command,check", [
    ("map", lambda d: d["model"] == "CancellingLM" and "entries" in d),
    ("generate", lambda d: d == []),  # nothing this model runs has a template
])
def test_json_alone_on_stdout(tmp_path, capsys, command, check):
    argv = [command, TINY, "--json"] + (["--out", str(tmp_path / "run")]
                                        if command == "generate" else [])
    assert main(argv) == 0
    out = capsys.readouterr()
    assert check(json.loads(out.out))  # the whole of stdout is one JSON document
    if command == "generate":
        assert "coverage" in out.err  # the tables went to stderr


def test_test_only_packages_are_the_dev_extra():
    """pytest and pytest-xdist are the dev extra, not runtime dependencies: nothing the
    package runs imports them at module level (a kernel contract helper imports pytest inside
    the function the tests call)."""
    import ast
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}
    assert {"pytest", "pytest-xdist"} <= names(project["optional-dependencies"]["dev"])
    assert not {"pytest", "pytest-xdist"} & names(project["dependencies"])
    for pkg in ("onboarding", "agents"):
        for f in (root / pkg).rglob("*.py"):
            for node in ast.parse(f.read_text()).body:  # module level only
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not any(m.split(".")[0] in ("pytest", "xdist") for m in mods), f
