"""Patch binding of `mlp.dense` and `moe.shared_expert` blocks to the swiglu kernel:
``forward(x)`` -> ``down(swiglu(gate(x), up(x)))`` over the block's three linears, or over a fused
gate_up linear and down (the `fused` entry takes gate_up whole, in its own layout); which linear (or half) is which is left to calibration
(`onboarding.patching.core.calibrated`) where the widths cannot tell.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, calibrated, entry_function


def mlp_bindings(module: nn.Module, fn: Callable, fused_entry: bool = False) -> dict[str, Callable]:
    """Description -> call for each way the block's linears can feed ``fn``: the `split` entry
    ``fn(gate, up)``, or with ``fused_entry`` the `fused` one, ``fn(gate_up)``."""
    linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
    if len(linears) == 3:
        # Which linear is down, gate or up is left to calibration: widths can coincide.
        def bind(g: str, u: str, d: str):
            gate, up, down = linears[g], linears[u], linears[d]
            return lambda x, *args, **kw: down(fn(gate(x), up(x)))

        return {f"gate={g}, up={u}, down={d}": bind(g, u, d)
                for g, u, d in itertools.permutations(linears)
                if linears[d].in_features == linears[g].out_features == linears[u].out_features}
    if len(linears) == 2:
        a, b = linears.values()
        fused, down = (a, b) if a.out_features == 2 * b.in_features else (b, a)
        if fused.out_features != 2 * down.in_features:
            return {}

        if fused_entry:
            # the `fused` entry takes the one gate_up tensor in its own layout ([gate | up] halves
            # or interleaved): handed as the projection gives it, or with its halves swapped
            # for a projection that writes [up | gate]
            def fused_call(swap: bool):
                def call(x, *args, **kw):
                    gu = fused(x)
                    if swap:
                        g, u = gu.chunk(2, dim=-1)
                        gu = torch.cat((u, g), dim=-1)
                    return down(fn(gu))
                return call

            return {"gate_up as projected (gate first)": fused_call(False),
                    "gate_up halves swapped (up first)": fused_call(True)}

        def halves(first_gate: bool):
            def call(x, *args, **kw):
                g, u = fused(x).chunk(2, dim=-1)
                return down(fn(g, u) if first_gate else fn(u, g))
            return call

        return {"gate_up halves (gate first)": halves(True),
                "gate_up halves (up first)": halves(False)}
    return {}


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`)."""
    fused_entry = getattr(kernels[0], "VARIANT", None) == "fused"
    return calibrated(module, record, mlp_bindings(module, entry_function(kernels[0]), fused_entry))
