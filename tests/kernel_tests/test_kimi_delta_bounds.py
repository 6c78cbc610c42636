"""kimi_delta's K-tiled chunk-local backward (`kda_qk` "ktiles") under the interpreter's bounds check
(`onboarding.testing.bounds`): every load, store and atomic of the forward and backward inside the
launch's tensor arguments, at the bench's KTILES_SWEEP rows.

Why: on an H100 (triton 3.6) every "ktiles" row raised "an illegal memory access" (docs/LOG.md,
thirty-fourth session, call 2). These tests pin what the CPU can rule out: no address of ours
(masked-in lane of a load, store or atomic) leaves its tensor, on the GPU's 16-bit path (16-bit dots
and stored intermediates, the bucket's own tiles: `kernel_cases.fp16_dot_path`) and on the fp32 path,
with a partial last chunk, several K and V tiles, per value head slots (HV = 2 HK) and final dq, dk
(HV = HK). The device's fault is therefore in the build, not in the kernels' indexing, unless a
test here fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import DEVICE, fp16_dot_path
from test_gated_delta import Case, grads_of, load, make_inputs

from onboarding.families import family_module
from onboarding.testing.bounds import OutOfBounds, bounds_checked, interpreting

kimi_delta = family_module("kimi_delta")

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu" or not interpreting(),
                                reason="checks the interpreter (TRITON_INTERPRET=1 on the CPU)")


def _grads_pinned(monkeypatch, module, cfg, path, args, douts):
    """The entry's outputs and gradients under `bounds_checked`, `cfg` pinned for all shapes: the fp16
    path with the bucket's own tiles (CPU_CONFIG unpinned) as on the GPU, fp32 over the test pin."""
    prev = module._CONFIG_OVERRIDE
    module.set_config(cfg if path == "fp16" else {**(prev or {}), **cfg})
    try:
        if path == "fp16":
            with fp16_dot_path(monkeypatch, module), bounds_checked(), np.errstate(over="ignore", invalid="ignore"):
                return grads_of(module.entry, args, douts)
        with bounds_checked():
            return grads_of(module.entry, args, douts)
    finally:
        module.set_config(prev)


@triton.jit
def _atomic_rows(p_x, p_y, n, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    if MASKED:
        tl.atomic_add(p_y + o, tl.load(p_x + o, mask=o < n, other=0.0), mask=o < n, sem="relaxed")
    else:
        tl.atomic_add(p_y + o, tl.load(p_x + o, mask=o < n, other=0.0), sem="relaxed")


def test_atomics_are_checked():
    """The ktiles K-tile kernel adds dbeta's share with tl.atomic_add: the check covers atomics
    (masked-off lanes excluded), as it does loads and stores."""
    x, y = torch.randn(16), torch.zeros(12)
    with bounds_checked():
        _atomic_rows[(1,)](x, y, 12, MASKED=True, BLOCK=16)
        torch.testing.assert_close(y, x[:12])
        with pytest.raises(OutOfBounds, match=r"atomic in Triton kernel _atomic_rows: 4 of 16 "):
            _atomic_rows[(1,)](x, y, 12, MASKED=False, BLOCK=16)


# (row of bench.KTILES_SWEEP, HK, HV, K = V): HV = 2 HK takes the fp32 per value head slots and the
# group sum, HV = HK (the bench's Kimi-Linear layout) writes dq, dk final from the K-tile kernel.
# T 100: a full chunk and a partial one (36 rows). K = V = 64: four K tiles at BK 16, two at 32, two
# V tiles at bwd_bv 32; K = V = 128 (the faulting shapes' head dims) is the slow row.
ROWS = kimi_delta.bench.KTILES_SWEEP
# The fp16 path takes 9-21 s a row on 2 cores (fp32 3-9 s): one fp16 row in the fast set.
SLOW = pytest.mark.slow
CASES = [
    pytest.param("fp16", ROWS[0], 1, 2, 64, id="fp16-bk16-w8-grouped"),
    pytest.param("fp32", ROWS[0], 2, 2, 64, id="fp32-bk16-w8-hv=hk"),
    pytest.param("fp32", ROWS[1], 1, 2, 64, id="fp32-bk32-w8-grouped"),
    pytest.param("fp16", ROWS[0], 2, 2, 64, id="fp16-bk16-w8-hv=hk", marks=SLOW),
    pytest.param("fp16", ROWS[1], 2, 2, 64, id="fp16-bk32-w8-hv=hk", marks=SLOW),
    pytest.param("fp16", ROWS[3], 1, 2, 64, id="fp16-bk16-w8-state3-grouped", marks=SLOW),
    pytest.param("fp16", ROWS[0], 1, 2, 128, id="fp16-bk16-w8-grouped-k128", marks=SLOW),
    pytest.param("fp32", ROWS[0], 1, 2, 128, id="fp32-bk16-w8-grouped-k128", marks=SLOW),
]


@pytest.mark.parametrize("path,cfg,HK,HV,D", CASES)
def test_ktiles_forward_backward_in_bounds(monkeypatch, path, cfg, HK, HV, D):
    module = load(kimi_delta.FAMILY, {"chunk_size": 64})
    case = Case(HK=HK, HV=HV, T=100, l2=True, h0=True, K=D, V=D)
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16 if path == "fp16" else torch.float32
    args = make_inputs(case, True, dtype, DEVICE, gen)
    douts = [torch.randn(case.B, case.T, case.HV, case.V, generator=gen).to(DEVICE, dtype),
             torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)]
    launched = []
    for name in ("kda_chunk_bwd_vside_kernel", "kda_chunk_bwd_ktile_kernel"):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, _Spy(kernel, lambda kw, _n=name: launched.append((_n, kw["BK"], kw["BV"]))))
    outs, grads = _grads_pinned(monkeypatch, module, cfg, path, args, douts)
    bk = cfg.get("kda_qk_bk") or 32
    assert launched == [("kda_chunk_bwd_vside_kernel", 32, 32), ("kda_chunk_bwd_ktile_kernel", bk, 32)], launched
    for name, x in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], [*outs, *grads]):
        assert torch.isfinite(x).all(), name


