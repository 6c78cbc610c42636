"""`onboard --help` and every `onboard <command> --help` build the parser without torch (or
transformers, the stages, `load.model`): the commands import what they run inside their
functions. Importing torch made `onboard --help` take ~2.6 s for a page of text."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from onboarding.cli.main import build_parser

HEAVY = ("torch", "transformers", "onboarding.stages", "onboarding.load.model")

# runs `main(argv)` (the `onboard` entry point, which `python -m onboarding` calls) for each
# command line given as JSON, then says each one's exit code and which heavy modules were imported
_PROBE = """
import contextlib, io, json, sys
from onboarding.cli.main import main
codes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        codes.append([main(argv), "usage: onboard" in out.getvalue()])
print(json.dumps({"codes": codes, "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[list[str]]:
    """Every command path of the parser, nested ones (`pr create`) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append([*prefix, name])
                found.extend(_commands(sub, (*prefix, name)))
    return found


def test_help_imports_no_torch():
    commands = _commands(build_parser())
    assert ["map"] in commands and ["train"] in commands and ["pr", "create"] in commands
    argvs = [["--help"], ["-h"], *([*c, "--help"] for c in commands)]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["codes"] == [[0, True]] * len(argvs), list(zip(argvs, got["codes"]))
    assert got["heavy"] == [], got


def test_lazy_stage_packages_export_what_they_list():
    """`onboarding.train` and `onboarding.plan` import their names at first use
    (`onboarding.lazy`): each listed name is its submodule's object; another is AttributeError."""
    for package in ("onboarding.train", "onboarding.plan"):
        pkg = importlib.import_module(package)
        for module, names in pkg._EXPORTS.items():
            for name in names:
                assert getattr(pkg, name) is getattr(importlib.import_module(module), name)
        assert sorted(pkg.__all__) == sorted(n for ns in pkg._EXPORTS.values() for n in ns)
        with pytest.raises(AttributeError):
            pkg.no_such_name
