"""Kernel tests: Triton runs in the interpreter when no GPU is present.

TRITON_INTERPRET is read when `@triton.jit` runs, so it is set here, before any rendered kernel
module is imported. On CPU the tests pin large tiles (few programs: the interpreter costs a few
ms per program); on a GPU the modules' own per-bucket configs are used.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from onboarding.generate import templating  # noqa: E402
from onboarding.testing.kernel_contract import OPCHECK_AOT, OPCHECK_FAST  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 passes in the interpreter too: the kernels upcast on load, so its broken bf16 arithmetic
# is never hit.
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
_MODULES: dict = {}


# The opcheck of the families whose ops are slow in the interpreter, split: schema, autograd
# registration and fake tensors in CI, the AOT-dispatch trace (two thirds of the time) nightly.
OPCHECK_SPLIT = [pytest.param(OPCHECK_FAST, id="opcheck-fast"),
                 pytest.param(OPCHECK_AOT, id="opcheck-aot", marks=pytest.mark.slow)]


def case_id(variant: str, params: dict) -> str:
    """Readable parametrize id: variant plus non-default params, e.g. `fused-layout=interleaved`."""
    return "-".join([variant] + [f"{k}={v}" for k, v in sorted(params.items())])


def check_sample_inputs_fit(module, family, variant: str, params: dict, shape: list[int]) -> None:
    """The generate stage's check calls `entry(*sample_inputs(...))`: the arguments must fit, and
    the rendered `module` must agree with its own reference on them."""
    resolved = family.FAMILY.resolve(variant, params)
    args = family.sample_inputs(variant, resolved, [shape], torch.Generator().manual_seed(0))
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    torch.testing.assert_close(module.entry(*args), module.reference(*args), rtol=1e-5, atol=1e-5)


def check_match(family, block, expected: tuple[str, dict] | None) -> None:
    """`family.match(block)` is None when `expected` is, else its (variant, params over the
    defaults)."""
    got = family.match(block)
    if expected is None:
        assert got is None
        return
    variant, params = expected
    assert got == {"variant": variant, "params": family.FAMILY.resolve(variant, params)}


def training_root(tmp_path_factory, device, kind: str, cpu_config: dict):
    """A kernels dir the training stage's attach of ``kind`` renders into, with the module it
    serves rendered there (the same module object the attach loads: modules are cached by
    content) and, on the CPU, pinned to the test's small tiles ``cpu_config``."""
    from onboarding.families import training_kernel
    from onboarding.train.kernels import load_training_variant

    root = tmp_path_factory.mktemp(kind.replace(".", "_"))
    mod = load_training_variant(training_kernel(kind), root, 0)
    if device.type == "cpu":
        mod.set_config(cpu_config)
    return root


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
