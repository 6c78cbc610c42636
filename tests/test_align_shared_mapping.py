"""Alignment's isolated replay of blocks that share a mapping the model writes into (Gemma-3n's
``KVSharingDict``, a ``UserDict``: a "store" attention layer puts its keys there, later "reuse"
layers read them). The capture keeps a snapshot of the mapping as the block was handed it, and
each replay runs on a private copy in its own dtype. Before, the mapping was kept live: the
store layer's fp32 replay wrote fp32 keys into the reference run's mapping, the reuse layer's
fp64 replay then failed (``expected ... same dtype``), and every such block went unjudged in
isolation ("fail" where the model's own fp32 noise was all there was)."""

from __future__ import annotations

from collections import UserDict

import torch
from torch import nn

from onboarding.align.core import align, build_pair
from onboarding.graph.opgraph import Block, OpGraph


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
    blocks = [Block(path=f"layers.{i}", kind="attention.full", layer=i, class_name="_Attn")
              for i in range(3)]
    graph = OpGraph(model="shared_kv", capture="export", capture_note="", batch=1, seq=5,
                    dtype="float32", blocks=blocks, layer_pattern="", layer_kinds=[],
                    param_counts={}, total_flops=0)
    result = align(ref, cand, graph, (torch.randn(1, 5, 8),), isolate="always")
    for b in result.blocks:
        assert b.fwd.local is not None and b.bwd.local is not None, (b.path, b.fwd.message)
        assert "isolated replay failed" not in b.fwd.message + b.bwd.message, b.fwd.message
        assert b.fwd.verdict == "pass" and b.bwd.verdict == "pass", (b.path, b.bwd.message)
        assert b.fwd.local.rel_rms < 1e-6, (b.path, b.fwd.local.rel_rms)
