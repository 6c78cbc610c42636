"""Top-k sparse attention's benchmark cases (the spec's `bench_cases`): issue 7's shapes.

T = 8k, 16k, 32k, 64k with K = 2048 and B = 1, in two layouts:

- ``mha``: H = 16 query heads, one KV head each, D = 128 (the issue's anchor shape);
- ``mla``: the absorbed MLA layout DeepSeek-V3.2 runs DSA in: one shared latent kv
  [B, S, 1, 576] whose first 512 columns are the values, H = 128 query heads of width 576.

Why the MHA layout cannot beat masked SDPA by 3x (issue 7's goal), and MLA can: with one KV
head per query head, the program of each (token, head) must read its own K = 2048 gathered key
and value rows: T * H * K * (D_QK + D_V) * 2 bytes = 8192 * 16 * 2048 * 256 * 2 = 137 GB at
T = 8192, 32 ms at the H200's measured 4.24 TB/s copy rate (the backward re-reads it and adds
its dk/dv scatter-adds). Dense masked SDPA computes all T^2 pairs, 2 * 16 * 8192^2 * 256 =
5.5 * 10^11 FLOPs (0.8 ms at ~700 TFLOP/s; 2.11 ms measured with its mask), reading each K/V
row once per tile of ~128 queries that share it from shared memory. Gathering per query turns a
compute-bound problem into a memory-bound one, so at this K / T ratio (1/4) the sparse kernel
stays ~15x slower whatever its code; it wins only where T >> K (its time is linear in T, the
dense one quadratic: 281 vs 134 ms measured at T = 64k, so they cross near T = 128k).
In the shared-KV layouts (GQA groups, the MLA latent) one gathered block serves a whole block
of query heads (the M dimension of the dot):
at 64 heads per program MLA reads T * 2 * K * 576 * 2 = 38.7 GB at T = 8192 (9 ms, and the
two head blocks of a query run back to back so the second read mostly hits L2) for
2 * 128 * 8192 * 2048 * 1088 = 4.7 * 10^12 FLOPs (7 ms at 700 TFLOP/s): there the bf16
tensor-core dots decide, and the dense baseline pays T^2 for 128 heads of width 576.

Per (layout, T) two cases, ``...-fwd`` (forward under `torch.no_grad`) and ``...-fwdbwd``
(forward + backward of the output), so that each case's ``flops`` is the right one for all its
rows: the *useful* work of the sparse attention, 2 (D_QK + D_V) per (query, selected key, head)
forward and 8 D_QK + 6 D_V with the backward (recomputed scores, dP, dV, dQ, dK), summed over
the min(K, t + 1) keys row t really has. Dense baselines therefore show *effective* TFLOP/s.

Impls: ``ours`` (the gathered kernel); ``masked_sdpa`` (what transformers does: SDPA with a
boolean mask that keeps the selected keys, KV repeated to every head as transformers does;
left out where the masks would not fit) and ``causal_sdpa`` (dense causal SDPA, flash where it
applies: the cost of not being sparse at all). Both dense baselines are left out for MLA at
T > DENSE_MLA_MAX_T (no flash kernel takes head dim 576: seconds per step and [B, H, T, T]
scores), and the MLA forward + backward at T > MLA_FWDBWD_MAX_T (the whole family must run in
one 10-minute device command; 8k-32k already show its linear growth in T); each case's note
says what was left out and why. The selections are drawn stratified: row t >= K takes one
random position in each of K equal slices of [0, t] (distinct, spread over the whole row, the
diagonal not forced).

``indexer-T...`` cases time the DSA indexer + causal top-k (DeepSeek-V3.2: 64 index heads of
width 128, fp32 scores): ``ours`` (query-chunked scores + selection kernel), ``eager`` (the
transformers formula: [B, T, H, T] fp32 scores, relu, head-weighted sum, torch.topk; only where
it fits) and ``torch_topk`` (torch.topk on our scores, the selection alone).

``check``: the bf16 kernel vs the fp32 dense masked reference at T = CHECK_T and at most
CHECK_H heads (same D, K and layout; the reference materialises [B, H, T, T]): output and every
input gradient, relative RMS; ``ok`` when within O_TOL / GRAD_TOL. Indexer: the selected set
equals torch.topk's on fp32 scores (fraction of rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from onboarding.bench.cases import N_SETS, config_sweep, fwd_bwd, fwd_only, fwd_sweep, kernel, shared_inputs
from onboarding.bench.harness import BenchCase, Step
from onboarding.families import NightlySpec
from onboarding.testing.tolerance import rel_rms

TS = (8192, 16384, 32768, 65536)
TOPK = 2048
LAYOUTS = {  # name: (H, HK, D_QK, D_V)
    "mha": (16, 16, 128, 128),
    "mla": (128, 1, 576, 512),
}
INDEXER = (64, 128)  # DeepSeek-V3.2 index heads, index head dim
# Dense MLA baselines (128 heads of 576 over all T^2 pairs, no flash kernel for that head dim)
# take seconds per step beyond this; the harness runs each impl >= 10 times, and a device
# command gets 10 minutes.
DENSE_MLA_MAX_T = 8192
MLA_FWDBWD_MAX_T = 32768
MEM_BUDGET = 100 * 2**30  # of the H200's 139 GiB: what a baseline may need before it is left out
CHECK_T, CHECK_H = 4096, 32
O_TOL, GRAD_TOL = 5e-3, 1e-2  # bf16 (16-bit dots) vs fp32 relative RMS: the acceptance bar


def useful_pairs(T: int, K: int) -> int:
    """sum over rows t of min(K, t + 1): (query, key) pairs a causal top-K attention computes."""
    k = min(K, T)
    return k * (k + 1) // 2 + (T - k) * k


def stratified_indices(B: int, T: int, K: int, device: torch.device, gen: torch.Generator
                       ) -> torch.Tensor:
    """int32 [B, T, min(K, T)]: rows t < K keep 0..t (then -1), later rows one random position
    per slice of [0, t] cut into K equal slices (so the K positions are distinct)."""
    k = min(K, T)
    t = torch.arange(T, device=device).view(1, T, 1)
    j = torch.arange(k, device=device).view(1, 1, k)
    u = torch.rand(B, T, k, device=device, generator=gen)
    lo, hi = j * (t + 1) // k, (j + 1) * (t + 1) // k  # slice j: [lo, hi), hi > lo when t >= k - 1
    spread = lo + (u * (hi - lo)).long()
    early = torch.where(j <= t, j, -1)
    return torch.where(t >= k, spread, early).to(torch.int32)


def _gathered(layout: str) -> Callable:
    H, HK, D_QK, D_V = LAYOUTS[layout]
    params = {"layout": "mla", "d_v": D_V} if layout == "mla" else {}
    _, entry = kernel("sparse_attention", "gathered", params)
    return entry


@shared_inputs
def _inputs(layout: str, T: int, H: int, device: torch.device, seed: int) -> tuple:
    """bf16 leaves q [1, T, H, D_QK] and k, v [1, T, HK, D] (mla: one kv [1, T, 1, D_QK]),
    stratified indices."""
    _, HK, D_QK, D_V = LAYOUTS[layout]
    HK = min(HK, H)  # the check runs fewer heads
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16

    def leaf(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(bf16).requires_grad_(True)

    q = leaf(1, T, H, D_QK)
    kvs = (leaf(1, T, 1, D_QK),) if layout == "mla" else (leaf(1, T, HK, D_QK), leaf(1, T, HK, D_V))
    return (q, *kvs, stratified_indices(1, T, TOPK, device, gen))


def _dense(layout: str, masked: bool) -> Callable:
    """SDPA on [B, H, T, D]: the selected keys as a boolean mask, or plain causal."""
    H, HK, D_QK, D_V = LAYOUTS[layout]

    def call(q, *rest):
        *kvs, idx = rest
        k, v = (kvs[0], kvs[0][..., :D_V]) if layout == "mla" else kvs
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scale = D_QK ** -0.5
        if not masked:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                  enable_gqa=kt.shape[1] != qt.shape[1])
        if kt.shape[1] != qt.shape[1]:  # as transformers' repeat_kv: SDPA's fused GQA paths take no mask
            kt = kt.expand(-1, qt.shape[1], -1, -1)
            vt = vt.expand(-1, qt.shape[1], -1, -1)
        T = q.shape[1]
        i = idx.long()
        keep = torch.zeros(i.shape[0], T, T + 1, dtype=torch.bool, device=q.device)
        keep = keep.scatter_(-1, torch.where(i >= 0, i, T), True)[..., :T]
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep[:, None], scale=scale)

    return call


def masked_sdpa_bytes(layout: str, T: int) -> int:
    """The masks masked SDPA needs: the bool [B, 1, T, T] and the additive bf16 bias SDPA makes
    of it, plus the KV expanded to every query head (MLA). A backend that falls back to the math
    path needs [B, H, T, T] more and fails with an out-of-memory error row instead."""
    H, HK, D_QK, D_V = LAYOUTS[layout]
    expand = 2 * T * H * (D_QK + D_V) if HK != H else 0
    return 3 * T * T + expand


# MLA forward cases time ``ours`` alone. The forward sweep's rows were FWD_SPLIT_SCORES,
# FWD_STAGES 3 and FWD_ROW_END in combinations that since template v5 all equal the d_le_1024
# bucket's forward (within 0.5% of it on an H100, docs/LOG.md, thirty-sixth session), and
# FWD_LAZY_RESCALE 1, which lost and was removed in v9 (family.py). The value-split and two-pass
# forwards (FWD_DV_SPLIT 2, FWD_TWO_PASS 1) lost to the fused forward at BLOCK_K 64 on the H200
# (docs/LOG.md, eighteenth session, call C); they stay in the tuning space. The bucket's forward
# built for sm_90 with the runtime's marks (d_qk 576, d_v 512, 64 heads x 64 keys, 8 warps, 3
# stages): 230144 B shared, [4, 2], 40 wgmma per warp group and key block; 247 registers / 0 B
# spilled on triton 3.9, 255 / 24 on the H200's 3.6 (outside the loop).
# Since template v10 the MLA forward cases time ``ours@...`` rows again (MLA_FWD_SWEEP): the
# bucket's forward with FWD_EARLY_GATHER 1 (the next key block's gather issued right after the
# score dots instead of after the value dot: family.py), at its 3 stages and at 2. Their sm_90
# builds (the same marks; triton 3.9 / the H200's 3.6): 3 stages 229888 B shared, 255 / 255
# registers, 76 / 32 B spilled, none inside the loop (nvdisasm), [4, 2], 10 async copies (the
# mask's index load is a plain load at the loop's end); 2 stages 229376 B, 255 / 255, 4 / 0 B,
# 4 async copies (the gather's index loads plain too). The default's build is unchanged by v10
# (TTGIR and SASS identical on both).
# Since v11 FWD_EARLY_GATHER 1 is the bucket's own (faster on an H100 in two runs: family.py,
# d_le_1024), so the sweep times the forward it replaced (FWD_EARLY_GATHER 0); the 2-stage row lost
# in both runs (10% slower at T 8192) and is gone.
MLA_FWD_SWEEP = [
    {"FWD_EARLY_GATHER": 0},
]


# MLA forward + backward cases also time ``ours@...`` rows beside the d_le_1024 bucket's backward,
# the split one since template v7 (BWD_SPLIT 1, family.py: a dq kernel at 64 heads x 32 keys, then
# a dkv kernel that sums a key block's gradient over all 128 heads in registers and adds it once;
# 2 stages): the fused backward it replaced (BWD_SPLIT 0, 32 heads x 16 keys: 182.8 ms fwd+bwd at
# T 8192 against 88.1 on the H200, docs/LOG.md), and the split backward at 1 stage, with 16-head
# dkv steps, with 16-key dq steps (100.7, 103.2 and 114.8 ms at T 8192 in the same call).
# sm_90 AOT with the runtime's marks, 8 warps, 255 registers each; shared bytes, then B spilled
# under triton 3.9 / the H200's 3.6. 1 stage: dq 184320, 12 / 232; dkv x 32 heads 155648, 320 /
# 156, x 16 heads 131072, 272 / 92. 2 stages, whose loads are cp.async: dq 217216, 32 / 268; dkv x
# 32 heads 225536, 296 / 172, x 16 heads 149632, 264 / 96. The fused backward's 32 x 16 tiles
# leave a dq kernel on mma.sync (95232, 136 / 124).
MLA_FWDBWD_SWEEP = [
    {"BWD_SPLIT": 0},
    {"BWD_SPLIT": 1, "BWD_STAGES": 1},
    {"BWD_SPLIT": 1, "BLOCK_H_DKV": 16},
    {"BWD_SPLIT": 1, "BLOCK_K_DQ": 16},
]


def _attn_steps(layout: str, T: int, backward: bool, device: torch.device) -> dict[str, Step]:
    H = LAYOUTS[layout][0]
    sets = [_inputs(layout, T, H, device, seed=s) for s in range(N_SETS)]
    fns = {"ours": _gathered(layout)}
    dense = layout != "mla" or T <= DENSE_MLA_MAX_T
    if dense and masked_sdpa_bytes(layout, T) <= MEM_BUDGET:
        fns["masked_sdpa"] = _dense(layout, masked=True)
    if dense:
        fns["causal_sdpa"] = _dense(layout, masked=False)
    if not backward:
        steps = {name: fwd_only(fn, sets) for name, fn in fns.items()}
        if layout == "mla":
            import sys

            mod = sys.modules[fns["ours"].__module__]  # the module whose config the rows pin
            steps.update(fwd_sweep(mod, fns["ours"], sets, LAYOUTS[layout][2], MLA_FWD_SWEEP))
        return steps
    D_V = LAYOUTS[layout][3]
    grads = [torch.randn(1, T, H, D_V, device=device, dtype=torch.bfloat16)]
    # the dense baselines return [B, H, T, D_V]: their output gradient is laid out the same way
    grads_t = [g.transpose(1, 2).contiguous() for g in grads]
    steps = {name: fwd_bwd(fn, sets, grads if name == "ours" else grads_t) for name, fn in fns.items()}
    if layout == "mla":
        import sys

        mod = sys.modules[fns["ours"].__module__]  # the module whose config the rows pin
        steps.update(config_sweep(mod, fns["ours"], sets, grads, LAYOUTS[layout][2], MLA_FWDBWD_SWEEP))
    return steps


def _attn_check(layout: str) -> Callable[[torch.device], dict[str, float]]:
    def check(device: torch.device) -> dict[str, float]:
        mod_entry = _gathered(layout)
        import sys

        mod = sys.modules[mod_entry.__module__]
        H = min(LAYOUTS[layout][0], CHECK_H)
        leaves = _inputs(layout, CHECK_T, H, device, seed=11)
        *tensors, idx = leaves
        gen = torch.Generator(device=device).manual_seed(7)
        do = torch.randn(1, CHECK_T, H, LAYOUTS[layout][3], device=device, generator=gen)
        o = mod_entry(*tensors, idx)
        grads = torch.autograd.grad(o, tensors, do.to(o.dtype))
        hi = [t.detach().float().requires_grad_(True) for t in tensors]
        o32 = mod.reference(*hi, idx)
        grads32 = torch.autograd.grad(o32, hi, do)
        names = ["dq", "dkv"] if layout == "mla" else ["dq", "dk", "dv"]
        res = {"o": rel_rms(o, o32),
               **{n: rel_rms(a, b) for n, a, b in zip(names, grads, grads32, strict=True)}}
        res["ok"] = float(res["o"] <= O_TOL and all(res[n] <= GRAD_TOL for n in names))
        return res
    return check


def attention_flops(layout: str, T: int, backward: bool) -> int:
    """Useful FLOPs of one step: per head and valid pick 2 (d_qk + d_v) forward, 8 d_qk + 6 d_v
    forward + backward (the backward's 6 d_qk + 4 d_v: s again, dp, ds k, ds^T q, p^T do)."""
    H, _, D_QK, D_V = LAYOUTS[layout]
    pairs = H * useful_pairs(T, TOPK)
    return pairs * ((8 * D_QK + 6 * D_V) if backward else 2 * (D_QK + D_V))


def attention_case(layout: str, T: int, backward: bool) -> BenchCase:
    H, HK, D_QK, D_V = LAYOUTS[layout]
    flops = attention_flops(layout, T, backward)
    # bytes: q read (and dq written), o written (and do read), each selected KV row at least
    # once per KV head (the kernel reads it once per query row and group: this is the floor)
    kv_row = 2 * (D_QK if layout == "mla" else D_QK + D_V) * HK
    io = 2 * T * H * (D_QK + D_V)
    min_bytes = (2 if backward else 1) * (io + T * kv_row) + 4 * T * min(TOPK, T)
    notes = [f"layout {layout}: H={H} HK={HK} D_QK={D_QK} D_V={D_V}, K={TOPK}"]
    if masked_sdpa_bytes(layout, T) > MEM_BUDGET:
        notes.append(f"masked_sdpa left out: ~{masked_sdpa_bytes(layout, T) / 2**30:.0f} GiB")
    if layout == "mla" and T > DENSE_MLA_MAX_T:
        notes.append(f"masked_sdpa and causal_sdpa left out above T={DENSE_MLA_MAX_T} (seconds per step)")
    return BenchCase(
        family="sparse_attention", name=f"{layout}-T{T}-{'fwdbwd' if backward else 'fwd'}",
        shape={"B": 1, "T": T, "K": TOPK, "H": H, "HK": HK, "D_QK": D_QK, "D_V": D_V},
        min_bytes=min_bytes, flops=flops,
        setup=lambda device: _attn_steps(layout, T, backward, device),
        check=_attn_check(layout) if backward else None, note="; ".join(notes))


# ---- indexer + selection ----------------------------------------------------------------------

def _indexer_inputs(T: int, device: torch.device, seed: int) -> tuple:
    H, D = INDEXER
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, T, H, D, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, T, D, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(1, T, H, device=device, generator=gen) * H ** -0.5
    return q, k, w


def eager_indexer(q, k, w, topk: int) -> torch.Tensor:
    """transformers' DeepseekV32Indexer scoring: fp32 [B, T, H, T] scores, relu, weighted sum."""
    T = q.shape[1]
    s = torch.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * q.shape[-1] ** -0.5)
    s = torch.matmul(w.float().unsqueeze(-2), s).squeeze(-2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~causal, float("-inf")).topk(min(topk, T), dim=-1).indices


