"""Where the gathered top-k kernel is worth running: the measured crossover in T against dense
attention, and the patching's choice by it.

Cost model (the bench module's docstring has the traffic argument): the gathered kernel reads K
selected key/value rows per query row and KV head group, so its time grows as T K; dense
attention computes every causal pair, T^2 / 2. For T <= K the selection is every causal key
and both compute the same function; past K they differ, and the dense time overtakes the sparse
one at some T* that grows with K (T* / K is what a layout's table row fixes).

Two dense baselines are timed beside ours (`measure`, on a GPU; docs/LOG.md has the command):

- ``masked_sdpa``: SDPA with a boolean mask keeping the selected keys, the block's own dense
  attention in transformers. Same function as ours: the patching falls back to it (the block's
  original attention call) below its crossover.
- ``causal_sdpa``: dense causal flash SDPA, the cheapest dense attention there is. A different
  function past T = K (it drops the top-k selection), so never a fallback; its crossover is the
  T from which the sparse kernel beats every dense attention, as issue 33 asks it measured.

`TABLE` (crossover.json beside this file) holds the measured times per (layout, query heads per
KV head, head dim, K) and the crossovers `fit` derives from them; `policy` reads it when a block
is patched and decides at each call by the call's shape (T, its group, K, with or without a
backward). Without a table row for the layout, or off a GPU (the table's times are the H200's),
the kernel serves every call, as before.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("crossover.json")
BASELINES = ("masked_sdpa", "causal_sdpa")
FALLBACK = "masked_sdpa"  # the dense attention the patching falls back to: the block's own
MODES = ("fwd", "fwdbwd")


def fit(ts: list[int], ours_ms: list[float], dense_ms: list[float]) -> dict[str, Any]:
    """The T from which ours is faster than the dense baseline, from times at increasing `ts`
    (None where a baseline was not timed): {"t": T*, "how": ...}.

    ``interpolated``: the ratio dense / ours crosses 1 between two measured T (log-linear in
    both); ``below``: ours already wins at the smallest measured T (T* = that T: below it the
    table says nothing); ``extrapolated``: dense wins at every measured T, T* from ours = a T + c
    (the two largest T) against dense = b T^2 (the largest T); ``never``: no such T (ours grows
    faster than quadratically); ``untimed``: no T with both timed (nothing to decide by)."""
    pts = [(t, o, d) for t, o, d in zip(ts, ours_ms, dense_ms, strict=True) if o and d]
    if not pts:
        return {"t": None, "how": "untimed"}
    if pts[0][2] >= pts[0][1]:
        return {"t": pts[0][0], "how": "below"}
    for (t0, o0, d0), (t1, o1, d1) in itertools.pairwise(pts):
        if d1 >= o1:  # log(d / o) from < 0 at t0 to >= 0 at t1
            r0, r1 = math.log(d0 / o0), math.log(d1 / o1)
            frac = -r0 / (r1 - r0)
            return {"t": round(math.exp(math.log(t0) + frac * (math.log(t1) - math.log(t0)))),
                    "how": "interpolated"}
    t1, o1, d1 = pts[-1]
    b = d1 / t1 ** 2
    if len(pts) >= 2:
        t0, o0, _ = pts[-2]
        a = (o1 - o0) / (t1 - t0)
        c = o1 - a * t1
    else:
        a, c = o1 / t1, 0.0
    disc = a * a + 4 * b * c
    if a <= 0 or disc < 0:
        return {"t": None, "how": "never"}
    return {"t": round((a + math.sqrt(disc)) / (2 * b)), "how": "extrapolated"}


def crossovers(row: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{mode: {baseline: fit}} of one table row (its "times": {mode: {impl: [ms per T]}})."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode, times in row["times"].items():
        ours = times.get("ours") or []
        out[mode] = {b: fit(row["ts"], ours, times.get(b) or [None] * len(ours))
                     for b in BASELINES if b in times}
    return out


def load_table(path: Path | None = None) -> dict[str, Any] | None:
    """The measured table, or None when there is none (then no call falls back to dense)."""
    path = path or TABLE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _row(table: dict[str, Any] | None, layout: str, group: int) -> dict[str, Any] | None:
    """The row of `layout` with `group` query heads per KV head, or None. No borrowing from
    another group: one gathered KV block serves the whole group, so the sparse kernel's cost per
    query head falls with the group while dense attention's does not, and a crossover moves by
    about the group's factor (the table holds measured rows only)."""
    return next((r for r in (table or {}).get("rows", []) if r["layout"] == layout and r["group"] == group), None)


