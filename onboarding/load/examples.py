"""The built-in examples under ``examples/`` and the MODEL forms in words: what the commands'
help shows, so that building the command line's parser needs no torch (`load.model` resolves
MODEL and re-exports these names)."""

from __future__ import annotations

from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
DEFAULT_EXAMPLE = "onboard_hybrid"
EXAMPLE_ALIAS = "example"  # names the default example, as the commands' help long promised


def list_examples() -> list[str]:
    if not EXAMPLES_DIR.is_dir():
        return []
    return sorted(p.name for p in EXAMPLES_DIR.iterdir() if (p / "config.json").is_file())


def builtin_example(ref: str) -> str | None:
    """The built-in example ``ref`` names (`EXAMPLE_ALIAS`: the default one), None if none."""
    name = DEFAULT_EXAMPLE if ref == EXAMPLE_ALIAS else ref
    return name if "/" not in name and name in list_examples() else None


def model_forms() -> str:
    """The MODEL forms `load_model` resolves, in words, the built-in examples by name: the one
    text of every command's help, the train.toml header and the error for a MODEL that is none
    of them, so that none of them promises a form the resolver refuses."""
    return ("a model directory, hf:<model_type>, file.py:Name, module:Name, or a built-in "
            f"example: {', '.join(list_examples()) or 'none'} "
            f"({EXAMPLE_ALIAS} = {DEFAULT_EXAMPLE})")
