"""Mamba-2 state-space duality (SSD) family: the selective state-space scan of Mamba-2 mixers.

One variant, `scan`: x [B, T, H, P], dt [B, T, H] (bias, softplus and limits applied inside),
A [H], grouped B and C [B, T, G, N], D skip [H], initial and final state [B, H, P, N]; chunked
Triton forward and backward (gradients to every tensor input) and a one-token decode step,
against a pure-PyTorch reference built like transformers' chunked torch path. `chunk_size` is
the reference's (the model's) chunk length; the kernels' own chunk is a tuning value. Served
blocks are patched by swapping the mixer's chunked-scan call (`binding`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, ShapeBucket

from . import bench
from .binding import bind

NAME = "ssd"
CHUNK_SIZES = (8, 16, 32, 64, 128, 256)


def heads(block: Any) -> int | None:
    """H of a Mamba-2 mixer by structure: the decay's head dim ([b, h, chunks, chunk], cumsum over
    the chunk), held by at least two of the block's 1-D parameters (A, and D or the dt bias)."""
    shape = block.attrs.get("decay_shape") or []
    if len(shape) != 4:
        return None
    h = shape[1]
    per_head = [s for s in (block.params or {}).values() if list(s) == [h]]
    return h if len(per_head) >= 2 else None


def match(block: Any) -> dict[str, Any] | None:
    """Render params for a Mamba-2 (SSD) mixer core, by structure: a `linear_attention.mamba`
    block (softplus time step, exp + cumsum decay, no delta-rule beta) whose decay is a scalar
    per head (cumsum over the last dim of [b, h, chunks, chunk], with per-head parameters of
    that h) and that runs the chunked form (tril segment sums)."""
    if block.kind != "linear_attention.mamba" or block.attrs.get("per_channel_decay", False):
        return None
    hist = block.op_histogram or {}
    if not (hist.get("tril") and hist.get("cumsum")) or heads(block) is None:
        return None
    chunk = block.attrs.get("chunk")
    return FAMILY.served("scan", {"chunk_size": chunk if chunk in CHUNK_SIZES else 64})


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """x [1, 19, H, P], dt, A, B/C [1, 19, 1, 16], D, dt_bias, in the ranges Mamba-2 initialises
    (A = -[1, 16], dt_bias the inverse softplus of dt in [0.001, 0.1]); H, P from a [B, T, H, P]
    input shape."""
    H, P = (shapes[0][2], shapes[0][3]) if shapes and len(shapes[0]) == 4 else (4, 16)
    G, N, T = 1, 16, 19
    dt0 = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    return [torch.randn(1, T, H, P, generator=gen), torch.randn(1, T, H, generator=gen),
            -(1 + 15 * torch.rand(H, generator=gen)), torch.randn(1, T, G, N, generator=gen),
            torch.randn(1, T, G, N, generator=gen), torch.randn(H, generator=gen),
            dt0 + torch.log(-torch.expm1(-dt0))]


