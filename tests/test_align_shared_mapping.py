"""Alignment's isolated replay of blocks that share a mapping the model writes into (Gemma-3n's
``KVSharingDict``, a ``UserDict``: a "store" attention layer puts its keys there, later "reuse"
layers read them). The capture keeps a snapshot of the mapping as the block was handed it, and
each replay runs on a private copy in its own dtype. Before, the mapping was kept live: the
store layer's fp32 replay wrote fp32 keys into the reference run's mapping, the reuse layer's
fp64 replay then failed (``expected ... same dtype``), and every such block went unjudged in
isolation ("fail" where the model's own fp32 noise was all there was)."""

from __future__ import annotations

from collections import UserDict

import pytest

import torch
from torch import nn

from onboarding.align.core import align, build_pair
from fixtures.align_toys import ScaledGrad, layers_graph


class _Attn(nn.Module):
    def __init__(self, store: bool, reuse: bool) -> None:
        super().__init__()
        self.store, self.reuse = store, reuse
        self.q = nn.Linear(8, 8, bias=False)
        self.k = nn.Linear(8, 8, bias=False)
        self.o = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, shared: UserDict) -> torch.Tensor:
        q = self.q(x)
        k = shared["k"] if self.reuse else self.k(x)
        if self.store:
            shared["k"] = k
        return self.o(torch.softmax(q @ k.transpose(-1, -2), -1) @ k)


class _SharedKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attn(True, False), _Attn(False, True), _Attn(False, True)])
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = UserDict()
        for layer in self.layers:
            x = x + layer(x, shared=shared)
        return self.head(x)


def test_replay_of_layers_sharing_a_written_mapping():
    torch.manual_seed(0)
    model = _SharedKV()
    ref, cand = build_pair(model)
    result = align(ref, cand, layers_graph("shared_kv", 3, "_Attn"), (torch.randn(1, 5, 8),), isolate="always")
    for b in result.blocks:
        assert b.fwd.local is not None and b.bwd.local is not None, (b.path, b.fwd.message)
        assert "isolated replay failed" not in b.fwd.message + b.bwd.message, b.fwd.message
        assert b.fwd.verdict == "pass" and b.bwd.verdict == "pass", (b.path, b.bwd.message)
        assert b.fwd.local.rel_rms < 1e-6, (b.path, b.fwd.local.rel_rms)


# ---- a block that writes a tensor into a shared object that a later block reads -----------------
# Layer 0 puts ``s = w(x)`` into the shared object (``s`` feeds nothing else in layer 0); layer 1
# reads it. In the real run the gradient from layer 1 flows back through ``s`` into layer 0's
# ``w`` and its input: the written tensor is an output of layer 0, and its replay must carry that
# gradient or it can never reproduce the real one (Gemma-3n's KV-store attention, layer 4).

class _Writer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o = nn.Linear(8, 8, bias=False)
        self.w = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, shared) -> torch.Tensor:
        shared["s"] = (self.shared_value(x),)  # a tuple, as Gemma-3n stores (keys, values)
        return self.o(x)

    def shared_value(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w(x))


class _Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, shared) -> torch.Tensor:
        (s,) = shared["s"]
        return self.o(x * s)


class _Writes(nn.Module):
    def __init__(self, container: type) -> None:
        super().__init__()
        self.container = container
        self.embed = nn.Linear(8, 8, bias=False)  # the layers' input requires grad
        self.layers = nn.ModuleList([_Writer(), _Reader()])
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared, x = self.container(), self.embed(x)
        for layer in self.layers:
            x = x + layer(x, shared=shared)
        return self.head(x)






@pytest.mark.parametrize("container", [dict, UserDict])
def test_replay_of_a_block_that_writes_into_a_shared_object_reproduces_its_gradient(container):
    """The reference block replayed on its own recorded call gives the real run's parameter and
    input gradients: the gradient that later blocks send back through the written tensor is
    part of the replay's backward."""
    from onboarding.align.core import _run
    from onboarding.align.replay import _replay

    torch.manual_seed(0)
    ref, _ = build_pair(_Writes(container))
    run = _run(ref, layers_graph("writes", 2, "_Layer"), (torch.randn(1, 5, 8),), {}, seed=0)
    (call,) = run.rec.calls["layers.0"]
    again = _replay(ref.layers[0], call, call, torch.float64)
    names = [n for n, p in ref.layers[0].named_parameters()]
    for n, g in zip(names, again.param_grads):
        real = run.param_grads[f"layers.0.{n}"]
        assert g is not None and torch.allclose(g, real, rtol=1e-12, atol=1e-12), n
    (tap,) = call.taps
    assert torch.allclose(again.input_grads[0], tap, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("container", [dict, UserDict])
@pytest.mark.parametrize("bug", [None, "forward", "backward"])
def test_align_judges_a_block_by_the_tensors_it_writes_into_a_shared_object(container, bug,
                                                                            monkeypatch):
    """Correct kernels pass in isolation; a bug in the written tensor alone (its forward, or only
    its backward) fails the writing block in isolation, where it is: the block's own output is
    right, only what it wrote is off."""
    torch.manual_seed(0)
    ref, cand = build_pair(_Writes(container))
    if bug == "forward":
        monkeypatch.setattr(cand.layers[0], "shared_value",
                            lambda x: torch.tanh(cand.layers[0].w(x)) * 1.01)
    elif bug == "backward":
        monkeypatch.setattr(cand.layers[0], "shared_value",
                            lambda x: ScaledGrad.apply(torch.tanh(cand.layers[0].w(x))))
    result = align(ref, cand, layers_graph("writes", 2, "_Layer"), (torch.randn(1, 5, 8),), isolate="always")
    b = result.block("layers.0")
    assert b.fwd.local is not None and b.bwd.local is not None, b.fwd.message
    if bug is None:
        assert b.fwd.verdict == "pass" and b.bwd.verdict == "pass", (b.fwd.message, b.bwd.message)
        assert b.bwd.local_ok and b.bwd.local_params.rel_rms < 1e-6
    else:
        d = b.fwd if bug == "forward" else b.bwd
        assert d.verdict == "fail" and d.local_ok is False, (d.verdict, d.message)
        assert b.bwd.verdict == "fail" and b.bwd.local_ok is False, (b.bwd.verdict, b.bwd.message)
