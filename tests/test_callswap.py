"""`CallSwapPatch` (a mixer's core served by swapping the function its forward calls) under
activation checkpointing: the first call calibrates inside the checkpointed region, so it must
save for the backward exactly what the region's recomputation will save, whether the kernel is
kept or refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from onboarding.patching.callswap import CallSwapPatch, Interface, min_required
from onboarding.patching.core import PatchRecord


def core(q, k, v):  # the mixer's plain core function (module-level: the forward reads it)
    a = torch.tanh(q @ k.transpose(-1, -2))
    return torch.softmax(a, -1) @ v


class Mixer(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        return core(q, k, v)


def _ours(q, k, v):  # the same math by other ops: fewer saved tensors than the original's
    return torch.softmax(torch.tanh(torch.einsum("...id,...jd->...ij", q, k)), -1) @ v


def _wrong(q, k, v):
    return _ours(q, k, v) + 1.0


IFACE = Interface(what="toy", fits=min_required(3),
                  call=lambda fn, kernel, args, kwargs, variant: kernel(*args, **kwargs))


@pytest.mark.parametrize("kernel, status", [(_ours, "active"), (_wrong, "rejected")])
def test_first_call_under_checkpoint(kernel, status):
    torch.manual_seed(0)
    ref_mod, x = Mixer(), torch.randn(2, 5, 8)
    mod = Mixer()
    mod.load_state_dict(ref_mod.state_dict())
    record = PatchRecord(path="mixer", kind="toy", family="toy")
    patch = CallSwapPatch(mod, kernel, record, IFACE)
    mod.forward = patch.forward
    # the first (calibrating) call inside a non-reentrant checkpoint: its backward recomputes
    # the region with the swap decided and checks that the same tensors were saved
    y = checkpoint(mod, x, use_reentrant=False)
    y.square().sum().backward()
    ref_mod(x).square().sum().backward()
    assert record.status == status
    torch.testing.assert_close(y, ref_mod(x).detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(mod.parameters(), ref_mod.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
