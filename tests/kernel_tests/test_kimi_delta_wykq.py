"""KDA's `kda_wykq` 1 (template v60): "ksplit"'s K tiles and the qkt kernel's hot launch as one kernel per (K tile,
chunk, key head), `kda_chunk_bwd_wykq_kernel`, after the V side with FULL (`kda_chunk_bwd_wyvp_kernel`: the
l2norm's row dots whole, in the fused kernel's closed form); tiles whose decays do not fit the chunk tier go to
the qkt kernel's cold launch. Against the naive recurrence in the interpreter, its AOT specs against its launches,
and on a GPU the bench row's bf16 bars and the cold launch at work.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, LaunchSpy
from test_gated_delta import Case, grads_of, load, make_inputs
from test_kimi_delta import (KSPLIT_KERNELS, _sweep_row_bars, _sweep_rows, cold_tiles_against_inline, pinned,
                             spec_case)

from onboarding.families import family_module

kimi_delta = family_module("kimi_delta")

# `kda_wykq` 1 (template v60): "ksplit"'s K tiles and the qkt kernel's hot launch as one kernel per (K tile, chunk,
# key head), `kda_chunk_bwd_wykq_kernel`, after the V side with FULL (the l2norm's row dots whole, closed form);
# tiles whose decays do not fit the chunk tier go to the qkt kernel's cold launch. Cases: l2norm, HV (HK is 1), K,
# V, T, the K tile (0: the pinned tiles' 32), and the decays' scale per (chunk, value head) (x 4: the 16-row tier,
# x 30: the exact one; a tile is flagged where any head of its key head is scaled). The first is the fast one: two K tiles, grouped
# values, an odd T whose second chunk is partial, a flagged chunk beside an unflagged one, an initial state.
WYKQ_CASES = {
    "l2-grouped-cold-odd-t": (True, 2, 32, 16, 71, 16, ((0, 1, 30.0),)),
    "l2-mixed-bk16": (True, 1, 48, 16, 150, 16, ((1, 0, 4.0), (2, 0, 30.0))),
    "l2-grouped-bv16-odd-t": (True, 2, 48, 40, 149, 0, ()),
    "no-l2-grouped-cold": (False, 2, 48, 16, 150, 0, ((0, 0, 30.0),)),
}


@pytest.mark.parametrize("case_id", [pytest.param(c, marks=() if i == 0 else pytest.mark.slow)
                                     for i, c in enumerate(WYKQ_CASES)])
def test_wykq_vs_naive(monkeypatch, case_id):
    """Under `kda_wykq` 1 the forward and every gradient (dq, dk, dv, dg, dbeta, d initial_state) equal the naive
    recurrence's (fp32); its launches are the V side (FULL with the l2norm), the fused K tiles over (K tile, chunk,
    key head), the row sums (dbeta only) and the qkt kernel's cold launch on their flag buffer; in the interpreter
    the flags are 1 exactly on the scaled chunks' tiles and the chunk tier ran in the fused kernel."""
    l2, HV, K, V, T, bk, scaled = WYKQ_CASES[case_id]
    module = load(kimi_delta.FAMILY, {"chunk_size": 64})
    case = Case(HK=1, HV=HV, T=T, l2=l2, h0=True, K=K, V=V)
    gen = torch.Generator().manual_seed(7)
    args = make_inputs(case, True, torch.float32, DEVICE, gen)
    g = args[3].clone()
    for chunk, head, f in scaled:
        g[:, 64 * chunk:64 * (chunk + 1), head] *= f
    args[3] = g
    douts = [torch.randn(case.B, case.T, case.HV, case.V, generator=gen).to(DEVICE),
             torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)]
    launches = []
    for name in (*KSPLIT_KERNELS, "kda_chunk_bwd_wykq_kernel"):
        monkeypatch.setattr(module, name, LaunchSpy(getattr(module, name), lambda grid, kw, _n=name: launches.append(
            (_n, grid, kw))))
    dots = []
    if DEVICE.type == "cpu":  # interpreted: the jit helpers go through the module globals
        fn = module._kda_qkt_chunk_dots
        monkeypatch.setattr(module, "_kda_qkt_chunk_dots", lambda *a, **kw: (dots.append(1), fn(*a, **kw))[1])
    with pinned(module, {"kda_qk": "ksplit", "kda_wykq": 1, **({"BK": bk} if bk else {})}):
        (o, ht), grads = grads_of(module.entry, args, douts)
    nk, nt = -(-K // (bk or 32)), -(-T // 64)
    assert [(n, g) for n, g, _ in launches] == [
        ("kda_chunk_bwd_wyvp_kernel", (nt, HV)), ("kda_chunk_bwd_wykq_kernel", (nk, nt, 1)),
        ("kda_chunk_bwd_rowsum_kernel", launches[2][1]), ("kda_chunk_bwd_qkt_kernel", (nk, nt, 1))], launches
    assert launches[0][2].get("FULL", False) is l2 and launches[2][2]["USE_L2"] is False
    assert launches[3][2]["SPLIT"] == 2 and launches[3][2]["BK"] == launches[1][2]["BK"] == (bk or 32)
    if DEVICE.type == "cpu":
        flagged = {c for c, _, _ in scaled}
        want = torch.tensor([int(t in flagged) for t in range(nt) for _ in range(nk)], dtype=torch.int32)
        assert torch.equal(launches[3][2]["p_flag"].cpu(), want), (launches[3][2]["p_flag"], want)
        assert len(dots) == HV * nk * (nt - len(flagged)), dots
    (ro, rht), ref_grads = grads_of(module.reference, args, douts)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ht, rht, rtol=1e-4, atol=1e-5)
    for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dinitial_state"], grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_wykq_aot_specs_are_the_launches(monkeypatch):
    """`kda_wykq` 1's AOT specs (fp32, K 128, one value head per key head) are its launches: the V side with FULL,
    the fused K tiles and the qkt kernel's cold launch at their BK (constexprs, warps, no register cap); the k_le_128
    bucket takes it (v62), and `kda_wykq` 0's specs hold none of them (the V side's FULL off, p_qg, p_h None as
    launched)."""
    module, args, douts = spec_case()
    names = ("kda_chunk_bwd_wyvp_kernel", "kda_chunk_bwd_wykq_kernel", "kda_chunk_bwd_qkt_kernel")
    seen = []
    for name in names:
        monkeypatch.setattr(module, name, LaunchSpy(getattr(module, name), lambda grid, kw, _n=name: seen.append(
            (_n, kw))))
    assert module.config_for(128)["kda_wykq"] == 1  # the k_le_128 bucket's since v62
    with pinned(module, {"kda_wykq": 0}):
        apart = [s for s in module.aot_specs("fp32", 128) if s["kernel"] in names[:2]]
    assert [(s["kernel"], s["constexprs"]["FULL"]) for s in apart] == [(names[0], False)], apart
    with pinned(module, {"kda_wykq": 1}):
        assert module.config_for(128)["kda_qk"] == "ksplit"
        grads_of(module.entry, args, douts)
        specs = module.aot_specs("fp32", 128)
    for name, kw in seen:
        want = [s for s in specs if s["kernel"] == name and all(kw.get(k) == v for k, v in s["constexprs"].items()
                                                                 if k not in ("p_qg", "p_h", "p_flag"))]
        assert len(want) == 1, (name, kw, [s for s in specs if s["kernel"] == name])
        assert (kw["num_warps"], kw.get("maxnreg")) == (want[0]["num_warps"], want[0].get("maxnreg")), (kw, want)
        if name == names[0]:  # the V side's FULL spec takes qg and S_c as pointers
            assert want[0]["constexprs"]["FULL"] is True and want[0]["signature"]["p_h"] == "*fp32", want


