"""`onboard --version` answers before the commands are imported: no torch, no stages (a
subprocess that imports torch to print one line took ~2.3 s), and the same answer the full
parser gives for every command line that asks it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from onboarding import __version__

# runs `python -m onboarding ARGS` in-process (as runpy does for -m), then says whether torch
# or the stages were imported
_PROBE = """
import runpy, sys
sys.argv = ["onboarding", *sys.argv[1:]]
try:
    runpy.run_module("onboarding", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print("exit", code)
print("heavy", sorted(m for m in ("torch", "transformers", "onboarding.stages",
                                  "onboarding.load.model") if m in sys.modules))
"""


def test_version_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", _PROBE, "--version"], capture_output=True,
                         text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out
    assert lines == [f"onboard {__version__}", "exit 0", "heavy []"], out


@pytest.mark.parametrize("argv", [
    ["--version"], ["--vers"], ["--debug", "--version"], ["-vq", "--version"],
    ["--families", "x", "--version"], ["--fam=x", "--version"], ["--version", "--help"],
    ["--help", "--version"], ["--version", "nosuchcommand"], ["--bogus", "--version"],
    ["--families", "--version"], ["map", "--version"], ["--ver"], ["--version=1"],
])
def test_version_answer_matches_the_full_parser(argv, capsys):
    """Whatever the fast path answers is what argparse with every command would: the same exit
    code and output (`--help` first, a bad option, `--version` after a command are left to it)."""
    from onboarding.cli.main import build_parser, main

    code = main(argv)
    got = capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    want = capsys.readouterr()
    assert (code, got.out, got.err) == (exc.value.code, want.out, want.err)
