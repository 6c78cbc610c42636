"""Every `from onboarding... import name` (or `agents`) in the library, the agent and the kernel
templates' Python, at module level or inside a function, names something its module has.

Function-level imports run only when their function does; a helper renamed in one module left
`onboard tune`'s block path raising ImportError for days while CI stayed green, because the only
test reaching it is slow. This finds such imports without running them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("onboarding", "agents")  # what is imported from
WALKED = PACKAGES + ("kernel_templates",)  # where the imports are read


def _imports(root: Path = ROOT, packages: tuple[str, ...] = WALKED
             ) -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of every `from <one of packages>... import name` in the .py
    files under root/<package>."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:
                    if alias.name != "*":
                        found.append((str(path.relative_to(root)), node.lineno, node.module,
                                      alias.name))
    return found


def _missing(imports: list[tuple[str, int, str, str]]) -> list[str]:
    """The imports whose module does not import or has no such name (nor such a submodule)."""
    missing = []
    for file, line, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{file}:{line}: module {module} does not import ({exc})")
            continue
        if hasattr(mod, name):
            continue
        try:  # a submodule imported by name (`from onboarding import graph`)
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(f"{file}:{line}: {module} has no {name}")
    return missing


def test_every_internal_from_import_names_something_that_exists():
    imports = _imports()
    assert len(imports) > 100, "the walk found too few imports: wrong root?"
    assert not (missing := _missing(imports)), "\n".join(missing)


def test_the_check_sees_a_function_level_import_of_a_missing_name(tmp_path):
    (tmp_path / "onboarding").mkdir()
    (tmp_path / "onboarding" / "a.py").write_text(
        "def f():\n    from onboarding.generate.blockcheck import no_such_helper, judge_once\n"
        "    return no_such_helper, judge_once\n")
    found = _imports(tmp_path, ("onboarding",))
    assert found == [("onboarding/a.py", 2, "onboarding.generate.blockcheck", "no_such_helper"),
                     ("onboarding/a.py", 2, "onboarding.generate.blockcheck", "judge_once")]
    assert _missing(found) == ["onboarding/a.py:2: onboarding.generate.blockcheck has no "
                               "no_such_helper"]
