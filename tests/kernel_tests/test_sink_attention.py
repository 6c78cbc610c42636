"""Sink attention (per-head sinks or none; causal, sliding window, GQA, additive mask, logit
soft-cap): forward and every gradient, d(sinks) included, against the eager math written out in
torch; planted bugs that the comparison must catch; opcheck; the sm_90 build."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from kernel_cases import DTYPES

from onboarding.generate import aot, templating
from onboarding.testing import KernelFixture, check_forward_backward, check_module_contract, check_opcheck
from onboarding.testing.tolerance import rel_rms

# small tiles: odd T crosses partial blocks and several key blocks per row
CPU_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BWD_BLOCK_M": 16, "BWD_BLOCK_N": 16}
# (B, H, Hk, Tq, Tk, D, sinks, window, causal, mask)
SHAPES = [
    (1, 4, 2, 37, 37, 16, True, 8, True, False),  # GQA 2, T > window, odd T
    (2, 2, 2, 21, 21, 8, False, 0, True, False),  # no sink, GQA 1, full causal
    (1, 2, 1, 19, 19, 16, True, 40, True, False),  # T < window, GQA 2
    (1, 4, 1, 5, 23, 16, True, 12, True, False),  # decode-like: Tq < Tk (bottom-right causal)
    (1, 4, 2, 17, 17, 12, True, 6, True, True),  # additive mask on top, head dim not a power of 2
    (1, 2, 2, 13, 13, 16, True, 0, False, False),  # not causal
]


def shape_id(s) -> str:
    B, H, Hk, Tq, Tk, D, sinks, window, causal, mask = s
    return (f"B{B}H{H}K{Hk}T{Tq}" + (f"x{Tk}" if Tk != Tq else "") + f"D{D}" + ("-sink" if sinks else "")
            + (f"-w{window}" if window else "") + ("" if causal else "-full") + ("-mask" if mask else ""))


def make_inputs(shape, dtype, device, gen, softcap=None):
    """The entry's arguments for ``shape``; with ``softcap`` that too (a ninth argument)."""
    B, H, Hk, Tq, Tk, D, sinks, window, causal, mask = shape
    q = torch.randn(B, H, Tq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hk, Tk, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hk, Tk, D, generator=gen).to(device, dtype)
    s = (torch.randn(H, generator=gen) + 1.0).to(device, dtype) if sinks else None
    m = None
    if mask:  # transformers' form: the dtype's minimum where hidden (here the first 3 keys), 0 elsewhere
        m = 0.3 * torch.randn(B, 1, Tq, Tk, generator=gen)
        m[..., :3] = torch.finfo(torch.float32).min
        m = m.to(device, dtype if dtype != torch.float16 else torch.float32)
    return [q, k, v, s, m, None, causal, window] + ([softcap] if softcap is not None else [])


def fixture(module, shape, softcap=None) -> KernelFixture:
    return KernelFixture(name="sink_attention", module=module, weights=(3,), no_grad=(4,),
                         make_inputs=lambda dtype, device, gen: make_inputs(shape, dtype, device, gen, softcap))


@pytest.fixture(scope="module")
def module(load_kernel):
    return load_kernel("sink_attention", "attention", {}, CPU_CONFIG)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward(module, device, dtype, shape):
    check_forward_backward(fixture(module, shape), dtype, device)


def _errors(mod, shape, device, seed=0, softcap=None):
    """Relative RMS error of o and of every gradient (q, k, v, sinks) against the reference, fp32."""
    gen = torch.Generator().manual_seed(seed)
    args = make_inputs(shape, torch.float32, device, gen, softcap)
    leaves = [a.requires_grad_(True) for a in args[:4] if a is not None]
    out = mod.entry(*args)
    do = torch.randn(out.shape, generator=gen).to(device)
    grads = torch.autograd.grad(out, leaves, do)
    ref = mod.reference(*args)
    ref_grads = torch.autograd.grad(ref, leaves, do)
    names = ["o", "dq", "dk", "dv", "dsinks"]
    return {n: rel_rms(a, b) for n, a, b in zip(names, [out, *grads], [ref, *ref_grads])}


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fp32_every_gradient(module, device, shape):
    """o, dq, dk, dv and d(sinks) within 1e-4 relative RMS of the eager math in fp32."""
    errs = _errors(module, shape, device)
    assert len(errs) == 4 + shape[6]
    bad = {n: e for n, e in errs.items() if not e <= 1e-4}
    assert not bad, f"{shape_id(shape)}: {bad}"


