"""`onboarding.patching.core.calibrated` when the block's own code cannot run in the call's
16-bit dtype (transformers' MiniMax lightning attention multiplies bf16 scores by a float32 decay
it builds in its forward, then matmuls with bf16 values: "expected scalar type Float but found
BFloat16" on a GPU run): the patch calibrates against the block run in float32 instead of
failing the model's first forward."""

import pytest
import torch
from torch import nn

from onboarding.patching.core import PatchRecord, calibrated


class Mixes32(nn.Module):
    """x @ w, scaled by a float32 vector it builds itself, then @ v: fails for bf16 x, w, v."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.v = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.register_buffer("kept32", torch.linspace(0.5, 1.5, d))  # a float32 buffer, kept so

    def forward(self, x):
        decay = torch.exp(-torch.arange(x.shape[-1], dtype=torch.float32) / 8)  # float32 always
        return torch.matmul((x @ self.w) * decay * self.kept32, self.v)


def _kernel(m: Mixes32):
    """What a kernel replacing the block computes, in the call's dtype (the right maths)."""
    def run(x):
        decay = torch.exp(-torch.arange(x.shape[-1], dtype=torch.float32) / 8)
        return ((x @ m.w).float() * decay * m.kept32).to(x.dtype) @ m.v
    return run


def _wrong(m: Mixes32):
    return lambda x: (x @ m.w) @ m.v  # no decay


def test_the_block_itself_fails_in_bf16():
    m = Mixes32().to(torch.bfloat16)
    m.kept32.data = m.kept32.float()
    with pytest.raises(RuntimeError):
        m(torch.randn(3, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("bindings, status", [(("wrong", "right"), "active"), (("wrong",), "rejected")])
def test_calibrates_against_the_block_in_float32(bindings, status):
    torch.manual_seed(0)
    m = Mixes32().to(torch.bfloat16)
    m.kept32.data = m.kept32.float()  # a float32 buffer beside bf16 weights, as the model keeps it
    w0, v0 = m.w.detach().clone(), m.v.detach().clone()
    rec = PatchRecord(path="blk", kind="k", family="f")
    make = {"wrong": _wrong, "right": _kernel}
    calibrated(m, rec, {name: make[name](m) for name in bindings})
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    if status == "rejected":  # nothing matches: the block is given back, and its own error shows
        with pytest.raises(RuntimeError):
            m(x)
        assert rec.status == "rejected"
    else:
        out = m(x)
        assert rec.status == "active" and rec.binding == "right"
        assert "fails in bfloat16" in rec.detail and "float32" in rec.detail
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, _kernel(m)(x))
    # the widened parameters are the same objects, back in bf16 with the same values; the
    # float32 buffer stays float32
    assert m.w.dtype == m.v.dtype == torch.bfloat16 and m.kept32.dtype == torch.float32
    assert torch.equal(m.w, w0) and torch.equal(m.v, v0)
    assert isinstance(m.w, nn.Parameter) and m.w.requires_grad


def test_a_block_that_runs_keeps_its_own_reference():
    """A block that runs in its dtype calibrates as before: no float32 note."""
    m = nn.Linear(8, 8).to(torch.bfloat16)
    rec = PatchRecord(path="blk", kind="k", family="f")
    calibrated(m, rec, {"same": lambda x: torch.nn.functional.linear(x, m.weight, m.bias)})
    m(torch.randn(2, 8, dtype=torch.bfloat16))
    assert rec.status == "active" and rec.detail == ""
