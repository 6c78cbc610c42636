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
from .binding import CHUNKED_SCAN, bind
from .binding import refusal as binding_refusal

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


def _claims(block: Any) -> dict[str, Any] | None:
    """What `match` serves of a block by its structure alone (`match`)."""
    if block.kind != "linear_attention.mamba" or block.attrs.get("per_channel_decay", False):
        return None
    hist = block.op_histogram or {}
    if not (hist.get("tril") and hist.get("cumsum")) or heads(block) is None:
        return None
    chunk = block.attrs.get("chunk")
    return FAMILY.served("scan", {"chunk_size": chunk if chunk in CHUNK_SIZES else 64})


def refusal(block: Any) -> dict[str, str] | None:
    """For a block `match` would serve by its structure: why the binding would leave it unpatched,
    by its own acceptance test (`binding.refusal`) on the core calls the parse stage recorded
    (attrs ``core_calls``, `FAMILY.probe`), as {"serves": None (the block's core), "reason"};
    None when it would take the block or nothing was recorded (a graph not probed: the match
    stands)."""
    if _claims(block) is None:
        return None
    found = (block.attrs.get("core_calls") or {}).get(CHUNKED_SCAN.what)
    if found is None:
        return None
    why = binding_refusal(found)
    return None if why is None else {"serves": None, "reason": why}


def match(block: Any) -> dict[str, Any] | None:
    """Render params for a Mamba-2 (SSD) mixer core, by structure: a `linear_attention.mamba`
    block (softplus time step, exp + cumsum decay, no delta-rule beta) whose decay is a scalar
    per head (cumsum over the last dim of [b, h, chunks, chunk], with per-head parameters of
    that h) and that runs the chunked form (tril segment sums), and that the binding can take
    (no `refusal`)."""
    m = _claims(block)
    return None if m is None or refusal(block) is not None else m


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


