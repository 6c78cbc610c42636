"""Kernel tests' fixtures. On CPU the tests pin large tiles (few programs: the interpreter costs
a few ms per program); on a GPU the modules' own per-bucket configs are used. The shared names
(DEVICE, DTYPES, checks) live in kernel_cases.py, which also sets TRITON_INTERPRET off a GPU.
"""

from __future__ import annotations

from kernel_cases import DEVICE, case_id  # noqa: I001  (first: sets TRITON_INTERPRET)

import pytest

from onboarding.generate import templating

_MODULES: dict = {}


@pytest.fixture(scope="session")
def kernel_root(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="session")
def load_kernel(kernel_root):
    """load_kernel(family, variant, params, cpu_config) -> rendered, written and imported module."""

    def load(family: str, variant: str, params: dict, cpu_config: dict | None = None):
        key = (family, variant, tuple(sorted(params.items())))
        if key not in _MODULES:
            source = templating.render(family, variant, params)
            name = case_id(variant, params).replace("=", "_").replace("-", "_").replace(".", "p").lower()
            path = templating.write_module(source, kernel_root / family / f"{name}.py")
            module = templating.load_module(path)
            if DEVICE.type == "cpu" and cpu_config:
                module.set_config(cpu_config)
            _MODULES[key] = module
        return _MODULES[key]

    return load


@pytest.fixture(scope="session")
def device():
    return DEVICE
