"""Kernel families from outside the repo: a family folder given with `--families DIR` (or
`ONBOARD_FAMILIES`, or an `onboard.families` entry point) works in every stage as a built-in one
does, and a broken one is skipped with one warning naming its path and the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from onboarding import families as fam
from onboarding.errors import InputError
from onboarding.families import discover

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "kernel_templates"
EXAMPLE = ROOT / "examples" / "families"


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    """Each test starts from the built-in families alone and leaves them so."""
    monkeypatch.delenv(fam.ENV_VAR, raising=False)
    monkeypatch.setattr(discover, "_EXTRA_DIRS", [])
    fam.reset()
    yield
    fam.reset()


def renamed_copy(src: str, new: str, dest: Path) -> Path:
    """A built-in family folder copied to `dest/new`, renamed throughout (folder, NAME, template
    file): another family that serves the same blocks."""
    folder = dest / new
    shutil.copytree(BUILTIN / src, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / f"{src}.py.j2").rename(folder / f"{new}.py.j2")
    spec = folder / "family.py"
    text = spec.read_text()
    assert f'NAME = "{src}"' in text and f'template="{src}.py.j2"' in text
    spec.write_text(text.replace(f'NAME = "{src}"', f'NAME = "{new}"')
                    .replace(f'template="{src}.py.j2"', f'template="{new}.py.j2"'))
    return folder


def _onboard(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onboarding", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env=env)


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fam.FamilyWarning)
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category, fam.FamilyWarning)]


def test_the_worked_example_loads_from_its_folder():
    fam.add_dirs([EXAMPLE])
    spec = fam.get_family("rmsnorm_gate_first")
    assert spec.folder == EXAMPLE / "rmsnorm_gate_first"
    assert fam.registry().loaded["rmsnorm_gate_first"].origin == "--families"
    assert not fam.skipped()


def test_a_family_from_env_and_from_an_entry_point(tmp_path, monkeypatch):
    renamed_copy("swiglu", "swiglu_env", tmp_path / "env")
    renamed_copy("swiglu", "swiglu_ep", tmp_path / "pkg" / "my_families")
    monkeypatch.setenv(fam.ENV_VAR, str(tmp_path / "env"))
    # an installed package's entry point names a module; its folder is searched for families
    (tmp_path / "pkg" / "my_families" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))

    class EntryPoint:
        name, value = "mine", "my_families"

        def load(self):
            import my_families

            return my_families

    monkeypatch.setattr(discover.metadata, "entry_points",
                        lambda group: [EntryPoint()] if group == discover.ENTRY_POINT_GROUP else [])
    loaded = fam.registry().loaded
    assert loaded["swiglu_env"].origin == fam.ENV_VAR
    assert loaded["swiglu_ep"].origin.startswith("entry point mine")
    assert {"swiglu", "swiglu_env", "swiglu_ep"} <= set(fam.families())


BROKEN = {
    "syntax": (lambda t: t.replace("FAMILY = FamilySpec(", "FAMILY = FamilySpec((", 1),
               "syntax error"),
    "invalid_spec": (lambda t: t.replace('default_config={', 'default_config={"NO_SUCH_TILE": 1, ', 1),
                     "unknown config key"),
    "no_family": (lambda t: t.replace("FAMILY = FamilySpec(", "NOT_FAMILY = FamilySpec(", 1),
                  "defines no FAMILY"),
    "wrong_name": (lambda t: t.replace('NAME = "rmsnorm_x"', 'NAME = "another_name"', 1),
                   "folder is named"),
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_broken_family_is_skipped_with_its_path_and_reason(tmp_path, how):
    folder = renamed_copy("rmsnorm", "rmsnorm_x", tmp_path)
    edit, reason = BROKEN[how]
    spec = folder / "family.py"
    broken = edit(spec.read_text())
    assert broken != spec.read_text()
    spec.write_text(broken)
    fam.add_dirs([tmp_path])
    names, messages = _warnings_of(lambda: set(fam.families()))
    assert "rmsnorm_x" not in names and "rmsnorm" in names  # the built-ins load as usual
    assert len(messages) == 1 and str(folder) in messages[0] and reason in messages[0], messages
    (skip,) = fam.skipped()
    assert skip.folder == folder and reason in skip.reason


def test_a_template_that_does_not_render_is_skipped(tmp_path):
    folder = renamed_copy("rmsnorm", "rmsnorm_x", tmp_path)
    (folder / "rmsnorm_x.py.j2").write_text("{{ no_such_variable }}\n")
    fam.add_dirs([tmp_path])
    names, messages = _warnings_of(lambda: set(fam.families()))
    assert "rmsnorm_x" not in names
    assert len(messages) == 1 and "does not render" in messages[0] and str(folder) in messages[0]


def test_a_duplicate_name_is_skipped(tmp_path):
    shutil.copytree(BUILTIN / "rmsnorm", tmp_path / "rmsnorm")
    fam.add_dirs([tmp_path])
    _, messages = _warnings_of(fam.families)
    assert fam.get_family("rmsnorm").folder == BUILTIN / "rmsnorm"  # the built-in one wins
    assert len(messages) == 1 and "taken by" in messages[0] and str(tmp_path / "rmsnorm") in messages[0]


def test_families_dir_must_exist(tmp_path):
    with pytest.raises(InputError, match="no such folder"):
        fam.add_dirs([tmp_path / "missing"])


@pytest.mark.slow
def test_a_copied_family_outside_the_repo_serves_map_generate_and_align(tmp_path):
    """The must-show of the plug-in layout: a family folder outside the repo, given with
    `--families`, is used by map, generate and align on a model it serves (tiny_dense's
    RMSNorms), exactly as the built-in family it was copied from; the same folder with a broken
    spec gives one warning and the run completes."""
    plugins = tmp_path / "plugins"
    renamed_copy("rmsnorm", "rmsnorm_x", plugins)
    work = tmp_path / "work"
    work.mkdir()

    mapped = _onboard("--families", str(plugins), "map", "tiny_dense", "--seq", "16", "--out", "m",
                      cwd=work)
    assert mapped.returncode == 0, mapped.stderr
    cov = json.loads((work / "m" / "coverage.json").read_text())
    ours = [e for e in cov["entries"] if e["family"] == "rmsnorm_x"]
    builtin = [e for e in cov["entries"] if e["family"] == "rmsnorm"]
    assert ours and [e["path"] for e in ours] == [e["path"] for e in builtin]

    gen = _onboard("generate", "tiny_dense", "--seq", "16", "--out", "g", "--families", str(plugins),
                   cwd=work)
    assert gen.returncode == 0, gen.stderr
    cands = json.loads((work / "g" / "candidates.json").read_text())
    ours = [c for c in cands if c["family"] == "rmsnorm_x"]
    assert ours and all(c["status"] == "passed" for c in ours), ours
    assert {c["variant"] for c in ours} == {c["variant"] for c in cands if c["family"] == "rmsnorm"}

    aligned = _onboard("align", "tiny_dense", "--seq", "16", "--out", "a", "--kernels", "rmsnorm_x",
                       "--dtype", "fp32", "--reference", "fp32", "--families", str(plugins), cwd=work)
    assert aligned.returncode == 0, aligned.stdout + aligned.stderr
    result = json.loads((work / "a" / "alignment.json").read_text())
    patched = [p for p in result["patches"] if p["family"] == "rmsnorm_x" and p["status"] == "active"]
    assert patched and len(patched) == len(builtin), result["patches"]
    assert result["passed"] is True

    # the same folder with a broken spec: one warning, and the run goes on without it
    spec = plugins / "rmsnorm_x" / "family.py"
    spec.write_text(spec.read_text().replace("FAMILY = FamilySpec(", "FAMILY = FamilySpec((", 1))
    again = _onboard("--families", str(plugins), "map", "tiny_dense", "--seq", "16", "--out", "m2",
                     cwd=work)
    assert again.returncode == 0, again.stderr
    lines = [ln for ln in again.stderr.splitlines() if "skipped" in ln]
    assert len(lines) == 1 and "rmsnorm_x" in lines[0] and "syntax error" in lines[0], again.stderr
    cov2 = json.loads((work / "m2" / "coverage.json").read_text())
    assert not [e for e in cov2["entries"] if e["family"] == "rmsnorm_x"]
