"""Many blocks of one class served by Inductor: each is compiled with its own ladder backend,
and every one is a new entry in dynamo's cache of the class's forward."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def test_more_blocks_of_one_class_than_dynamos_recompile_limit(monkeypatch):
    """hy_v4_vl: align swapped in Inductor for every layer's block of one class (one backend
    each) after generate's checks had compiled it: past dynamo's recompile limit (8 entries of
    one code object, different backends) the run ended in FailOnRecompileLimitHit, an internal
    error (onboard run hf:hy_v4_vl --llm off: rc 1)."""
    from onboarding.generate import inductor

    # dynamo alone (no Inductor build): the graph module runs as captured
    monkeypatch.setattr(inductor.LadderBackend, "compile_graph",
                        lambda self, gm, inputs, rung: gm.forward)
    torch._dynamo.reset()
    try:
        limit = torch._dynamo.config.recompile_limit
        blocks = [Block() for _ in range(limit + 4)]
        x = torch.randn(2, 8)
        for b in blocks:
            fn = inductor.compiled(b)
            torch.testing.assert_close(fn(x), b(x))
            assert fn.finish()["graphs"] >= 0
    finally:
        torch._dynamo.reset()
