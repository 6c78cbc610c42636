"""MODEL, the one argument most commands take: every command's help names the forms the resolver
accepts (the built-in examples by their names, `example` for the default one), a MODEL that is
none of them exits 2 with one line listing them and leaves nothing behind, and `example`
resolves in every command because it resolves in `load_model`."""

from __future__ import annotations

import argparse
import json

import pytest

from onboarding.cli.main import build_parser, main
from onboarding.load.model import DEFAULT_EXAMPLE, list_examples, load_model

# the commands that take MODEL; the first runs the default example when MODEL is left out
DEFAULTS_TO_EXAMPLE = ("parse", "map", "generate", "align", "plan", "run")
NO_DEFAULT = ("tune", "train", "scale")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _model_help(p: argparse.ArgumentParser) -> str | None:
    for a in p._actions:
        if a.dest == "model" and not a.option_strings:
            return " ".join(a.help.split())
    return None


def test_every_model_argument_names_the_builtin_examples():
    examples = list_examples()
    assert DEFAULT_EXAMPLE in examples and len(examples) >= 2
    helps = {name: _model_help(p) for name, p in _subparsers().items()}
    takes_model = {name for name, h in helps.items() if h is not None}
    assert takes_model == set(DEFAULTS_TO_EXAMPLE + NO_DEFAULT)
    first = helps["parse"].split(";")[0]
    for name in takes_model:
        h = helps[name]
        assert h.split(";")[0] == first, (name, h)  # one text, not copies that drift apart
        for form in ("hf:<model_type>", "file.py:Name", "module:Name", *examples,
                     f"example = {DEFAULT_EXAMPLE}"):
            assert form in h, (name, form, h)
        # the default is named only where leaving MODEL out runs it
        assert (f"default: {DEFAULT_EXAMPLE}" in h) == (name in DEFAULTS_TO_EXAMPLE), (name, h)
    blocks = next(a for a in _subparsers()["bench"]._actions if a.dest == "blocks")
    assert first in " ".join(blocks.help.split())  # --blocks MODEL takes the same forms


def test_example_is_the_default_builtin_in_the_resolver(workdir):
    alias, default = load_model("example"), load_model(None)
    assert alias.source == default.source == "example"
    assert alias.ref == alias.name == default.name == DEFAULT_EXAMPLE
    (workdir / "example").mkdir()  # a directory of that name is still the user's directory
    (workdir / "example" / "config.json").write_text('{"model_type": "llama"}')
    assert load_model("example").source == "directory"


def test_plan_example_loads_the_default_example(workdir, capsys):
    # fast: a bad --ep is found once the model is loaded, before the op graph is captured
    assert main(["plan", "example", "--gpus", "6", "--ep", "3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--ep 3: does not divide the model's 16 routed experts" in err, err  # onboard_hybrid's
    assert not any(workdir.iterdir())


@pytest.mark.slow  # the whole plan: ~20 s on a loaded 2-core machine
def test_plan_example_plans_the_default_example(workdir, capsys):
    assert main(["plan", "example", "--json", "--gpus", "8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == DEFAULT_EXAMPLE and plan["fitting"]
    assert not any(workdir.iterdir())


@pytest.mark.parametrize("argv", [
    ["parse", "no_such_example"], ["map", "no_such_example", "--out", "o"],
    ["generate", "no_such_example"], ["align", "no_such_example", "--out", "o"],
    ["plan", "no_such_example", "--out", "o"], ["tune", "no_such_example", "--out", "o"],
    ["run", "no_such_example"], ["run", "no_such_example", "--out", "o"],
    ["train", "no_such_example"], ["train", "no_such_example", "--out", "o"],
    ["scale", "no_such_example", "--gpus", "2", "--ep", "1"],
], ids=lambda v: "-".join(v[:1] + v[2:3]))
def test_unknown_model_lists_the_forms_and_leaves_nothing(workdir, capsys, argv):
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: no_such_example: no such path"), err
    for form in ("hf:<model_type>", "file.py:Name", "module:Name", *list_examples(),
                 f"example = {DEFAULT_EXAMPLE}"):
        assert form in err, (form, err)
    assert not any(workdir.iterdir())  # no runs/, no --out, no partial artifact


def test_scale_without_model_says_what_scale_takes(workdir, capsys):
    assert main(["scale", "--gpus", "2", "--ep", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "onboard scale: give a MODEL" in err and "--config" not in err, err
    assert not any(workdir.iterdir())
