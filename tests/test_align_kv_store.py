"""Alignment of three attention layers that share a key/value mapping, as Gemma-3n's do: layer 0
plain, layer 1 a KV "store" layer (it attends with its own keys and values and puts them into the
mapping), layer 2 a "reuse" layer (it attends with the stored ones). In the real run the reuse
layer's gradient with respect to the stored keys and values flows back into the store layer's
k / v projections and its input.

Both sides of that edge are checked: the store layer's replay backpropagates what the reuse layer
sent back through the entries it wrote (53a3690: before it, the store layer's replay could not
reproduce its real gradient, and gemma3n_text's layer 4 read "fail" on fp32 noise), and the reuse
layer's gradient with respect to what it read from the mapping is one of its input gradients
(tapped at capture, a leaf in the replay). Before the latter, a reuse layer that dropped or
scaled the gradient of the keys it read passed in a mapping that is no plain dict (a ``UserDict``,
as transformers' ``KVSharingDict``): the store layer read "propagated", the reuse layer "pass",
and the model passed."""

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
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8, bias=False) for _ in range(4))

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k(x), self.v(x)

    def read(self, shared) -> tuple[torch.Tensor, torch.Tensor]:
        return shared["full"]

    def forward(self, x: torch.Tensor, shared) -> torch.Tensor:
        k, v = self.read(shared) if self.reuse else self.kv(x)
        if self.store:
            shared["full"] = k, v
        a = torch.softmax(self.q(x) @ k.transpose(-1, -2) / 8 ** 0.5, -1)
        return self.o(a @ v)


class _KVStore(nn.Module):
    def __init__(self, container: type) -> None:
        super().__init__()
        self.container = container
        self.embed = nn.Linear(8, 8, bias=False)  # the layers' inputs require grad
        self.layers = nn.ModuleList([_Attn(False, False), _Attn(True, False), _Attn(False, True)])
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared, x = self.container(), self.embed(x)
        for layer in self.layers:
            x = x + layer(x, shared=shared)
        return self.head(x)






def _reference_run(container: type):
    from onboarding.align.core import _run

    torch.manual_seed(0)
    ref, _ = build_pair(_KVStore(container))
    return ref, _run(ref, layers_graph("kv_store", 3, "_Attn"), (torch.randn(1, 5, 8),), {}, seed=0)


@pytest.mark.parametrize("container", [dict, UserDict])
def test_store_layers_replay_gives_its_real_gradients(container):
    """The reference store layer replayed on its own recorded call: the real run's parameter and
    input gradients, the reuse layer's share through the stored keys and values included."""
    from onboarding.align.replay import _replay

    ref, run = _reference_run(container)
    (call,) = run.rec.calls["layers.1"]
    again = _replay(ref.layers[1], call, call, torch.float64)
    for (n, _), g in zip(ref.layers[1].named_parameters(), again.param_grads):
        real = run.param_grads[f"layers.1.{n}"]
        assert g is not None and torch.allclose(g, real, rtol=1e-12, atol=1e-12), n
    assert torch.allclose(again.input_grads[0], call.taps[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("container", [dict, UserDict])
def test_reuse_layers_input_gradients_include_the_keys_it_read(container):
    """The reuse layer's recorded input gradients hold its gradient with respect to the keys and
    values it read from the mapping (nonzero: the store layer's k / v receive it), and its replay
    on its own call reproduces every one of them."""
    from onboarding.align.replay import _replay

    ref, run = _reference_run(container)
    (call,) = run.rec.calls["layers.2"]
    taps = [t for t in call.taps if t is not None]
    assert sorted(tuple(t.shape) for t in taps) == [(1, 5, 8)] * 3  # x, k, v
    assert all(float(t.abs().max()) > 0 for t in taps)
    again = _replay(ref.layers[2], call, call, torch.float64)
    assert len(again.input_grads) == len(call.taps)
    for g, t in zip(again.input_grads, call.taps):
        assert torch.allclose(g, t, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("container", [dict, UserDict])
@pytest.mark.parametrize("bug", [None, "store forward", "store backward", "reuse backward",
                                 "reuse drops the gradient"])
def test_align_blames_the_layer_with_the_bug(container, bug, monkeypatch):
    """Correct layers pass; a bug in the store layer's keys (forward, or backward only) fails the
    store layer in isolation; a bug in the reuse layer's gradient with respect to the keys it read
    (scaled, or dropped) fails the reuse layer in isolation, and the store layer, whose gradient
    it corrupts, reads "propagated"."""
    torch.manual_seed(0)
    ref, cand = build_pair(_KVStore(container))
    store, reuse = cand.layers[1], cand.layers[2]
    if bug == "store forward":
        monkeypatch.setattr(store, "kv", lambda x: (store.k(x) * 1.01, store.v(x)))
    elif bug == "store backward":
        monkeypatch.setattr(store, "kv", lambda x: (ScaledGrad.apply(store.k(x)), store.v(x)))
    elif bug == "reuse backward":
        monkeypatch.setattr(reuse, "read", lambda s: (ScaledGrad.apply(s["full"][0]),
                                                      s["full"][1]))
    elif bug == "reuse drops the gradient":
        monkeypatch.setattr(reuse, "read", lambda s: tuple(t.detach() for t in s["full"]))
    result = align(ref, cand, layers_graph("kv_store", 3, "_Attn"), (torch.randn(1, 5, 8),))
    got = {b.path: (b.fwd.verdict, b.bwd.verdict) for b in result.blocks}
    if bug is None:
        assert result.passed and set(got.values()) == {("pass", "pass")}, got
        return
    assert not result.passed, got
    if bug.startswith("store"):
        d = result.block("layers.1").fwd if bug == "store forward" else \
            result.block("layers.1").bwd
        assert d.verdict == "fail" and d.local_ok is False, (got, d.message)
    else:
        b = result.block("layers.2")
        assert b.bwd.verdict == "fail" and b.bwd.local_ok is False, (got, b.bwd.message)
        assert b.fwd.verdict == "pass", got
        assert got["layers.1"] == ("pass", "propagated"), got