def threshold(table: dict[str, Any] | None, layout: str, group: int, topk: int, backward: bool,
              baseline: str = FALLBACK) -> tuple[int | None, str]:
    """(T*, why): calls with T < T* should run the dense `baseline`, T >= T* the gathered kernel;
    T* None: always the kernel. T* scales with K from the row's (the model above)."""
    row = _row(table, layout, group)
    mode = "fwdbwd" if backward else "fwd"
    if row is None:
        return None, f"no measured crossover for the {layout} layout at {group} query heads per KV head"
    found = crossovers(row).get(mode, {}).get(baseline)
    if found is None or found["t"] is None:
        why = "not measured" if found is None or found["how"] == "untimed" else "the kernel never slower"
        return None, f"{layout} g{row['group']} {mode} vs {baseline}: {why}"
    t = int(found["t"] * topk / row["K"])
    return t, (f"{mode} vs {baseline}: crossover T {found['t']} at K {row['K']} ({found['how']}; "
               f"{row['layout']} layout, {row['group']} query heads per KV head, head dim {row['d']}), "
               f"x {topk}/{row['K']} for K {topk}")


def summary(layout: str, topk: int, table: dict[str, Any] | None = None) -> str:
    """One line for coverage: what the patching picks by shape for a block of `layout`."""
    table = load_table() if table is None else table
    rows = [r for r in (table or {}).get("rows", []) if r["layout"] == layout]
    if not rows:
        return f"by shape: no measured crossover for the {layout} layout, the kernel at every T"
    parts = []
    for r in sorted(rows, key=lambda r: r["group"]):
        found = [threshold(table, layout, r["group"], topk, bwd) for bwd in (False, True)]
        parts.append(f"g{r['group']}: " + " / ".join(
            str(t) if t is not None else "not measured" if "not measured" in why else "never" for t, why in found))
    return (f"by shape at each call (GPU): the block's own dense attention below T*, the kernel from "
            f"T* (fwd / fwd+bwd, K {topk}, measured on {table.get('device', '?')}: "
            + "; ".join(parts) + f"; other groups: the kernel at every T; {TABLE.name})")


