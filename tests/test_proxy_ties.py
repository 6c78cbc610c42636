"""A tie between config fields that the model's code makes and the proxy's shrink broke
(`onboarding.load._proxy_ties`): found by running the proxy, the field set to the width its
linear is given, kept only when the proxy then runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig

from onboarding.load._proxy_ties import keep_ties


class _Shuffled(nn.Module):
    """An MLP of intermediate_size, then 2 x 2 neighbours merged into one 4 x hidden-wide
    feature that a linear of intermediate_size inputs reads (Llama 4's pixel-shuffle adapter:
    the tie intermediate_size = 4 x hidden is in the code, not in the config)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.adapter = nn.Sequential(nn.Linear(config.intermediate_size, config.out_dim))

    def forward(self, x):
        x = x + self.fc2(self.fc1(x))
        b, n, d = x.shape
        return self.adapter(x.reshape(b, n // 4, 4 * d))


def _run(model, cfg):
    with torch.no_grad():
        model(torch.randn(1, 8, cfg.hidden_size))


def test_a_broken_width_tie_is_kept():
    full = PretrainedConfig(hidden_size=16, intermediate_size=64, out_dim=8, image_size=16)
    proxy = copy.deepcopy(full)
    proxy.hidden_size, proxy.intermediate_size = 8, 16  # the FFN width capped on its own
    with pytest.raises(RuntimeError):
        _run(_Shuffled(proxy), proxy)
    cfg, notes = keep_ties(full, proxy, _Shuffled, _run)
    assert cfg.intermediate_size == 32 and cfg.hidden_size == 8 and cfg.image_size == 16
    assert proxy.intermediate_size == 16  # the caller's config is left as it was
    assert len(notes) == 1 and "intermediate_size 16 -> 32" in notes[0] \
        and "adapter.0" in notes[0], notes
    _run(_Shuffled(cfg), cfg)


def test_no_repair_for_other_failures_or_unshrunk_fields():
    full = PretrainedConfig(hidden_size=16, intermediate_size=64, out_dim=8)
    # a field the shrink left as it was is no tie it broke: nothing to change
    same = copy.deepcopy(full)
    same.hidden_size = 8
    same.intermediate_size = 64
    assert keep_ties(full, same, _Shuffled, _run) is None

    class Fails(_Shuffled):
        def forward(self, x):
            raise ValueError("not a width")

    proxy = copy.deepcopy(full)
    proxy.hidden_size, proxy.intermediate_size = 8, 16
    assert keep_ties(full, proxy, Fails, _run) is None
    # a proxy that runs needs no repair
    fine = copy.deepcopy(full)
    fine.hidden_size, fine.intermediate_size = 8, 32
    assert keep_ties(full, fine, _Shuffled, _run) is None
