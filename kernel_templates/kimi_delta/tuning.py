"""Tuning hooks of KDA: the delta-rule family's dims and inputs, with a per-channel decay."""

from __future__ import annotations

from typing import Any

import torch

from onboarding.families import family_module

_base = family_module("gated_delta")
problem_dims = _base.problem_dims


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    return _base.delta_rule_inputs(dims, dtype, gen, per_channel=True)
