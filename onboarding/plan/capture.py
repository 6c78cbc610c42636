"""The op graph the plan reads: the tiny proxy captured at a short length, and again longer where
that length hid part of an attention block.

The plan captures the proxy at T = 64 tokens (a second or two on the CPU). A block whose structure
depends on the length can take another branch at the full size: an attention that pools windows of
r tokens into compressed keys pools nothing while T < r, so its capture reads as plain attention
and the plan would cost it so. What gives it away is structural: parameters of the attention
block (its submodules' included) that no op of the forward read (the pooling's position bias and
norm, say; a parameter handed to a functional call, as a conv weight often is, was read). When
some attention block has such idle parameters, the proxy is captured again at twice the length
until none is idle (at most `MAX_SEQ` tokens), then once more at twice that (a length-gated
branch is seen at least twice, not at its threshold), and the blocks at and under those attention
blocks' paths come from that capture (each with its length in the attr ``capture_seq``);
everything else, launch counts included, stays the short capture's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from onboarding.graph.opgraph import Block, OpGraph
from onboarding.modpath import inside
from onboarding.plan.shapes import CAPTURE_SEQ

if TYPE_CHECKING:
    from onboarding.graph.parse import ModelInfo

SHORT_SEQ = 64  # the plan's capture length (`onboard plan`)
MAX_SEQ = 1024  # the longest re-capture (about 10x the short one's time on the tiny proxy)
MIXER_PREFIXES = ("attention.", "sparse_attention.", "linear_attention.")


class _ParamReads(TorchFunctionMode):
    """Records the id of every parameter a torch function gets (directly or in a list) while
    ``active`` (the model's forward: the capture around it reads every parameter's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[int] = set()
        self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            for a in (*args, *kwargs.values()):
                for x in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(x, nn.Parameter):
                        self.read.add(id(x))
        return func(*args, **kwargs)


def idle_parameters(model: nn.Module, graph: OpGraph, read: set[int]) -> dict[str, list[str]]:
    """Attention-kind block path -> the parameters under it that no op read (``read``: their
    ids, `_ParamReads`)."""
    out: dict[str, list[str]] = {}
    for b in graph.blocks:
        if not (b.path and b.kind.startswith(MIXER_PREFIXES)):
            continue
        try:
            root = model.get_submodule(b.path)
        except AttributeError:
            continue
        idle = [f"{b.path}.{n}" for n, p in root.named_parameters() if id(p) not in read]
        if idle:
            out[b.path] = idle
    return out


def _capture(info: ModelInfo, model: nn.Module, seq: int) -> tuple[OpGraph, set[int]]:
    """The op graph of ``model`` at ``seq`` tokens, and the ids of the parameters its ops read."""
    from onboarding.graph.parse import parse_stage

    mode = _ParamReads()

    def on(mod, args):
        mode.active = True

    def off(mod, args, out):
        mode.active = False

    hooks = [model.register_forward_pre_hook(on), model.register_forward_hook(off)]
    try:
        with mode:
            graph = parse_stage(info, seq=seq, try_export=False, model=model)
    finally:
        for h in hooks:
            h.remove()
    return graph, mode.read


def merge(short: OpGraph, long: OpGraph, roots: list[str]) -> OpGraph:
    """``short`` with the blocks at and under each of ``roots`` taken from ``long``, in place."""
    from onboarding.graph.parse import layer_pattern

    blocks: list[Block] = []
    done: set[str] = set()
    for b in short.blocks:
        root = next((r for r in roots if b.path and inside(b.path, r)), None)
        if root is None:
            blocks.append(b)
        elif root not in done:
            done.add(root)
            for x in long.blocks:
                if x.path and inside(x.path, root):
                    x.attrs[CAPTURE_SEQ] = long.seq  # its shapes' T (`shapes._width`)
                    blocks.append(x)
    pattern, kinds = layer_pattern(blocks)
    return OpGraph(model=short.model, capture=short.capture, capture_note=short.capture_note,
                   batch=short.batch, seq=short.seq, dtype=short.dtype, blocks=blocks,
                   layer_pattern=pattern, layer_kinds=kinds, param_counts=short.param_counts,
                   total_flops=sum(b.flops for b in blocks), sliced_tables=short.sliced_tables)


def plan_graph(info: ModelInfo, *, seq: int = SHORT_SEQ, max_seq: int = MAX_SEQ
               ) -> tuple[OpGraph, list[str]]:
    """The op graph of ``info``'s model's tiny proxy for the plan (module docstring; ``info``
    itself when its proxy is the tiny one), and what the plan should say about a longer capture
    (no line when none was needed)."""
    from onboarding.graph.parse import load_shipped_weights, load_stage

    if info.proxy_size != "tiny":
        info = load_stage(info.loaded, "tiny")

    model = info.loaded.build(info.proxy_config, device="cpu", seed=0).to(torch.float32).eval()
    load_shipped_weights(model, info)
    short, read = _capture(info, model, seq)
    idle = idle_parameters(model, short, read)
    if not idle:
        return short, []
    t, ran_at, long = seq, None, None
    try:
        while t < max_seq:
            t *= 2
            long, read = _capture(info, model, t)
            if not set(idle) & set(idle_parameters(model, long, read)):
                ran_at = t
                break
        if ran_at is not None and 2 * ran_at <= max_seq:
            t = 2 * ran_at
            long, _ = _capture(info, model, t)
    except Exception as exc:  # noqa: BLE001 - the short capture stands; the plan says why
        return short, [f"attention blocks with parameters idle at T={seq} ({', '.join(idle)}): "
                       f"the capture at T={t} failed ({type(exc).__name__}: {exc}); costed "
                       f"as captured at T={seq}"]
    first = [mods[0] for mods in idle.values()]
    if ran_at is None:
        return short, [f"attention blocks with parameters idle at T={seq} and still at "
                       f"T={max_seq} (e.g. {', '.join(first[:3])}): costed as captured at "
                       f"T={seq}"]
    merged = merge(short, long, list(idle))
    kinds = {b.path: b.kind for b in merged.blocks}
    before = {b.path: b.kind for b in short.blocks}
    changed = sorted({f"{before[r]} -> {kinds.get(r)}" for r in idle})
    return merged, [f"{len(idle)} attention blocks had parameters that no op of the T={seq} "
                    f"capture read (e.g. {first[0]}): they were captured again at T={t} "
                    f"(all ran from T={ran_at}): " + ", ".join(changed)]