def test_sink_gradient_closed_form(module, device):
    """d sink_h = -sum_{b, i} p_sink(b, h, i) D(b, h, i), D = rowsum(dO * o), p_sink = exp(sink -
    logsumexp of the row with the sink): the kernel's d(sinks) matches the formula evaluated in
    fp64 from the written-out softmax."""
    B, H, Hk, T, D = 2, 4, 2, 23, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, n, T, D, generator=gen).to(device) for n in (H, Hk, Hk))
    sinks = torch.randn(H, generator=gen).to(device).requires_grad_(True)
    o = module.entry(q, k, v, sinks, None, None, True, 7)
    do = torch.randn(o.shape, generator=gen).to(device)
    (dsink,) = torch.autograd.grad(o, [sinks], do)
    qd, kd, vd = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = qd @ kd.transpose(-1, -2) * D ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    s = s.masked_fill(~((j <= i) & (j > i - 7)).to(device), float("-inf"))
    lse = torch.logsumexp(torch.cat([s, sinks.double().detach().view(1, H, 1, 1).expand(B, H, T, 1)], -1), -1)
    p = torch.exp(s - lse[..., None])
    o_ref = p @ vd
    p_sink = torch.exp(sinks.double().detach().view(1, H, 1) - lse)
    expected = -(p_sink * (do.double() * o_ref).sum(-1)).sum(dim=(0, 2))
    assert rel_rms(dsink, expected) < 1e-5


# Planted bugs: the same module with one line wrong (and its own op name) must fail the checks above.
PLANTED = {
    "sink left out of the denominator": ("b_l = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0",
                                         "b_l = tl.zeros([BLOCK_M], dtype=tl.float32) + 0.0"),
    "sink gradient's sign": ("-tl.exp2(b_sink - b_lse) * b_delta", "tl.exp2(b_sink - b_lse) * b_delta"),
    "window one key short": ("ok = ok & (o_n[None, :] > o_m[:, None] + off - WINDOW)",
                             "ok = ok & (o_n[None, :] > o_m[:, None] + off - WINDOW + 1)"),
    "GQA head of the dK/dV sum": ("i_h = i_hk * GROUP + g", "i_h = i_hk + g * Hk"),
    "dq's D term dropped": ("b_ds = b_p * (b_dp - b_delta[:, None])\n        if SOFTCAP",
                            "b_ds = b_p * b_dp\n        if SOFTCAP"),
}


def _mutant(module, tmp_path, old: str, new: str, tag: str):
    """The module with ``old`` (spelled once) replaced by ``new``, under its own op name."""
    src = Path(module.__file__).read_text()
    assert src.count(old) == 1, f"the rendered module no longer spells {old!r} once"
    src = src.replace(old, new).replace(module.OP_NAME, module.OP_NAME + "_planted_" + tag)
    mutant = templating.load_module(templating.write_module(src, tmp_path / f"planted_{tag}.py"))
    mutant.set_config(CPU_CONFIG)
    return mutant


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bug_is_caught(module, device, tmp_path, bug):
    mutant = _mutant(module, tmp_path, *PLANTED[bug], str(list(PLANTED).index(bug)))
    worst = max(max(_errors(mutant, s, device).values()) for s in (SHAPES[0], SHAPES[2]))
    assert worst > 1e-2, f"planted bug {bug!r} not caught (worst relative RMS error {worst:.2e})"


# ---- the logit soft-cap: s -> c tanh(s / c) after the scaling, before the mask (Gemma 2's) -------

# (shape, c): caps that bend the scores (scale q k^T is about N(0, 1) here, so tanh(s / c) is far
# from linear), odd T, GQA, a window and an additive mask
CAPPED = [
    ((1, 4, 2, 21, 21, 16, True, 8, True, True), 1.5),  # sinks, window 8, mask, GQA 2
    ((1, 4, 1, 7, 19, 12, False, 0, True, True), 1.0),  # decode-like Tq < Tk, no sink, mask, D 12, GQA 4
]
TINY_CAPPED = ((1, 2, 1, 9, 9, 8, True, 4, True, True), 1.0)  # opcheck's and the None / 0 test's


def capped_id(case) -> str:
    return f"{shape_id(case[0])}-cap{case[1]}"


