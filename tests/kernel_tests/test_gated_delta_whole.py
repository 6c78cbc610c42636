"""GDN's `bwd_wy` "whole" (template v35, off): the chunk-local backward as one program per (chunk, key head)
holding the whole K side, `gdn_chunk_bwd_whole_kernel`, in place of `gdn_chunk_bwd_wy_kernel` (per value head,
K in tiles) and `gdn_group_sum_kernel`. Against the naive fp32 recurrence and the default path in the
interpreter, its launches spied, its AOT spec against its launch, its sm_90 build, and on a GPU the bench rows'
bf16 bars.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, LaunchSpy
from test_gated_delta import GPU_CASES, Case, check_bf16_vs_fp32_gpu, grads_of, load, make_inputs

from onboarding.families import family_module
from onboarding.generate import aot

gated_delta = family_module("gated_delta")

WHOLE = "gdn_chunk_bwd_whole_kernel"
APART = ("gdn_chunk_bwd_wy_kernel", "gdn_group_sum_kernel")
NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]

# The first two run by default (~9 s together in the interpreter), the rest are marked slow. The first: grouped values (HV = 2 HK), an odd T (37: the CPU chunk of 16 leaves a partial
# third chunk), K 64 (two K tiles of the default path's pinned BK 32; one whole K here), V 48 over two V tiles
# (the second partial), an initial state and the l2norm. Then one value head per key head (HV = HK, two key
# heads); grouped at B 2 without the l2norm or an initial state; four value heads per key head with K 16 < V 32
# at a T that is a multiple of the chunk; K 48, not a power of two (the K side masked).
WHOLE_CASES = [
    Case(HK=1, HV=2, T=37, l2=True, h0=True, K=64, V=48),
    Case(HK=2, HV=2, T=37, l2=True, h0=True),
    Case(HK=1, HV=2, T=37, l2=False, h0=False, B=2),
    Case(HK=1, HV=4, T=32, l2=True, h0=True, K=16, V=32),
    Case(HK=1, HV=2, T=21, l2=True, h0=False, K=48, V=16),
]


def _run(module, cfg: dict, case: Case, monkeypatch, launches: list | None = None):
    gen = torch.Generator().manual_seed(3)
    args = make_inputs(case, False, torch.float32, DEVICE, gen)
    douts = [torch.randn(case.B, case.T, case.HV, case.V, generator=gen).to(DEVICE),
             torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)]
    if launches is not None:
        for name in (WHOLE, *APART):
            monkeypatch.setattr(module, name, LaunchSpy(getattr(module, name), lambda grid, kw, _n=name: launches.append(
                (_n, grid, kw))))
    prev = module._CONFIG_OVERRIDE
    module.set_config({**(prev or {}), **cfg})
    try:
        outs, grads = grads_of(module.entry, args, douts)
    finally:
        module.set_config(prev)
        monkeypatch.undo()
    return [*outs, *grads], args, douts


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if i < 2 else pytest.mark.slow, id=c.id)
                                  for i, c in enumerate(WHOLE_CASES)])
def test_whole_vs_naive_and_default(case, monkeypatch):
    """Under `bwd_wy` "whole" o, the final state and every gradient (dq, dk, dv, dg, dbeta, d initial_state)
    equal the naive fp32 recurrence's (1e-4) and the default path's (1e-5); the launches are the whole kernel
    alone over (chunks, B * HK) with BK the whole K (the default's WY kernel and group sum never run) at the
    warps `bwd_wy_warps` gives."""
    module = load(gated_delta.FAMILY)
    launches: list = []
    got, args, douts = _run(module, {"bwd_wy": "whole", "bwd_wy_warps": 8}, case, monkeypatch, launches)
    nt = -(-case.T // 16)
    assert [(n, g) for n, g, _ in launches] == [(WHOLE, (nt, case.B * case.HK))], launches
    kw = launches[0][2]
    assert (kw["BK"], kw["G"], kw["num_warps"], kw["USE_L2"]) == (max(16, 1 << (case.K - 1).bit_length()),
                                                                  case.HV // case.HK, 8, case.l2), kw
    ref = [*sum(grads_of(module.reference, args, douts), [])]
    base, _, _ = _run(module, {}, case, monkeypatch)
    for n, a, r, b in zip(NAMES, got, ref, base):
        assert (a is None) == (r is None), n
        if a is None:
            continue
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{n} vs naive: {m}")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n} vs default: {m}")


def test_whole_is_off_by_default():
    """Every bucket keeps the default chunk-local backward (`bwd_wy` "tiles"); "whole" is an option."""
    module = load(gated_delta.FAMILY)
    prev = module._CONFIG_OVERRIDE
    module.set_config(None)
    try:
        assert {module.config_for(k).get("bwd_wy") for k in (32, 64, 128, 256)} == {"tiles"}
    finally:
        module.set_config(prev)


def test_whole_aot_spec_is_the_launch(monkeypatch):
    """The whole kernel's AOT spec (fp32, K = V = 128) is its launch at one value head per key head but G:
    constexprs (BK the whole K), warps (`bwd_wy_warps`, else num_warps) and stages."""
    case = Case(HK=1, HV=1, T=20, l2=True, h0=True, K=128, V=128)
    module = load(gated_delta.FAMILY, {"chunk_size": 64})
    for warps in (0, 8):
        launches: list = []
        _run(module, {"bwd_wy": "whole", "bwd_wy_warps": warps}, case, monkeypatch, launches)
        prev = module._CONFIG_OVERRIDE
        module.set_config({**(prev or {}), "bwd_wy": "whole", "bwd_wy_warps": warps})
        try:
            specs = [s for s in module.aot_specs("fp32", 128) if s["kernel"] == WHOLE]
        finally:
            module.set_config(prev)
        assert len(specs) == 1 and [n for n, _, _ in launches] == [WHOLE], (specs, launches)
        kw = launches[0][2]
        assert {k: v for k, v in specs[0]["constexprs"].items() if k != "G"} == {
            k: kw[k] for k in specs[0]["constexprs"] if k != "G"}, (specs[0], kw)
        assert (kw["num_warps"], kw["num_stages"]) == (specs[0]["num_warps"], specs[0]["num_stages"]), (kw, specs)


# the rendered module cut down to the whole kernel, its spec at 4 and 8 warps (`aot.compile_files` builds every
# kernel of a module in a child process, outside the interpreter)
_WHOLE_ONLY = """

_SPECS = aot_specs
for _n in [n for n in list(globals()) if n.endswith("_kernel") and n != "{kernel}"]:
    del globals()[_n]


def aot_specs(dtype="bf16", size=128):
    spec = next(s for s in _SPECS(dtype, size) if s["kernel"] == "{kernel}")
    return [{{**spec, "num_warps": w}} for w in (4, 8)]
"""


@pytest.mark.slow  # two sm_90 builds of one kernel (~1 min on a shared 2-core host)
def test_aot_sm90_whole(tmp_path):
    """The whole kernel builds for sm_90 (bf16, K = V = 128, the Qwen3-Next layout's G 2, every integer
    marked) at 4 and 8 warps within the H100's shared memory; registers and spills are printed (-s)."""
    from onboarding.generate import templating

    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    source = templating.render(gated_delta.FAMILY, "chunk", {"chunk_size": 64, "qk_l2norm": True})
    path = templating.write_module(source + _WHOLE_ONLY.format(kernel=WHOLE), tmp_path / "gated_delta" / "chunk.py")
    results = next(iter(aot.compile_files([path], size=128, dtype="bf16", specialize="all").values()))
    assert [(r.kernel, r.num_warps) for r in results] == [(WHOLE, 4), (WHOLE, 8)], results
    for r in results:
        print(f"{r.kernel} {r.num_warps} warps: {r.n_regs} registers, {r.n_spills} B spilled, {r.shared_bytes} B shared")
        assert r.ok, r.error
        assert r.shared_bytes <= aot.H100_SHARED_BYTES, r.shared_bytes


# The bench's "whole" rows (bench.WHOLE_SWEEP, template v35): each within the bf16 bars on the GPU, forward and
# every gradient, at both GPU cases.
@pytest.mark.parametrize("cfg", [pytest.param(c, id=",".join(f"{k}={v}" for k, v in c.items()))
                                 for c in gated_delta.bench.WHOLE_SWEEP])
@pytest.mark.parametrize("case,slow", GPU_CASES)
def test_bf16_vs_fp32_on_gpu_whole(cfg, case, slow):
    if DEVICE.type != "cuda":
        pytest.skip("bf16 dots need a GPU (the interpreter computes them wrongly)")
    module = load(gated_delta.FAMILY, {"chunk_size": 64})
    prev = module._CONFIG_OVERRIDE
    module.set_config({**(prev or {}), **cfg})
    try:
        check_bf16_vs_fp32_gpu(gated_delta.FAMILY, False, case, slow)
    finally:
        module.set_config(prev)