class _Spy:
    def __init__(self, kernel, record):
        self.kernel, self.record = kernel, record

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.record(kw)
            return self.kernel[grid](*args, **kw)
        return launch


# `kda_qk` "ksplit" (template v38: the wy kernel's V side, its K tiles per (K tile, chunk, value head),
# since v47 by `kda_chunk_bwd_wyvp_kernel` and `kda_chunk_bwd_wykp_kernel`, the row sums over [NK + 1, B, T,
# HV] slots, then the tiled pair's qkt kernel) under the same check: "ksplit" and the bench's KSPLIT_SWEEP
# row (the K tiles at 8 warps capped at 128 registers: on the CPU the same launches), T 100 (a partial
# chunk), the fp16 path at the bucket's tiles and fp32 at the test pin, HV = 2 HK and HV = HK, K = V = 64
# (two K tiles of 32: three slots) and 128 (slow).
# (`kda_wykq` 0: the K tiles apart, as timed; since v62 the k_le_128 bucket fuses them with the qkt hot launch.)
KSPLIT_ROWS = ({"kda_qk": "ksplit", "kda_wykq": 0}, *kimi_delta.bench.KSPLIT_SWEEP)
KSPLIT_CASES = [
    pytest.param("fp16", 0, 1, 2, 64, id="fp16-grouped"),
    pytest.param("fp32", 0, 2, 2, 64, id="fp32-hv=hk"),
    pytest.param("fp16", 1, 2, 2, 64, id="fp16-wyk8-hv=hk"),
    pytest.param("fp16", 0, 2, 2, 128, id="fp16-hv=hk-k128", marks=SLOW),
    pytest.param("fp32", 0, 1, 2, 128, id="fp32-grouped-k128", marks=SLOW),
]
KSPLIT_KERNELS = ("kda_chunk_bwd_wyvp_kernel", "kda_chunk_bwd_wykp_kernel", "kda_chunk_bwd_rowsum_kernel",
                  "kda_chunk_bwd_qkt_kernel")


@pytest.mark.parametrize("path,row,HK,HV,D", KSPLIT_CASES)
def test_ksplit_forward_backward_in_bounds(monkeypatch, path, row, HK, HV, D):
    module = load(kimi_delta.FAMILY, {"chunk_size": 64})
    case = Case(HK=HK, HV=HV, T=100, l2=True, h0=True, K=D, V=D)
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16 if path == "fp16" else torch.float32
    args = make_inputs(case, True, dtype, DEVICE, gen)
    cfg = KSPLIT_ROWS[row]
    douts = [torch.randn(case.B, case.T, case.HV, case.V, generator=gen).to(DEVICE, dtype),
             torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)]
    launched = []
    for name in KSPLIT_KERNELS:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, _Spy(kernel, lambda kw, _n=name: launched.append(_n)))
    outs, grads = _grads_pinned(monkeypatch, module, cfg, path, args, douts)
    # the qkt kernel twice where `kda_qkt_cold` is "split" (the k_le_128 bucket's default since v56: D 128)
    split = {**module.config_for(D), **cfg}.get("kda_qkt_cold") == "split"
    assert split is (D == 128 and cfg.get("kda_qkt_cold") != "inline"), (D, cfg)
    assert launched == [*KSPLIT_KERNELS, *KSPLIT_KERNELS[-1:] * split], launched
    for name, x in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], [*outs, *grads]):
        assert torch.isfinite(x).all(), name


