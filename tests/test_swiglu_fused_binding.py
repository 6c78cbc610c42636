"""swiglu's binding of a fused gate_up MLP calls the `fused` entry with the one gate_up tensor
(``swiglu_fused(gate_up)``), as projected or with its halves swapped: it called it as the `split`
entry, ``fn(gate, up)``, so every fused block coverage gave the template (MiniMax M3's clamped
shared experts: alpha 1.702, up + 1, gate first) was rejected on calibration ("gate_up halves (up
first): TypeError: swiglu_fused() takes 1 positional argument but 2 were given")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from onboarding.families import family_module
from onboarding.generate.templating import load_module, render_to
from onboarding.graph.opgraph import Block
from onboarding.patching.core import patch_model

D, F, LIMIT = 16, 24, 7.0


class FusedMLP(nn.Module):
    """A clamped SwiGLU over one gate_up projection (MiniMax M3's dense MLP / shared experts)."""

    def __init__(self, up_first: bool):
        super().__init__()
        self.up_first = up_first
        self.gate_up_proj = nn.Linear(D, 2 * F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)

    def forward(self, x):
        a, b = self.gate_up_proj(x).chunk(2, dim=-1)
        gate, up = (b, a) if self.up_first else (a, b)
        gate = gate.clamp(max=LIMIT)
        up = up.clamp(min=-LIMIT, max=LIMIT)
        return self.down_proj((up + 1.0) * (gate * torch.sigmoid(gate * 1.702)))


@pytest.mark.parametrize("up_first", [False, True], ids=["gate-first", "up-first"])
def test_fused_gate_up_mlp_is_patched(tmp_path, up_first):
    block = Block(path="mlp", kind="moe.shared_expert", layer=0, class_name="Anything",
                  params={"gate_up_proj.weight": [2 * F, D], "down_proj.weight": [D, F]},
                  attrs={"activation": "silu", "gated": True, "clamp": LIMIT,
                         "clamp_style": "pre_act", "alpha": 1.702, "up_offset": 1.0})
    fam = family_module("swiglu")
    m = fam.match(block)
    assert m["variant"] == "fused", m
    kmod = load_module(render_to(tmp_path, fam.NAME, m["variant"], m["params"], overwrite=True))
    model = nn.Module()
    model.mlp = FusedMLP(up_first)
    torch.manual_seed(0)
    x = 3 * torch.randn(2, 5, D)
    with torch.no_grad():
        ref = model.mlp(x)
        with patch_model(model, SimpleNamespace(blocks=[block]), {("mlp", "swiglu"): kmod}) as patches:
            model.mlp(x)
            (rec,) = patches.records
            assert rec.status == "active", rec
            assert ("up first" in rec.binding) == up_first, rec.binding
            torch.testing.assert_close(model.mlp(x), ref, rtol=1e-5, atol=1e-5)
