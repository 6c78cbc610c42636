"""Mamba-2 SSD scan family: forward, final state and every gradient (x, dt, A, B, C, D, dt_bias,
initial_state) against the chunked reference, fp32 (and one bf16 case) on tiny shapes (the interpreter is slow):
odd T, T not a multiple of the reference chunk nor of the kernels' chunk, grouped B/C, initial
states, several P and N blocks; the decode step; opcheck; imports of the rendered module; on a GPU,
the bf16 path against the fp32 path at the GDN bars."""

from __future__ import annotations

import ast
import importlib
import math
from pathlib import Path

import pytest
import torch
from kernel_cases import (
    OPCHECK_SPLIT,
    LaunchSpy,
    assert_within_bars,
    check_match,
    check_sample_inputs_fit,
    fp16_dot_path,
)

from onboarding.families import family_module
from onboarding.generate import aot
from onboarding.graph.opgraph import Block
from onboarding.testing import (
    KernelFixture,
    check_forward_backward,
    check_module_contract,
    check_opcheck,
    poisoned,
)
from onboarding.testing.bounds import checked_when_interpreted, interpreting

PARAMS = {"chunk_size": 16}
# CHUNK 16: T=23 spans two kernel chunks, the last one partial; T=7 one partial chunk.
# DBC_N, STATE_N, SCAN_N 16: N=24 gives the dB/dC, chunk-state and chunk output kernels two N
# blocks, the second partial. gstate and pass keep the bucket's defaults (P <= 64: 16-bit
# end-state gradients for 16-bit inputs, the fused pass); STATE_CHUNKS 4 (state chunks of 4 kernel
# chunks, the P <= 64 bucket's value until template v18, whose default is 1): the tests that take
# the one-chunk state passes (split or fused) pin STATE_CHUNKS 1, and the bucket's own default runs
# in test_fp16_vs_fp32_interpreted[default], test_split_backward[sc1-fused-T41] and, on a GPU,
# test_bf16_vs_fp32_on_gpu[default]. `fwd` "scan": most tests
# here check the scan forward's options (the P > 64 bucket's forward); the P <= 64 bucket's
# "split" forward has its own tests (test_split_forward, test_split_forward_backward), which set it.
CPU_CONFIG = {"CHUNK": 16, "BLOCK_P": 16, "BLOCK_N": 16, "BLOCK_S": 256, "num_warps": 4, "bwd_warps": 4,
              "dot": "tf32", "DBC_N": 16, "STATE_N": 16, "SCAN_N": 16, "fwd": "scan", "STATE_CHUNKS": 4}
# (B, T, H, P, G, N, D and dt_bias, initial state)
SHAPES = [
    (1, 23, 2, 20, 1, 24, True, True),    # two chunks, the last partial; 2 P and 2 N blocks
    (2, 7, 4, 8, 2, 16, True, False),    # odd T < chunk, 2 groups of 2 heads
    (1, 16, 2, 8, 2, 8, False, True),     # T = one chunk exactly, no D / dt_bias, G = H
]


def shape_id(s) -> str:
    b, t, h, p, g, n, skip, h0 = s
    return f"B{b}T{t}H{h}P{p}G{g}N{n}" + ("-D" if skip else "") + ("-h0" if h0 else "")


def fixture(module, shape, dt_limit=(0.0, math.inf), softplus=True) -> KernelFixture:
    b, t, h, p, g, n, skip, h0 = shape

    def make_inputs(dtype, device, gen):
        def r(*s, scale=1.0):
            return (scale * torch.randn(*s, generator=gen)).to(device, dtype)
        A = (-torch.exp(torch.rand(h, generator=gen))).to(device, dtype)
        return [r(b, t, h, p), r(b, t, h), A, r(b, t, g, n, scale=0.5), r(b, t, g, n, scale=0.5),
                r(h) if skip else None, r(h) if skip else None, softplus, dt_limit,
                r(b, h, p, n) if h0 else None, True]

    # A, D, dt_bias, B and C gradients are sums over time (and heads, head dim)
    return KernelFixture(name=f"ssd/{shape_id(shape)}", module=module, make_inputs=make_inputs,
                         weights=(2, 3, 4, 5, 6))


@pytest.fixture()
def module(load_kernel):
    return load_kernel("ssd", "scan", PARAMS, CPU_CONFIG)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_forward_backward(module, device, shape):
    check_forward_backward(fixture(module, shape), torch.float32, device)


SC1 = {"STATE_CHUNKS": 1}  # the one-chunk state passes, where `pass` acts


@pytest.mark.parametrize("cfg", [{"state": "fp32", "gstate": "fp32"}, {"state": "input"},
                                 {"state": "input", **SC1}, {"state": "input", "pass": "fused", **SC1},
                                 {"gstate": "input", **SC1},
                                 {"state": "input", "gstate": "input", "pass": "fused", **SC1},
                                 {"state": "input", "scan": "blocks"},
                                 # nightly (7 s): the GPU bars' [default] row checks the 16-bit path (split at P <= 64)
                                 pytest.param({"state": "input", "fwd": "split"}, marks=pytest.mark.slow),
                                 # v12: the split forward's C B^T in bf16, its fused state pass
                                 {"state": "input", "fwd": "split", "cb": "input", "pass": "fused"},
                                 # v13: `bwd` "split" (bf16 states, end-state gradients and C B^T;
                                 # row blocks of 16: three of the four wholly past T)
                                 {"state": "input", "gstate": "input", "fwd": "split", "cb": "input",
                                  "bwd": "split", "BWD_M": 16}],
                         ids=["fp32", "input", "input-split", "input-fused", "gstate-input-split",
                              "both-input-fused", "input-blocks", "input-fwd-split", "input-split-cb-fused",
                              "input-bwd-split"])
def test_bf16_inputs(module, device, cfg):
    """bf16 storage (loads upcast, fp32 maths; the chunks' states and the backward's end-state
    gradients fp32 or bf16; state chunks of 4 (CPU_CONFIG's) or split or fused one-chunk
    passes) against the reference at the bf16 tolerances."""
    module.set_config({**CPU_CONFIG, **cfg} if device.type == "cpu" else cfg)
    try:
        check_forward_backward(fixture(module, (1, 7, 2, 8, 1, 16, True, True)), torch.bfloat16, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("pas", ["split", "fused"])
def test_one_chunk_state_passes(module, device, shape, pas):
    """STATE_CHUNKS 1 (v7's former default), `pass` "split" and "fused", on every shape: with and
    without an initial state, one partial chunk, two P and two N blocks."""
    cfg = {"pass": pas, **SC1}
    module.set_config({**CPU_CONFIG, **cfg} if device.type == "cpu" else cfg)
    try:
        check_forward_backward(fixture(module, shape), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_state_chunks(module, device, shape):
    """STATE_CHUNKS 2 (state chunks of two kernel chunks; the chunk output kernel carries the state
    through them) on every shape: T 23 one state chunk whose second chunk is partial, T 7 one
    partial chunk (the state chunk's second chunk past T), T 16 one full chunk; initial states."""
    module.set_config({**CPU_CONFIG, "STATE_CHUNKS": 2} if device.type == "cpu" else {"STATE_CHUNKS": 2})
    try:
        check_forward_backward(fixture(module, shape), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("cfg", [{"STATE_CHUNKS": 2, "STATE_N": 32}, {"STATE_CHUNKS": 4, "BLOCK_P": 32}],
                         ids=["sc2-state32", "sc4"])
def test_state_chunks_three_chunks(module, device, cfg):
    """STATE_CHUNKS over three kernel chunks (T 41, chunk 16, the last partial): 2 gives two state
    chunks (the second holding one chunk and one past T), 4 one state chunk; 2 groups of 2 heads,
    D, dt_bias, initial state; the forward under no_grad (no states stored) gives the same y and
    final state (the scan forward's property: the split forward's no_grad path sums per split
    chunk, so its y differs in rounding from the path that stores per-chunk states)."""
    cfg = {**cfg, "fwd": "scan"}
    module.set_config({**CPU_CONFIG, **cfg} if device.type == "cpu" else cfg)
    try:
        fx = fixture(module, (1, 41, 4, 8, 2, 24, True, True))
        check_forward_backward(fx, torch.float32, device)
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(1))
        y, ht = module.entry(*args)
        leaves = [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        y2, ht2 = module.entry(*leaves)
        torch.testing.assert_close(y, y2.detach(), rtol=0, atol=0)
        torch.testing.assert_close(ht, ht2.detach(), rtol=0, atol=0)
        with torch.no_grad():
            _, _, st, _ = module.ssd_fwd_op(*args[:7], args[9], True, 0.0, math.inf, False)
        assert st.shape[1] == 0
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


T41 = (1, 41, 4, 8, 2, 24, True, True)    # 3 chunks of 16, the last partial; 2 groups of 2 heads
T71 = (2, 71, 2, 20, 1, 24, True, False)  # 5 chunks, 2 batches, 2 P blocks
BLOCKS = [({"STATE_CHUNKS": 2}, T41), ({"STATE_CHUNKS": 4, "BLOCK_P": 32}, T41),
          ({"STATE_CHUNKS": 2}, T71), ({"STATE_CHUNKS": 4, "SCAN_N": 32}, T71),
          ({"STATE_CHUNKS": 8}, (1, 7, 2, 8, 2, 8, False, True))]


def mild(fx: KernelFixture) -> KernelFixture:
    """A scaled by 1/50 (per-step decay ~0.98, a chunk's ~0.7): the terms of chunks two and three
    back weigh in (at the fixture's A a chunk decays by ~e^-17 and they vanish under the bars)."""
    make = fx.make_inputs
    fx.make_inputs = lambda dtype, dev, gen: [a * 0.02 if i == 2 else a for i, a in enumerate(make(dtype, dev, gen))]
    return fx


# sc2-T71 nightly (10 s on 2 cores): T71 runs under sc4-scan32 in CI, state chunks of 2 under T41
@pytest.mark.parametrize("cfg,shape", [
    pytest.param(*b, id=i, marks=[pytest.mark.slow] if i == "sc2-T71" else [])
    for b, i in zip(BLOCKS, ["sc2-T41", "sc4-p32-T41", "sc2-T71", "sc4-scan32-T71", "sc8-T7"])])
def test_blocks_scan(module, device, cfg, shape):
    """`scan` "blocks" (every chunk in parallel, the earlier chunks of its state chunk as [L, L]
    blocks): the forward under no_grad (nothing stored) against the reference, and with a
    backward to come (each chunk's incoming state formed and stored beside y) bit for bit the
    same y and final state. T 41 (chunk 16): three chunks, the last partial (state chunks of 2: two, the second
    one chunk; of 4: one); T 71: 5 chunks (of 2: two state chunks and a partial one; of 4: a full
    one and one chunk); T 7 one partial chunk in a state chunk of 8, G = H, no D / dt_bias."""
    module.set_config({**CPU_CONFIG, **cfg, "scan": "blocks"} if device.type == "cpu" else {**cfg, "scan": "blocks"})
    try:
        fx = mild(fixture(module, shape))
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(2))
        with torch.no_grad():
            y, ht = module.entry(*args)
            yr, htr = module.reference(*args[:9], args[9], True)
        torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ht, htr, rtol=1e-4, atol=1e-4)
        leaves = [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        y2, ht2 = module.entry(*leaves)  # y computed the same way, the states formed beside it
        torch.testing.assert_close(y, y2.detach(), rtol=0, atol=0)
        torch.testing.assert_close(ht, ht2.detach(), rtol=0, atol=0)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("cfg,shape", [BLOCKS[0], ({"STATE_CHUNKS": 4, "BLOCK_P": 32, "SCAN_N": 32}, T71)],
                         ids=["sc2-T41", "sc4-p32-scan32-T71"])
def test_blocks_scan_backward(module, device, cfg, shape):
    """`scan` "blocks" with a backward: the incoming states the forward's programs form and store
    are the ones the backward reads (every gradient against the reference); A mild (`mild`)."""
    module.set_config({**CPU_CONFIG, **cfg, "scan": "blocks"} if device.type == "cpu" else {**cfg, "scan": "blocks"})
    try:
        check_forward_backward(mild(fixture(module, shape)), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


# `fwd` "split" (v9): split chunks of CHUNK * STATE_CHUNKS tokens, FWD_M rows per output program
SPLIT = [
    # T 41, split chunks of 32: two, the second 9 tokens (its second row block wholly past T); with
    # a backward the states per chunk of 16 (three) and the output kernel reads every second
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16}, T41, id="sc2-m16-T41"),
    # T 45, one split chunk of 64: two row blocks of 32 (the second partial), off-diagonal steps of
    # 16 (FWD_K < FWD_M), 2 P and 2 N blocks; with a backward the first of three states
    pytest.param({"STATE_CHUNKS": 4, "FWD_M": 32, "FWD_K": 16}, (1, 45, 2, 20, 1, 24, True, False),
                 id="sc4-m32-k16-T45"),
    # one partial chunk of 16 (split chunk = kernel chunk), 2 batches, 2 groups of 2 heads
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16}, SHAPES[1], id="sc1-T7"),
    # `split_states` "fill": with a backward to come, the states passed per split chunk of 32 and
    # its two chunks' incoming states filled in (the second partial)
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "split_states": "fill"},
                 (1, 23, 2, 8, 1, 16, True, True), id="sc2-fill-T23"),
    # `pass` "fused" (v12): the chunk states and the pass in one serial loop per tile; T 41 with an
    # initial state: two split chunks of 32 (the second 9 tokens; PASS_K 16: two dot steps each)
    # without a backward, three chunks of 16 with one; T 45: one split chunk of 64 (one step of
    # PASS_K 64), 2 P and 2 N blocks
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "pass": "fused", "PASS_K": 16}, T41,
                 id="sc2-fused-T41"),
    pytest.param({"STATE_CHUNKS": 4, "FWD_M": 32, "FWD_K": 16, "pass": "fused"},
                 (1, 45, 2, 20, 1, 24, True, False), id="sc4-fused-T45"),
    # "fused" under "fill" (the fused pass over split chunks of 32, then the fill-in), T 41: 2
    # batches, 2 split chunks (the last 9 tokens), 3 chunks of 16
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "pass": "fused", "split_states": "fill"},
                 (2, 41, 2, 8, 1, 16, True, True), id="sc2-fused-fill-B2T41"),
]
# the split forward's backward rows that run in CI (the others nightly)
SPLIT_BWD_CI = ("sc2-fill-T23", "sc2-fused-fill-B2T41")