def _indexer_steps(T: int, device: torch.device) -> dict[str, Step]:
    H, _ = INDEXER
    mod, entry = kernel("sparse_attention", "indexer", {"topk": TOPK})
    sets = [_indexer_inputs(T, device, seed=s) for s in range(N_SETS)]
    fns = {"ours": lambda q, k, w: entry(q, k, w, TOPK)}
    if 4 * H * T * T * 2 <= MEM_BUDGET:
        fns["eager"] = lambda q, k, w: eager_indexer(q, k, w, TOPK)
    if 4 * T * T <= MEM_BUDGET // 4:
        fns["torch_topk"] = lambda q, k, w: mod.index_scores(q, k, w).topk(TOPK, dim=-1).indices
    return {name: fwd_only(fn, sets) for name, fn in fns.items()}


def _indexer_check(device: torch.device) -> dict[str, float]:
    mod, entry = kernel("sparse_attention", "indexer", {"topk": TOPK})
    q, k, w = _indexer_inputs(CHECK_T, device, seed=11)
    got = entry(q, k, w, TOPK).long()
    ref = mod.reference(q, k, w, TOPK).long()  # fp32 scores of the same bf16 inputs
    same = (got.sort(-1).values == ref.sort(-1).values).all(-1).float().mean().item()
    # scores summed in another order than the reference's einsum can swap near-tied entries at
    # the threshold; a wrong selection kernel gets far fewer rows right
    return {"rows_equal_torch_topk": same, "ok": float(same >= 0.99)}


