"""Third-party kernel packages that model code would pick up on its own, hidden from it.

transformers' modelling code takes flash-linear-attention, causal-conv1d, mamba-ssm or
flash-attn kernels whenever they import: the choice is made when the modelling module is
imported (an availability check, or a wrapper that imports the package and keeps its function).
What happens to be installed would then decide which code runs in the proxy, the training
reference and the transformers + PEFT baseline — and fla 0.6's backward refuses to run with
triton < 3.7.1 on Hopper, so a Qwen3-Next reference run crashed wherever fla was installed.

`onboard` decides instead. Before any model code is imported, `hide` makes these packages
unimportable in the process (``sys.modules[name] = None``: ``import`` raises ImportError and
``importlib.util.find_spec`` answers None, which is what transformers' checks read), and clears
transformers' cached availability answers. The model then runs its own torch path, and the
patches put onboard's kernels in. The choice is recorded (`state`) in every run's environment.
`onboard bench` is the one command that imports some of them, by name, as comparison rows.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

from onboarding.load.compat import pypi_name

# import names (their PyPI names: `onboarding.load.compat.PYPI_NAMES`)
PACKAGES = ("fla", "causal_conv1d", "mamba_ssm", "flash_attn", "flash_attn_interface",
            "liger_kernel")

_STATE: dict[str, str] = {}


def _version(name: str) -> str:
    dists = importlib.metadata.packages_distributions().get(name) or []
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return pypi_name(name)


def _clear_transformers_checks() -> None:
    """Forget transformers' cached ``is_*_available`` answers (they are lru-cached)."""
    utils = sys.modules.get("transformers.utils.import_utils")
    for attr in dir(utils) if utils is not None else ():
        fn = getattr(utils, attr, None)
        if attr.startswith("is_") and attr.endswith("_available") and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def hide(allow: tuple[str, ...] = ()) -> dict[str, str]:
    """Hide every installed package of `PACKAGES` not in `allow` from this process's imports.

    Returns `state()`. A package imported before this call cannot be hidden any more; it is
    recorded as such (model code may use it)."""
    for name in PACKAGES:
        if name in allow:
            continue
        loaded = sys.modules.get(name, ...)
        if loaded is None:  # hidden already
            continue
        if loaded is not ...:
            _STATE[name] = f"{_version(name)}: imported before onboard could hide it"
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        _STATE[name] = f"{_version(name)}: installed, hidden from model code"
        sys.modules[name] = None  # type: ignore[assignment]
    _clear_transformers_checks()
    return state()


def state() -> dict[str, str]:
    """What `hide` found in this process: import name -> what was done with it (only the
    packages that are installed)."""
    return dict(_STATE)
