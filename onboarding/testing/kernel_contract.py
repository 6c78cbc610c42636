"""Contract suite for rendered kernel modules: a family supplies only a `KernelFixture`.

Checks: the module exposes the rendered-module contract (constants, `entry`, `reference` with the
same signature, ops, AOT specs); the forward output and EVERY input and weight gradient match
`reference` under the dtype's `Tolerance`, with outputs poisoned (NaN-filled before the kernels
write) so unwritten elements fail, and, in the interpreter, every load and store inside the
launch's tensor arguments (`onboarding.testing.bounds`); `torch.library.opcheck` passes on every
custom op.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from onboarding.testing.bounds import checked_when_interpreted
from onboarding.testing.tolerance import Comparison, Tolerance, compare, tolerance_for

REQUIRED_ATTRS = (
    "TEMPLATE", "TEMPLATE_VERSION", "PARAMS", "OP_NAME", "TUNING_SPACE", "SHAPE_BUCKETS",
    "DEFAULT_CONFIG", "OPS", "entry", "reference", "op_samples", "aot_specs", "set_config", "config_for",
)


@dataclass(kw_only=True)
class KernelFixture:
    """A rendered module plus how to build its inputs.

    `make_inputs(dtype, device, generator)` returns the positional arguments of `module.entry`
    (tensors, None or scalars). Every floating tensor argument gets `requires_grad` except the
    positions in `no_grad`; gradients at `weights` positions are compared with the "reduction"
    tolerance (they are sums over rows).
    """

    name: str
    module: ModuleType
    make_inputs: Callable[[torch.dtype, torch.device, torch.Generator], Sequence[Any]]
    weights: tuple[int, ...] = ()
    no_grad: tuple[int, ...] = ()
    tolerances: dict[str, Tolerance] = field(default_factory=dict)  # kind -> override (say why)

    def tolerance(self, dtype: torch.dtype, kind: str) -> Tolerance:
        return self.tolerances.get(kind) or tolerance_for(dtype, kind)


@contextlib.contextmanager
def poisoned(module: ModuleType) -> Iterator[None]:
    """Make the module allocate its outputs (and partial buffers) as NaN while inside."""
    old = module._POISON_OUTPUTS
    module._POISON_OUTPUTS = True
    try:
        yield
    finally:
        module._POISON_OUTPUTS = old


def check_module_contract(module: ModuleType) -> None:
    """The rendered-module contract: required names, and `reference` shaped like `entry`."""
    missing = [name for name in REQUIRED_ATTRS if not hasattr(module, name)]
    if missing:
        raise AssertionError(f"{module.__name__}: missing {missing}")
    entry_sig = list(inspect.signature(module.entry).parameters)
    ref_sig = list(inspect.signature(module.reference).parameters)
    if entry_sig != ref_sig:
        raise AssertionError(f"{module.__name__}: reference{ref_sig} != entry{entry_sig}")
    if not module.OP_NAME.startswith("onboard::"):
        raise AssertionError(f"{module.__name__}: op {module.OP_NAME} is not in the onboard namespace")
    for op in module.OPS:
        if not isinstance(op, torch._library.custom_ops.CustomOpDef):
            raise AssertionError(f"{module.__name__}: {op!r} is not a torch.library custom op")


def _inputs(fx: KernelFixture, dtype: torch.dtype, device: torch.device, seed: int) -> list[Any]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    args = list(fx.make_inputs(dtype, torch.device(device), gen))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and i not in fx.no_grad:
            args[i] = a.detach().requires_grad_(True)
    return args


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_forward_backward(
    fx: KernelFixture, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0
) -> list[Comparison]:
    """Forward output(s) and every gradient vs `reference`; AssertionError lists all failures."""
    args = _inputs(fx, dtype, device, seed)
    grad_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    with poisoned(fx.module), checked_when_interpreted():  # CPU runs: out-of-bounds raises here
        out = _as_tuple(fx.module.entry(*args))
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        douts = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype) for o in out]
        grads = torch.autograd.grad(out, [args[i] for i in grad_pos], douts, allow_unused=True)
    ref_out = _as_tuple(fx.module.reference(*args))
    ref_grads = torch.autograd.grad(ref_out, [args[i] for i in grad_pos], douts, allow_unused=True)
    names = list(inspect.signature(fx.module.entry).parameters)
    results = []
    for j, (o, r) in enumerate(zip(out, ref_out, strict=True)):
        results.append(compare(o, r, fx.tolerance(dtype, "elementwise"), f"{fx.name}: out[{j}]"))
        if o.dtype != r.dtype:
            raise AssertionError(f"{fx.name}: out[{j}] dtype {o.dtype} != reference {r.dtype}")
    for i, g, rg in zip(grad_pos, grads, ref_grads, strict=True):
        label = f"{fx.name}: grad {names[i] if i < len(names) else i}"
        if g is None or rg is None:
            if (g is None) != (rg is None):
                raise AssertionError(f"{label}: kernel grad {'missing' if g is None else 'present'}, reference not")
            continue
        kind = "reduction" if i in fx.weights else "elementwise"
        results.append(compare(g, rg, fx.tolerance(dtype, kind), label))
        if g.dtype != args[i].dtype:
            raise AssertionError(f"{label}: dtype {g.dtype} != input dtype {args[i].dtype}")
    failures = [r.message for r in results if not r.passed]
    if failures:
        raise AssertionError("\n".join(failures))
    return results


# torch.library.opcheck's checks, split by cost: the AOT-dispatch one traces every op's forward
# and backward through AOTAutograd with dynamic shapes and runs them again (about two thirds of an
# opcheck's time in the interpreter)
OPCHECK_FAST = ("test_schema", "test_autograd_registration", "test_faketensor")
OPCHECK_AOT = ("test_aot_dispatch_dynamic",)


def check_opcheck(
    fx: KernelFixture, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
    utils: Sequence[str] = OPCHECK_FAST + OPCHECK_AOT,
) -> int:
    """`torch.library.opcheck` on every custom op of the module (samples from `op_samples`),
    its checks ``utils`` (default: all of them)."""
    args = _inputs(fx, dtype, device, seed)
    samples = fx.module.op_samples(*args)
    covered = {op for op, _ in samples}
    missing = [op for op in fx.module.OPS if op not in covered]
    if missing:
        raise AssertionError(f"{fx.name}: op_samples does not cover {missing}")
    for op, op_args in samples:
        torch.library.opcheck(op, op_args, test_utils=tuple(utils))
    return len(samples)


def run_contract(
    fx: KernelFixture,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16),
    device: str | torch.device = "cpu",
    opcheck: bool = True,
) -> list[Comparison]:
    """Everything above for one fixture."""
    check_module_contract(fx.module)
    results = []
    for dtype in dtypes:
        results += check_forward_backward(fx, dtype, device)
    if opcheck:
        check_opcheck(fx, dtypes[0], device)
    return results


def check_aot_sm90(paths: list[str], **compile_kwargs: Any) -> None:
    """Every kernel of the rendered modules at ``paths`` compiles ahead of time for sm_90
    (``compile_kwargs``: `aot.compile_files`' size / dtype) and fits an H100/H200 SM's shared
    memory; the calling test is skipped where this triton cannot compile ahead of time."""
    import pytest

    from onboarding.generate import aot

    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    for path, rs in aot.compile_files(list(paths), registers=False, **compile_kwargs).items():
        assert rs, path
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"
            assert r.shared_bytes is not None and r.shared_bytes <= aot.H100_SHARED_BYTES, \
                (path, r.kernel, r.shared_bytes)
