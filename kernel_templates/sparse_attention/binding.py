"""Patch binding of `sparse_attention.topk` blocks to the family's gathered-attention kernel, by the
top-k + attention intercept (`onboarding.patching.sparse`): the dense masked attention after the
block's top-k (SDPA, or the eager q k^T -> softmax -> v chain) -> the gathered kernel over the
selected keys.

Two layouts. ``mha``: q/k/v as SDPA sees them (GQA kept). ``mla`` (absorbed, one shared latent as
DeepSeek-V3.2 runs DSA): the block expands a latent ``c`` [B, S, r] per head with one projection
``W`` [H (n + d_v), r]; with ``W_k``/``W_v`` its per-head key/value rows, q.k = (W_k^T q_n).c +
q_r.k_r, so the kernel runs on q' = [W_k^T q_n, q_r], kv = [c, k_r] (d_qk = r + rope, d_v = r)
and the output goes back through ``W_v``. Which rows of W are keys and where the rope part sits
are left to calibration (on the first call, against the original attention call), as every
binding's open choices are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from types import ModuleType

import torch
from torch import nn

from onboarding.patching.sparse import patch_sparse_block
from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord, entry_function, run_probed, swap_forward

from . import crossover


def _sink(sinks: torch.Tensor | None) -> torch.Tensor | None:
    # the kernel reads the per-head sink logits as fp32
    return None if sinks is None else sinks.float()


def mha_attend(fn: Callable) -> Callable:
    """SDPA-layout q [B, H, T, D], k/v [B, HK, S, D] -> the gathered kernel (GQA), back to SDPA's;
    ``sinks`` [H]: the per-head logits of a sink column the block's softmax read (`SparseIntercept`)."""
    def attend(q, k, v, idx, scale, _linears, sinks=None):
        o = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), idx, _sink(sinks), scale)
        return o.transpose(1, 2)
    return attend