@pytest.mark.parametrize("case", CAPPED, ids=capped_id)
def test_softcap_every_gradient(module, device, case):
    """With a soft-cap: o, dq, dk, dv and d(sinks) within 1e-4 relative RMS of the eager math in
    fp32 (transformers' order: scaled, capped, masked); the cap changes the reference's output
    by far more than that, so the comparison sees it."""
    shape, cap = case
    errs = _errors(module, shape, device, softcap=cap)
    assert len(errs) == 4 + shape[6]
    bad = {n: e for n, e in errs.items() if not e <= 1e-4}
    assert not bad, f"{capped_id(case)}: {bad}"
    args = make_inputs(shape, torch.float32, device, torch.Generator().manual_seed(0))
    assert rel_rms(module.reference(*args, cap), module.reference(*args)) > 0.05


def test_softcap_none_or_zero_is_the_uncapped_kernel(module, device):
    """softcap None or 0 runs the uncapped kernels: the output and every gradient bit for bit
    those of the call without the argument; a negative or non-finite cap is refused."""
    args = make_inputs(TINY_CAPPED[0], torch.float32, device, torch.Generator().manual_seed(1))
    leaves = [a.requires_grad_(True) for a in args[:4]]
    results = []
    for extra in ([], [None], [0.0]):
        out = module.entry(*args, *extra)
        results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out))])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            module.entry(*args, bad)


# Planted soft-cap bugs: each must fail the capped comparison (the uncapped kernels are not affected).
PLANTED_CAP = {
    "dK/dV without the cap's slope (1 - tanh^2)": (
        "            if SOFTCAP:\n                b_ds = b_ds * _cap_slope(b_x, softcap)\n", ""),
    "dQ without the cap's slope (1 - tanh^2)": (
        "        if SOFTCAP:\n            b_ds = b_ds * _cap_slope(b_x, softcap)\n", ""),
    "the scale applied after the cap": ("return scale / softcap, softcap * LOG2E",
                                        "return 1.0 / softcap, softcap * scale * LOG2E"),
}


@pytest.mark.parametrize("bug", list(PLANTED_CAP))
def test_planted_softcap_bug_is_caught(module, device, tmp_path, bug):
    mutant = _mutant(module, tmp_path, *PLANTED_CAP[bug], f"cap{list(PLANTED_CAP).index(bug)}")
    shape, cap = CAPPED[0]
    worst = max(_errors(mutant, shape, device, softcap=cap).values())
    assert worst > 1e-2, f"planted bug {bug!r} not caught (worst relative RMS error {worst:.2e})"


def test_bool_mask_and_broadcast_heads(module, device):
    """A boolean mask (True: seen) over [B, H, Tq, Tk] (a head axis of its own) is the additive
    mask with -inf where False."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=gen).to(device) for _ in range(3))
    seen = torch.rand(1, 2, 9, 9, generator=gen).to(device) > 0.3
    seen[..., 0] = True
    sinks = torch.randn(2, generator=gen).to(device)
    out = module.entry(q, k, v, sinks, seen, 0.5, False, 0)
    add = torch.zeros(seen.shape, device=device).masked_fill(~seen, float("-inf"))
    assert rel_rms(out, module.reference(q, k, v, sinks, add, 0.5, False, 0)) < 1e-5


def test_strided_inputs(module, device):
    """q, k, v as transposed views of [B, T, H, D] projections (how attention modules hand them)."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 11, 4, 16, generator=gen).to(device).transpose(1, 2)
    k, v = (torch.randn(2, 11, 2, 16, generator=gen).to(device).transpose(1, 2) for _ in range(2))
    sinks = torch.randn(4, generator=gen).to(device)
    assert rel_rms(module.entry(q, k, v, sinks, None, None, True, 4),
                   module.reference(q, k, v, sinks, None, None, True, 4)) < 1e-5


def test_opcheck_and_contract(module, device):
    check_module_contract(module)
    for shape in (SHAPES[4], SHAPES[1]):
        check_opcheck(fixture(module, shape), torch.float32, device)
    check_opcheck(fixture(module, *TINY_CAPPED), torch.float32, device)


def test_shape_errors_name_shapes(module, device):
    q = torch.randn(1, 3, 4, 8, device=device)
    k = torch.randn(1, 2, 4, 8, device=device)
    with pytest.raises(ValueError, match=r"k \(1, 2, 4, 8\)"):
        module.entry(q, k, k)
    with pytest.raises(ValueError, match=r"sinks \(2,\)"):
        module.entry(q, q, q, torch.zeros(2, device=device))


