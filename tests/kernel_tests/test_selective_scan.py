"""Mamba-1 selective-scan family: forward, final state and every gradient (u, delta, A, B, C, D, z,
delta_bias, initial_state) against the reference in fp32 on tiny shapes (the interpreter is slow):
odd T, T not a multiple of the kernel's tile, grouped B/C, initial states, several channel blocks,
non-contiguous [B, T, D] views as the mixers pass them; bf16 against fp32 on the GPU at the
0.005 / 0.01 relative-RMS bars; the decode step chained to the scan; opcheck; match by structure;
the rendered module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from kernel_cases import check_match, check_sample_inputs_fit, zero_fill_shapes

from onboarding.families import family_module
from onboarding.graph.opgraph import Block
from onboarding.testing import (
    KernelFixture,
    check_aot_sm90,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
)
from onboarding.testing.tolerance import rel_rms

# BLOCK_T 8: T=19 spans three tiles, the last one partial; BLOCK_D 8: D=12 two channel blocks;
# BWD_BLOCK_T 16 (the "nt" backward): T=19 two chunks, the forward storing every second tile's
# start state, T <= 8 one chunk of 8.
CPU_CONFIG = {"BLOCK_D": 8, "BLOCK_T": 8, "num_warps": 4, "BWD_BLOCK_D": 8, "bwd_warps": 4,
              "BWD_BLOCK_T": 16, "fwd_order": "dnt", "bwd_order": "dnt"}
# (fwd_order, bwd_order): each kernel in both tile orders, a forward of one order feeding a
# backward of the other (the tile-start states they share), and the "nt" backward after each
# forward
ORDERS = [("dnt", "dnt"), ("tdn", "tdn"), ("tdn", "dnt"), ("tdn", "nt"), ("dnt", "nt")]
# (B, D, T, N, G (0: ungrouped [B, N, T]), D skip / z / delta bias, initial state)
SHAPES = [
    (1, 12, 19, 4, 0, True, True),     # 3 tiles (last partial), 2 channel blocks, N < 16
    (1, 16, 7, 16, 2, True, False),    # odd T < tile, 2 groups of 8 channels
    (1, 8, 8, 5, 0, False, True),      # T = one tile exactly, no D / z / bias, N not a power of 2
]


def shape_id(s) -> str:
    b, d, t, n, g, extra, h0 = s
    return f"B{b}D{d}T{t}N{n}G{g}" + ("-Dzb" if extra else "") + ("-h0" if h0 else "")


def make(shape, *, bt_layout=False):
    """make_inputs(dtype, device, gen) for `shape`; `bt_layout`: u, delta, z as [B, T, D] tensors
    transposed to [B, D, T] views (what the mixers pass)."""
    b, d, t, n, g, extra, h0 = shape

    def make_inputs(dtype, device, gen):
        def r(*s, scale=1.0):
            return (scale * torch.randn(*s, generator=gen)).to(device, dtype)

        def seq():
            return r(b, t, d).transpose(1, 2) if bt_layout else r(b, d, t)

        A = (-torch.exp(torch.randn(d, n, generator=gen))).to(device, dtype)
        bc = (b, n, t) if g == 0 else (b, g, n, t)
        return [seq(), seq(), A, r(*bc, scale=0.5), r(*bc, scale=0.5), r(d) if extra else None,
                seq() if extra else None, (r(d) - 1.0) if extra else None, True, True,
                r(b, d, n) if h0 else None]

    return make_inputs


def fixture(module, shape, **kw) -> KernelFixture:
    # A, B, C, D, delta_bias gradients are sums over time and/or channels
    return KernelFixture(name=f"selective_scan/{shape_id(shape)}", module=module,
                         make_inputs=make(shape, **kw), weights=(2, 3, 4, 5, 7))


@pytest.fixture()
def module(load_kernel):
    return load_kernel("selective_scan", "scan", {}, CPU_CONFIG)


def _pinned(module, device, cfg: dict):
    """Pin `cfg` over the tiles the module runs on `device` (CPU_CONFIG in the interpreter, the
    defaults on a GPU); returns the undo."""
    base = CPU_CONFIG if device.type == "cpu" else {}
    module.set_config({**base, **cfg})
    return lambda: module.set_config(base or None)


@pytest.fixture(params=ORDERS, ids=lambda o: f"{o[0]}-{o[1]}")
def ordered(module, device, request):
    """The module with its forward and backward in each order of ORDERS."""
    fwd, bwd = request.param
    undo = _pinned(module, device, {"fwd_order": fwd, "bwd_order": bwd})
    yield module
    undo()


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_forward_backward(ordered, device, shape):
    check_forward_backward(fixture(ordered, shape), torch.float32, device)


def test_tdn_odd_tiles(module, device):
    """The "tdn" kernels at other tiles: 3 channels per group (a 4-wide block, one row masked),
    T 13 over tiles of 8 (the last partial), N 3, fewer warps than the lanes need."""
    undo = _pinned(module, device, {"BLOCK_D": 4, "BLOCK_T": 8, "num_warps": 2, "BWD_BLOCK_D": 2,
                                    "bwd_warps": 1, "fwd_order": "tdn", "bwd_order": "tdn"})
    try:
        check_forward_backward(fixture(module, (2, 6, 13, 3, 2, True, True)), torch.float32, device)
    finally:
        undo()


@pytest.mark.parametrize("cfg", [{"BWD_BLOCK_D": 1, "bwd_warps": 1, "BWD_BLOCK_T": 16},
                                 {"BWD_BLOCK_D": 4, "bwd_warps": 2, "BWD_BLOCK_T": 32, "bwd_maxnreg": 128}],
                         ids=["d1-t16", "d4-t32-maxnreg"])
def test_nt_chunks_and_channel_blocks(module, device, cfg):
    """The "nt" backward at other tiles: 3 channels per group (a 4-wide block has a masked row),
    T 40 over chunks of 16 (three chunks: the carries' two slots end on the odd parity, the last
    chunk partial) or 32 (two), N 3, initial states and every gradient; the forward's stored
    states are one per chunk; on the GPU the second also under a register cap (`maxnreg`, a
    compile option the interpreter drops)."""
    undo = _pinned(module, device, {"BLOCK_D": 4, "BLOCK_T": 8, "num_warps": 2, "fwd_order": "tdn",
                                    "bwd_order": "nt", **cfg})
    try:
        shape = (2, 6, 40, 3, 2, True, True)
        check_forward_backward(fixture(module, shape), torch.float32, device)
        args = make(shape)(torch.float32, device, torch.Generator().manual_seed(0))
        _, _, ck = module.selective_scan_fwd_op(*args[:8], args[10], True)
        assert ck.shape == (2, 6, -(-40 // cfg["BWD_BLOCK_T"]), 3)
    finally:
        undo()


def test_backward_fills_no_zero_gradient_for_unused_outputs(module, device):
    """The stored states reach the backward as None (v5), not as zeros autograd fills: no fill of
    their shape while it runs (the final state's zero gradient, which the kernel reads, is the
    backward's own, once); the gradients still match."""
    shape = (1, 16, 40, 4, 0, True, True)
    args = make(shape)(torch.float32, device, torch.Generator().manual_seed(5))
    args[9] = True  # return_last_state: the final state is an output the loss leaves unused
    u, delta, A, B, C, D, z, bias, softplus, _, h0 = args
    states = module.selective_scan_fwd_op(u, delta, A, B, C, D, z, bias, h0, softplus)[2]
    leaves = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    y, _ = module.entry(*leaves)
    fills = zero_fill_shapes((y * torch.randn_like(y)).sum())
    assert list(states.shape) not in fills, (list(states.shape), fills)
    assert [s for s in fills if s == [1, 16, 4]] in ([[1, 16, 4]], [[1, 16, 4]] * 2), fills  # zero_ (+ its fill_)
    check_forward_backward(fixture(module, shape), torch.float32, device)


def test_backward_refuses_states_of_another_spacing(module, device):
    """The backward reads the stored states at the spacing the forward wrote them; a mismatch is
    an error, not a silently wrong gradient."""
    args = make((1, 4, 20, 2, 0, False, False))(torch.float32, device, torch.Generator().manual_seed(0))
    undo = _pinned(module, device, {"fwd_order": "tdn", "bwd_order": "nt"})
    try:
        y, ht, ck = module.selective_scan_fwd_op(*args[:8], None, True)
        with pytest.raises(ValueError, match="do not cover T 20 in steps of 8"):
            module.selective_scan_bwd_op(torch.ones_like(y), torch.zeros_like(ht), *args[:8], None, ck, 8, True)
    finally:
        undo()


def test_strided_inputs_and_no_softplus(ordered, device):
    module = ordered
    """u, delta, z as transposed [B, T, D] views (the mixer's layout, no copy), and raw dt."""
    check_forward_backward(fixture(module, (1, 12, 9, 4, 0, True, True), bt_layout=True),
                           torch.float32, device)
    fx = fixture(module, (1, 8, 5, 4, 0, False, False))
    base = fx.make_inputs
    fx.make_inputs = lambda dtype, dev, gen: [a.abs() if i == 1 else (False if i == 8 else a)
                                              for i, a in enumerate(base(dtype, dev, gen))]
    check_forward_backward(fx, torch.float32, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 bars are for the GPU kernels")
@pytest.mark.parametrize("shape", [(2, 96, 300, 16, 0, True, True), (1, 64, 129, 16, 2, True, False)],
                         ids=shape_id)
@pytest.mark.parametrize("order", ["dnt", "tdn", "tdn-nt"])
def test_bf16_against_fp32(module, device, shape, order):
    """bf16 storage against the fp32 reference on the same (bf16-representable) values: output
    within 0.005 and every gradient within 0.01 relative RMS (the bars used for GDN)."""
    fwd, _, bwd = order.partition("-")
    module.set_config({"fwd_order": fwd, "bwd_order": bwd or fwd})
    try:
        _bf16_against_fp32(module, device, shape)
    finally:
        module.set_config(None)


def _bf16_against_fp32(module, device, shape):
    gen = torch.Generator().manual_seed(5)
    args = make(shape)(torch.bfloat16, device, gen)
    args[7] = None if args[7] is None else args[7].float()  # the mixers' fp32 D, bias and A
    args[5] = None if args[5] is None else args[5].float()
    args[2] = args[2].float()
    if args[10] is not None:
        args[10] = args[10].float()
    lo = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
    hi = [a.detach().float().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
    y, ht = module.entry(*lo)
    y32, ht32 = module.reference(*hi)
    dy = torch.randn(y.shape, device=device, generator=torch.Generator(device).manual_seed(1))
    ts = [i for i, a in enumerate(lo) if isinstance(a, torch.Tensor)]
    g = torch.autograd.grad((y, ht), [lo[i] for i in ts], (dy.to(y.dtype), torch.zeros_like(ht)))
    g32 = torch.autograd.grad((y32, ht32), [hi[i] for i in ts], (dy, torch.zeros_like(ht32)))
    errs = {"y": rel_rms(y, y32), "ht": rel_rms(ht, ht32)}
    errs.update({f"d{i}": rel_rms(a, b) for i, a, b in zip(ts, g, g32)})
    assert errs["y"] <= 0.005 and errs["ht"] <= 0.005, errs
    assert all(v <= 0.01 for k, v in errs.items() if k.startswith("d")), errs


def test_reference_matches_transformers_torch_path(module):
    """The reference equals transformers' Mamba-1 torch scan (its token loop) where that applies
    (no initial state, ungrouped B/C)."""
    mm = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    fn = getattr(mm, "mamba_selective_scan", None)
    if fn is None:
        pytest.skip("this transformers runs Mamba-1's scan inline")
    import inspect

    args = make((2, 6, 11, 4, 0, True, False))(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(2))
    u, delta, A, B, C, D, z, bias = args[:8]
    y, ht = inspect.unwrap(fn)(u, delta, A, B, C, D, z, bias, True, True)
    ry, rht = module.reference(u, delta, A, B, C, D, z, bias, True, True)
    torch.testing.assert_close(ry, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rht, ht, rtol=1e-5, atol=1e-5)


def test_decode_steps_chain_to_the_scan(module, device):
    """selective_state_update token by token from an initial state gives the scan's outputs and
    final state (grouped B/C, D, z, bias, softplus)."""
    b, d, t, n, g = 1, 16, 5, 8, 2
    args = make((b, d, t, n, g, True, True))(torch.float32, device, torch.Generator().manual_seed(4))
    u, delta, A, B, C, D, z, bias, _, _, h0 = args
    y, ht = module.entry(u, delta, A, B, C, D, z, bias, True, True, h0)
    state = h0.clone()
    ys = [module.selective_state_update(state, u[..., i], delta[..., i], A, B[..., i], C[..., i], D, z[..., i],
                                        bias, True) for i in range(t)]
    torch.testing.assert_close(torch.stack(ys, -1), y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ht, rtol=1e-4, atol=1e-4)


def test_opcheck_and_contract(module, device):
    check_module_contract(module)
    check_opcheck(fixture(module, (1, 4, 3, 2, 0, True, True)), torch.float32, device)


def test_opcheck_nt_backward(module, device):
    """opcheck with the "nt" backward (its carries' buffer, the stored states every chunk)."""
    undo = _pinned(module, device, {"fwd_order": "tdn", "bwd_order": "nt"})
    try:
        check_opcheck(fixture(module, (1, 4, 11, 2, 0, True, True)), torch.float32, device)
    finally:
        undo()


def test_sample_inputs_fit(module):
    check_sample_inputs_fit(module, family_module("selective_scan"), "scan", {}, [1, 19, 32])


def mixer_block(scan="selective", kind="linear_attention.mamba") -> Block:
    attrs = {"per_channel_decay": True, "inner": 256, "state": 16, "dt_rank": 48, "conv_width": 4}
    if scan:
        attrs["scan"] = scan
    return Block(path="backbone.layers.0.mixer", kind=kind, layer=0, class_name="X", evidence=[],
                 op_histogram={"softplus": 1, "exp": 2}, inputs=[], outputs=[], params={}, attrs=attrs)


def test_match_by_structure():
    fam = family_module("selective_scan")
    check_match(fam, mixer_block(), ("scan", {}))
    check_match(fam, mixer_block(scan=None), None)  # Mamba-2's SSD block: no selective scan
    check_match(fam, mixer_block(kind="linear_attention.gated_delta"), None)


def test_a_user_written_mamba1_model_is_read_and_served(parse_model, module, device):
    """A Mamba-1 mixer under names of its own (no transformers class, its own scan function) is
    classified by structure, matched, and its scan served: the binding finds the function by its
    signature and the mixer's output and gradients stay the same."""
    from fixtures.user_models import SelectiveMixer

    from onboarding.patching.core import PatchRecord

    g = parse_model("tests/fixtures/user_models.py:SelectiveScanLM")
    mixers = [b for b in g.blocks if b.kind == "linear_attention.mamba"]
    assert [b.path for b in mixers] == ["mixers.0", "mixers.1"]
    assert {k: mixers[0].attrs[k] for k in ("scan", "inner", "state", "dt_rank", "conv_width", "norm_bc")} == {
        "scan": "selective", "inner": 32, "state": 4, "dt_rank": 3, "conv_width": 3, "norm_bc": False}
    fam = family_module("selective_scan")
    check_match(fam, mixers[0], ("scan", {}))
    torch.manual_seed(0)
    mixer = SelectiveMixer(16, 32, 4, 3).to(device)
    x = torch.randn(1, 11, 16, device=device)
    ref = mixer(x)
    record = PatchRecord(path="mixers.0", kind="linear_attention.mamba", family="selective_scan")
    undo = fam.FAMILY.binding(mixers[0], mixer, [module], record, mixer)
    try:
        mixer(x)
        out = mixer(x)
    finally:
        undo()
    assert record.status == "active" and "ssm_scan" in record.binding, (record.status, record.detail)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rendered_module_imports_only_torch_triton_stdlib(module):
    tree = ast.parse(Path(module.__file__).read_text())
    roots = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert roots <= {"torch", "triton", "typing", "os"}, roots


def test_shape_errors_name_shapes(module, device):
    u = torch.randn(1, 4, 6, device=device)
    with pytest.raises(ValueError, match=r"B and C must be \[B, N, T\].*B \(1, 3, 5\)"):
        module.selective_scan(u, u, -torch.ones(4, 3), torch.randn(1, 3, 5), torch.randn(1, 3, 5))


@pytest.mark.slow  # sm_90 build, nightly: 15.1 s on CI's cold Triton cache (28th session)
def test_aot_sm90(module):
    """The scan kernels compile for sm_90 (what the interpreter cannot check: the associative
    scans' lowering, loop-carried types) and fit an SM's shared memory."""
    check_aot_sm90([module.__file__])


def test_binding_serves_a_mixers_scan(module, device):
    """The binding swaps the selective-scan function a Mamba-1 mixer calls (found by signature),
    calibrates on the first call and keeps the kernel: the first call (after its check) and
    later calls run it, output and every parameter gradient equal the unpatched mixer's; undo
    restores the mixer."""
    mm = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    from transformers import MambaConfig

    from onboarding.patching.core import PatchRecord

    bind = family_module("selective_scan").FAMILY.binding
    cfg = MambaConfig(hidden_size=8, intermediate_size=16, state_size=4, num_hidden_layers=1, vocab_size=32,
                      time_step_rank=2, conv_kernel=3)
    torch.manual_seed(0)
    mixer = mm.MambaMixer(cfg, 0).to(device)
    x = torch.randn(2, 9, 8, device=device)
    ref = mixer(x)
    ref_grads = torch.autograd.grad(ref.sum(), list(mixer.parameters()))
    record = PatchRecord(path="mixer", kind="linear_attention.mamba", family="selective_scan")
    undo = bind(mixer_block(), mixer, [module], record, mixer)
    assert undo is not None and record.binding.startswith("calibrating")
    calls = []
    real = module.selective_scan_fwd_op
    module.selective_scan_fwd_op = lambda *a: calls.append(1) or real(*a)
    try:
        mixer(x)  # calibration: ours checked against the original, then ours serves the call
        assert record.status == "active", record.detail
        out = mixer(x)
        grads = torch.autograd.grad(out.sum(), list(mixer.parameters()))
    finally:
        module.selective_scan_fwd_op = real
        undo()
    assert len(calls) == 3 and "forward" not in mixer.__dict__  # check + first call, second call
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-5)
