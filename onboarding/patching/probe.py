"""What the call-swapping bindings would find in each block, recorded in the op graph at parse.

A family whose binding swaps a function the block hands its core to declares the swap's
interface (`FamilySpec.probe`). For each block its `match` accepts, one forward of the proxy
(the capture's inputs, no grad) records what a swap by that interface would find: the
reachable functions that fit, and the first core call of each with its arguments described
(`onboarding.patching.callswap.record_core_calls`). It lands in ``block.attrs["core_calls"]``
keyed by the interface's name, and the family's `refusal` runs the binding's own acceptance
test on it, so coverage says what patching will do. A probe may record by its own means
(``record_calls``: rope's binding swaps functions in the modules beside its block, not in it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from onboarding.formatting import clip
from onboarding.graph.opgraph import Block


def probe_core_calls(model: nn.Module, blocks: list[Block], run: Callable[[], Any]) -> str:
    """Record ``attrs["core_calls"]`` on the blocks of ``model`` that a family with a `probe`
    matches (one ``run`` of the model for all of them); returns a note when the run failed
    (the blocks then stay unprobed, and their matches stand), else ""."""
    from onboarding.families import families
    from onboarding.patching.callswap import record_core_calls

    modules = dict(model.named_modules())
    targets: list[tuple[Block, nn.Module, Any]] = []
    for b in blocks:
        module = modules.get(b.path)
        if module is None:
            continue
        seen: set[str] = set()
        for spec in families().values():
            iface = spec.probe
            if iface is None or spec.match is None or iface.what in seen:
                continue
            if spec.match(b) is not None:
                seen.add(iface.what)
                targets.append((b, module, iface))
    # a probe with its own recorder (`record_calls(model, [(block, module)], run) -> [found]`:
    # rope's, whose swaps sit in the modules beside the block) runs the model once for its blocks
    own: dict[int, list[tuple[Block, nn.Module, Any]]] = {}
    for t in targets:
        if callable(getattr(t[2], "record_calls", None)):
            own.setdefault(id(t[2]), []).append(t)
    note = ""
    for group in own.values():
        iface = group[0][2]
        try:
            found = iface.record_calls(model, [(b, m) for b, m, _ in group], run)
        except Exception as exc:  # as below: its blocks stay unprobed (the others are probed)
            note = note or clip(f"core-call probe not recorded: {type(exc).__name__}: {exc}", 300)
            continue
        for (b, _, _), f in zip(group, found):
            b.attrs.setdefault("core_calls", {})[iface.what] = f
    # one interface per module: the probes wrap the module's forward (a second interface on the
    # same module waits for the next run)
    pending = [t for t in targets if not callable(getattr(t[2], "record_calls", None))]
    while pending:
        taken: set[int] = set()
        batch, rest = [], []
        for t in pending:
            (batch if id(t[1]) not in taken else rest).append(t)
            taken.add(id(t[1]))
        try:
            found = record_core_calls([(m, iface) for _, m, iface in batch], run)
        except Exception as exc:  # the model's own forward failing here leaves matches as they were
            return clip(f"core-call probe not recorded: {type(exc).__name__}: {exc}", 300)
        for (b, _, iface), f in zip(batch, found):
            b.attrs.setdefault("core_calls", {})[iface.what] = f
        pending = rest
    return note