@pytest.mark.slow  # sm_90 builds of ten kernel specs (the masked and the soft-capped forward, dK/dV and dQ too)
def test_aot_sm90(module):
    """Every kernel builds at D 64, 128 and 256; at D 256 (its own bucket, Gemma 2's heads) the
    unmasked, uncapped forward and backward kernels (the first four specs) spill no register."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    for size, dtype in itertools.product((64, 128, 256), ("bf16",)):
        [results] = aot.compile_files([Path(module.__file__)], size=size, dtype=dtype,
                                      registers=size == 256).values()
        assert {r.kernel for r in results} == {"sink_attn_fwd_kernel", "sink_attn_bwd_rows_kernel",
                                               "sink_attn_bwd_dkdv_kernel", "sink_attn_bwd_dq_kernel"}
        for r in results:
            assert r.ok, f"D{size}: {r.kernel}: {r.error}"
        if size == 256:
            assert [r.n_spills for r in results[:4]] == [0, 0, 0, 0], [(r.kernel, r.n_spills) for r in results]


def _aot_failures(module, tmp_path, runs, pin=None):
    """AOT-compile (sm_90) the module's kernels at each (head dim, dtype) of ``runs``; with ``pin``
    a copy whose tiles are pinned to it at import (the build runs in a child process: a pin set
    here would not reach it). The failures, as "D<d> <dtype> <kernel>: <error>"."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    path = Path(module.__file__)
    if pin is not None:
        src = path.read_text().replace(module.OP_NAME, module.OP_NAME + "_aot_pinned")
        path = templating.write_module(src + f"\n\nset_config({pin!r})\n", tmp_path / "sink_pinned.py")
    bad = []
    for size, dtype in runs:
        [results] = aot.compile_files([path], size=size, dtype=dtype, registers=False).values()
        assert {r.kernel for r in results} == {"sink_attn_fwd_kernel", "sink_attn_bwd_rows_kernel",
                                               "sink_attn_bwd_dkdv_kernel", "sink_attn_bwd_dq_kernel"}
        bad += [f"D{size} {dtype} {r.kernel}: {(r.error or '')[-300:]}" for r in results if not r.ok]
    return bad


def test_aot_sm90_small_head_dim(module, tmp_path):
    """Every kernel builds for sm_90 at head dim 8 in bf16 (the default tiles): tl.dot on a GPU
    needs each dimension >= 16 (K >= 16 for 16-bit operands), which the interpreter does not ask;
    the head-dim tile was D's power of two (8) and 10 of the H100's 30 tests failed to compile.
    The builds include every kernel that reads the additive mask with it (forward, dK/dV, dQ),
    and every kernel that applies the soft-cap with it."""
    for flag in ("HAS_MASK", "SOFTCAP"):
        built = {s["kernel"] for s in module.aot_specs("bf16", 8) if s["constexprs"].get(flag)}
        assert built == {"sink_attn_fwd_kernel", "sink_attn_bwd_dkdv_kernel", "sink_attn_bwd_dq_kernel"}, flag
    bad = _aot_failures(module, tmp_path, [(8, "bf16")])
    assert not bad, bad


@pytest.mark.slow  # three more sm_90 builds of ten kernel specs
def test_aot_sm90_small_head_dims_every_tile(module, tmp_path):
    """Head dims 8 and 12 in bf16, and 8 in fp32 (the config's "tf32" dots; triton 3.6 asks
    K >= 16 of fp32 dots too, 3.9 only 8), at the smallest tiles the tuning space holds (16
    everywhere): each dot dimension is a tile."""
    small = {k: min(v) for k, v in module.TUNING_SPACE.items() if k.startswith(("BLOCK", "BWD_BLOCK"))}
    bad = _aot_failures(module, tmp_path, [(8, "bf16"), (12, "bf16"), (8, "fp32")], pin=small)
    assert not bad, bad