def _split(module, device, cfg):
    # the P <= 64 bucket's `bwd` "split" and `pass` "fused" (v15) only where a row asks for them:
    # these rows cover the split forward's other paths (the chunk backward, the two-kernel pass)
    full = {"bwd": "chunk", "pass": "split", **cfg, "fwd": "split"}
    module.set_config({**CPU_CONFIG, **full} if device.type == "cpu" else full)


@pytest.mark.parametrize("cfg,shape", SPLIT)
def test_split_forward(module, device, cfg, shape):
    """`fwd` "split" under no_grad (the states formed and passed per split chunk, nothing kept):
    y and the final state against the reference, outputs poisoned and loads bounds-checked; then
    the forward with a backward to come (the states per kernel chunk, every STATE_CHUNKS-th read by
    the output kernel) the same within rounding. A mild (`mild`) so that the earlier row blocks'
    and chunks' terms weigh in."""
    _split(module, device, cfg)
    try:
        fx = mild(fixture(module, shape))
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(4))
        with torch.no_grad(), poisoned(module), checked_when_interpreted():
            y, ht = module.entry(*args)
        yr, htr = module.reference(*args[:9], args[9], True)
        torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ht, htr, rtol=1e-4, atol=1e-4)
        y2, ht2 = module.entry(*[a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args])
        torch.testing.assert_close(y2.detach(), yr, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ht2.detach(), htr, rtol=1e-4, atol=1e-4)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


# T41's, T45's and T7's backward nightly (3-20 s each in the interpreter, bounds-checked): their
# forwards run above, the backward's own kernels under every other config
@pytest.mark.parametrize("cfg,shape", [p if p.id in SPLIT_BWD_CI else pytest.param(*p.values, id=p.id,
                                                                               marks=pytest.mark.slow)
                                       for p in SPLIT])
def test_split_forward_backward(module, device, cfg, shape):
    """`fwd` "split" with a backward to come: the states and the pass per kernel chunk (what the
    backward reads), the output kernel on every STATE_CHUNKS-th; y, the final state and every
    gradient against the reference (A mild)."""
    _split(module, device, cfg)
    try:
        check_forward_backward(mild(fixture(module, shape)), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


# `bwd` "split" (v13): the backward over the split chunks (the forward's states per split chunk, as
# without a backward), row blocks of BWD_M
SPLIT_BWD = [
    # T 41, split chunks of 32: two, the second 9 tokens (its second row block wholly past T), two
    # row blocks of 16 each (a pair below the diagonal); 2 groups (of one head: the groups' B, C,
    # C B^T and dB / dC rows); D, dt_bias, initial state
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16}, (1, 41, 2, 8, 2, 16, True, True),
                 id="sc2-m16-G2-T41"),
    # 2 batches, T 23 (one split chunk, its second row block partial), 2 groups of 2 heads, dB / dC
    # partials of one head each (DBC_SPLIT 2)
    # partials of one head each (DBC_SPLIT 2); nightly (11 s), the two groups run under [sc2-m16-G2-T41]
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "DBC_SPLIT": 2},
                 (2, 23, 4, 8, 2, 16, True, False), id="sc2-split2-B2T23", marks=pytest.mark.slow),
    # T 45, one split chunk of 64 in four row blocks of 16 (three pairs below the diagonal for the
    # first), the last partial; 2 P and 2 N blocks of the pull, P 20 and N 24 padded elsewhere
    pytest.param({"STATE_CHUNKS": 4, "FWD_M": 32, "FWD_K": 16, "BWD_M": 16}, (1, 45, 2, 20, 1, 24, True, False),
                 id="sc4-m16-T45"),
    # `pass` "fused": dy's pull and the reverse pass in one loop (and the forward's fused pass); T 41,
    # PASS_K 16: two steps per split chunk of 32, the last chunk's second step wholly past T; 2 P
    # blocks (P 20, BLOCK_P 16)
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "pass": "fused", "PASS_K": 16},
                 (1, 41, 2, 20, 1, 16, True, True), id="sc2-fused-T41"),
    # the P <= 64 bucket's paths since v18 (split chunks of one kernel chunk, the fused pass and
    # pull; since the thirty-sixth session `split_dbc` "paired" and `bwd_sums` "kernel") at CPU
    # tiles: T 41, three split chunks of 16 (the last 9 tokens), PASS_K 16
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "pass": "fused", "PASS_K": 16},
                 (1, 41, 2, 20, 1, 16, True, True), id="sc1-fused-T41"),
    # PULL_N (v21): the backward's pull over state tiles of 32 (N 24: one block, padded) beside the
    # forward's STATE_N 16 (two blocks, the second partial); the fused pull, then the split pull and
    # reverse pass (split chunks of 32, 2 groups)
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "pass": "fused", "PASS_K": 16,
                  "PULL_N": 32}, (1, 41, 2, 20, 1, 24, True, True), id="sc1-fused-pull32-T41"),
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "PULL_N": 32},
                 (1, 41, 2, 8, 2, 24, True, True), id="sc2-pull32-G2-T41"),
    # PULL_P and `pull_scale` (v24): the split backward's pull over P tiles of 32 (P 20: one block,
    # padded) beside the forward's BLOCK_P 16 (two blocks, the second partial), its weights on C's
    # rows and on dy's columns ("dy"), and "dy" at the forward's P tiles (two blocks); the split pull
    # and reverse pass at P tiles of 32 (split chunks of 32, 2 groups)
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "pass": "fused", "PASS_K": 16,
                  "PULL_P": 32}, (1, 41, 2, 20, 1, 24, True, True), id="sc1-fused-pullp32-T41"),
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "pass": "fused", "PASS_K": 16,
                  "PULL_P": 32, "pull_scale": "dy"}, (1, 41, 2, 20, 1, 24, True, True), id="sc1-fused-pullp32-dy-T41"),
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "pass": "fused", "PASS_K": 16,
                  "pull_scale": "dy"}, (1, 41, 2, 20, 1, 24, True, True), id="sc1-fused-dy-T41"),
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "PULL_P": 32},
                 (1, 41, 2, 20, 2, 24, True, True), id="sc2-pullp32-G2-T41"),
    # T41: 2 groups of 2 heads, N 24; nightly (12 s)
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16}, T41, id="sc2-m16-H4G2-T41",
                 marks=pytest.mark.slow),
]