def indexer_case(T: int) -> BenchCase:
    H, D = INDEXER
    flops = 2 * H * D * T * (T + 1) // 2  # the causal half of the score GEMMs
    notes = [f"indexer H={H} D={D}, K={TOPK}, chunked fp32 scores"]
    if 4 * H * T * T * 2 > MEM_BUDGET:
        notes.append(f"eager left out: [B, T, H, T] fp32 scores = {4 * H * T * T / 2**30:.0f} GiB")
    return BenchCase(
        family="sparse_attention", name=f"indexer-T{T}",
        shape={"B": 1, "T": T, "K": TOPK, "H": H, "D": D},
        min_bytes=2 * T * (H * D + D) + 4 * T * H + 4 * T * min(TOPK, T), flops=flops,
        setup=lambda device: _indexer_steps(T, device), check=_indexer_check,
        note="; ".join(notes))


def cases() -> list[BenchCase]:
    out = [attention_case(layout, T, bwd) for layout in LAYOUTS for T in TS for bwd in (False, True)
           if not (layout == "mla" and bwd and T > MLA_FWDBWD_MAX_T)]
    return out + [indexer_case(T) for T in TS]


# The nightly regression suite's share (the anchor layout's shortest sequence, forward, against dense causal SDPA).
NIGHTLY = NightlySpec(cases={"mha-T8192-fwd": ("ours", "causal_sdpa")}, min_threshold=0.05)