def test_every_tile_is_a_dot_dimension_of_16_or_more(module):
    """The query and key tiles are dot dimensions (K of p v, of p^T dO, of ds^T q): every value
    the tuning space, the default config and the buckets can give is >= 16, and the head-dim tile
    is padded to 16."""
    tiles = ("BLOCK_M", "BLOCK_N", "BWD_BLOCK_M", "BWD_BLOCK_N")
    assert all(min(module.TUNING_SPACE[t]) >= 16 for t in tiles), module.TUNING_SPACE
    configs = [module.DEFAULT_CONFIG] + [b["config"] for b in module.SHAPE_BUCKETS]
    assert all(c[t] >= 16 for c in configs for t in tiles if t in c), configs
    assert [module._block_d(d) for d in (1, 8, 12, 16, 17, 64, 80)] == [16, 16, 16, 16, 32, 64, 128]


# ---- the binding, on transformers' own attention modules ---------------------------------------

def _causal_mask(t: int, window: int | None) -> torch.Tensor:
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    seen = (j <= i) & ((j > i - window) if window else True)
    return torch.zeros(t, t).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]


def _attention_pair(kind: str, layer: int, device=torch.device("cpu")):
    """(reference, candidate, call args) for one eager attention module of transformers: gpt-oss's
    (sinks; layer 0 sliding with window 8, layer 1 full), Gemma 2's (a logit soft-cap of 2.0, small
    enough to bend these scores; layers as gpt-oss's) or Llama's (no sink), T 13, GQA 2, on
    ``device`` (the kernel's: a GPU when there is one)."""
    import copy

    if kind == "gemma2":
        from transformers.models.gemma2 import modeling_gemma2 as mm
        cfg = mm.Gemma2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              sliding_window=8, num_hidden_layers=2, query_pre_attn_scalar=8,
                              attn_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention"])
        cls = mm.Gemma2Attention
    elif kind == "gpt_oss":
        from transformers.models.gpt_oss import modeling_gpt_oss as mm
        cfg = mm.GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              sliding_window=8, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"])
        cls = mm.GptOssAttention
    else:
        from transformers.models.llama import modeling_llama as mm
        cfg = mm.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_hidden_layers=2)
        cls = mm.LlamaAttention
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = cls(cfg, layer_idx=layer)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cand = copy.deepcopy(ref)
    t = 13
    x = torch.randn(2, t, 32)
    ang = torch.randn(2, t, 4 if kind == "gpt_oss" else 8)
    if kind != "gpt_oss":
        ang = torch.cat([ang[..., :4], ang[..., :4]], -1)
    window = getattr(ref, "sliding_window", None)
    ref, cand = ref.to(device), cand.to(device)
    return ref, cand, (x.to(device), (ang.cos().to(device), ang.sin().to(device)),
                       _causal_mask(t, window).to(device))


def _bind(cand, kernel, capped=None):
    """The family binding's swap on ``cand`` with ``kernel`` as the entry, for a core that caps its
    scores or not (``capped``, as `bind` reads the graph; None: not known); its patch record."""
    import importlib

    from onboarding.families import family_module
    from onboarding.patching.callswap import install
    from onboarding.patching.core import PatchRecord

    binding = importlib.import_module(family_module("sink_attention").__package__ + ".binding")
    record = PatchRecord(path="attn", kind="attention.full", family="sink_attention")
    assert install(cand, kernel, record, binding.interface(capped), "none") is not None
    return record


def _run(mod, args):
    for p in mod.parameters():
        p.grad = None
    out, _ = mod(*args)
    out.square().sum().backward()
    return out, {n: p.grad for n, p in mod.named_parameters()}


@pytest.mark.parametrize("kind,layer", [("gpt_oss", 0), ("gpt_oss", 1), ("llama", 0)],
                         ids=["gpt_oss-sliding", "gpt_oss-full", "llama-nosink"])
def test_binding_serves_transformers_attention(module, device, kind, layer):
    """The swap serves the eager attention function transformers' module hands its core to
    (handed the module itself): the output and every parameter gradient (projections, sinks)
    as the unpatched module's, the second output (attention weights) None. The mask handed is
    transformers' pure causal / sliding-window one: it adds nothing to the kernel's band and the
    kernel runs without it."""
    pytest.importorskip("transformers")
    ref, cand, args = _attention_pair(kind, layer, device)
    calls = []

    def kernel(q, k, v, sinks, mask, scale, causal, window):
        calls.append((sinks, causal, window, mask))
        return module.entry(q, k, v, sinks, mask, scale, causal, window)

    record = _bind(cand, kernel)
    y, grads = _run(cand, args)
    assert record.status == "active" and "eager_attention_forward" in record.binding, record
    # the reading kept: the block's sink parameter (gpt-oss), the layer's window as the band
    sinks, causal, window, mask = calls[-1]
    assert sinks is getattr(cand, "sinks", None) and causal and window == (getattr(cand, "sliding_window", None) or 0)
    assert all(c[3] is None for c in calls), "the pure causal / window mask was handed to the kernel"
    assert cand(*args)[1] is None
    y_ref, ref_grads = _run(ref, args)
    assert rel_rms(y, y_ref) < 1e-5
    assert (kind == "gpt_oss") == ("sinks" in grads)
    for n, g in ref_grads.items():
        assert rel_rms(grads[n], g) < 1e-5, n


