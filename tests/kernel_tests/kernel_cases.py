"""What the kernel tests share besides fixtures: the device, dtypes, opcheck split and case
checks. Triton runs in the interpreter when no GPU is present; TRITON_INTERPRET is read when
`@triton.jit` runs, so it is set here, before any rendered kernel module is imported (conftest.py
imports this module first).

A plain module, not conftest.py: `from conftest import ...` resolves to whichever conftest was
imported last, so a run that also collects another test folder (tests/reviewed_kernels) got the
wrong one.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from onboarding.testing.kernel_contract import OPCHECK_AOT, OPCHECK_FAST  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 passes in the interpreter too: the kernels upcast on load, so its broken bf16 arithmetic
# is never hit.
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


# The opcheck of the families whose ops are slow in the interpreter, split: schema, autograd
# registration and fake tensors in CI, the AOT-dispatch trace (two thirds of the time) nightly.
OPCHECK_SPLIT = [pytest.param(OPCHECK_FAST, id="opcheck-fast"),
                 pytest.param(OPCHECK_AOT, id="opcheck-aot", marks=pytest.mark.slow)]


class LaunchSpy:
    """Stands for a Triton kernel of a rendered module (`monkeypatch.setattr(module, name,
    LaunchSpy(kernel, record))`): each `kernel[grid](*args, **kw)` calls `record(grid, kw)`, then
    launches the kernel."""

    def __init__(self, kernel, record):
        self.kernel, self.record = kernel, record

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.record(grid, kw)
            return self.kernel[grid](*args, **kw)
        return launch


def assert_within_bars(errs: dict[str, float], outputs: tuple[str, ...], out_bar: float,
                       grad_bar: float) -> None:
    """Every relative error in `errs` within its bar: `out_bar` for the names in `outputs` (and
    their `_`-suffixed variants, e.g. "y_no_grad"), `grad_bar` for the rest (the gradients). A NaN
    fails (`not e <= bar`)."""
    def bar(name: str) -> float:
        return out_bar if any(name == o or name.startswith(o + "_") for o in outputs) else grad_bar
    bad = {k: e for k, e in errs.items() if not e <= bar(k)}
    assert not bad, f"relative RMS over the bar (or nan): {bad} (all: {errs})"


@contextlib.contextmanager
def fp16_dot_path(monkeypatch, module):
    """`module` (a rendered kernel module) on its GPU's 16-bit path for fp16 inputs, in the
    interpreter: `_dot_mode` returns "fp16" for 16-bit inputs as it does on a GPU ("bf16"/"fp16"),
    so `_tiles` picks 16-bit dots and 16-bit stored intermediates, which the kernels read at launch
    time; other dtypes keep the module's own mode. The interpreter computes fp16 right (not bf16):
    fp16 inputs then take the GPU's 16-bit path at fp16's unit roundoff (2^-11 against bf16's
    2^-8), so the GPU's bf16-vs-fp32 bars scaled by 2^-3 predict its outcome (fp16's narrower range
    aside: a kernel that guards exponent ranges by mode may route differently). Undone on exit."""
    dot_mode = module._dot_mode
    with monkeypatch.context() as patch:
        patch.setattr(module, "_dot_mode", lambda precision, dtype, device: "fp16" if dtype in (
            torch.bfloat16, torch.float16) else dot_mode(precision, dtype, device))
        yield module


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


def zero_fill_shapes(loss: torch.Tensor) -> list[list[int]]:
    """The shapes of the tensors zero-filled while `loss.backward()` runs (aten zero_ / fill_ /
    zeros_like on the CPU profiler's records): where autograd materializes a zero gradient for an
    output the loss does not use, a [*shape] zero_ appears here."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    return [list(ev.input_shapes[0]) for ev in prof.events()
            if ev.name in ("aten::zero_", "aten::fill_", "aten::zeros_like") and ev.input_shapes and ev.input_shapes[0]]