# `split_dbc` "one" (v16): dC and dB's partials in one launch; T 41 two split chunks of 32 in
# row blocks of 16 (one pair below the diagonal, dB's partials summed), T 45 one split chunk of 64
# in four row blocks, split chunks of one row block (no sum: NB 1), dB / dC partials (DBC_SPLIT 2)
SPLIT_DBC1 = [
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16}, (1, 41, 2, 8, 2, 16, True, True),
                 id="one-sc2-m16-G2-T41"),
    pytest.param({"STATE_CHUNKS": 4, "FWD_M": 32, "FWD_K": 16, "BWD_M": 16}, (1, 45, 2, 20, 1, 24, True, False),
                 id="one-sc4-m16-T45"),
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 32, "pass": "fused", "PASS_K": 16},
                 (1, 41, 2, 20, 1, 16, True, True), id="one-nb1-fused-T41"),
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "DBC_SPLIT": 2},
                 (2, 23, 4, 8, 2, 16, True, False), id="one-split2-B2T23", marks=pytest.mark.slow),
]


# `split_dbc` "fused" and "paired" (v19; split chunks of one row block): dx, dC and dB in one launch,
# one program or two per (split chunk, group); "triple" (v21) three. T 41 three split chunks of 16 (the last 9 tokens), 2
# groups of 2 heads, N 24 padded to 32, D, dt_bias, initial state; split chunks of 32 in one row
# block of 32 with the fused pass and pull, P 20 padded; 2 batches, T 23, dB / dC partials of one
# head each (DBC_SPLIT 2); a split chunk of two row blocks (BWD_M 16 under 32: neither applies and
# "two" runs)
SPLIT_FUSED = [
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16}, T41, id="fused-sc1-H4G2-T41"),
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 32, "pass": "fused", "PASS_K": 16},
                 (1, 41, 2, 20, 1, 16, True, True), id="fused-nb1-pass-T41"),
    pytest.param({"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "DBC_SPLIT": 2},
                 (2, 23, 4, 8, 2, 16, True, False), id="fused-split2-B2T23"),
    pytest.param({"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16}, (1, 41, 2, 8, 2, 16, True, True),
                 id="fused-nb2-two-T41", marks=pytest.mark.slow),
]


# The fused kernel's (`split_dbc` "fused" / "paired" / "triple") `bwd_exp` "exp" (tl.exp; v22's
# default): the rows above run the P <= 64 bucket's "exp2" (v23)
EXP = {"bwd_exp": "exp"}
# and its `bwd_qd` "dot" (v24): q's <Gs, S_in> and dD's sum(dy x) as the traces of tensor-core products
QD = {"bwd_qd": "dot"}
# and its `bwd_ahead` (v27): cs, dt, cs_last and D one head ahead in registers, x a dot operand in the dx
# program (dD the trace of x^T dy there), q's <Gs, S_in> term in the block pairs' program (on the chunk's
# last row of dL/dcs)
AHEAD = {"bwd_ahead": True}
# and its `bwd_dbc_ln` (v31): dC and dB accumulated as [L, N], the row-scaled dy and x the state terms' first
# (register) operands
DBC_LN = {"bwd_dbc_ln": True}


@pytest.mark.parametrize("cfg,shape", SPLIT_BWD + [pytest.param({**p.values[0], "split_dbc": "one"}, p.values[1],
                                                                id=p.id, marks=p.marks) for p in SPLIT_DBC1]
                         + [pytest.param({**p.values[0], "split_dbc": dbc}, p.values[1],
                                         id=p.id.replace("fused", dbc, 1), marks=p.marks)
                            for dbc in ("fused", "paired", "triple") for p in SPLIT_FUSED]
                         # the fused kernel's `bwd_exp` "exp" (the rows above: the bucket's "exp2") under
                         # "paired" (the non-slow rows: odd T with partial chunks, D, dt_bias, initial
                         # state; P 20 padded; 2 batches, DBC_SPLIT 2: one head per program), and at T 41
                         # under "fused" and "triple" (ROLES 1 and 3)
                         + [pytest.param({**p.values[0], "split_dbc": "paired", **EXP}, p.values[1],
                                         id=p.id.replace("fused", "exp-paired", 1), marks=p.marks)
                            for p in SPLIT_FUSED]
                         + [pytest.param({**SPLIT_FUSED[0].values[0], "split_dbc": dbc, **EXP},
                                         SPLIT_FUSED[0].values[1], id=f"exp-{dbc}-sc1-H4G2-T41")
                            for dbc in ("fused", "triple")]
                         # `bwd_qd` "dot" the same way: every SPLIT_FUSED row under "paired" (the last
                         # runs "two": the option does not apply), T 41 under "fused" and "triple"
                         + [pytest.param({**p.values[0], "split_dbc": "paired", **QD}, p.values[1],
                                         id=p.id.replace("fused", "qd-paired", 1), marks=p.marks)
                            for p in SPLIT_FUSED]
                         + [pytest.param({**SPLIT_FUSED[0].values[0], "split_dbc": dbc, **QD},
                                         SPLIT_FUSED[0].values[1], id=f"qd-{dbc}-sc1-H4G2-T41")
                            for dbc in ("fused", "triple")]
                         # `bwd_ahead` the same way (every SPLIT_FUSED row under "paired", T 41 under
                         # "fused" and "triple"; `bwd_qd` has no effect under it)
                         + [pytest.param({**p.values[0], "split_dbc": "paired", **AHEAD}, p.values[1],
                                         id=p.id.replace("fused", "ahead-paired", 1), marks=p.marks)
                            for p in SPLIT_FUSED]
                         + [pytest.param({**SPLIT_FUSED[0].values[0], "split_dbc": dbc, **AHEAD},
                                         SPLIT_FUSED[0].values[1], id=f"ahead-{dbc}-sc1-H4G2-T41")
                            for dbc in ("fused", "triple")]
                         # four heads in one program's loop (one group): the loads of heads 1..3 made
                         # during the head before, the last one's again at the last head; T 23, no D or
                         # dt_bias (the rows above have them)
                         + [pytest.param({**SPLIT_FUSED[0].values[0], "split_dbc": "paired", **AHEAD},
                                         (1, 23, 4, 8, 1, 16, False, True), id="ahead-paired-H4G1-noD-T23")]
                         # `pull_ahead` (v29): the fused pull's cs rows one step ahead, at T 41 with PASS_K
                         # 16 (two steps per split chunk of 32, the last chunk's second step wholly past T;
                         # 2 P blocks; D, dt_bias, initial state) and with its weights on dy's columns
                         # (PULL_P 32, split chunks of 16: one step per chunk)
                         # (the first nightly, 8 s: test_pull_ahead_matches_pull checks the pull alone)
                         + [pytest.param({**p.values[0], "pull_ahead": True}, p.values[1], id=f"pullahead-{p.id}",
                                         marks=[pytest.mark.slow] if p.id == "sc2-fused-T41" else [])
                            for p in SPLIT_BWD if p.id in ("sc2-fused-T41", "sc1-fused-pullp32-dy-T41")]
                         # `bwd_dbc_ln` (v31) under "paired" at the bucket's `bwd_ahead` (every SPLIT_FUSED row: odd
                         # T with partial chunks, 2 groups, D, dt_bias, initial state, N 24 padded, P 20 padded,
                         # 2 batches with DBC_SPLIT 2), at T 41 under "fused" and "triple" (ROLES 1 and 3: their
                         # own dC / dB stores), and under "paired" without `bwd_ahead`
                         + [pytest.param({**p.values[0], "split_dbc": "paired", **DBC_LN}, p.values[1],
                                         id=p.id.replace("fused", "ln-paired", 1), marks=p.marks)
                            for p in SPLIT_FUSED]
                         + [pytest.param({**SPLIT_FUSED[0].values[0], "split_dbc": dbc, **DBC_LN},
                                         SPLIT_FUSED[0].values[1], id=f"ln-{dbc}-sc1-H4G2-T41",
                                         marks=pytest.mark.slow)  # (test_bwd_dbc_ln_matches_default runs both)
                            for dbc in ("fused", "triple")]
                         + [pytest.param({**SPLIT_FUSED[0].values[0], "split_dbc": "paired", **DBC_LN,
                                          "bwd_ahead": False}, SPLIT_FUSED[0].values[1],
                                         id="ln-noahead-paired-sc1-H4G2-T41")])
def test_split_backward(module, device, cfg, shape):
    """`bwd` "split": y, the final state and every gradient (x, dt, A, B, C, D, dt_bias, initial
    state) against the reference, outputs poisoned and loads bounds-checked (A mild)."""
    _split(module, device, {**cfg, "bwd": "split"})
    try:
        check_forward_backward(mild(fixture(module, shape)), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("scale_dy", [False, True], ids=["scale-C", "scale-dy"])
def test_pull_ahead_matches_pull(module, device, scale_dy):
    """ssd_split_fused_pull_kernel with `pull_ahead` (v29, AHEAD) and without, launched alone, against
    the pull's recurrence in fp64 (per split chunk from the last: gs[c] = G, then G <- exp(cs_last) G
    + sum_t exp(cs_t) dy_t^T C_t, cs cumulative within the chunk), with a final-state gradient and
    without (HAS_DHT False, the training step's): T 41 in split chunks of 32 of two PASS_K steps
    (cs_0 from the next step's row inside a chunk, 0 at a chunk's start; the last chunk's second step
    wholly past T), 2 P and 2 N blocks, the weights on C's rows or on dy's columns. Under the
    interpreter the two are also equal bit for bit (the same values in the same sums)."""
    gen = torch.Generator().manual_seed(8)
    b, t, h, p, g, n, lc, k = 1, 41, 1, 20, 1, 24, 32, 16
    nc = -(-t // lc)
    dy, C = torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, g, n, generator=gen)
    cs = (-0.05 * torch.rand(b, h, nc, lc, generator=gen)).cumsum(-1).reshape(b, h, nc * lc)
    dht = torch.randn(b, h, p, n, generator=gen)
    for has_dht in (True, False):
        want = torch.zeros(b, nc, h, p, n, dtype=torch.float64)
        G = dht.double() if has_dht else torch.zeros(b, h, p, n, dtype=torch.float64)
        for c in reversed(range(nc)):
            want[:, c] = G
            w = cs[:, :, c * lc:min(t, (c + 1) * lc)].double().exp()  # [b, h, tokens]
            G = cs[:, :, c * lc + lc - 1, None, None].double().exp() * G + torch.einsum(
                "bthp,bht,btn->bhpn", dy[:, c * lc:(c + 1) * lc].double(), w, C[:, c * lc:(c + 1) * lc, 0].double())
        got = {}
        for ahead in (False, True):
            gs = torch.full((b, nc, h, p, n), float("nan"), device=device)
            dh0 = torch.full((b, h, p, n), float("nan"), device=device)
            module.ssd_split_fused_pull_kernel[(b * h, 2 * 2)](
                dy.to(device), C.to(device), cs.to(device), dht.to(device), gs, dh0, t, nc * lc, h, g, p, n, nc,
                LC=lc, BLOCK_P=16, BLOCK_N=16, BLOCK_K=k, MODE="ieee", SCALE_DY=scale_dy, HAS_DHT=has_dht,
                AHEAD=ahead, num_warps=4)
            got[ahead] = (gs.cpu(), dh0.cpu())
            torch.testing.assert_close(got[ahead][0].double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[ahead][1].double(), G, rtol=1e-5, atol=1e-5)
        if interpreting():
            for a, r in zip(got[True], got[False]):
                torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_pull_ahead_reaches_the_pull(module, device, monkeypatch):
    """`pull_ahead` is the fused pull's AHEAD in the P <= 64 bucket's backward (that bucket's since
    v30: the bucket's own config, no override, launches AHEAD)."""
    seen = []
    monkeypatch.setattr(module, "ssd_split_fused_pull_kernel", LaunchSpy(
        module.ssd_split_fused_pull_kernel, lambda grid, kw: seen.append(kw["AHEAD"])))
    gen = torch.Generator().manual_seed(6)
    args = [torch.randn(1, 8, 1, 16, generator=gen), torch.randn(1, 8, 1, generator=gen) - 3.0,
            -torch.exp(torch.rand(1, generator=gen)), torch.randn(1, 8, 1, 16, generator=gen),
            torch.randn(1, 8, 1, 16, generator=gen)]
    for cfg in ({"pull_ahead": False}, {}):
        module.set_config(cfg or None)
        try:
            ins = [a.to(device).requires_grad_() for a in args]
            y = module.ssd_scan(*ins)
            torch.autograd.grad(y, ins, torch.ones_like(y))
        finally:
            module.set_config(CPU_CONFIG if device.type == "cpu" else None)
    assert seen == [False, True]


@pytest.mark.parametrize("dbc", ["fused", "paired", "triple"])
def test_bwd_dbc_ln_matches_default(module, device, monkeypatch, dbc):
    """`bwd_dbc_ln` (v31) reaches ssd_bwd_split_fused_kernel (DBC_LN) and gives the default's y, final state
    and every gradient within fp32 rounding (the same products and sums; dC and dB accumulated as [L, N],
    not [N, L]), fp32 at the bucket's fused tiles: T 41 (split chunks of 16, the last 9 tokens), 2 groups
    of 2 heads, N 24 padded, D, dt_bias, initial state, A mild (the earlier chunks' state terms weigh in)."""
    seen = []
    monkeypatch.setattr(module, "ssd_bwd_split_fused_kernel", LaunchSpy(
        module.ssd_bwd_split_fused_kernel, lambda grid, kw: seen.append(kw["DBC_LN"])))
    gen = torch.Generator().manual_seed(5)
    b, t, h, p, g, n = T41[:6]
    args = [torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen) - 1.0,
            -0.02 * torch.exp(torch.rand(h, generator=gen)), 0.5 * torch.randn(b, t, g, n, generator=gen),
            0.5 * torch.randn(b, t, g, n, generator=gen), torch.randn(h, generator=gen),
            torch.randn(h, generator=gen), 0.3 * torch.randn(b, h, p, n, generator=gen)]
    args = [a.to(device) for a in args]
    dy = torch.randn(b, t, h, p, generator=gen).to(device)
    dht = torch.randn(b, h, p, n, generator=gen).to(device)
    got = {}
    for ln in (False, True):
        _split(module, device, {**SPLIT_FUSED[0].values[0], "bwd": "split", "split_dbc": dbc, "bwd_dbc_ln": ln})
        try:
            got[ln] = _outputs_and_grads(module, args, dy, dht)
        finally:
            module.set_config(CPU_CONFIG if device.type == "cpu" else None)
    assert seen == [False, True]
    for name, a, r in zip(_BAR_NAMES, got[True], got[False]):
        torch.testing.assert_close(a, r, rtol=2e-5, atol=2e-5 * r.abs().max().item(), msg=name)


# `bwd_sums` "kernel" (v20): d(dt) in dt's dtype with its per-chunk sums, dA, dD and dt bias's
# gradient summed by one launch. T 41 split chunks of 16 (three, the last 9 tokens), 2 groups of 2
# heads, D, dt_bias, initial state, under "two" (one row block), "paired" and "triple"; split chunks of 32 in
# two row blocks (dD's partials per row block); 2 batches, T 23, no D / dt_bias
@pytest.mark.parametrize("cfg,shape", [
    pytest.param({"STATE_CHUNKS": 1, "split_dbc": "two"}, T41, id="two-T41"),
    pytest.param({"STATE_CHUNKS": 1, "split_dbc": "paired"}, T41, id="paired-T41"),
    pytest.param({"STATE_CHUNKS": 2}, (1, 41, 2, 8, 2, 16, True, True), id="nb2-T41"),
    pytest.param({"STATE_CHUNKS": 1, "split_dbc": "paired"}, (2, 23, 4, 8, 2, 16, False, False), id="paired-B2-noD"),
    pytest.param({"STATE_CHUNKS": 1, "split_dbc": "triple"}, T41, id="triple-T41"),
])
def test_split_backward_sums(module, device, cfg, shape):
    """`bwd_sums` "kernel": every gradient against the reference (outputs poisoned, loads
    bounds-checked); then against "host" on the same inputs: d(dt) and all but dA, dD, dt bias's
    bit for bit, those three within fp32 rounding (another summation order)."""
    base = {"FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "bwd": "split", **cfg}
    _split(module, device, {**base, "bwd_sums": "kernel"})
    try:
        check_forward_backward(mild(fixture(module, shape)), torch.float32, device)
        fx = fixture(module, shape)
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(4))
        got = []
        for sums in ("kernel", "host"):
            _split(module, device, {**base, "bwd_sums": sums})
            ins = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            y = module.ssd_scan(*ins[:7], initial_state=ins[9], return_final_state=False)
            named = [(n, ins[i]) for n, i in zip(("x", "dt", "A", "B", "C", "D", "dt_bias", "h0"),
                                                 (0, 1, 2, 3, 4, 5, 6, 9)) if ins[i] is not None]
            got.append(torch.autograd.grad(y, [a for _, a in named], torch.ones_like(y)))
        for (name, _), a, b in zip(named, *got, strict=True):
            if name in ("A", "D", "dt_bias"):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(a, b), name
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("dbc", ["two", "fused", "paired", "triple"])
def test_split_backward_limits_no_softplus(module, device, dbc):
    """`bwd` "split" with clamped dt (the gradient stops where a limit binds; its own dt and d dt
    tiles) and then raw dt without softplus (no D, dt_bias or initial state); T 23, split chunks of
    16 (the second partial), the fixture's A; `split_dbc` "two", "fused", "paired" and "triple"
    (split chunks of one row block)."""
    _split(module, device, {"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "bwd": "split", "split_dbc": dbc})
    try:
        check_forward_backward(fixture(module, (1, 23, 2, 8, 1, 8, True, True), dt_limit=(0.1, 1.5)),
                               torch.float32, device)
        fx = fixture(module, (1, 9, 2, 8, 1, 8, False, False), softplus=False)
        make = fx.make_inputs
        fx.make_inputs = lambda dtype, dev, gen: [a.abs() if i == 1 else a for i, a in enumerate(make(dtype, dev, gen))]
        check_forward_backward(fx, torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("dbc", ["fused", "paired", "triple"])
def test_split_fused_launches(module, device, monkeypatch, dbc):
    """`split_dbc` "fused" / "paired" / "triple" at the P <= 64 bucket's tiles (split chunks of 64,
    one row block): ssd_bwd_split_fused_kernel with one, two or three programs per split chunk and group, in
    place of the split dx and dC / dB kernels, for 16-bit inputs at P 64, N 128 (a head's tiles
    48 KB); "two"'s kernels for fp32 inputs there (96 KB: the build would not fit an SM's shared
    memory) and at two row blocks (BWD_M 32)."""
    launched = []
    for name in ("ssd_bwd_split_fused_kernel", "ssd_bwd_split_dx_kernel", "ssd_bwd_split_dbc_kernel"):
        monkeypatch.setattr(module, name, LaunchSpy(getattr(module, name),
                                                    lambda grid, kw, _n=name: launched.append((_n, grid[0]))))
    gen = torch.Generator().manual_seed(6)
    b, t, h, p, g, n = 1, 8, 2, 64, 1, 128
    base = [torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen) - 3.0,
            -torch.exp(torch.rand(h, generator=gen)), 0.3 * torch.randn(b, t, g, n, generator=gen),
            0.3 * torch.randn(b, t, g, n, generator=gen)]
    def split(nb):  # (kernel, its grid's first dim: B * H; row blocks)
        return [("ssd_bwd_split_dx_kernel", h), ("ssd_bwd_split_dbc_kernel", nb), ("ssd_bwd_split_dbc_kernel", nb)]
    roles = {"fused": 1, "paired": 2, "triple": 3}[dbc]
    for dtype, cfg, want in ((torch.float16, {}, [("ssd_bwd_split_fused_kernel", roles)]),
                             (torch.float32, {}, split(1)), (torch.float16, {"BWD_M": 32}, split(2))):
        module.set_config({"split_dbc": dbc, **cfg})
        launched.clear()
        try:
            args = [a.to(device, dtype if i != 2 else torch.float32).requires_grad_() for i, a in enumerate(base)]
            y = module.ssd_scan(*args)
            torch.autograd.grad(y, args, torch.ones_like(y))
        finally:
            module.set_config(CPU_CONFIG if device.type == "cpu" else None)
        assert launched == want, (dtype, cfg, launched)


@pytest.mark.parametrize("bwd", ["split", "chunk"])
def test_backward_fills_no_unused_grads(module, device, bwd):
    """The chunk states and log decays the forward returns for the backward have no gradient: the
    backward gets None for them (autograd's zeros of st's shape were the largest fill of the
    fwd+bwd, v20), and for an unused final state. Gradients of y alone, bit for bit the same as of
    (y, final state) with a zero d(final state); no aten zeros of st's or dac's shape during the
    backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Zeros(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.new_zeros,
                                       torch.ops.aten.fill_, torch.ops.aten.zero_):
                self.shapes.append(tuple(out.shape))
            return out

    _split(module, device, {"STATE_CHUNKS": 1, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "bwd": bwd})
    try:
        fx = fixture(module, (1, 23, 2, 8, 1, 16, True, True))
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(5))
        leaves = [args[i] for i in (0, 1, 2, 3, 4, 5, 6, 9)]
        _, _, st, dac = module.ssd_fwd_op(*args[:7], args[9], True, 0.0, math.inf, True)
        dy = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(6)).to(device)
        grads = []
        for with_ht in (False, True):
            ins = [a.clone().requires_grad_() for a in leaves]
            y, ht = module.ssd_scan(*ins[:7], initial_state=ins[7], return_final_state=True)
            with Zeros() as rec:
                grads.append(torch.autograd.grad((y, ht) if with_ht else y, ins,
                                                 (dy, torch.zeros_like(ht)) if with_ht else dy))
            assert tuple(st.shape) not in rec.shapes and tuple(dac.shape) not in rec.shapes, rec.shapes
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


def test_split_backward_saves_split_states(module, device):
    """`bwd` "split" keeps the forward's states per split chunk (T 33, split chunks of 32: two, not
    three chunks of 16), what the op's fake says; opcheck's schema, autograd and fake-tensor checks
    on both ops."""
    _split(module, device, {"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "BWD_M": 16, "bwd": "split"})
    try:
        fx = fixture(module, (1, 33, 2, 8, 1, 16, True, True))
        args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(3))
        _, _, st, dac = module.ssd_fwd_op(*args[:7], args[9], True, 0.0, math.inf, True)
        assert st.shape[1] == 2 and dac.shape[2] == 2, (st.shape, dac.shape)
        check_opcheck(fx, torch.float32, device, utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor"))
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("cfg,shape", [({"dbc": "head"}, SHAPES[1]),
                                       ({"DBC_SPLIT": 2}, (1, 41, 8, 8, 2, 24, True, True)),
                                       ({"DBC_SPLIT": 4}, SHAPES[1])], ids=["head", "split2-hg4", "split4-hg2"])
def test_dbc_partials(module, device, cfg, shape):
    """dB/dC as partials summed by the host: dbc "head" (one head per program, 2 groups of 2
    heads); DBC_SPLIT 2 over groups of 4 heads (two programs of two heads each per group; three
    chunks, the last partial); DBC_SPLIT 4 over groups of 2 heads (its divisor 2: one head each)."""
    module.set_config({**CPU_CONFIG, **cfg} if device.type == "cpu" else cfg)
    try:
        check_forward_backward(fixture(module, shape), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


@pytest.mark.parametrize("tiles", [{"DBC_N": 32, "STATE_N": 32, "SCAN_N": 32}, {"DBC_N": 16, "STATE_N": 32, "BLOCK_S": 512},
                                   {"pass": "fused", **SC1}, {"pass": "fused", "STATE_N": 32, **SC1},
                                   {"pass": "split", "PULL_N": 32}, {"pass": "fused", "PULL_N": 32, **SC1}],
                         ids=["n32", "dbc16-state32", "fused", "fused-state32", "pull32", "fused-pull32"])
def test_n_tiles_three_chunks(module, device, tiles):
    """The dB/dC, chunk-state and chunk output kernels at other N tiles (one block over N 24, padded; or two),
    three kernel chunks (the state passes' one-step-ahead loads over a chain, the last partial),
    2 groups of 2 heads summed in the dB/dC kernel, D, dt_bias and an initial state; `pass`
    "fused" (chunk states and state passes in one serial loop, forward and backward); PULL_N 32
    (the backward's pull and reverse pass over one N block, the forward's over two)."""
    module.set_config({**CPU_CONFIG, **tiles} if device.type == "cpu" else tiles)
    try:
        check_forward_backward(fixture(module, (1, 41, 4, 8, 2, 24, True, True)), torch.float32, device)
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)


def test_dt_limit_and_no_softplus(module, device):
    """Clamped dt (gradient stops where the limit binds) and raw dt without softplus."""
    check_forward_backward(fixture(module, (1, 9, 2, 8, 1, 8, True, True), dt_limit=(0.1, 1.5)),
                           torch.float32, device)
    shape = (1, 9, 2, 8, 1, 8, False, False)
    fx = fixture(module, shape, softplus=False)
    make = fx.make_inputs
    fx.make_inputs = lambda dtype, dev, gen: [a.abs() if i == 1 else a for i, a in enumerate(make(dtype, dev, gen))]
    check_forward_backward(fx, torch.float32, device)


def test_reference_matches_token_recurrence(module):
    """The chunked reference equals the plain recurrence S_t = a_t S_{t-1} + dt_t x_t B_t^T."""
    gen = torch.Generator().manual_seed(3)
    b, t, h, p, g, n = 1, 21, 4, 4, 2, 8
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen)
    A, D, bias = -torch.exp(torch.rand(h, generator=gen)), torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    B, C = torch.randn(b, t, g, n, generator=gen), torch.randn(b, t, g, n, generator=gen)
    h0 = torch.randn(b, h, p, n, generator=gen)
    y, ht = module.reference(x, dt, A, B, C, D, bias, True, (0.0, math.inf), h0, True)
    d = torch.nn.functional.softplus(dt + bias)
    Bh, Ch = B.repeat_interleave(h // g, 2), C.repeat_interleave(h // g, 2)
    s, ys = h0, []
    for i in range(t):
        s = s * torch.exp(d[:, i] * A)[..., None, None] + (d[:, i, :, None] * x[:, i])[..., None] * Bh[:, i, :, None]
        ys.append((s * Ch[:, i, :, None]).sum(-1) + D[:, None] * x[:, i])
    torch.testing.assert_close(y, torch.stack(ys, 1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, s, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opcheck_utils", OPCHECK_SPLIT)
def test_opcheck_and_contract(module, device, opcheck_utils):
    check_module_contract(module)
    check_opcheck(fixture(module, (1, 5, 2, 8, 1, 8, True, True)), torch.float32, device, utils=opcheck_utils)


def test_sample_inputs_fit(module):
    check_sample_inputs_fit(module, family_module("ssd"), "scan", PARAMS, [1, 19, 2, 8])


def test_rendered_module_imports_only_torch_triton_stdlib(module):
    tree = ast.parse(Path(module.__file__).read_text())
    roots = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert roots <= {"torch", "triton", "math", "typing", "os"}, roots


def test_shape_errors_name_shapes(module, device):
    x = torch.randn(1, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match=r"B and C must be \[B, T, G, N\].*B \(1, 4, 3, 8\)"):
        module.ssd_scan(x, torch.randn(1, 4, 2), -torch.ones(2), torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8))


def mixer_block(kind="linear_attention.mamba", per_channel=False, tril=True, chunk=256, heads=8) -> Block:
    """A Mamba-2 mixer as `onboard parse hf:mamba2 --proxy tiny` records it (attrs, core ops, params)."""
    hist = {"cumsum": 3, "exp": 5, "softplus": 1, "einsum": 5, "linear": 2}
    if tril:
        hist["tril"] = 4
    params = {"dt_bias": [heads], "A_log": [heads], "D": [heads], "conv1d.weight": [512, 1, 4],
              "in_proj.weight": [776, 128], "norm.weight": [256], "out_proj.weight": [128, 256]}
    return Block(path="backbone.layers.0.mixer", kind=kind, layer=0, class_name="Anything", op_histogram=hist,
                 attrs={"decay_shape": [1, 8, 1, chunk], "cumsum_dim": -1, "per_channel_decay": per_channel,
                        "chunk": chunk}, params=params)


def test_match_by_structure():
    family = family_module("ssd")
    check_match(family, mixer_block(), ("scan", {"chunk_size": 256}))
    check_match(family, mixer_block(chunk=100), ("scan", {"chunk_size": 64}))
    check_match(family, mixer_block(per_channel=True), None)
    check_match(family, mixer_block(tril=False), None)
    check_match(family, mixer_block(kind="linear_attention.gated_delta"), None)
    check_match(family, mixer_block(heads=4), None)  # no per-head parameters of the decay's head count


@pytest.mark.slow  # nine sm_90 compiles (7 s here at load 1; 35-50 s at load 8 for seven); nightly keeps the file short
def test_aot_sm90(module, device):
    """Both kernels compile for sm_90 (what the interpreter cannot check: barriers, loop types)."""
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    # compile_files builds the specs of a fresh load of the module (the default config): count
    # those, not CPU_CONFIG's (its STATE_CHUNKS 4 lists one more kernel than the default's 1)
    module.set_config(None)
    try:
        n_specs = len(module.aot_specs())
    finally:
        module.set_config(CPU_CONFIG if device.type == "cpu" else None)
    for path, rs in aot.compile_files([module.__file__], registers=False).items():
        assert len(rs) == n_specs, [r.kernel for r in rs]
        for r in rs:
            assert r.ok, f"{path}: {r.kernel}: {r.error}"


def test_decode_steps_chain_to_the_full_scan(module, device):
    """Decoding token by token (T=1 calls, each from the last final state) gives the full scan."""
    gen = torch.Generator().manual_seed(5)
    b, t, h, p, g, n = 1, 5, 2, 8, 1, 8
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen)
    A, D, bias = -torch.exp(torch.rand(h, generator=gen)), torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    B, C = torch.randn(b, t, g, n, generator=gen), torch.randn(b, t, g, n, generator=gen)
    state = torch.randn(b, h, p, n, generator=gen)
    x, dt, A, D, bias, B, C, state = (v.to(device) for v in (x, dt, A, D, bias, B, C, state))
    y, ht = module.ssd_scan(x, dt, A, B, C, D, bias, initial_state=state, return_final_state=True)
    for i in range(t):
        s = slice(i, i + 1)
        yi, state = module.ssd_scan(x[:, s], dt[:, s], A, B[:, s], C[:, s], D, bias, initial_state=state,
                                    return_final_state=True)
        torch.testing.assert_close(yi, y[:, s], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ht, rtol=1e-5, atol=1e-5)


def test_decode_kernel_matches_the_scan(module, device):
    """ssd_decode (one token, state in and out) chains to ssd_scan's outputs and final state,
    grouped B/C, with and without D / dt_bias, softplus and a dt limit."""
    gen = torch.Generator().manual_seed(7)
    b, t, h, p, g, n = 2, 2, 4, 20, 2, 24
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen)
    A, D, bias = -torch.exp(torch.rand(h, generator=gen)), torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    B, C = torch.randn(b, t, g, n, generator=gen), torch.randn(b, t, g, n, generator=gen)
    h0 = torch.randn(b, h, p, n, generator=gen)
    x, dt, A, D, bias, B, C, h0 = (v.to(device) for v in (x, dt, A, D, bias, B, C, h0))
    for skip, limit in ((True, (0.0, math.inf)), (False, (0.2, 1.0))):
        d, bs = (D, bias) if skip else (None, None)
        y, ht = module.ssd_scan(x, dt, A, B, C, d, bs, dt_limit=limit, initial_state=h0, return_final_state=True)
        state = h0
        for i in range(t):
            yi, state = module.ssd_decode(x[:, i], dt[:, i], A, B[:, i], C[:, i], state, d, bs, dt_limit=limit)
            torch.testing.assert_close(yi, y[:, i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state, ht, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"ssd_decode: .*state \(2, 4, 20, 8\)"):
        module.ssd_decode(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], h0[..., :8])


UNTIMED = pytest.mark.xfail(reason="a tuning value beside the default: this measures its bf16 error", strict=False)


# Rows of the bars on the GPU: the default, tf32 dots with fp32 states, template v8's `scan`
# "blocks" (kernel_templates/ssd/bench.py's SWEEP) at state chunks of 4 and of 8 (kernel chunks
# of 128, a forward sweep row, not here: its backward's compiles would not fit the GPU call's 60 s),
# the P <= 64 bucket's former forward (`fwd` "scan", the default until the twenty-sixth session,
# when [fwd-split] XPASSed and "split" became the bucket's forward).
# Dropped in v8 (call G ran them: [v7-default], [state-chunks-2], [fused] XPASS). `split_states`
# "fill" (v9), an xfail-marked tuning value (XPASS is the pass; it XPASSed on the H200, h35_ssd5.sh).
# Dropped in v11 with `split_states` "local": [local] XFAIL (outside the bars), [local-stages2] XPASS.
# v12 (xfail-marked tuning values): the split forward's `pass` "fused" (with a backward to come
# per chunk of 64; under "fill" per split chunk) and `cb` "input" (C B^T stored in bf16).
# v13 (xfail-marked tuning values): `bwd` "split" (the backward over the split chunks of 256, its
# forward keeping the states per split chunk), row blocks of 64 (the default) and of 32, and with
# `pass` "fused" (the forward's fused pass, the backward's pull and reverse pass as one loop).
# v15: the P <= 64 bucket's default is `bwd` "split" with `pass` "fused" ([default] runs it; v14's
# three rows passed on the H200); [bwd-chunk] keeps the chunk backward with the two-kernel pass.
@pytest.mark.parametrize("cfg", [pytest.param({}, id="default"),
                                 pytest.param({"scan": "blocks"}, id="blocks", marks=UNTIMED),
                                 pytest.param({"scan": "blocks", "STATE_CHUNKS": 8}, id="blocks-sc8", marks=UNTIMED),
                                 pytest.param({"dot": "tf32", "state": "fp32"}, id="tf32-fp32-state"),
                                 pytest.param({"fwd": "scan"}, id="fwd-scan"),
                                 pytest.param({"split_states": "fill"}, id="fill", marks=UNTIMED),
                                 pytest.param({"pass": "fused"}, id="split-fused", marks=UNTIMED),
                                 pytest.param({"pass": "fused", "split_states": "fill", "cb": "input"},
                                              id="split-fused-fill-cb", marks=UNTIMED),
                                 pytest.param({"bwd": "split"}, id="bwd-split", marks=UNTIMED),
                                 pytest.param({"bwd": "split", "BWD_M": 32}, id="bwd-split-m32", marks=UNTIMED),
                                 pytest.param({"bwd": "split", "pass": "fused"}, id="bwd-split-fused",
                                              marks=UNTIMED),
                                 pytest.param({"bwd": "chunk", "pass": "split"}, id="bwd-chunk"),
                                 # v16 (xfail-marked tuning values; `.ci/h200/h35_ssd8.sh`, the likeliest
                                 # winner first): `split_dbc` "one" at 16 warps uncapped with split chunks
                                 # of 128, split chunks of 128, 16 warps, "one" at 16 warps, chunks of 64
                                 pytest.param({"split_dbc": "one", "bwd_split_warps": 16, "bwd_split_maxnreg": 0,
                                               "STATE_CHUNKS": 2}, id="v16-one-w16-sc2", marks=UNTIMED),
                                 pytest.param({"STATE_CHUNKS": 2}, id="v16-sc2", marks=UNTIMED),
                                 pytest.param({"bwd_split_warps": 16, "bwd_split_maxnreg": 0}, id="v16-w16",
                                              marks=UNTIMED),
                                 pytest.param({"split_dbc": "one", "bwd_split_warps": 16, "bwd_split_maxnreg": 0},
                                              id="v16-one-w16", marks=UNTIMED),
                                 # v18: the P <= 64 bucket's STATE_CHUNKS is 1 ([v16-sc1] passed on an
                                 # H100, h35_ssd8.sh; [default] runs it now); [sc4] keeps v17's default
                                 pytest.param({"STATE_CHUNKS": 4}, id="sc4", marks=UNTIMED),
                                 # v19 (`.ci/h200/h35_ssd9.sh`): `split_dbc` "fused" (dx, dC and dB in one
                                 # launch per split chunk of 64 and group) at 16 warps uncapped; "paired"
                                 # (a dx and a dC / dB program per chunk and group) at 16 warps and at 8,
                                 # both uncapped
                                 pytest.param({"split_dbc": "fused", "bwd_split_warps": 16, "bwd_split_maxnreg": 0},
                                              id="v19-fused-w16", marks=UNTIMED),
                                 pytest.param({"split_dbc": "paired", "bwd_split_warps": 16, "bwd_split_maxnreg": 0},
                                              id="v19-paired-w16", marks=UNTIMED),
                                 # v20 (`.ci/h200/h35_ssd10.sh`, H100): [v19-paired-w8], [v20-paired-w8-sums]
                                 # (now [default]: "paired" at 8 warps uncapped, `bwd_sums` "kernel"), num_stages
                                 # 2 and STATE_N 32 passed (dropped: bench.py's SWEEP says why). [v20-two] is v20's
                                 # default ("two" capped at 128, host sums)
                                 pytest.param({"split_dbc": "two", "bwd_split_maxnreg": 128, "bwd_sums": "host"},
                                              id="v20-two", marks=UNTIMED),
                                 # v21 (`.ci/h200/h36_ssd11.sh`): `split_dbc` "triple" at 8 and 16 warps
                                 pytest.param({"split_dbc": "triple"}, id="v21-triple-w8", marks=UNTIMED),
                                 pytest.param({"split_dbc": "triple", "bwd_split_warps": 16}, id="v21-triple-w16",
                                              marks=UNTIMED),
                                 # and the backward's pull over state tiles of 32 and 16 (PULL_N)
                                 pytest.param({"PULL_N": 32}, id="v21-pull32", marks=UNTIMED),
                                 pytest.param({"PULL_N": 16}, id="v21-pull16", marks=UNTIMED),
                                 # v22 (`.ci/h200/h38_ssd12.sh`, H100): [v22-exp2] (now [default]: the
                                 # fused backward's exponentials as exp2 of cs in log2 units, `bwd_exp`
                                 # "exp2"), [v22-pre] and [v22-exp2-pre] (`bwd_prefetch`, removed in v23)
                                 # passed. [v22-exp] is v22's default (tl.exp)
                                 pytest.param({"bwd_exp": "exp"}, id="v22-exp", marks=UNTIMED),
                                 # v24: the split backward's pull over P tiles of 32 (512 programs at the
                                 # bench shape), with its weights on dy's columns; the fused backward's q
                                 # and dD sums from tensor-core products; all three
                                 pytest.param({"PULL_P": 32}, id="v24-pullp32", marks=UNTIMED),
                                 pytest.param({"PULL_P": 32, "pull_scale": "dy"}, id="v24-pullp32-dy",
                                              marks=UNTIMED),
                                 pytest.param({"bwd_qd": "dot"}, id="v24-qd", marks=UNTIMED),
                                 pytest.param({"PULL_P": 32, "pull_scale": "dy", "bwd_qd": "dot"}, id="v24-all",
                                              marks=UNTIMED),
                                 # v27's `bwd_ahead` (the fused backward's per-head loads one head ahead or
                                 # staged) is the P <= 64 bucket's from v28 (its rows v27-ahead, -pull,
                                 # -triple XPASSed on the H200): v27's default beside it, and "triple"
                                 pytest.param({"bwd_ahead": False}, id="v27-default", marks=UNTIMED),
                                 pytest.param({"split_dbc": "triple"}, id="v28-triple", marks=UNTIMED),
                                 # v29's `pull_ahead` (the fused pull's cs rows one step ahead) is the P <= 64
                                 # bucket's from v30 (v29-pull-ahead and -pull-ahead-pull XPASSed on an H100):
                                 # v29's default beside it, and the pull pair under it
                                 pytest.param({"pull_ahead": False}, id="v29-default", marks=UNTIMED),
                                 pytest.param({"pull_ahead": True, "PULL_P": 32, "pull_scale": "dy"},
                                              id="v29-pull-ahead-pull", marks=UNTIMED),
                                 # v31's `bwd_dbc_ln` (the fused backward's dC and dB accumulated as [L, N]), untimed
                                 pytest.param({"bwd_dbc_ln": True}, id="v31-dbc-ln", marks=UNTIMED)])
def test_bf16_vs_fp32_on_gpu(module, device, cfg):
    """GPU, the default tiles (chunk 64; at P 64 16-bit dots and bf16 chunk states, template v6's
    rows dot-input / state-input / dot-state-input XPASSed on the H200; state chunks of 4 kernel
    chunks, bf16 end-state gradients and N tiles of 64 in the backward, v7's rows state-chunks-4,
    sc4-gstate-n64, gstate-input XPASSed on the H200: all the bucket's default now); tf32 dots +
    fp32 states beside it (as precise as the default or more in every part); other tuning
    values (v8's `scan` "blocks"), xfail-marked (they measure their own error); the former forward
    (`fwd` "scan"; "split" is the default at P <= 64 since the twenty-sixth session):
    the bf16 path against the fp32 path (exact fp32 dots,
    itself checked against the reference above) on the same bf16-representable inputs, a Mamba-2
    head (P 64, N 128, 2 groups), T 1000 (not a multiple of the chunk), initial state: relative
    RMS <= 5e-3 on y and the final state (of the forward with a backward to come and of the one
    under no_grad, which stores no states), <= 1e-2 on every gradient (the GDN bars)."""
    if device.type != "cuda":
        pytest.skip("bf16 dots need a GPU (the interpreter computes them wrongly)")
    low, full, dy, dht = _low_and_full((2, 1000, 8, 64, 2, 128), torch.bfloat16, device)

    def run(inputs, dy):
        with torch.no_grad():  # the forward that stores no states (`scan` "blocks": its own path)
            y0, ht0 = module.ssd_scan(*inputs[:7], initial_state=inputs[7], return_final_state=True)
        inputs = [a.clone().requires_grad_() for a in inputs]
        y, ht = module.ssd_scan(*inputs[:7], initial_state=inputs[7], return_final_state=True)
        grads = torch.autograd.grad((y, ht), inputs, (dy.to(y.dtype), dht))
        return [y, ht, *grads, y0, ht0]

    module.set_config(cfg or None)
    try:
        got = run(low, dy)
        ref = run(full, dy)
    finally:
        module.set_config(None)
    names = [*_BAR_NAMES, "y_no_grad", "final_state_no_grad"]
    errs = {k: ((a.float() - r.float()).norm() / r.float().norm()).item() for k, a, r in zip(names, got, ref)}
    assert_within_bars(errs, ("y", "final_state"), 5e-3, 1e-2)


def test_bf16_vs_fp32_on_gpu_no_final_state_grad(module, device):
    """GPU, the default tiles, the training step whose final state gets no gradient (v25's pull
    without `HAS_DHT`: no d(final state) tensor, no fill): the same Mamba-2 head, T 1000 and
    initial state as test_bf16_vs_fp32_on_gpu, y alone back-propagated, both with the final state
    not asked for and asked for and left out of the loss. Same bars."""
    if device.type != "cuda":
        pytest.skip("bf16 dots need a GPU (the interpreter computes them wrongly)")
    low, full, dy, _ = _low_and_full((2, 1000, 8, 64, 2, 128), torch.bfloat16, device)

    def run(inputs, final: bool):
        inputs = [a.clone().requires_grad_() for a in inputs]
        out = module.ssd_scan(*inputs[:7], initial_state=inputs[7], return_final_state=final)
        y = out[0] if final else out
        return [y, *torch.autograd.grad(y, inputs, dy.to(y.dtype))]

    names = ["y", *_BAR_NAMES[2:]]
    for final in (False, True):
        got, ref = run(low, final), run(full, final)
        errs = {f"{k}_final{int(final)}": ((a.float() - r.float()).norm() / r.float().norm()).item()
                for k, a, r in zip(names, got, ref)}
        assert_within_bars(errs, ("y",), 5e-3, 1e-2)


_BAR_NAMES = ["y", "final_state", "dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias", "dinitial_state"]


def _outputs_and_grads(module, inputs, dy, dht) -> list:
    """y, the final state and every input's gradient of one scan (initial state: inputs[7])."""
    inputs = [a.clone().requires_grad_() for a in inputs]
    y, ht = module.ssd_scan(*inputs[:7], initial_state=inputs[7], return_final_state=True)
    return [y, ht, *torch.autograd.grad((y, ht), inputs, (dy.to(y.dtype), dht))]


def _low_and_full(shape: tuple, dtype: torch.dtype, device) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """The bars tests' inputs at (b, t, h, p, g, n), seed 11: x, dt, A, B, C, D, dt_bias and the
    initial state in `dtype` (A and the state fp32, as in the models), the same values in fp32,
    and the cotangents dy (representable in `dtype`: both paths back-propagate the same values)
    and d(final state)."""
    gen = torch.Generator().manual_seed(11)
    b, t, h, p, g, n = shape
    args = [torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen) - 3.0,
            -torch.exp(torch.rand(h, generator=gen) * 2), 0.3 * torch.randn(b, t, g, n, generator=gen),
            0.3 * torch.randn(b, t, g, n, generator=gen), torch.randn(h, generator=gen),
            torch.randn(h, generator=gen), 0.1 * torch.randn(b, h, p, n, generator=gen)]
    low = [a.to(device, dtype) for a in args]
    low[2], low[7] = low[2].float(), low[7].float()
    full = [a.float().detach() for a in low]
    dy = torch.randn(b, t, h, p, generator=gen).to(dtype).float().to(device)
    dht = torch.randn(b, h, p, n, generator=gen).to(device)
    return low, full, dy, dht


# The 16-bit path on the interpreter, which dots fp16 right (not bf16): fp16 inputs with the
# module's dot mode forced to "fp16" run the GPU's 16-bit path (docs/LOG.md, thirty-first session:
# on the H200 template v13's `bwd` "split" was outside the bf16 bars, and this emulation gave it
# dA 8.4e-3, ddt_bias 1.5e-2 at B1 T300 H2 P64 G1 N128, the default <= 4.1e-4 everywhere). The bars
# are the GDN bars scaled by fp16's unit roundoff against bf16's (2^-11 / 2^-8): 6.25e-4 on y and
# the final state, 1.25e-3 on every gradient. v13's split backward fails them here (ddt 1.9e-3,
# dA 1.9e-2, ddt_bias 4.1e-2); the default and v14's split backward give <= 3.7e-4. BWD_M 32
# nightly (7 s).
@pytest.mark.parametrize("cfg", [pytest.param({}, id="default"), pytest.param({"bwd": "split"}, id="bwd-split"),
                                 pytest.param({"bwd": "split", "BWD_M": 32}, id="bwd-split-m32",
                                              marks=pytest.mark.slow),
                                 pytest.param({"bwd": "split", "pass": "fused"}, id="bwd-split-fused"),
                                 # split chunks of 128 and of 256 (the bucket's `bwd` "split", `pass` "fused";
                                 # 256 its default until v18, 64 since)
                                 pytest.param({"STATE_CHUNKS": 2}, id="sc2"),
                                 pytest.param({"STATE_CHUNKS": 4}, id="sc4", marks=pytest.mark.slow),
                                 # v16's `split_dbc` "one" at split chunks of 64, 128, 256 (1, 2, 4 row blocks)
                                 pytest.param({"split_dbc": "one"}, id="dbc-one"),
                                 pytest.param({"split_dbc": "one", "STATE_CHUNKS": 2}, id="dbc-one-sc2"),
                                 pytest.param({"split_dbc": "one", "STATE_CHUNKS": 4}, id="dbc-one-sc4",
                                              marks=pytest.mark.slow),
                                 # v19's `split_dbc` "fused" (dx, dC, dB in one launch) at the bucket's split
                                 # chunks of 64 (one row block)
                                 pytest.param({"split_dbc": "fused"}, id="dbc-fused"),
                                 # v20's default ("paired" with `bwd_sums` "kernel" since: [default])
                                 pytest.param({"split_dbc": "two", "bwd_sums": "host"}, id="dbc-two"),
                                 # v21's "triple" (dx, dC, dB in three programs per chunk and group)
                                 pytest.param({"split_dbc": "triple"}, id="dbc-triple"),
                                 # `bwd_exp` "exp" (v22's default; "exp2" since v23: [default]) under "paired"
                                 pytest.param({"bwd_exp": "exp"}, id="paired-exp"),
                                 # v24: the pull over P tiles of 32 (two here), its weights on C's rows and
                                 # on dy's columns (`pull_scale` "dy": dy rounded to 16 bits after its weight)
                                 pytest.param({"PULL_P": 32}, id="pullp32"),
                                 pytest.param({"PULL_P": 32, "pull_scale": "dy"}, id="pullp32-dy"),
                                 # and `bwd_qd` "dot" (q's and dD's sums from tensor-core products) under
                                 # "paired" and "triple"
                                 pytest.param({"bwd_qd": "dot"}, id="paired-qd"),
                                 pytest.param({"bwd_qd": "dot", "split_dbc": "triple"}, id="triple-qd"),
                                 # v27's `bwd_ahead` under "paired" and "triple"
                                 pytest.param({"bwd_ahead": True}, id="paired-ahead"),
                                 pytest.param({"bwd_ahead": True, "split_dbc": "triple"}, id="triple-ahead"),
                                 # v31's `bwd_dbc_ln` under "paired" (the bucket's `bwd_ahead`)
                                 pytest.param({"bwd_dbc_ln": True}, id="paired-dbc-ln"),
                                 # v29's `pull_ahead` (nightly: test_pull_ahead_matches_pull checks its pull)
                                 pytest.param({"pull_ahead": True}, id="pull-ahead", marks=pytest.mark.slow)])
def test_fp16_vs_fp32_interpreted(module, device, monkeypatch, cfg):
    """Interpreter only (on a GPU test_bf16_vs_fp32_on_gpu runs the real bf16 path; 3 s a row
    here): the P <= 64 bucket's 16-bit path (16-bit dots, stored states and end-state gradients,
    split chunks of 64 since v18) in fp16 against the fp32 path on the same fp16-representable
    inputs, two heads of P 64, N 64, T 270 (five split chunks of 64, the last 14 tokens; at 256 two),
    an initial state: y, the final state and every gradient within the scaled bars.

    The bars hold at this shape, not at any T for ddt_bias: each head's ddt_bias is the sum of its
    T per-token d(dt) terms, whose 16-bit errors (about 2e-4 relative here, from the dx kernel's
    16-bit dots) are unbiased, so its relative error is about that times ||terms||_2 / |sum|, large
    where a head's terms cancel. At T 1000 (these inputs' head 0: sum -0.61, sum |terms| 640)
    ddt_bias is 1.5e-3 here, and the same in mamba-ssm's Triton SSD emulated the same way
    (docs/LOG.md, helper-79); test_fp16_ddt_bias_long_t bounds it by that scale."""
    if not interpreting():
        pytest.skip("the interpreter's emulation of the 16-bit path (on a GPU: test_bf16_vs_fp32_on_gpu)")
    low, full, dy, dht = _low_and_full((1, 270, 2, 64, 1, 64), torch.float16, device)

    module.set_config(cfg or None)
    try:
        with fp16_dot_path(monkeypatch, module):
            got, ref = _outputs_and_grads(module, low, dy, dht), _outputs_and_grads(module, full, dy, dht)
    finally:
        module.set_config(CPU_CONFIG)
    errs = {k: ((a.float() - r.float()).norm() / r.float().norm()).item() for k, a, r in zip(_BAR_NAMES, got, ref)}
    assert_within_bars(errs, ("y", "final_state"), 6.25e-4, 1.25e-3)


@pytest.mark.slow
def test_fp16_ddt_bias_long_t(module, device, monkeypatch):
    """Interpreter only, nightly (7 s): the bucket's 16-bit path in fp16 at T 1000 (sixteen split
    chunks of 64 since v18, the last 40 tokens; four of 256 before), test_fp16_vs_fp32_interpreted's
    other inputs. Every output but
    ddt_bias within its bars; ddt_bias, whose plain relative error is 1.5e-3 here (over the 1.25e-3
    bar, as in mamba-ssm's Triton SSD: a head's terms cancel to -0.61 from sum |terms| 640), per
    head within the gradient bar times the norm of its per-token terms (the fp32 path's ddt): the
    error of a sum of terms each within the bar and unbiased (measured: 0.04 and 0.29 of that
    bound; 0.07 and 0.28 at split chunks of 256). Planted, a per-token error of one sign (2e-4 of
    each term) gives 2.9 and 3.6, a running sum in fp16 1.4 and 1.7 (at split chunks of 256)."""
    if not interpreting():
        pytest.skip("the interpreter's emulation of the 16-bit path (on a GPU: test_bf16_vs_fp32_on_gpu)")
    low, full, dy, dht = _low_and_full((1, 1000, 2, 64, 1, 64), torch.float16, device)

    module.set_config(None)
    try:
        with fp16_dot_path(monkeypatch, module):
            got, ref = _outputs_and_grads(module, low, dy, dht), _outputs_and_grads(module, full, dy, dht)
    finally:
        module.set_config(CPU_CONFIG)
    errs = {k: ((a.float() - r.float()).norm() / r.float().norm()).item() for k, a, r in zip(_BAR_NAMES, got, ref)}
    i_bias, i_ddt = _BAR_NAMES.index("ddt_bias"), _BAR_NAMES.index("ddt")
    del errs["ddt_bias"]
    assert_within_bars(errs, ("y", "final_state"), 6.25e-4, 1.25e-3)
    scale = ref[i_ddt].float().flatten(0, 1).norm(dim=0)  # [H]: each head's per-token terms' norm
    ratio = (got[i_bias].float() - ref[i_bias].float()).abs() / (1.25e-3 * scale)
    assert (ratio <= 1.0).all(), f"ddt_bias error over the bar times its terms' norm: {ratio.tolist()}"


def test_binding_swaps_the_mixers_chunked_scan(module, device):
    """The `binding` on a tiny transformers Mamba-2 mixer: the chunked-scan call it makes runs our
    kernel (the first call included), outputs and parameter gradients match the unpatched mixer,
    and undo restores it. A scan function whose arguments the kernel does not take stays."""
    transformers = pytest.importorskip("transformers")
    from onboarding.patching.callswap import min_required, reachable
    from onboarding.patching.core import PatchRecord

    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16,
                                    state_size=16, n_groups=2, expand=2, chunk_size=16)
    mixer = transformers.Mamba2Model(cfg).layers[0].mixer.to(device)
    if not reachable(mixer, min_required(5)):  # what the binding wraps (ssd's CHUNKED_SCAN)
        pytest.skip(f"transformers {transformers.__version__}'s Mamba-2 mixer inlines its scan (no call to swap)")
    x = torch.randn(1, 9, 32, device=device)
    ref = mixer(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [mixer.A_log, mixer.dt_bias, mixer.D, mixer.in_proj.weight])
    calls = []
    counting = module.entry

    class Counting:
        entry = staticmethod(lambda *a, **k: calls.append(1) or counting(*a, **k))

    record = PatchRecord(path="mixer", kind="linear_attention.mamba", family="ssd")
    undo = family_module("ssd").FAMILY.binding(None, mixer, [Counting], record, mixer)
    try:
        out = mixer(x)
        assert record.status == "active" and "-> kernel" in record.binding, record
        assert len(calls) == 2  # the calibration and the call it served
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        grads = torch.autograd.grad(out.square().sum(), [mixer.A_log, mixer.dt_bias, mixer.D, mixer.in_proj.weight])
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    finally:
        undo()
    assert "forward" not in mixer.__dict__
    binding = importlib.import_module(family_module("ssd").FAMILY.binding.__module__)

    def scan(x, dt, A, B, C, chunk_size, D=None, seq_idx=None, **kwargs):
        return x
    with pytest.raises(TypeError, match="seq_idx"):
        binding._call_ours(scan, module.entry, (x, x, x, x, x, 16), {"seq_idx": torch.zeros(1)})


@pytest.mark.parametrize("split_states", ["pass", "fill"])
def test_split_fused_pass_matches_split(module, device, split_states):
    """`pass` "fused" of the split forward (v12) against its two launches ("split"): the same y,
    final state, stored incoming states and total log decays of ssd_fwd_op (what the backward of
    another `pass` would read), with a backward to come (states per chunk of 16, or with "fill" per
    split chunk of 32 then filled in) and without (y and the final state); T 41 (3 chunks, 2 split
    chunks, the last 9 tokens), 2 P blocks, an initial state, PASS_K 16 (two steps per split chunk)."""
    fx = mild(fixture(module, (1, 41, 2, 20, 1, 24, True, True)))
    args = fx.make_inputs(torch.float32, device, torch.Generator().manual_seed(6))
    outs = {}
    for pas in ("split", "fused"):
        _split(module, device, {"STATE_CHUNKS": 2, "FWD_M": 16, "FWD_K": 16, "PASS_K": 16, "pass": pas,
                                "split_states": split_states})
        try:
            outs[pas] = [module.ssd_fwd_op(*args[:7], args[9], True, 0.0, math.inf, save)
                         for save in (True, False)]
        finally:
            module.set_config(CPU_CONFIG if device.type == "cpu" else None)
    for got, want, save in zip(outs["fused"], outs["split"], (True, False)):
        for g, w in zip(got if save else got[:2], want if save else want[:2]):  # no-save: no states, dac unwritten
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# Host cost of one training step (forward + backward of y, no final-state gradient) at the
# P <= 64 bucket's own config (the bench's `ours` row: `fwd` and `bwd` "split", `pass` "fused",
# `split_dbc` "paired", `bwd_sums` "kernel"), counted by `onboarding.testing.hostcost`: Triton
# launches, aten ops that would launch on a GPU, allocations. v25: 10 launches, no aten launch (v24
# filled a zero d(final state) with torch.zeros when y alone had a gradient), 25 allocations
# (v24: 27, two of the split forward's unused).
STEP_TRITON, STEP_ATEN_LAUNCHES, STEP_EMPTY = 10, 0, 25


def _counted_step(module, dtype=torch.bfloat16):
    from onboarding.testing.hostcost import counting

    gen = torch.Generator().manual_seed(11)
    b, t, h, p, g, n = 1, 40, 4, 16, 2, 16
    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=gen)).to(dtype)
    leaves = [r(b, t, h, p), r(b, t, h, scale=0.5), -torch.exp(torch.rand(h, generator=gen)), r(b, t, g, n),
              r(b, t, g, n), r(h), r(h)]
    leaves = [x.requires_grad_() for x in leaves]
    dy = r(b, t, h, p)
    with counting() as mode:
        y = module.ssd_scan(*leaves)
        torch.autograd.grad(y, leaves, dy)
    return mode.cost


@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(),
                    reason="counts the Triton interpreter's launches on CPU tensors")