def test_binding_keeps_the_original_when_the_kernel_drops_the_sink(module, device):
    """A kernel that leaves the sink out (planted) disagrees with gpt-oss's eager function on the
    first call under every reading: the swap is refused, and the block runs its own code."""
    pytest.importorskip("transformers")
    ref, cand, args = _attention_pair("gpt_oss", 0, device)

    def no_sink(q, k, v, sinks, mask, scale, causal, window):
        return module.entry(q, k, v, None, mask, scale, causal, window)

    record = _bind(cand, no_sink)
    y, _ = _run(cand, args)
    assert record.status == "rejected", record
    assert rel_rms(y, ref(*args)[0]) < 1e-6


@pytest.mark.parametrize("layer,capped", [(0, True), (1, True), (0, None)],
                         ids=["sliding", "full", "sliding-graph-unknown"])
def test_binding_serves_a_softcapped_core(module, device, layer, capped):
    """Gemma 2's eager attention function, handed its logit soft-cap as ``softcap``: the swap keeps
    the reading with the call's cap (told by the graph that the core caps its scores, or not told:
    the call's cap is tried first), and the output and every parameter gradient are the unpatched
    module's."""
    pytest.importorskip("transformers")
    ref, cand, args = _attention_pair("gemma2", layer, device)
    calls = []

    def kernel(q, k, v, sinks, mask, scale, causal, window, softcap=None):
        calls.append((sinks, causal, window, softcap))
        return module.entry(q, k, v, sinks, mask, scale, causal, window, softcap)

    record = _bind(cand, kernel, capped)
    y, grads = _run(cand, args)
    assert record.status == "active" and "eager_attention_forward" in record.binding, record
    assert calls[-1] == (None, True, cand.sliding_window or 0, 2.0), calls[-1]
    y_ref, ref_grads = _run(ref, args)
    assert rel_rms(y, y_ref) < 1e-5
    for n, g in ref_grads.items():
        assert rel_rms(grads[n], g) < 1e-5, n


def test_binding_keeps_the_original_when_the_kernel_drops_the_softcap(module, device):
    """A kernel that ignores the soft-cap (planted: the entry as it was before it took one) is
    refused on the first call (these scores are bent by the cap): the block runs its own code."""
    pytest.importorskip("transformers")
    ref, cand, args = _attention_pair("gemma2", 0, device)

    def no_cap(q, k, v, sinks, mask, scale, causal, window, softcap=None):
        return module.entry(q, k, v, sinks, mask, scale, causal, window)

    record = _bind(cand, no_cap, capped=True)
    y, _ = _run(cand, args)
    assert record.status == "rejected" and "output" in record.detail, record
    assert rel_rms(y, ref(*args)[0]) < 1e-6


def _band_mask_module():
    import importlib

    from onboarding.families import family_module

    return importlib.import_module(family_module("sink_attention").__package__ + ".band_mask")


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_binding_keeps_a_padded_mask(module, device, layer):
    """A batch whose second sequence is right-padded (keys 10-12 hidden from every query, inside
    the band): the mask carries information the band does not, so the kernel gets it, and the
    output and every gradient are the unpatched module's (a swap that dropped it would also fail
    the first call's check and be rejected)."""
    pytest.importorskip("transformers")
    ref, cand, (x, pos, mask) = _attention_pair("gpt_oss", layer, device)
    mask = mask.expand(2, 1, -1, -1).clone()
    mask[1, :, :, 10:] = torch.finfo(torch.float32).min
    args = (x, pos, mask)
    calls = []

    def kernel(q, k, v, sinks, m, scale, causal, window):
        calls.append(m)
        return module.entry(q, k, v, sinks, m, scale, causal, window)

    record = _bind(cand, kernel)
    y, grads = _run(cand, args)
    assert record.status == "active", record
    assert calls and all(m is mask for m in calls), "the padded mask was not handed to the kernel"
    y_ref, ref_grads = _run(ref, args)
    assert rel_rms(y, y_ref) < 1e-5
    for n, g in ref_grads.items():
        assert rel_rms(grads[n], g) < 1e-5, n