FAMILY = FamilySpec(
    name=NAME,
    template="ssd.py.j2",
    template_version=16,
    folder=Path(__file__).parent,
    variants={"scan": "Mamba-2 selective state-space scan with grouped B/C, D skip, dt bias/softplus/limits, states"},
    params=(
        Param(name="chunk_size", type=int, default=64, choices=CHUNK_SIZES,
              doc="chunk length of the reference's chunked quadratic form (the model's chunk_size)"),
    ),
    # CHUNK: tokens per chunk L of the kernels (the intra-chunk [L, L] tiles); BLOCK_P: head-dim
    # columns of a forward program (the backward's chunk kernel holds all of P); BLOCK_N: state
    # columns per step of the C B^T kernel's and the backward chunk kernel's N loops; BLOCK_S: state
    # elements per program of the serial state passes; dot: "tf32" keeps fp32 dot operands,
    # "input" dots 16-bit inputs in their own dtype on a GPU; state: the dtype of the chunks'
    # stored states (the forward's largest tensors), fp32 or 16-bit inputs' own; dbc: dB/dC summed
    # over a group's heads in the kernel ("group") or per-head partials summed by the host; DBC_N:
    # state columns per dB/dC program (each program recomputes its chunk's dy x^T once per head);
    # STATE_N: state columns per program of the chunk-state kernels (the forward's chunk states,
    # the backward's dy pull on the incoming states), which hold one [BLOCK_P, STATE_N] product;
    # pass: "split" runs those kernels over every chunk in parallel and the state passes apart
    # (serial over chunks, BLOCK_S elements per program), "fused" one serial loop per (b, h,
    # BLOCK_P x STATE_N tile) that computes each chunk's product in place (no stored chunk states);
    # SCAN_N: state columns per step of the chunk output kernel's C S^T loop (BLOCK_N before v7);
    # gstate: the dtype of the backward's stored end-state gradients (its largest tensors), fp32 or
    # 16-bit inputs' own (as `state`: the reverse pass sums in fp32); STATE_CHUNKS: chunks of CHUNK
    # tokens per state chunk of the forward (over `pass`): > 1 computes the state chunks' own states
    # (one program loops over their chunks), passes states over T / (CHUNK * STATE_CHUNKS) state
    # chunks (that many fewer serial steps and stored states), and one chunk output program per
    # (state chunk, head, P block) carries the state [BLOCK_P, N] in registers through its chunks
    # (storing each chunk's incoming state only when a backward will run); the backward likewise
    # pulls dy on each state chunk's incoming state, passes over the state chunks, then fills in
    # each state chunk's own chunks' end-state gradients in a reverse loop per state chunk.
    # scan (v8; STATE_CHUNKS > 1): "carry" the chunk output program per state chunk above;
    # "blocks" one program per (chunk, head, P block), all chunks in parallel: the state chunk's
    # incoming state's term plus the intra-state-chunk quadratic term tiled in [CHUNK, CHUNK]
    # blocks (its own chunk's causal one and one per earlier chunk of the state chunk, the groups'
    # C B^T blocks computed once beforehand), as a chunk of CHUNK * STATE_CHUNKS tokens with its
    # C B^T tiled. With a backward to come each program also forms its chunk's incoming state from
    # the state chunk's and its earlier chunks' products (SCAN_N columns at a time) and stores it
    # for the backward (y the same as without). scan_maxnreg: the
    # "blocks" kernel's register cap (Triton's `maxnreg`; 0 none): 128 lets two programs of 8
    # warps share an SM (the sm_90 bf16 build at P 64, N 128: 133 registers uncapped, 128 and no
    # spills capped). DBC_SPLIT (v8; `dbc` "group"): programs per group of the dB/dC kernel, each
    # over H / G / DBC_SPLIT of its heads, writing partials the host sums (1: one program walks all
    # of the group's heads: 2048 programs of 16 heads at B1 T8192 G8 N128, DBC_N 64).
    # bwd_maxnreg (v8): a register cap for the backward chunk and dB/dC kernels (0: none); at 128
    # two programs of 8 warps fit an SM (the sm_90 bf16 build at P 64, N 128 of the P <= 64
    # default: bwd_chunk 188 registers uncapped, 208 bytes of spills at 128; bwd_dbc 222, 208;
    # rebuilt with every integer marked as the JIT marks them at T8192, helper-68's
    # /tmp/aot_audit/audit.py, docs/LOG.md: bwd_dbc 220, 224; on triton 3.6, the H200's: bwd_chunk
    # 191, 244 (98336 bytes of shared memory), bwd_dbc 224, 216-220).
    # 128 is the P <= 64 bucket's value since the twenty-second session: on the H200 (B1 T8192
    # H128 P64 G8 N128 bf16) fwd+bwd 3.958 ms (graph 3.641) against 4.180 (3.902) uncapped, and
    # the bf16-vs-fp32 bars held (test_bf16_vs_fp32_on_gpu[default], docs/LOG.md device call M).
    # fwd (v9): "scan" the forward above (`pass`, STATE_CHUNKS, `scan`); "split" five launches over
    # split chunks of CHUNK * STATE_CHUNKS tokens (256 at the P <= 64 bucket), each with many
    # small programs: dt and its chunk cumsum stored once; the chunks' own states (one program per
    # (chunk, head, BLOCK_P x STATE_N tile), FWD_K tokens per dot step); the state pass; C B^T per
    # (chunk, group) in [FWD_M, FWD_M] tiles on and below the diagonal; the outputs, one program per
    # (chunk, head, FWD_M rows, BLOCK_P columns): exp(cs) C S_in^T over SCAN_N steps plus the causal
    # C B^T sum in FWD_K steps plus D x. With a backward to come the states and the pass run per
    # CHUNK tokens (what the backward reads; the output kernel takes every STATE_CHUNKS-th);
    # the backward is unchanged. fwd_warps: warps of those kernels; fwd_maxnreg: the output kernel's
    # register cap (0 none; the sm_90 bf16 build at P 64, N 128, FWD_M 64, FWD_K 32, 4 warps: 158
    # registers uncapped, 128 and no spills capped: four programs per SM instead of three).
    # split_states (STATE_CHUNKS > 1, a backward to come): "pass" forms and passes the states per
    # CHUNK tokens (a serial pass over T / CHUNK chunks); "fill" as without a backward (per split
    # chunk, T / (CHUNK * STATE_CHUNKS) pass steps), then one program per (split chunk, head, tile)
    # fills in its chunks' incoming states from its own (STATE_CHUNKS - 1 products in a loop).
    # Template v10's "local" (the chunks' split-chunk-local states and end-state gradients, completed
    # in the backward's chunk kernels; no serial pass over T / CHUNK chunks) was slower and failed the
    # bars once on the H200 (`BUDGET=230 bash .ci/h200/h35_ssd5.sh` at v10, 40401a5; B1 T8192 H128
    # P64 G8 N128 bf16): test_ssd.py::test_bf16_vs_fp32_on_gpu [fill] XPASS, [local] XFAIL (outside
    # the bars), [local-stages2] XPASS; forward + backward GPU time (torch.profiler, summed over
    # kernels): default ("pass") 3.359 ms, "local" 4.227 ms (ssd_bwd_chunk_kernel 1.560 against
    # 0.880 ms, ssd_bwd_dbc_kernel 1.221 against 0.700; both read two more [P, N] tiles per step
    # under it). v11 removed it.
    # bwd_stages (v10): software-pipelining stages of the backward chunk and dB/dC kernels
    # (Triton's num_stages; 3 is its default), a plain compile option of the default backward. The
    # sm_90 bf16 build at the P <= 64 bucket (triton 3.9): the chunk kernel's shared memory 90144
    # bytes at 3, 57376 at 2 (188 registers both); dB/dC 98560 and 65792 (222 and 220 registers).
    # Not timed on its own.
    # pass "fused" with `fwd` "split" (v12): the split forward's chunk-state kernel and state pass
    # as one launch, one program per (b, h, BLOCK_P x STATE_N tile) in one flat loop over T in
    # steps of PASS_K tokens (software-pipelined across the chunks of CHUNK * STATE_CHUNKS tokens
    # without a backward to come, CHUNK with one): each chunk's incoming state stored at its first
    # step, every step's product added into the decayed carried state, the products never stored
    # and read back (on the H200 at B1 T8192 H128 P64 G8 N128 bf16 the two launches it replaces
    # took 0.119 + 0.097 ms of the forward's 0.574: docs/LOG.md, twenty-eighth session, call 1).
    # Since v12 "fused" also takes the backward's one-loop dy pull and reverse pass at
    # STATE_CHUNKS > 1 (it replaces, per tile, the dstate kernel, the pass over state chunks and
    # the fill-in: in device call A of the twenty-sixth session 0.273 and 0.310 ms, and one of the
    # two state passes of 0.488 together, of fwd+bwd's 3.356). The sm_90 bf16 build (triton 3.9)
    # at the P <= 64 bucket, 4 warps: PASS_K 64 50688 bytes of shared memory, 128 registers, no
    # spills (triton 3.6, the H200's: 164 registers, so three programs per SM by registers, not
    # four; helper-68's rebuild, docs/LOG.md); PASS_K 128 100352, 172; STATE_N 32 38400, 90. cb
    # (v12): the dtype of the split
    # forward's stored C B^T [L, L] per (chunk, group), the output kernel's largest operand (each of
    # a group's heads reads it; fp32 or 16-bit inputs' own, summed in fp32 either way); the output
    # kernel's build: 128 registers uncapped with it (158 without; at the forward-only launch,
    # whose R = 1 the JIT compiles as a constant, 133 without on triton 3.9 and 167 on 3.6, the
    # H200's: helper-68's rebuild, docs/LOG.md), shared memory unchanged.
    # bwd (v13): "chunk" the backward above (per CHUNK tokens: with `fwd` "split" the forward then
    # forms and passes its states per CHUNK tokens, 128 serial steps at T 8192); "split" (only under
    # `fwd` "split", else "chunk") the backward over the split chunks of CHUNK * STATE_CHUNKS tokens:
    # the forward keeps its states per split chunk as without a backward, and the backward runs dy's
    # pull per split chunk (ssd_split_state_kernel, PULL), the reverse pass over the split chunks,
    # C B^T per group in BWD_M tiles, dx per (head, BWD_M rows, chunk) (ssd_bwd_split_dx_kernel),
    # dC then dB per (BWD_M rows, chunk, group) (ssd_bwd_split_dbc_kernel, the group's heads summed
    # per [BWD_M, BWD_M] block pair before one dot with B or C) and d(dt) per (chunk, 4 heads) from
    # per-token terms (ssd_bwd_split_ddt_kernel); with `pass` "fused" the pull and the reverse pass
    # are one reverse loop per (head, BLOCK_P x STATE_N tile) (ssd_split_fused_pull_kernel, PASS_K
    # tokens a step; the sm_90 bf16 build: 135 registers, 49672 bytes of shared memory, 4 warps, no
    # spills). On the H200 (device call A of the twenty-sixth
    # session, B1 T8192 H128 P64 G8 N128 bf16) the "chunk" path's per-64 states and their passes
    # cost the forward 0.189 ms (state kernel, 0.119 without a backward) and most of 0.488 (two
    # passes), its backward 2.8 ms (ssd_bwd_chunk_kernel 0.878, ssd_bwd_dbc_kernel 0.700,
    # dstate 0.273, fill-in 0.310). bwd_split_maxnreg: the register cap of the split backward's dx
    # and dB/dC kernels (0 none); the sm_90 bf16 build (triton 3.9, P 64, N 128) at BWD_M 64, 8
    # warps: dx 171 registers uncapped, 128 and no spills capped (81952 bytes of shared memory); dC
    # 233, 128 / 112 spill bytes (66048); dB 188, 128 / 40 (74760); at BWD_M 32 capped: 116, 128,
    # 128, no spills (49184, 41216, 45576). Rebuilt as the JIT compiles the launch at T8192
    # (every integer that is a multiple of 16 marked, and SPLIT, 1 at DBC_SPLIT 1, a constant;
    # helper-68's /tmp/aot_audit/audit.py, docs/LOG.md): dB's 40 bytes were an artifact of
    # building SPLIT as a variable (126 registers, no spills; on triton 3.6, the H200's, 128 / 0
    # with any marks); dC spills 104 bytes (3.6: 184); dx capped spills none on 3.9, 24 bytes on
    # 3.6 (uncapped 142 there); at BWD_M 32 on 3.6 dx 128 / 4. Shared memory and async copies the
    # same in every build. Not timed on a GPU (`.ci/h200/h35_ssd7.sh`).
    # v14: `bwd` "split"'s d(dt) stable. v13 took each intra-chunk term's part of dL/dcs as a row
    # from the dC programs' fp32 products but as a column from dx's 16-bit dots (dt_s x_s . dxs_s),
    # so the two did not cancel and the suffix sums over the split chunk of 256 kept their 16-bit
    # residues: on the H200 (bf16, B2 T1000 H8 P64 G2 N128) test_bf16_vs_fp32_on_gpu [bwd-split],
    # [bwd-split-m32], [bwd-split-fused] outside the bars; in the interpreter's fp16 emulation
    # (B1 T300 H2 P64 G1 N128) dA 8.4e-3, ddt_bias 1.5e-2, ddt 9.1e-4 against the default's 1.3e-4,
    # 4.1e-4, 3.0e-4. Now the dB programs form their block pairs as M^T (x dy^T, no transpose before
    # the dot with C) and store the columns' parts from those products (row sums of E^T: column
    # sums in the dC programs took their capped build from 112 to 304 spill bytes), dx the end-state
    # terms alone, and the rows buffer has NB + 2 slots per token: 2.5e-5, 4.1e-4, 2.9e-4
    # (test_fp16_vs_fp32_interpreted). The sm_90 bf16 build (triton 3.9, specialize "all", P 64,
    # N 128, BWD_M 64, 8 warps) at bwd_split_maxnreg 128: dC 128 registers / 112 spill bytes as
    # before, dB 128 / 192 (40 before; uncapped 240 registers, 188 before), dx unchanged; at BWD_M
    # 32 no spills. Not timed on a GPU.
    # v15: the P <= 64 bucket takes `bwd` "split" and `pass` "fused". On the H200 (thirty-first
    # session, docs/LOG.md) v14's test_bf16_vs_fp32_on_gpu [bwd-split], [bwd-split-m32],
    # [bwd-split-fused] passed (--runxfail), and at B1 T8192 H128 P64 G8 N128 bf16 (`onboard bench
    # --family ssd --case '^B1T8192H128' --impl ours`, CUDA-graph ms) fwd+bwd took 2.759 with both
    # against 3.478 for v14's bucket, 2.824 with `bwd` "split" alone; the forward with `pass`
    # "fused" 0.505 against 0.581, mamba-ssm's Triton SSD 0.580 in the same run (`--impl
    # ours,ours_fwd,mamba_ssm,mamba_ssm_fwd` with $ONBOARD_ANCHOR_MAMBA_SSM: 1.15x).
    # v16: split_dbc "one": `bwd` "split"'s dC and dB in one launch (each block pair's M formed once, dB's
    # terms as fp32 partials summed after); bwd_split_warps: its dx and dB/dC warps (0: bwd_warps; 16
    # builds without spills). Untimed (`.ci/h200/h35_ssd8.sh`; docs/LOG.md, helper-74).
    tuning_space={
        "CHUNK": (16, 32, 64, 128),
        "BLOCK_P": (16, 32, 64, 128),
        "BLOCK_N": (16, 32, 64, 128),
        "BLOCK_S": (256, 512, 1024, 2048),
        "num_warps": (2, 4, 8),
        "bwd_warps": (2, 4, 8),
        "dot": ("tf32", "input"),
        "state": ("fp32", "input"),
        "dbc": ("group", "head"),
        "DBC_N": (16, 32, 64, 128),
        "STATE_N": (16, 32, 64, 128),
        "pass": ("split", "fused"),
        "SCAN_N": (16, 32, 64, 128),
        "gstate": ("fp32", "input"),
        "STATE_CHUNKS": (1, 2, 4, 8),
        "scan": ("carry", "blocks"),
        "scan_maxnreg": (0, 128, 168),
        "DBC_SPLIT": (1, 2, 4),
        "bwd_maxnreg": (0, 128, 168),
        "fwd": ("scan", "split"),
        "FWD_M": (16, 32, 64, 128),
        "FWD_K": (16, 32, 64, 128),
        "fwd_warps": (2, 4, 8),
        "fwd_maxnreg": (0, 128, 168),
        "split_states": ("pass", "fill"),
        "bwd_stages": (3, 2),
        "cb": ("fp32", "input"),
        "PASS_K": (16, 32, 64, 128),
        "bwd": ("chunk", "split"),
        "BWD_M": (16, 32, 64, 128),
        "bwd_split_maxnreg": (0, 128, 168),
        "split_dbc": ("two", "one"),
        "bwd_split_warps": (0, 4, 8, 16),
    },
    # Chosen from the sm_90 AOT build's spills at P 64, N 128 bf16; CHUNK..dbc timed at template v3
    # (docs/LOG.md), STATE_N (v4) not yet timed on a GPU, SCAN_N 64 (v7) from the build.
    # The P <= 64 bucket (Mamba-2's heads of 64) dots 16-bit inputs in their dtype and stores the
    # forward's chunk states in it: on the H200 (call D) the bf16-vs-fp32 bars of
    # tests/kernel_tests/test_ssd.py held for both (test_bf16_vs_fp32_on_gpu[dot-state-input]
    # XPASS); fp32 inputs keep fp32 (tf32 or exact) dots and states either way. Since v7 it also
    # takes state chunks of 4 kernel chunks, 16-bit end-state gradients and N tiles of 64 in the
    # backward (BLOCK_N sizes the forward's C B^T kernel and the backward chunk kernel's N loop,
    # DBC_N the dB/dC kernel's): on the H200 (B1 T8192 H128 P64 G8 N128 bf16, `onboard bench
    # --family ssd --case '^B1T8192H128' --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --profile`
    # with $ONBOARD_ANCHOR_MAMBA_SSM set) v7's former bucket default took 1.451 ms forward (CUDA
    # graph 1.230) and 5.554 ms forward + backward; STATE_CHUNKS 4 alone 1.305 / 1.104 forward;
    # BLOCK_N, DBC_N 64 alone 4.711 fwd+bwd (graph 4.263); all four together 4.469 (graph 3.913);
    # mamba-ssm 1.416 / 0.602 forward, 6.257 fwd+bwd. The bars held with each
    # (test_bf16_vs_fp32_on_gpu [state-chunks-4], [sc4-gstate-n64], [gstate-input] XPASS).
    # `fwd` "split" since the twenty-sixth session: on the H200 at that shape the split forward
    # took 0.866 ms against the "scan" forward's 1.250 (mamba-ssm 0.993; kernel sums 0.575
    # against mamba-ssm's 0.583) and fwd+bwd 3.782 against 3.923, and its bars held
    # (test_bf16_vs_fp32_on_gpu[fwd-split] XPASS; docs/LOG.md, twenty-sixth session).
    default_config={"CHUNK": 64, "BLOCK_P": 64, "BLOCK_N": 16, "BLOCK_S": 512, "num_warps": 8, "bwd_warps": 8,
                    "dot": "tf32", "state": "fp32",
                    "dbc": "group", "DBC_N": 32, "STATE_N": 64, "pass": "split", "SCAN_N": 64, "gstate": "fp32",
                    "STATE_CHUNKS": 1, "scan": "carry", "scan_maxnreg": 128, "DBC_SPLIT": 1,
                    "bwd_maxnreg": 0, "fwd": "scan", "FWD_M": 64, "FWD_K": 32, "fwd_warps": 4,
                    "fwd_maxnreg": 128, "split_states": "pass", "bwd_stages": 3, "cb": "fp32",
                    "PASS_K": 64, "bwd": "chunk", "BWD_M": 64,
                    "bwd_split_maxnreg": 128, "split_dbc": "two", "bwd_split_warps": 0},
    shape_buckets=(
        ShapeBucket(name="p_le_64", dim="P", lo=1, hi=64,
                    config={"dot": "input", "state": "input", "STATE_CHUNKS": 4, "gstate": "input",
                            "BLOCK_N": 64, "DBC_N": 64, "bwd_maxnreg": 128, "fwd": "split",
                            "bwd": "split", "pass": "fused"}),
        ShapeBucket(name="p_big", dim="P", lo=65, hi=2**31 - 1, config={"BLOCK_P": 64}),
    ),
    match=match,
    sample_inputs=sample_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
)