def mla_attend(fn: Callable, d_latent: int, block: nn.Module, key_rows_first: bool,
               nope_first: bool) -> Callable:
    """Absorbed MLA over the latent that the block's last width-``d_latent`` projection expanded."""
    def attend(q, k, v, idx, scale, linears, sinks=None):
        B, H, T, D_QK = q.shape
        S, D_V = k.shape[2], v.shape[-1]
        found = [(c, W, b) for c, W, b in linears
                 if W is not None and W.dim() == 2 and W.shape[0] % H == 0
                 and W.shape[0] // H > D_V and c.numel() == B * S * d_latent]
        if not found or k.shape[1] != H:
            raise ValueError("no latent expansion [H * (d_nope + d_v), r] feeding this attention")
        c, W, bias = found[-1]
        # looked up per call: FSDP2 swaps the block's parameters between forwards
        _check_plain_projection(W, bias, {id(p): n for n, p in block.named_parameters()},
                                dict(block.named_modules()))
        width = W.shape[0] // H
        nope, rope = width - D_V, D_QK - (width - D_V)
        if rope <= 0:
            raise ValueError(f"q/k width {D_QK} leaves no rope part after {nope} latent columns")
        Wr = W.view(H, width, d_latent)
        Wk, Wv = (Wr[:, :nope], Wr[:, nope:]) if key_rows_first else (Wr[:, D_V:], Wr[:, :D_V])
        qn, qr = (q[..., :nope], q[..., nope:]) if nope_first else (q[..., rope:], q[..., :rope])
        kr = k[:, 0, :, nope:] if nope_first else k[:, 0, :, :rope]  # shared by every head
        q_abs = torch.cat([torch.einsum("bhtn,hnr->bthr", qn, Wk.to(q.dtype)), qr.transpose(1, 2)], -1)
        kv = torch.cat([c.reshape(B, S, d_latent).to(q.dtype), kr.to(q.dtype)], -1)[:, :, None]
        o = fn(q_abs, kv, idx, _sink(sinks), scale)  # [B, T, H, r]
        return torch.einsum("bthr,hvr->bhtv", o, Wv.to(o.dtype))

    return attend


def _check_plain_projection(W, bias, owned: dict, modules: dict) -> None:
    # The absorbed form reuses W's weight alone: a bias, or anything that adds to that
    # projection's output (a LoRA adapter beside the base layer), would be silently lost.
    if bias is not None:
        raise ValueError("the latent expansion has a bias; the absorbed form would drop it")
    name = owned.get(id(W))
    if name is None:
        raise ValueError("the latent expansion weight is not a parameter of the block")
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    if "." in owner:
        parent = modules[owner.rsplit(".", 1)[0]]
        mine = {id(p) for p in modules[owner].parameters()}
        if any(id(p) not in mine for p in parent.parameters()):
            raise ValueError(f"{owner} is wrapped by a module with its own parameters (an adapter)")


def sparse_bindings(block_module: nn.Module, gathered: ModuleType
                    ) -> dict[str, tuple[Callable, int | None, str]]:
    """Candidate bindings: name -> (attend, latent width whose projections to record, index
    source: "topk" (the recorded selection) or "mask" (every key the attention's mask keeps)).

    The selection stays the model's own top-k. Swapping in the indexer module's selection kernel
    was tried and is not offered: torch.topk breaks ties in no specified order, ReLU indexer
    scores tie (at 0) often, and an equally valid but different selection changes the output,
    so calibration against the original rejected it on a tiny DeepSeek-V3.2 proxy at T=32.
    """
    fn = entry_function(gathered)
    params = getattr(gathered, "PARAMS", {})
    out = {}
    # The top-k set first (its masks are read at K positions per row); the mask's kept keys
    # for blocks whose mask adds keys to the selection. DeepSeek's MLA order first (key rows
    # first in the expansion, rope last): calibration stops at the first match.
    for source, what in (("topk", "the top-k keys"), ("mask", "the mask's kept keys")):
        if params.get("layout") != "mla":
            out[f"gathered over {what} (q/k/v as the model has them)"] = (mha_attend(fn), None, source)
            continue
        r = int(params["d_v"])
        for rows_first in (True, False):
            for nope_first in (True, False):
                name = (f"absorbed MLA over {what} (latent {r}, {'keys' if rows_first else 'values'} "
                        f"first in the expansion, {'rope last' if nope_first else 'rope first'} in q/k)")
                out[name] = (mla_attend(fn, r, block_module, rows_first, nope_first), r, source)
    return out


def bind(block: Block, module: nn.Module, kernels: list[ModuleType], record: PatchRecord,
         model: nn.Module) -> Callable[[], None] | None:
    """The `binding` hook (`onboarding.patching.core.patch_model`): the gathered module among the
    block's kernels of this family (found by its VARIANT: another variant, the indexer, may hold
    the family's first key), bound inside the block's forward."""
    gathered = next((m for m in kernels if getattr(m, "VARIANT", "") == "gathered"), None)
    if gathered is None:
        record.status, record.detail = "rejected", "no gathered-attention kernel for this block"
        return None
    layout = getattr(gathered, "PARAMS", {}).get("layout", "mha")
    # by measured shape: calls below the crossover run the block's own (dense, same-function)
    # attention, the others the kernel (crossover.py; never off a GPU)
    undo = patch_sparse_block(module, sparse_bindings(module, gathered), record,
                              prefer_dense=crossover.policy(layout))
    record.binding = "calibrating: top-k + attention intercept"
    return undo


NO_ATTENTION = "no attention (SDPA, or q @ k^T -> softmax -> @ v) over the top-k positions"


class SparseProbe:
    """The family's `probe` (`onboarding.patching.probe.probe_core_calls`): what `bind`'s
    intercept finds in each block, recorded by one run of the model with the intercept in place
    and no kernel: ``{"attention": [{"q", "k", "v": shapes, "latent": [[out, in] of each
    projection of the latent width before it], "sink": True when the softmax read a per-head
    sink column}]}``, one entry per attention call over the top-k positions (none: the intercept finds
    nothing to replace, e.g. a sink column that is not one logit per head; then "declined" holds
    the intercept's reasons, if it gave any)."""

    what = "sparse-attention"

    def record_calls(self, model: nn.Module, targets: list[tuple[Block, nn.Module]],
                     run: Callable[[], Any]) -> list[dict[str, Any]]:
        from onboarding.patching.sparse import SparseIntercept

        found: list[dict[str, Any]] = [{"attention": []} for _ in targets]
        undos = []

        def probing(module: nn.Module, seen: list, declined: list, latent: int | None
                    ) -> Callable[[], None]:
            def attend(q, k, v, idx, scale, linears, sinks=None):
                seen.append({"q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
                             "latent": [list(w.shape) for _, w, _ in linears
                                        if w is not None and w.dim() == 2],
                             **({"sink": True} if sinks is not None else {})})
                raise ValueError("probe: recorded")  # the block's own attention runs

            original = module.forward

            def forward(*args, **kwargs):
                mode = SparseIntercept({"probe": (attend, latent, "topk")})
                with mode:
                    out = original(*args, **kwargs)
                for why in mode.declined:
                    if why not in declined:
                        declined.append(why)
                return out

            return swap_forward(module, forward)

        for (block, module), f in zip(targets, found):
            latent = block.attrs.get("kv_latent") if block.attrs.get("layout") == "mla" else None
            latent = latent[0] if isinstance(latent, (list, tuple)) and latent else latent
            undos.append(probing(module, f["attention"], f.setdefault("declined", []),
                                 latent if isinstance(latent, int) else None))
        run_probed(undos, run)
        for f in found:
            if not f["declined"]:
                del f["declined"]
        return found


SPARSE = SparseProbe()


def probe_refusal(found: dict[str, Any], d_v: int | None) -> str | None:
    """Why `bind` would leave the block unpatched, read off what `SPARSE` recorded (``found``),
    or None: no attention over the top-k positions for the intercept to replace; or, for the
    absorbed MLA layout (latent width ``d_v``), q/k no wider than the latent part of every
    expansion (no rope part: the kernel's shared KV is [latent | rope], D_QK > D_V)."""
    calls = found.get("attention") or []
    if not calls:
        declined = found.get("declined") or []
        return NO_ATTENTION + (f" ({'; '.join(declined)})" if declined else "")
    if d_v is None:
        return None
    call = calls[0]
    heads, d_qk, width_v = call["q"][1], call["q"][-1], call["v"][-1]
    ropes = [d_qk - (out // heads - width_v) for out, inp in call.get("latent") or []
             if inp == d_v and out % heads == 0 and out // heads > width_v]
    if ropes and max(ropes) <= 0:
        return (f"q/k width {d_qk} leaves no rope part after {d_qk - max(ropes)} latent columns: "
                f"the absorbed MLA kernel takes a shared KV of [latent | rope] (D_QK > D_V = {d_v}); "
                "this layer's attention has no rotary part")
    return None