def test_training_step_host_cost(module):
    """The bucket's training step issues STEP_TRITON Triton launches, STEP_ATEN_LAUNCHES aten ops
    that launch on a GPU (no zeros fill for an unused final state: the split backward's pull
    starts from zero, HAS_DHT False), at most STEP_EMPTY allocations and no host sync. Then a
    bucket pin made after that warm step changes the next step's launches (`split_dbc` "two": the
    split dx kernel and two dC / dB launches in place of the fused kernel), and clearing it
    restores them: nothing per shape is kept across a `set_config`."""
    module.set_config(None)  # the bucket's own config, not the CPU tests' all-shapes pin
    bucket = module.shape_bucket(16)
    try:
        cost = _counted_step(module)
        summary = cost.summary()
        assert summary["triton_launches"] == STEP_TRITON, dict(cost.triton)
        assert summary["aten_launch_ops"] == STEP_ATEN_LAUNCHES, cost.by_line()
        assert summary["allocations"] <= STEP_EMPTY, cost.by_line(kind="view")
        assert summary["syncs"] == 0, summary["sync_lines"]
        fused = [w for w in cost.triton if "ssd_bwd_split_fused_kernel" in w or "_split_backward" in w]
        assert fused, dict(cost.triton)
        module.set_config({"split_dbc": "two"}, bucket=bucket)
        pinned = _counted_step(module)
        names = " ".join(pinned.triton)
        assert sum(pinned.triton.values()) == STEP_TRITON + 2, dict(pinned.triton)
        module.set_config(None, bucket=bucket)
        again = _counted_step(module)
        assert sum(again.triton.values()) == STEP_TRITON and dict(again.triton) == dict(cost.triton), names
    finally:
        module.set_config(None, bucket=bucket)
        module.set_config(CPU_CONFIG)