def policy(layout: str, table: dict[str, Any] | None = None, devices: tuple[str, ...] = ("cuda",)
           ) -> Callable[..., str | None]:
    """prefer_dense(q, k, topk, backward) for the patching's intercept (SDPA layout q [B, H, T,
    D], k [B, HK, S, D]): the reason (the crossover's T) when the measured table puts the call
    below its crossover, else None (the kernel). It acts on tensors of `devices` only: the
    table's times are a GPU's, and off one (the CPU runs check numerics) the kernel serves every
    call; a test passes ``devices=("cpu",)`` with its own table to drive the choice on a CPU."""
    table = load_table() if table is None else table
    cache: dict[tuple[int, int, bool], int | None] = {}
    where = table.get("device", "?") if table else "?"

    def prefer_dense(q, k, topk: int, backward: bool) -> str | None:
        if table is None or q.device.type not in devices:
            return None
        group = max(1, q.shape[1] // max(1, k.shape[1]))
        key = (group, topk, backward)
        if key not in cache:
            cache[key] = threshold(table, layout, group, topk, backward)[0]
        t, T = cache[key], q.shape[-2]
        if t is None or T >= t:
            return None
        return (f"T {T} below the crossover T {t} ({'fwd+bwd' if backward else 'fwd'}, K {topk}, "
                f"{layout} g{group}, measured on {where}, {TABLE.name})")

    return prefer_dense


# ---- measuring (GPU) ------------------------------------------------------------------------

# (layout, query heads, KV heads, head dim): the bench's MHA shape and a GQA one (8 query heads
# per KV head, as Llama-style models), both D = 128, K = 2048
SWEEP_LAYOUTS = (("mha", 16, 16, 128), ("mha", 32, 4, 128))
SWEEP_TS = (16384, 32768, 65536, 131072)
SWEEP_K = 2048


def _time(fn: Callable[[], Any], reps: int) -> float:
    import torch

    fn()  # compile / warm
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return sorted(out)[len(out) // 2]


def measure(device: str = "cuda", layouts=SWEEP_LAYOUTS, ts=SWEEP_TS, K: int = SWEEP_K,
            budget_s: float = 120.0, step_cap_ms: float = 2500.0, log: Callable[[str], None] = print
            ) -> dict[str, Any]:
    """Times ours, masked and causal SDPA, forward and forward + backward (bf16, B = 1), at each
    T of each layout. A (layout, impl, mode) is left out from the T whose step would take over
    `step_cap_ms` (its last time grown as T for ours, T^2 for dense), or whose masks would not
    fit; nothing more starts after `budget_s`. The fits extrapolate from what was timed."""
    import torch

    from . import bench

    start = time.perf_counter()
    _, entry = bench.kernel("sparse_attention", "gathered", {})
    impls = {"ours": entry, **dict(zip(("masked_sdpa", "causal_sdpa"), _dense_fns(), strict=True))}
    rows = []
    for layout, H, HK, D in layouts:
        times = {m: {i: [] for i in impls} for m in MODES}
        last: dict[tuple[str, str], tuple[int, float]] = {}  # (impl, mode) -> (T, ms) last timed
        for T in ts:
            gen = torch.Generator(device=device).manual_seed(T)
            q, k, v = (torch.randn(1, T, h, D, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
                       for h in (H, HK, HK))
            args = (q, k, v, bench.stratified_indices(1, T, K, torch.device(device), gen))
            do = torch.randn(1, T, H, D, device=device, generator=gen, dtype=torch.bfloat16)
            for mode in MODES:
                for impl, fn in impls.items():
                    prev = last.get((impl, mode))
                    grown = prev[1] * (T / prev[0]) ** (1 if impl == "ours" else 2) if prev else 0.0
                    # the bool mask, SDPA's additive copy of it and (backward) its gradient's
                    mask_bytes = (3 + 2 * (mode == "fwdbwd")) * T * T
                    ms = None
                    if not (grown > step_cap_ms or time.perf_counter() - start > budget_s
                            or (impl == "masked_sdpa" and mask_bytes > bench.MEM_BUDGET)):
                        ms = _time_step(fn, args, do if impl == "ours" else do.transpose(1, 2), mode,
                                        reps=2 if T >= 65536 else 3)
                        if ms is not None:
                            last[(impl, mode)] = (T, ms)
                    times[mode][impl].append(ms)
                    log(f"{layout} H{H}/HK{HK} D{D} T{T} {mode} {impl}: " + ("-" if ms is None else f"{ms:.3f} ms"))
            del q, k, v, args, do
            torch.cuda.empty_cache()
        row = {"layout": layout, "H": H, "HK": HK, "group": H // HK, "d": D, "K": K, "ts": list(ts),
               "times": times}
        row["crossover"] = crossovers(row)
        rows.append(row)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}


def _time_step(fn: Callable, args: tuple, do, mode: str, reps: int) -> float | None:
    """Median ms of fn(*args) (fwd: under no_grad; fwdbwd: with the gradients of q, k, v for
    `do`); None when it runs out of memory."""
    import torch

    def fwd():
        with torch.no_grad():
            return fn(*args)

    def fwdbwd():
        return torch.autograd.grad(fn(*args), args[:3], do)

    try:
        return _time(fwd if mode == "fwd" else fwdbwd, reps)
    except torch.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()


def _dense_fns():
    """(masked, causal): SDPA on our [B, T, H, D] layout, as the bench's dense baselines."""
    import torch
    from torch.nn import functional as F

    def causal(q, k, v, _idx):  # the selection unused: every causal key
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=k.shape[2] != q.shape[2])

    def masked(q, k, v, idx):
        T, H = q.shape[1], q.shape[2]
        i = idx.long()
        keep = torch.zeros(i.shape[0], T, T + 1, dtype=torch.bool, device=q.device)
        keep = keep.scatter_(-1, torch.where(i >= 0, i, T), True)[..., :T]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        if kt.shape[1] != H:  # as transformers' repeat_kv: SDPA's fused GQA paths take no mask
            kt = kt.repeat_interleave(H // kt.shape[1], 1)
            vt = vt.repeat_interleave(H // vt.shape[1], 1)
        return F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=keep[:, None])

    return masked, causal


def main(argv: list[str] | None = None) -> int:
    """`python -c "...crossover.main(['OUT.json', BUDGET_S, GROUPS])"`: measure the SWEEP_LAYOUTS
    rows (GROUPS: comma-separated query heads per KV head to keep, e.g. "8"; default all) within
    BUDGET_S seconds and write the table to OUT.json (rows to merge into crossover.json)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else TABLE
    budget = float(args[1]) if len(args) > 1 else 120.0
    groups = {int(g) for g in args[2].split(",")} if len(args) > 2 else None
    layouts = [lay for lay in SWEEP_LAYOUTS if groups is None or lay[1] // lay[2] in groups]
    table = measure(layouts=layouts, budget_s=budget)
    out.write_text(json.dumps(table, indent=1) + "\n")
    for row in table["rows"]:
        for mode, fits in row["crossover"].items():
            for b, f in fits.items():
                print(f"crossover {row['layout']} g{row['group']} {mode} vs {b}: T {f['t']} ({f['how']})")
    return 0
