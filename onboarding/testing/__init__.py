"""Test support shared by kernel tests, tuning and layer-wise alignment."""

from onboarding.testing.kernel_contract import (
    KernelFixture,
    check_aot_sm90,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
    poisoned,
    run_contract,
)
from onboarding.testing.tolerance import (
    Comparison,
    Tolerance,
    assert_close,
    compare,
    tolerance_for,
)

__all__ = [
    "Comparison",
    "KernelFixture",
    "Tolerance",
    "assert_close",
    "check_aot_sm90",
    "check_forward_backward",
    "check_module_contract",
    "check_opcheck",
    "compare",
    "poisoned",
    "run_contract",
    "tolerance_for",
]