def saved_shapes(batch: int, T: int, heads: int, head_dim: int, groups: int, state: int,
                 dtype: torch.dtype, config: dict[str, Any], *, skip: bool = True,
                 dt_bias: bool = True, initial_state: bool = False,
                 weights: torch.dtype = torch.float32) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What the kernel's autograd Function keeps for its backward (its `setup_context`'s
    `save_for_backward`), as (shape, dtype): its inputs x [B, T, H, P], dt [B, T, H], A [H],
    B and C [B, T, G, N] (x, dt, B, C in ``dtype``; A, and D and dt_bias where given, in
    ``weights``), the initial state where given, and per saved chunk (CHUNK tokens of
    ``config``, CHUNK x STATE_CHUNKS under `fwd` and `bwd` "split") the state entering it
    [B, NC, H, P, N] (fp32, or 16-bit ``dtype`` where the config's `state` is "input") and its
    total log decay [B, H, NC] fp32. The plan's count of a block the family serves
    (`onboarding.plan.memory`, `plan_saves` "scan"); tests/test_plan_scan.py checks it against
    the tensors the Function saves."""
    f32 = torch.float32
    split = config["bwd"] == "split" and config["fwd"] == "split"
    nc = -(-max(T, 1) // (config["CHUNK"] * (config["STATE_CHUNKS"] if split else 1)))
    sdt = dtype if config["state"] == "input" and dtype in (torch.bfloat16, torch.float16) else f32
    out = [((batch, T, heads, head_dim), dtype), ((batch, T, heads), dtype), ((heads,), weights),
           ((batch, T, groups, state), dtype), ((batch, T, groups, state), dtype)]
    out += [((heads,), weights)] * (int(skip) + int(dt_bias))
    if initial_state:
        out.append(((batch, heads, head_dim, state), f32))
    return out + [((batch, nc, heads, head_dim, state), sdt), ((batch, heads, nc), f32)]


def plan_saved(widths: dict[str, int], seq: int) -> float | None:
    """Bytes per token the kernel keeps for a Mamba-2 mixer of ``widths`` (`memory._scan_widths`:
    inner, heads, groups, state) over ``seq`` tokens, bf16 inputs, fp32 A, D and dt bias
    (`saved_shapes` under the untuned config of its head dim)."""
    if "heads" not in widths:  # not a Mamba-2 mixer's widths
        return None
    h = widths["heads"]
    p = widths["inner"] // h
    shapes = saved_shapes(1, seq, h, p, widths["groups"], widths["state"], torch.bfloat16,
                          FAMILY.untuned_config(p))
    return sum(math.prod(s) * d.itemsize for s, d in shapes) / seq


FAMILY = FamilySpec(
    name=NAME,
    template="ssd.py.j2",
    plan_saves="scan",
    # v31: `bwd_dbc_ln` (the fused backward's dC / dB accumulated as [L, N], the scaled rows a register
    # operand; untimed, off).
    # v30: `pull_ahead` True in the P <= 64 bucket (timed on an H100, fifty-fourth session, below).
    # v29: `pull_ahead` (the split backward's fused pull with its cs rows one step ahead; untimed, off).
    # v28: `bwd_ahead` True in the P <= 64 bucket (timed on the H200, fifty-third session, below).
    # v27: `bwd_ahead` (the fused backward kernel's per-head loads one head ahead or staged; untimed).
    # v26 (no kernel change): `_cdiv` / `_npow2` are `_common/_host_ints.py.j2`'s, the gated delta rule's
    # text (their docstrings; `_npow2` hands a non-int size, as a fake impl's symbolic one, to triton's).
    # v25 (host cost; kernels' maths unchanged): the split backward's pull takes HAS_DHT (no zeros
    # tensor for an unused final state: one aten fill and its 4 MB write gone from each training step
    # at the bench shape), host grids by a plain ceil division (triton 3.9's `triton.cdiv` is a
    # constexpr function, ~1.5 us a call on the host, 32 calls; `next_power_of_2` likewise, 18), no
    # unused allocations in the split forward, `_check` formats its message only on an error
    # (test_training_step_host_cost). Stubbed-launch host time per bench fwd+bwd on a CPU: 0.64 ->
    # 0.33 ms; the pull's sm_90 build at HAS_DHT False: 132 registers (130 with the load), no spills,
    # the same shared memory (triton 3.9). Untimed on a GPU.
    # v24: `PULL_P`, `pull_scale` (the split backward's pull), `bwd_qd` (its fused kernel); timed on an H100
    # (fortieth session, bars passed), CUDA-graph / wall ms of fwd+bwd against the default's 1.663 / 2.085
    # and 1.667 / 1.926 in two runs: PULL_P 32 + "dy" 1.567 / 2.172 and 1.573 / 1.991, PULL_P 32 1.631 /
    # 2.216 and 1.622 / 1.925, "dot" 1.628 / 2.377 and 1.630 / 2.013, all three 1.623 / 2.329 and 1.616 /
    # 1.960; none adopted (the pair faster by graph, slower by wall while the step is host-bound:
    # docs/families.md, ssd).
    # v23: `bwd_exp` "exp2" the P <= 64 bucket's, `bwd_prefetch` removed (timed: below). v22:
    # `bwd_exp`, `bwd_prefetch` (the fused backward kernel's; untimed). v21: `split_dbc` "triple",
    # PULL_N (untimed). v20: the backward gets None, not autograd's zeros,
    # for the outputs without a gradient; `bwd_sums`. v19: `split_dbc` "fused" and "paired" (dx, dC,
    # dB in one launch; "paired" the P <= 64 bucket's since the thirty-sixth session)
    template_version=31,
    folder=Path(__file__).parent,
    variants={"scan": "Mamba-2 selective state-space scan with grouped B/C, D skip, dt bias/softplus/limits, states"},
    params=(
        Param(name="chunk_size", type=int, default=64, choices=CHUNK_SIZES,
              doc="chunk length of the reference's chunked quadratic form (the model's chunk_size)"),
    ),
    # template_version 16: `split_dbc` "one" and `bwd_split_warps` added, untimed. Per-version
    # history with its measurements: docs/LOG.md (search "ssd template v<N>" or "ssd v<N>");
    # docs/families.md's ssd section has the timed tables.
    # Tuning keys (default first where it is one value for every P; the P <= 64 bucket below):
    # CHUNK (64): tokens per kernel chunk, the intra-chunk [L, L] tiles. Timed at v3 (docs/LOG.md).
    # BLOCK_P (64): head-dim columns per forward program; the backward chunk kernel holds all of P.
    #   64 is Mamba-2's head dim; 32 was slower on the H200 (docs/families.md, v7 table).
    # BLOCK_N (16): state columns per step of the C B^T kernel's and the backward chunk kernel's
    #   N loops.
    # BLOCK_S (512): state elements per program of the serial state passes (40 registers: 12
    #   programs per SM; docs/LOG.md, helper-56).
    # num_warps, bwd_warps (8, 8): warps of the "scan" forward's and of the backward's kernels.
    # dot ("tf32"): "tf32" keeps fp32 dot operands; "input" dots 16-bit inputs in their own dtype on
    #   a GPU. fp32 inputs keep fp32 dots either way.
    # state, gstate ("fp32"): dtype of the forward's stored chunk states and of the backward's
    #   stored end-state gradients (the largest tensors of each pass): fp32 or 16-bit inputs'
    #   own; sums are fp32.
    # dbc ("group"): dB/dC summed over a group's heads in the kernel, or "head": per-head partials
    #   summed by the host.
    # DBC_N (32): state columns per dB/dC program (each recomputes its chunk's dy x^T once per
    #   head).
    # STATE_N (64): state columns per program of the chunk-state kernels (one [BLOCK_P, STATE_N]
    #   product each). Chosen from the build; not timed alone.
    # pass ("split"): "split" computes the chunk states in parallel, then the serial state pass;
    #   "fused" one serial loop per (b, h, BLOCK_P x STATE_N tile) that never stores chunk states.
    #   Under `fwd` "split" (v12) "fused" is one launch over T in PASS_K steps, and in the backward
    #   one loop for dy's pull and the reverse pass.
    # SCAN_N (64): state columns per step of the chunk output kernel's C S^T loop; 64 from the
    #   build.
    # STATE_CHUNKS (1): kernel chunks per state chunk. > 1 passes states over T / (CHUNK *
    #   STATE_CHUNKS) state chunks (fewer serial steps and stored states); the output program
    #   carries the state through its chunks, and the backward fills in each chunk's end-state
    #   gradient in a reverse loop per state chunk.
    # scan ("carry", STATE_CHUNKS > 1): "carry" one output program per state chunk; "blocks" one
    #   per (chunk, head, P block), the quadratic part in [CHUNK, CHUNK] C B^T blocks.
    # scan_maxnreg (128): the "blocks" kernel's register cap (0 none). 128 fits two 8-warp programs
    #   per SM without spills (133 registers uncapped; docs/LOG.md, helper ssd20's v8 section).
    # DBC_SPLIT (1): programs per group in the dB/dC kernel (`dbc` "group"), each over
    #   H / G / DBC_SPLIT heads, partials summed by the host. Untimed alternative.
    # bwd_maxnreg (0): register cap of the backward chunk and dB/dC kernels (0 none). 128 fits two
    #   8-warp programs per SM at 208 spill bytes; used by the P <= 64 bucket (below).
    # fwd ("scan"): "scan" the forward above; "split" five launches over split chunks of CHUNK *
    #   STATE_CHUNKS tokens with many small programs (dt cumsum, chunk states, state pass, C B^T
    #   in FWD_M tiles, outputs in FWD_M rows and FWD_K steps).
    # FWD_M (64), FWD_K (32), fwd_warps (4): the split forward's row tile, dot step and warps.
    # fwd_maxnreg (128): the split output kernel's register cap (0 none). 128 gives four programs
    #   per SM instead of three without spills (158 registers uncapped; docs/LOG.md, helper-68).
    # split_states ("pass"; fwd "split", bwd "chunk", with a backward): "pass" forms and passes the
    #   states per CHUNK tokens; "fill" per split chunk, then fills in each chunk's incoming state.
    # bwd_stages (3): num_stages of the backward chunk and dB/dC kernels; 3 is Triton's default.
    #   2 cuts their shared memory by about a third (docs/LOG.md, v10). Not timed alone.
    # cb ("fp32"): dtype of the split forward's stored C B^T per (chunk, group); sums are fp32.
    # PASS_K (64): tokens per step of the fused pass. 64: 128 registers, no spills on triton 3.9
    #   (164 on 3.6, the H200's; docs/LOG.md, helper-68).
    # bwd ("chunk"): "chunk" the backward per CHUNK tokens; "split" (only with `fwd` "split") over
    #   the split chunks, in BWD_M row blocks, so the forward keeps states per split chunk only.
    # BWD_M (64): row tile of the split backward.
    # bwd_split_maxnreg (128): register cap of the split backward's dx and dB/dC kernels (0 none).
    #   128 fits two 8-warp programs per SM (uncapped dx 171, dC 233, dB 240 registers); capped,
    #   dC and dB spill 100-200 bytes (docs/LOG.md, helper-68 and thirty-first session, v14). The
    #   P <= 64 bucket: 0 (its "paired" kernel, 255 registers: below).
    # split_dbc ("two"): the split backward's dC and dB in two launches, or "one" launch that forms
    #   each block pair's matrix once (timed on an H100, h35_ssd8: slower than "two"), or "fused"
    #   (v19; where a split chunk is one row block, CHUNK * STATE_CHUNKS <= BWD_M, and a head's x,
    #   dy and two state tiles take <= 48 KB: 16-bit at P 64, N 128, not fp32; else "two"): dx, dC
    #   and dB in one launch per (split chunk, group), each head's x, dy and two states loaded once;
    #   or "paired" (v19, the same condition): that launch with two programs per (split chunk, group),
    #   next to each other in the grid, one for dx, one for dC and dB (fewer live registers; the
    #   second reads the inputs from L2). On an H100 (docs/LOG.md, thirty-fifth session's call 3, CUDA
    #   graph, fwd+bwd): "two" 2.372 ms, "paired" 8 warps uncapped 1.804, 16 warps 2.049, "fused" 16
    #   warps 3.064. "paired" is the P <= 64 bucket's value since the thirty-sixth session (below).
    #   Or "triple" (v21, where "paired" applies): "paired"'s dC / dB program split in two, one for
    #   dC and the block pairs' terms of dL/dcs, one for dB (forming each head's M again): at most one
    #   [N, L] accumulator and fewer staged operands per program (sm_90 build, 8 warps, triton 3.6:
    #   255 registers, no spills, 133 KB of shared memory, against "paired"'s 36 spill bytes and 173
    #   KB; at 16 warps 128 / 20, against 132), for a third program per (chunk, group). Untimed.
    # bwd_split_warps (0): warps of the split backward's dx and dB/dC kernels (0: bwd_warps; 16
    #   builds without spills). Untimed.
    # bwd_sums ("host"; v20): the split backward's dA, dD and dt-bias gradients as the host's three
    #   reductions of the kernels' fp32 partials (and d(dt)'s cast to dt's dtype), or "kernel": d(dt)
    #   stored in dt's dtype with its per-chunk sums, then one launch sums all three (fp32, another
    #   order: within fp32 rounding of "host"). Call 3's H100 profile: the reductions 0.026 ms in all.
    #   The P <= 64 bucket's value (below): 1.732 ms against 1.755 under "paired" uncapped, within a
    #   run's row-to-row spread, and its bars row passed.
    # PULL_N (0; v21): state columns per program of the backward's pull (dy's pull on the chunks'
    #   incoming states and the reverse pass; 0: STATE_N, the forward's). At the bench shape the
    #   fused pull runs 256 programs of 4 warps over 128 chunks (0.234 ms in the H100 profile of
    #   the thirty-sixth session) moving about 0.42 GB (dy read, bf16 gs written: 0.13 ms at HBM
    #   speed); 32 and 16 give 512 and 1024 programs. STATE_N 32 for both passes gained the
    #   backward about 0.03 ms and cost the forward 0.034 (bench.py). Untimed alone.
    # PULL_P (0; v24): head-dim rows per program of the split backward's pull (`bwd` "split": the fused
    #   pull, or the split pull before its reverse pass; 0: BLOCK_P, the forward's). At the bench shape
    #   the fused pull's 256 programs of 4 warps (BLOCK_P 64, STATE_N 64) put two 128-step serial chains
    #   on each of the H100's 132 SMs; 32 gives 512 (four per SM, one wave: 128 / 120 registers on
    #   triton 3.6 / 3.9, 33 KB of shared memory), each reading its own rows of dy (PULL_N splits N
    #   instead, and each of its programs reads all of dy's rows: PULL_N 32 read dy twice). H100 times: v24 note.
    # pull_scale ("C"; v24): the fused pull's weights exp(cs_t - cs_0) on C's rows (the [BLOCK_K, N tile]
    #   operand, scaled in registers and stored back to shared memory for the dot) or "dy" on dy's
    #   columns (the [PULL_P, BLOCK_K] operand, the dot's first, from registers; C read by the dot as
    #   loaded): fewer elements scaled where PULL_P < the N tile. sm_90 bf16 (PULL_P 32, N tile 64):
    #   110 registers on triton 3.6 (C: 128), its loop 381 instructions (475). H100 times: v24 note.
    # bwd_qd ("elem"; v24): ssd_bwd_split_fused_kernel's per-head sums <Gs, S_in> (q's end-state term) and
    #   sum(dy x) (dD's partial) from elementwise products of the upcast 16-bit tiles in the dx program,
    #   or "dot": as the traces of Gs S_in^T (a [P, P] wgmma in the dx program, which then reads S_in
    #   only as a dot operand) and of dy x^T (the product the block pairs' program forms for M_h; dD
    #   stored there). Removing both sums cut the dx loop from 1243 to 852 instructions (triton 3.6;
    #   a cost probe, not a kernel); "dot" keeps them at 1060 (dx) + 927 (dC / dB, +99) against 1243 +
    #   828 ("paired", bf16 at the bench shape; triton 3.9: 928 + 874 against 1151 + 823), 255 / 254
    #   registers, no spills (3.6: 20 bytes under "elem"), shared memory unchanged (173 KB). H100 times: v24 note.
    # bwd_exp ("exp"; v22): ssd_bwd_split_fused_kernel's exponentials (the [L, L] decays W, exp(cs),
    #   exp(cs_last - cs)) as tl.exp, or "exp2": exp2 of cs scaled by log2(e) once per head. tl.exp
    #   lowers to a multiply, a range check, MUFU.EX2 and a fix-up multiply per element; exp2 to
    #   MUFU.EX2 alone (results below 2^-126 flush to zero). The H100 profile of "paired" (thirty-
    #   eighth session, ncu) is latency-bound at one 8-warp program per SM with FMUL / FADD the most
    #   issued and sampled opcodes. sm_90 bf16 build at the bench shape (triton 3.9): head loops 823
    #   (dC / dB) and 1151 (dx) instructions against 914 / 1253, 246 registers against 254, no
    #   spills. "exp2" is the P <= 64 bucket's value since v23 (timed: below); the default's "exp"
    #   runs nowhere by default (the fused kernel runs only under that bucket's `split_dbc`): it
    #   stays the bench's SWEEP row, the former default, to time against on another card.
    # Removed options: v10's `split_states` "local" was slower and failed the bf16 bars on the
    #   H200 (docs/LOG.md, twenty-seventh session); v11 removed it. v22's `bwd_prefetch` (the fused
    #   kernel's per-head cs, dt and cs_last loaded one head ahead) won in neither of its rows on an
    #   H100 (below): v23 removed it.
    # bwd_ahead (False; v27): ssd_bwd_split_fused_kernel with no synchronous global load in its head loops
    #   (sm_90 TTGIR of "paired" at the bench's config, triton 3.9: the dx program waits each head on plain
    #   loads of x [64, 64], S_in [64, 128], cs, dt, cs_last and D; the dC / dB program on cs, dt, cs_last;
    #   Triton stages only dot operands). True: cs, dt, cs_last and D loaded one head ahead into
    #   registers, x a dot operand in the dx program (dD's partial the trace of x^T dy) and q's
    #   exp(cs_last) <Gs, S_in> formed in the block pairs' program (which stages S_in) on its chunk's last
    #   row of dL/dcs; `bwd_qd` has no effect under it. sm_90 bf16 builds at the bench shape (triton 3.9, 8
    #   warps, `bwd_exp` "exp2"): "paired" 252 registers, no spills, 139 KB of shared memory (default 246,
    #   none, 173 KB), head loops 886 (dx) + 1031 (dC / dB) SASS instructions against 1151 + 823;
    #   "triple" 251 / none / 131 KB (default 240 / none / 133 KB); "fused" (ROLES 1) 255 / 592 spill
    #   bytes (default 588). On the H200 (fifty-third session, `.ci/h200/h53b.sh`, B1 T8192 H128 P64 G8
    #   N128 bf16): fwd+bwd 1.505 ms by CUDA graph against v27's default 1.549 (wall 2.026 / 2.075), the
    #   forward 0.450; with v24's pull pair 1.529, under "triple" 1.645; its bf16 bars rows passed
    #   (v27-ahead, -pull, -triple XPASS). v28 makes it the P <= 64 bucket's; v27's default stays the
    #   bench's first SWEEP row.
    # pull_ahead (False; v29): ssd_split_fused_pull_kernel (`bwd` "split", `pass` "fused") with each step's
    #   cs row loaded one step ahead (carried in registers) and cs_0 from the next step's row: no plain
    #   load waited on inside the serial chain. Without it Triton's pipeline copies cs, cs_0, dy and C
    #   ahead (async copies) but loads the step's cs row a second time, in another layout (cs_e's sum),
    #   as a plain load each step waits on (sm_90 TTGIR, triton 3.6 and 3.9). At the bench shape the
    #   pull is 256 programs of 4 warps (at most two per SM), each a 128-step chain: 0.210 ms in the
    #   forty-eighth session's H100 profile, 1.64 us a step, for 17 GFLOP and 0.43 GB of HBM traffic
    #   (dy read 134 MB, gs written in bf16 268 MB, C, cs, dh0; 0.56 GB if the second N tile's programs
    #   read dy from HBM again): 0.13-0.17 ms at the H100's 3.35 TB/s, 0.09-0.12 at the H200's 4.8, so
    #   at most about 0.04-0.08 ms to gain on the H100. sm_90 bf16 builds at the bench's tiles (BLOCK_P
    #   64, STATE_N 64, PASS_K 64), triton 3.6: 145 -> 144 registers, no spills, 49.7 KB of shared
    #   memory either way, the loop 518 -> 535 SASS instructions and 7 -> 10 barriers (the carried row
    #   converted through shared memory for the two sums), one plain load waited on -> none; triton
    #   3.9: 132 -> 166 registers. With v24's pull pair (PULL_P 32, "dy"): 92 -> 108 (3.9: 84 -> 96).
    #   On an H100 (fifty-fourth session, `.ci/h200/h54b.sh`, B1 T8192 H128 P64 G8 N128 bf16): fwd+bwd
    #   1.510 ms by CUDA graph against v29's default 1.602 (wall 2.182 / 2.256), the forward 0.465;
    #   v24's pull pair under v29's default 1.519; its bf16 bars rows passed on that H100
    #   (v29-pull-ahead, -pull-ahead-pull XPASS). v30 makes it the P <= 64 bucket's; v29's default
    #   is the bench's first SWEEP row.
    #   Untimed (off in every bucket; the bench's first SWEEP row).
    # bwd_dbc_ln (False; v31): ssd_bwd_split_fused_kernel's dC and dB accumulated as [L, N] (DBC_LN), not
    #   transposed [N, L]: each head's state terms (dy exp(cs)) S_in and (x dt exp(cs_last - cs)) Gs with the
    #   row-scaled 16-bit tile as the wgmma's first operand, read from registers, and the staged S_in / Gs
    #   as the second; at the end M B and M^T C the same way. Count at B1 T8192 H128 P64 G8 N128 ("paired",
    #   8 warps, 2,048 programs of 16 heads, one per SM at a time): the dC / dB program's head loop forms
    #   four products a head (the two state terms, m64n128k64 each; dy x^T; C S_in^T) and, transposed, waits
    #   on each as soon as it is issued (sm_90 TTGIR, triton 3.9: four warp_group_dot_wait with pendings 0
    #   a head); [L, N] leaves the two state terms in flight behind the block pair's dot and its elementwise
    #   work (two waits a head). That loop's SASS: 1,031 -> 1,028 instructions, 4 -> 2 WARPGROUP.DEPBAR, 32
    #   -> 29 instructions naming a barrier; the dx program's loop 886 -> 882; the kernel 3,512 -> 3,448. The
    #   scaled rows still pass through shared memory (Triton converts them to the operand layout there), and
    #   the same products and fp32 sums are formed (the dots' order of accumulation aside). sm_90 bf16
    #   builds (triton 3.9, .ci/h200/sass_audit.py): "paired" 255 registers / 20 spill bytes / 139,264 B of
    #   shared memory against 252 / 0 / 139,264; without `bwd_ahead` 244 / 0 (246 / 0); "triple" 254 / 0
    #   (251 / 0); ROLES 1 512 spill bytes (592). "paired"'s 20 bytes are stored before the head loops and
    #   loaded after them (no local memory access inside either loop). Off in every bucket; a SWEEP row and
    #   a bars row (XPASS on an H100). Timed once on an H100 (bench.py): graph -2.2%, wall +5.6%, within the
    #   spread of one run; not adopted.
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
        "split_dbc": ("two", "one", "fused", "paired", "triple"),
        "bwd_split_warps": (0, 4, 8, 16),
        "bwd_sums": ("host", "kernel"),
        "PULL_N": (0, 16, 32, 64, 128),
        "bwd_exp": ("exp", "exp2"),
        "PULL_P": (0, 16, 32, 64),
        "pull_scale": ("C", "dy"),
        "bwd_qd": ("elem", "dot"),
        "bwd_ahead": (False, True),
        "pull_ahead": (False, True),
        "bwd_dbc_ln": (False, True),
    },
    # The defaults (used above P 64) come from the sm_90 build's registers and spills; CHUNK..dbc
    # were timed at v3 (docs/LOG.md).
    # The P <= 64 bucket (Mamba-2's heads of 64), each value timed on the H200 at B1 T8192 H128 P64
    # G8 N128 bf16 with test_bf16_vs_fp32_on_gpu's bars held (docs/families.md has the tables):
    # - dot, state "input": the bars held (docs/LOG.md, call D).
    # - STATE_CHUNKS 4, gstate "input", BLOCK_N 64, DBC_N 64 (v7): fwd+bwd 4.469 ms against 5.554
    #   (docs/LOG.md, nineteenth session, calls E and F).
    # - bwd_maxnreg 128: fwd+bwd 3.958 ms against 4.180 uncapped (docs/LOG.md, device call M).
    # - fwd "split" (v9): forward 0.866 ms against 1.250 (docs/LOG.md, twenty-sixth session,
    #   call A).
    # - bwd "split", pass "fused" (v15): fwd+bwd 2.759 ms (CUDA graph) against 3.478 (docs/LOG.md,
    #   thirty-first session, calls 4-5).
    # - STATE_CHUNKS 1 (v18; split chunks of 64 under `fwd`/`bwd` "split"): on an H100 (triton 3.6,
    #   .ci/h200/h35_ssd8.sh, one run) fwd+bwd 2.224 ms by CUDA graph against 2.953 at STATE_CHUNKS
    #   4 (wall 3.590 / 3.969), forward 0.474 against 0.532 (wall 0.907 / 0.944); its bf16 bars
    #   row [v16-sc1] passed. STATE_CHUNKS 4 stays a SWEEP row (bench.py).
    # - split_dbc "paired", bwd_split_maxnreg 0, bwd_sums "kernel" (v20; 8 warps, bwd_warps): on an
    #   H100 (triton 3.6, thirty-sixth session, `BUDGET=260 bash .ci/h200/h35_ssd10.sh` at 047b72b,
    #   one run) fwd+bwd 1.732 ms by CUDA graph against 2.292 for "two" capped at 128 with host sums
    #   (wall 2.872 / 3.114), 3.69x its forward (0.470); "paired" uncapped with host sums 1.755. The
    #   bars rows [v19-paired-w8] and [v20-paired-w8-sums] passed. fp32 inputs at P 64, N 128 run
    #   "two" (`_split_backward`: their tiles do not fit shared memory), uncapped under this bucket.
    # - bwd_exp "exp2" (v23): on an H100 (NVIDIA H100 80GB HBM3, torch 2.11, triton 3.6, thirty-ninth
    #   session's call 1, `BUDGET=170 bash .ci/h200/h38_ssd12.sh` at bccc7ae, one run) fwd+bwd 1.596
    #   ms by CUDA graph against 1.778 for v22's default ("exp"), wall 1.954 / 2.015 (graph -10%,
    #   wall -3%); forward 0.463 (wall 0.609): 3.45x by graph. Its bars row [v22-exp2] passed. In
    #   the same run `bwd_prefetch` lost alone (1.739 by graph, wall 2.141: +6%) and with "exp2" the
    #   clocks disagreed (1.536 by graph, -3.8%, wall 1.973, +1%): not adopted, removed in v23 (its
    #   bars rows [v22-pre], [v22-exp2-pre] passed). The fused kernel at this bucket's config builds
    #   to the PTX of v22's "exp2" row but for debug info (triton 3.9).
    # The P > 64 bucket names BLOCK_P 64, the default's value; it has no timing of its own.
    default_config={"CHUNK": 64, "BLOCK_P": 64, "BLOCK_N": 16, "BLOCK_S": 512, "num_warps": 8, "bwd_warps": 8,
                    "dot": "tf32", "state": "fp32",
                    "dbc": "group", "DBC_N": 32, "STATE_N": 64, "pass": "split", "SCAN_N": 64, "gstate": "fp32",
                    "STATE_CHUNKS": 1, "scan": "carry", "scan_maxnreg": 128, "DBC_SPLIT": 1,
                    "bwd_maxnreg": 0, "fwd": "scan", "FWD_M": 64, "FWD_K": 32, "fwd_warps": 4,
                    "fwd_maxnreg": 128, "split_states": "pass", "bwd_stages": 3, "cb": "fp32",
                    "PASS_K": 64, "bwd": "chunk", "BWD_M": 64,
                    "bwd_split_maxnreg": 128, "split_dbc": "two", "bwd_split_warps": 0,
                    "bwd_sums": "host", "PULL_N": 0, "bwd_exp": "exp", "PULL_P": 0, "pull_scale": "C",
                    "bwd_qd": "elem", "bwd_ahead": False, "pull_ahead": False, "bwd_dbc_ln": False},
    shape_buckets=(
        ShapeBucket(name="p_le_64", dim="P", lo=1, hi=64,
                    config={"dot": "input", "state": "input", "STATE_CHUNKS": 1, "gstate": "input",
                            "BLOCK_N": 64, "DBC_N": 64, "bwd_maxnreg": 128, "fwd": "split",
                            "bwd": "split", "pass": "fused", "split_dbc": "paired", "bwd_split_maxnreg": 0,
                            "bwd_sums": "kernel", "bwd_exp": "exp2", "bwd_ahead": True,
                            "pull_ahead": True}),
        ShapeBucket(name="p_big", dim="P", lo=65, hi=2**31 - 1, config={"BLOCK_P": 64}),
    ),
    match=match,
    sample_inputs=sample_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
    probe=CHUNKED_SCAN,
    refusal=refusal,
)
