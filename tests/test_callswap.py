"""`CallSwapPatch` (a mixer's core served by swapping the function its forward calls) under
activation checkpointing: the first call calibrates inside the checkpointed region, so it must
save for the backward exactly what the region's recomputation will save, whether the kernel is
kept or refused. And what a block can reach: function modules and helpers, as transformers 5.25
builds its mixers."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from onboarding.patching.callswap import CallSwapPatch, Interface, min_required
from onboarding.patching.core import PatchRecord
from fixtures.hub_function import function_module


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


# ---- what a block can reach: function modules and helpers (transformers 5.25's shapes) -------

def core_plain(q, k, v):
    a = torch.tanh(q @ k.transpose(-1, -2))
    return torch.softmax(a, -1) @ v


core_module = function_module(core_plain)  # the module-level name model code calls


def scan_forward(module, x, gate, cache):  # a helper handed the block: it calls the core
    q, k, v = module.proj(x).chunk(3, -1)
    return core_module(q, k, v) * gate


helper_module = function_module(scan_forward)


class HelperMixer(Mixer):
    def forward(self, x):
        return helper_module(self, x, torch.sigmoid(x), None)


def test_function_modules_and_helpers_are_reached():
    """A stateless module made of a function is that function (its forward's signature); a
    helper the forward calls (itself such a module) is followed into its module's names; the
    helper fits the interface too, but a call handed the block passes through uncalibrated, and
    the core it calls is served by the kernel."""
    from onboarding.patching.callswap import as_function, reachable

    assert as_function(core_module) is not None and as_function(nn.Linear(2, 2)) is None
    assert as_function(core_module.forward) is not None and as_function(nn.Linear(2, 2).forward) is None
    assert [(w, n) for w, n, _ in reachable(HelperMixer(), min_required(3))] == \
        [("global", "helper_module"), ("global", "core_module")]
    torch.manual_seed(0)
    ref_mod, x = HelperMixer(), torch.randn(2, 5, 8)
    mod = HelperMixer()
    mod.load_state_dict(ref_mod.state_dict())
    record = PatchRecord(path="mixer", kind="toy", family="toy")
    calls = []
    patch = CallSwapPatch(mod, lambda *a: calls.append(1) or _ours(*a), record, IFACE)
    mod.forward = patch.forward
    y = mod(x)
    assert record.status == "active" and "core_module" in record.binding, record
    assert patch.swaps[("global", "helper_module")].state == "helper"
    assert globals()["core_module"] is core_module and globals()["helper_module"] is helper_module
    mod(x)
    assert len(calls) == 3  # calibration, the first call, the second call
    torch.testing.assert_close(y, ref_mod(x), rtol=1e-5, atol=1e-6)


# ---- a core handed the block itself (transformers' attention interface) ----------------------

def toy_attention(module, q, k, v):  # fn(module, query, key, value) -> (output, weights)
    w = torch.softmax(q @ k.transpose(-1, -2) * module.scale, -1)
    return w @ v, w


class AttentionBlock(Mixer):
    scale = 0.5

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        out, _ = toy_attention(self, q, k, v)
        return out


def _fused(module, q, k, v):  # our kernel's reading of the call: no weights formed
    return torch.softmax(torch.einsum("...id,...jd->...ij", q, k) * module.scale, -1) @ v, None


@pytest.mark.parametrize("takes_block", [False, True])
def test_core_handed_the_block(takes_block):
    """A function handed the block itself as its first argument is a helper unless the interface
    says its calls take the block (`takes_block`); then it calibrates, and `judged` leaves out
    the weights the original returns and ours does not form (ours returns None there)."""
    iface = Interface(what="toy-attention", fits=min_required(4), takes_block=takes_block,
                      judged=lambda ref: (ref[0], None),
                      call=lambda fn, kernel, args, kwargs, variant: kernel(*args, **kwargs))
    torch.manual_seed(0)
    ref_mod, x = AttentionBlock(), torch.randn(2, 5, 8)
    mod = AttentionBlock()
    mod.load_state_dict(ref_mod.state_dict())
    record = PatchRecord(path="attn", kind="toy", family="toy")
    calls = []
    patch = CallSwapPatch(mod, lambda *a: calls.append(1) or _fused(*a), record, iface)
    mod.forward = patch.forward
    y = mod(x)
    y.square().sum().backward()
    ref_mod(x).square().sum().backward()
    swap = patch.swaps[("global", "toy_attention")]
    if not takes_block:
        assert swap.state == "helper" and not calls
        return
    assert swap.state == "bound" and record.status == "active" and len(calls) == 2, record
    torch.testing.assert_close(y, ref_mod(x).detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(mod.parameters(), ref_mod.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