# The bench's `kda_wykq` row (bench.WYKQ_SWEEP, template v60): within the bf16 bars on the GPU (its cases' gates
# flag no tile: the fused kernel finishes every one).
@pytest.mark.parametrize("cfg", _sweep_rows(kimi_delta.bench.WYKQ_SWEEP))
def test_bf16_vs_fp32_on_gpu_wykq_sweep(cfg):
    _sweep_row_bars(cfg)


# The same row on the GPU with the qkt kernel's cold launch at work, on test_qkt_split_cold_tiles_on_gpu's case and
# gates (one and two value heads per key head; some tiles flagged, others not): bf16 and fp32, o, the final state
# and every gradient within 5e-3 of "ksplit"'s one qkt launch (the same operations but the row dots' closed form).
# The k_le_128 bucket's own (`kda_wykq` 1 since v62) first.
@pytest.mark.parametrize("HV", [2, 4], ids=["hv=hk", "grouped"])
@pytest.mark.parametrize("cfg", _sweep_rows(({"kda_wykq": 1}, *kimi_delta.bench.WYKQ_SWEEP)))
def test_wykq_cold_tiles_on_gpu(monkeypatch, cfg, HV):
    if DEVICE.type != "cuda":
        pytest.skip("the GPU's builds (the interpreter's: test_wykq_vs_naive)")
    inline = {"kda_qk": "ksplit", "kda_qkt_cold": "inline", "kda_wykq": 0}  # the two kernels, qkt in one launch
    cold_tiles_against_inline(monkeypatch, cfg, inline, HV, qkt_launches=1)