# `kda_qkt_cold` "split" (template v51: "ksplit"'s qkt kernel as a chunk-tier launch that flags the tiles whose
# decays do not fit that tier, then a launch of every tier for the flagged ones; bench.QKT_COLD_SWEEP's rows)
# under the same check, with slow decays (about -0.05 a step: the chunk tier's, fp16's range included) but in
# the middle chunk of the first value head (x 100: the exact tier), so that both launches write tiles: HV = HK
# and HV = 2 HK (a key head's tile flagged by one of its heads), T 150 (a partial chunk), K = V = 64, the fp16
# path at the bucket's tiles and fp32 at the test pin.
QKT_SPLIT_CASES = [
    pytest.param("fp16", 0, 2, 2, id="fp16-hv=hk"),
    pytest.param("fp16", 1, 1, 2, id="fp16-bk16-cap-grouped"),
    pytest.param("fp32", 0, 1, 2, id="fp32-grouped"),
    pytest.param("fp32", 1, 2, 2, id="fp32-bk16-cap-hv=hk"),
]


def _cold_tier_case(path, HK, HV):
    """QKT_SPLIT_CASES' inputs: T 150, K = V = 64, l2norm and an initial state, the gates of the first value
    head's second chunk x 100 (past the chunk tier: flagged for the cold launch), in the path's dtype."""
    module = load(kimi_delta.FAMILY, {"chunk_size": 64})
    case = Case(HK=HK, HV=HV, T=150, l2=True, h0=True, K=64, V=64)
    gen = torch.Generator().manual_seed(12)
    dtype = torch.float16 if path == "fp16" else torch.float32
    args = make_inputs(case, True, dtype, DEVICE, gen)
    args[3] = make_inputs(case, True, dtype, DEVICE, gen, slow=True)[3]  # (fit fp16's range too)
    args[3][:, 64:128, 0] *= 100.0
    douts = [torch.randn(case.B, case.T, case.HV, case.V, generator=gen).to(DEVICE, dtype),
             torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)]
    return module, args, douts


@pytest.mark.parametrize("path,row,HK,HV", QKT_SPLIT_CASES)
def test_qkt_split_forward_backward_in_bounds(monkeypatch, path, row, HK, HV):
    module, args, douts = _cold_tier_case(path, HK, HV)
    cfg = kimi_delta.bench.QKT_COLD_SWEEP[row]
    flags = []
    name = "kda_chunk_bwd_qkt_kernel"
    monkeypatch.setattr(module, name, _Spy(getattr(module, name), lambda kw: flags.append(kw.get("p_flag"))))
    outs, grads = _grads_pinned(monkeypatch, module, cfg, path, args, douts)
    assert len(flags) == 2 and flags[0] is flags[1], flags
    assert 0 < int(flags[0].sum()) < flags[0].numel(), flags  # both launches wrote tiles
    for name, x in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], [*outs, *grads]):
        assert torch.isfinite(x).all(), name


# `kda_wykq` 1 (template v60: the V side with the row dots whole, "ksplit"'s K tiles and the qkt kernel's chunk tier
# as one kernel per (K tile, chunk, key head), the row sums of dbeta, the qkt kernel's cold launch for the tiles that
# kernel flagged; bench.WYKQ_SWEEP's rows) under the same check, on QKT_SPLIT_CASES' gates (both the fused kernel and
# the cold launch write tiles): HV = HK and HV = 2 HK, T 150, K = V = 64, the fp16 path at the bucket's tiles and fp32
# at the test pin (slow: 17-31 s each on two busy cores; test_kimi_delta_wykq.py's fast case checks the values).
WYKQ_CASES = [
    pytest.param("fp16", 0, 2, 2, id="fp16-hv=hk", marks=SLOW),
    pytest.param("fp32", 1, 1, 2, id="fp32-wy8-grouped", marks=SLOW),
]


@pytest.mark.parametrize("path,row,HK,HV", WYKQ_CASES)
def test_wykq_forward_backward_in_bounds(monkeypatch, path, row, HK, HV):
    module, args, douts = _cold_tier_case(path, HK, HV)
    cfg = kimi_delta.bench.WYKQ_SWEEP[row]
    launched, flags = [], []
    for name in ("kda_chunk_bwd_wyvp_kernel", "kda_chunk_bwd_wykq_kernel", "kda_chunk_bwd_rowsum_kernel",
                 "kda_chunk_bwd_qkt_kernel"):
        monkeypatch.setattr(module, name, _Spy(getattr(module, name), lambda kw, _n=name: (
            launched.append(_n), flags.append(kw.get("p_flag")) if _n.endswith("qkt_kernel") else None)))
    outs, grads = _grads_pinned(monkeypatch, module, cfg, path, args, douts)
    assert launched == ["kda_chunk_bwd_wyvp_kernel", "kda_chunk_bwd_wykq_kernel", "kda_chunk_bwd_rowsum_kernel",
                        "kda_chunk_bwd_qkt_kernel"], launched
    assert 0 < int(flags[0].sum()) < flags[0].numel(), flags  # both kernels wrote tiles
    for name, x in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], [*outs, *grads]):
        assert torch.isfinite(x).all(), name
