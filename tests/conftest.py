"""Shared fixtures: parsed op graphs are cached per session (export of hybrids takes seconds)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Kernel tests run Triton in the interpreter on CPU machines; it must be set before any
# @triton.jit runs (docs/design.md).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

# The interpreter's per-launch re-patch of triton.language, cached (what it patches unchanged):
# see tests/fixtures/interpreter_patch_cache.py.
if os.environ.get("TRITON_INTERPRET") == "1":
    from fixtures.interpreter_patch_cache import install as _install_interpreter_cache

    _install_interpreter_cache()

# Under pytest-xdist each worker gets an equal share of the cores: torch's default (all cores per
# process) oversubscribes the CPU when the workers run interpreter-heavy tests side by side.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    try:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    except ImportError:
        pass

# The repo root must not be on sys.path: `kernels/` there would import as a namespace package
# named `kernels`, the Hugging Face kernel hub's name, which transformers probes for.
for entry in ("", str(ROOT)):
    while entry in sys.path:
        sys.path.remove(entry)


def pytest_configure(config):
    """The suite must test this checkout: an editable install left pointing at another clone
    (a fresh-clone CI run re-points it) would test that clone's code instead, silently."""
    import onboarding

    where = Path(onboarding.__file__).resolve().parent.parent
    if where != ROOT:
        raise pytest.UsageError(f"onboarding is imported from {where}, not from this checkout "
                                f"{ROOT}: run `pip install -e . --no-deps` here")


@functools.cache
def parsed(ref: str, **kw):
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage, parse_stage

    info = load_stage(load_model(ref, trust_remote_code=True))
    return parse_stage(info, **kw)


@pytest.fixture(scope="session")
def parse_model():
    return parsed


@pytest.fixture
def families(monkeypatch):
    """The family registry with the built-in families alone (no extra folders), reset again
    after the test: a run or test that registers generated families leaves it as found."""
    from onboarding import families as fam
    from onboarding.families import discover

    monkeypatch.setattr(discover, "_EXTRA_DIRS", [])
    fam.reset()
    yield fam
    fam.reset()


@pytest.fixture(autouse=True, scope="module")
def _restore_tile_pins():
    """`load_module` shares one module per rendered source across tests, so a test module that
    pins tiles (`set_config`, e.g. the kernel tests' CPU tiles) would leave them pinned for the
    next test module in the same xdist worker. The pins are put back as they were when this test
    module began (modules loaded since: unpinned)."""
    from onboarding.generate import templating

    saved = {sha: (m._CONFIG_OVERRIDE, dict(m._TUNED)) for sha, m in templating._LOADED.items()}
    yield
    for sha, m in templating._LOADED.items():
        override, tuned = saved.get(sha, (None, {}))
        m._CONFIG_OVERRIDE = override
        m._TUNED.clear()
        m._TUNED.update(tuned)