def test_band_mask_verdicts(device):
    """`adds_nothing`: True only when the mask is 0 (True) at every (query, key) of the band;
    whatever it holds outside the band does not count. Bottom-right aligned when Tq < Tk."""
    bm = _band_mask_module()
    t, lo = 11, torch.finfo(torch.float32).min
    causal = _causal_mask(t, None).to(device)
    window4 = _causal_mask(t, 4).to(device)
    assert bm.adds_nothing(causal, t, t, True, 0)
    assert bm.adds_nothing(causal, t, t, True, 4)  # the band narrower than the mask: nothing to add
    assert bm.adds_nothing(window4, t, t, True, 4)
    assert not bm.adds_nothing(window4, t, t, True, 0)  # the window is the mask's alone
    assert not bm.adds_nothing(window4, t, t, True, 5)
    assert not bm.adds_nothing(causal, t, t, False, 0)
    assert bm.adds_nothing(window4 == 0, t, t, True, 4) and not bm.adds_nothing(window4 == 0, t, t, True, 0)
    junk = causal.clone()
    junk[..., 2, 7] = 3.0  # above the diagonal: outside the causal band
    assert bm.adds_nothing(junk, t, t, True, 0)
    for val in (0.5, lo, float("nan")):  # a bias, a padded key, a NaN inside the band
        bad = causal.clone()
        bad[..., 7, 2] = val
        assert not bm.adds_nothing(bad, t, t, True, 0), val
    # decode-like: 3 queries at the end of 9 keys, causal (bottom-right)
    dec = _causal_mask(9, None)[..., -3:, :].to(device)
    assert bm.adds_nothing(dec, 3, 9, True, 0)
    assert not bm.adds_nothing(_causal_mask(9, None)[..., :3, :].to(device), 3, 9, True, 0)
    # rows compared in chunks: a padded key in the last chunk counts
    old = bm.ROWS_PER_CHUNK
    try:
        bm.ROWS_PER_CHUNK = 4
        bad = causal.clone()
        bad[..., 10, 0] = lo
        assert bm.adds_nothing(causal, t, t, True, 0) and not bm.adds_nothing(bad, t, t, True, 0)
    finally:
        bm.ROWS_PER_CHUNK = old


def test_band_mask_reads_only_the_band(device):
    """The causal paths read only the band's entries (a window's Tq x W gathered entries, the
    lower triangle): their verdicts equal the dense one (every entry against `implied_seen`) on
    random masks with one planted entry in or out of the band, at square, decode-like (Tq < Tk),
    query-broadcast and batch-broadcast shapes, float and bool."""
    bm = _band_mask_module()
    gen = torch.Generator().manual_seed(0)

    def dense(mask, tq, tk, causal, window):
        seen = bm.implied_seen(tq, tk, causal, window, mask.device)
        info = ~mask if mask.dtype == torch.bool else mask != 0
        return not bool((info & seen).any())

    checked = {True: 0, False: 0}
    for tq, tk, lead, qrows in ((13, 13, (1, 1), 13), (3, 11, (2, 1), 3), (9, 9, (1, 1), 1),
                                (16, 21, (2, 3), 16)):
        for window in (0, 1, 4, tk - 1, tk + 2):
            for trial in range(6):
                seen = bm.implied_seen(qrows if qrows == tq else 1, tk, True, window, "cpu") \
                    if qrows == tq else torch.ones(1, tk, dtype=torch.bool)
                mask = torch.zeros(*lead, qrows, tk)
                mask = mask.masked_fill(~seen, float("-inf")) if trial % 2 else mask
                r = int(torch.randint(qrows, (1,), generator=gen))
                c = int(torch.randint(tk, (1,), generator=gen))
                mask[..., r, c] = (0.5, float("-inf"), float("nan"), 0.0)[trial % 4]
                for m in (mask, mask == 0):
                    m = m.to(device)
                    want = dense(m, tq, tk, True, window)
                    assert bm.adds_nothing(m, tq, tk, True, window) == want, (tq, tk, lead, window, trial)
                    checked[want] += 1
    assert checked[True] > 10 and checked[False] > 10, checked  # both verdicts exercised


