"""onboarding.testing.bounds: the interpreter's bounds check of every load and store."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import DEVICE

from onboarding.testing.bounds import OutOfBounds, available, bounds_checked

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="checks the interpreter (CPU runs)")


@triton.jit
def _shift_copy(p_x, p_y, n, SHIFT: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    if MASKED:
        m = o + SHIFT < n
        tl.store(p_y + o, tl.load(p_x + o + SHIFT, mask=m, other=0.0), mask=m)
    else:
        tl.store(p_y + o, tl.load(p_x + o + SHIFT))


@triton.jit
def _store_past(p_y, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p_y + o + 1, tl.zeros([BLOCK], dtype=tl.float32))


@triton.jit
def _pair_sum(p_xs, p_y, BLOCK: tl.constexpr):  # a tuple of tensors
    o = tl.arange(0, BLOCK)
    tl.store(p_y + o, tl.load(p_xs[0] + o) + tl.load(p_xs[1] + o))


def test_available_here():
    assert available() == (True, "")


def test_in_bounds_and_masked_lanes_pass():
    x = torch.randn(16)
    y = torch.empty(16)
    with bounds_checked():
        _shift_copy[(1,)](x, y, 16, SHIFT=0, MASKED=False, BLOCK=16)
        torch.testing.assert_close(y, x)
        _shift_copy[(1,)](x, y, 16, SHIFT=3, MASKED=True, BLOCK=16)  # lanes 13-15 masked off
        torch.testing.assert_close(y[:13], x[3:])
        _pair_sum[(1,)]((x, x[:8].repeat(2)), y, BLOCK=16)
        torch.testing.assert_close(y, x + x[:8].repeat(2))
        # a view's storage is the unit: the last 8 of x's 16 floats sit inside its storage
        _shift_copy[(1,)](x[:8], y[:8], 8, SHIFT=8, MASKED=False, BLOCK=8)
        torch.testing.assert_close(y[:8], x[8:])


def test_unmasked_load_past_the_end_raises():
    x, y = torch.randn(16), torch.empty(16)
    with bounds_checked(), pytest.raises(OutOfBounds, match=r"load in Triton kernel _shift_copy: 1 of 16 .*"
                                                             r"ends 4 bytes past an argument's storage \(64 bytes\)"):
        _shift_copy[(1,)](x, y, 16, SHIFT=1, MASKED=False, BLOCK=16)


def test_store_past_the_end_raises():
    y = torch.empty(16)
    with bounds_checked(), pytest.raises(OutOfBounds, match=r"store in Triton kernel _store_past"):
        _store_past[(1,)](y, BLOCK=16)


def test_nested_and_restored():
    x, y = torch.randn(32), torch.empty(16)
    with bounds_checked():
        with bounds_checked():
            pass
        with pytest.raises(OutOfBounds):  # still checked after the inner block ends
            _shift_copy[(1,)](x[:16].clone(), y, 16, SHIFT=1, MASKED=False, BLOCK=16)
    # unpatched after the outer block: the interpreter runs the out-of-range read (here inside x's
    # storage, so harmless) without a word
    _shift_copy[(1,)](x, y, 16, SHIFT=1, MASKED=False, BLOCK=16)
    torch.testing.assert_close(y, x[1:17])