def test_mask_guard_rereads_a_changed_mask(device):
    """`MaskGuard.needed` reads the values once per mask object and reuses the verdict while the
    object is unchanged; an in-place write (its version), another object, another band or shape
    re-reads them: a padded key written into a mask judged empty is then kept."""
    bm = _band_mask_module()
    guard = bm.MaskGuard()
    t = 11
    q = torch.zeros(1, 2, t, 8, device=device)
    mask = _causal_mask(t, None).to(device)
    assert guard.needed(mask, q, q, True, 0) is None and guard.reads == 1
    assert guard.needed(mask, q, q, True, 0) is None and guard.reads == 1  # the same object: kept
    assert guard.needed(mask, q, q, False, 0) is mask and guard.reads == 2  # another band
    mask[..., 6, 1] = torch.finfo(torch.float32).min  # padding written in place
    assert guard.needed(mask, q, q, True, 0) is mask and guard.reads == 3
    fresh = _causal_mask(t, None).to(device)
    assert guard.needed(fresh, q, q, True, 0) is None and guard.reads == 4
    assert guard.needed(None, q, q, True, 0) is None
    with torch.inference_mode():  # no version counter: read on every call
        frozen = _causal_mask(t, None).to(device)
        assert guard.needed(frozen, q, q, True, 0) is None and guard.reads == 5
        frozen[..., 6, 1] = torch.finfo(torch.float32).min
        assert guard.needed(frozen, q, q, True, 0) is frozen and guard.reads == 6


def test_problem_dims_and_timing_inputs(parse_model, module, device):
    """The tuning hooks read gpt-oss's attention layout off the parsed proxy (B, T off the input,
    H off the scores, D and Hk off the projections' shapes, the sink parameter), and the timing
    inputs at those dims run the kernel."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from onboarding.families import families

    spec = families()["sink_attention"]
    g = parse_model("hf:gpt_oss")
    blocks = [b for b in g.blocks if spec.match(b) is not None]
    assert {b.kind for b in blocks} == {"attention.sliding", "attention.full"}
    for b in blocks:
        dims = spec.problem_dims(SimpleNamespace(shapes=[t.shape for t in b.inputs]), b)
        assert dims is not None and dims["H"] == b.attrs["unfused_core"]["scores"][1] and dims["S"] == 1, dims
        q_rows = max(s[0] for s in b.params.values() if len(s) == 2)
        assert dims["H"] * dims["D"] == q_rows and dims["H"] % dims["Hk"] == 0, (dims, b.params)
    # the hook draws on its generator's device (the tune worker hands it one on the GPU)
    gen = torch.Generator(device=device).manual_seed(0)
    args = spec.timing_inputs("attention", {}, {**dims, "T": 9, "W": 4}, torch.float32, gen)
    assert all(a.device.type == device.type for a in args if isinstance(a, torch.Tensor))
    out = module.entry(*args)
    assert out.shape == (dims["B"], dims["H"], 9, dims["D"])
    assert rel_rms(out, module.reference(*args)) < 1e-5
    assert dims["C"] == 0 and args[-1] is None


def test_problem_dims_time_the_softcapped_kernels(module, device):
    """A block whose core soft-caps its scores (the graph's ``unfused_core.softcap``) is timed with
    a cap (C 1); without the mark, with none."""
    from types import SimpleNamespace

    from onboarding.families import families

    spec = families()["sink_attention"]
    params = {"q.weight": [32, 32], "k.weight": [16, 32], "v.weight": [16, 32], "o.weight": [32, 32]}
    entry = SimpleNamespace(shapes=[[1, 9, 32]])
    for capped in (True, False):
        core = {"scores": [1, 4, 9, 9], "score_gemms": 0, **({"softcap": True} if capped else {})}
        block = SimpleNamespace(attrs={"unfused_core": core}, params=params)
        dims = spec.problem_dims(entry, block)
        assert dims == {"B": 1, "T": 9, "H": 4, "Hk": 2, "D": 8, "S": 0, "C": int(capped)}, dims
        args = spec.timing_inputs("attention", {}, dims, torch.float32, torch.Generator(device=device).manual_seed(0))
        assert (args[-1] == 50.0) if capped else (args[-1] is None)
    assert rel_rms(module.entry(*args[:-1], 2.0), module.reference(*args[:-1], 2.0)) < 1e-5
