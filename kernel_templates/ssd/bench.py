"""SSD's benchmark cases (the spec's `bench_cases`): the Mamba-2 chunked scan at a Mamba-2 layout
(heads of 64, 8 groups, state 128, T 8192, bf16), issue 35's shapes.

Impls per case (a ``_fwd`` suffix: forward only, under `torch.no_grad`; otherwise forward +
backward of y, the training step, no final state):

- ``ours`` / ``ours_fwd``: our rendered ``scan`` kernel at its default tiles;
- ``eager_fwd`` (and ``eager``, forward + backward, only up to EAGER_BWD_MAX_T): transformers'
  Mamba-2 chunked torch path (the module-level
  chunk-scan function its mixers call, unwrapped so that an installed mamba_ssm does not take
  over), chunk 256 as the models configure it; it computes in fp32 and returns fp32, cast back
  to the inputs' dtype here as the mixer does. A transformers without that function gives
  ``reference`` rows instead: the rendered module's own reference, the same chunked torch
  algorithm;
- ``compile_fwd``: `torch.compile` of that path's forward;
- ``mamba_ssm`` / ``mamba_ssm_fwd``, only when ``--impl`` names them (never because mamba-ssm
  is installed): mamba-ssm's Triton SSD, ``mamba_chunk_scan_combined`` at the same inputs (chunk
  256 as the models configure it, dt bias + softplus, D, grouped B/C, no z). It is loaded from
  the source tree that ``$ONBOARD_ANCHOR_MAMBA_SSM`` names (the folder holding ``mamba_ssm/``),
  else from an installed mamba_ssm, in both cases without running the package's ``__init__``
  (which imports the CUDA extensions ``selective_scan_cuda`` & co.): a bare ``mamba_ssm``
  package is registered and ``mamba_ssm.ops.triton.ssd_combined`` imported from it (torch,
  triton, einops and packaging are all it needs). Neither there: the rows are ``skipped`` with
  the reason. Its own check (``anchor_checks``) runs first, at the case's full shape: its y and
  every gradient against ours on the same bf16 inputs and dy (relative RMS, printed on its row),
  within twice our bars (both are bf16 against the same function); a failed check leaves its
  rows untimed. E.g. ``ONBOARD_ANCHOR_MAMBA_SSM=.anchors onboard bench --family ssd --case
  H128 --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd``;
- ``ours@...`` (first case only, after its other rows, so that a run cut short keeps those):
  tuning values beside the default (`SWEEP`: v31's `bwd_dbc_ln`; v29's default, `pull_ahead` False; v27's
  default, `bwd_ahead` False; v24's pull rows, `PULL_P` 32 and `pull_scale` "dy"; "triple"; `bwd_exp`
  "exp", the default until v23), forward
  (``ours@<cfg>_fwd``) or forward + backward (``ours@<cfg>``); they run
  whenever ``ours`` is timed (``--impl ours,...``: an ``ours_fwd`` alone does not keep them).

``check``: the bf16 kernel against the fp32 torch path on the same (bf16-representable) values,
on the case's first CHECK_MAX_T tokens: relative RMS of y and of every gradient (x, dt, A, B, C,
D, dt_bias); ``ok`` is 1.0 when y is within O_TOL and every gradient within GRAD_TOL (the GDN
bars).

The torch path's backward at T 8192 asked for a 64 GiB buffer on the H200 (transformers 5.17,
the lead's call of this session, docs/LOG.md): its fwd+bwd rows and the check stop at 1024
tokens (16 of our chunks, 4 of its own), where that buffer is 8 GiB.

Shape legend: x [B, T, H, P], dt [B, T, H], A [H] fp32, B and C [B, T, G, N], D and dt_bias [H].
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import math
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

from onboarding.bench.cases import (N_SETS, config_sweep, fwd_bwd, fwd_only, fwd_sweep, kernel,
                                    shared_inputs)
from onboarding.bench.harness import BenchCase, Step, Unavailable
from onboarding.families import NightlySpec
from onboarding.testing.tolerance import rel_rms

MODEL_CHUNK = 256  # Mamba-2's configured chunk_size (the torch path's chunk)
O_TOL, GRAD_TOL = 0.005, 0.01
CHECK_MAX_T = EAGER_BWD_MAX_T = 1024
# (B, T, H, P, G, N, note)
SHAPES = (
    (1, 8192, 128, 64, 8, 128, "Mamba-2 layout, 128 heads"),
    (1, 8192, 64, 64, 8, 128, "Mamba-2 layout, 64 heads"),
)
# (config, rows): "both" gives ours@cfg (forward + backward) and ours@cfg_fwd, "fwd" / "bwd" one of
# them. Template v9's `fwd` "split" (five launches over chunks of 256 tokens at the P <= 64 bucket,
# each with many small programs: dt and its cumsum, the chunks' states, the state pass, C B^T per
# group, the outputs per (chunk, head, 64 rows); the sm_90 bf16 build's output kernel 128
# registers under its cap, no spills) at its defaults (forward and forward + backward: with a
# backward to come its states and pass run per kernel chunk of 64, as the backward reads them: a
# 128-step pass), forward + backward with `split_states` "fill" (the pass over the 32 split chunks,
# then each split chunk's four chunks' incoming states filled in: 140 registers, no spills), and
# forward-only (the output kernel's build: registers / spill bytes) at K steps of 16 (131
# uncapped, 128/0 capped), 8 warps (128/0 uncapped: two programs per SM), row blocks of 32 (128/0
# uncapped, a quarter of the shared memory: twice the programs, half the rows each), without the
# register cap (158/0: three programs of 4 warps per SM, not four), the chunk-state kernel over all
# 128 state columns (x read once, not twice; 128/0); beside the best forward of v8 (`scan` "blocks" with STATE_N 128, 0.942
# ms graph in device call M). v8's other rows were dropped to keep the GPU call short (calls L and M
# measured them: `scan` "blocks" at its defaults, uncapped, kernel chunks of 128, state chunks of
# 8, DBC_SPLIT 2 and 4, bwd_maxnreg 0).
#
# Template v10 (issue 35's backward; `fwd` "split" the P <= 64 bucket's default since c3230ba, so
# the rows above went: device call A of the twenty-sixth session measured them): forward + backward
# only: `split_states` "fill". v10's `split_states` "local" rows (uncapped, bwd_stages 2) went in
# v11: slower than the default and outside the bars once on the H200 (family.py,
# `BUDGET=230 bash .ci/h200/h35_ssd5.sh`).
#
# Templates v12-v14 (issue 35): the split forward's `pass` "fused" (its chunk-state kernel and
# state pass as one serial loop per (head, BLOCK_P x STATE_N tile)) and `bwd` "split" (the
# backward over the split chunks of 256: dy's pull, a 32-step reverse pass, dx per (head, 64 rows,
# chunk), dC then dB per (64 rows, chunk, group), d(dt) per (chunk, 4 heads)), timed on the H200
# in the thirty-first session (docs/LOG.md) and the P <= 64 bucket's default since v15. Rows
# beside it: the v14 bucket (the chunk backward, the two-kernel pass), `pass` "split" with the
# split backward (its pull and reverse pass as two kernels), row blocks of 32 (no spills in the
# sm_90 build; 4.211 against 2.824 ms fwd+bwd by graph in that call), and `cb` "input" (C B^T
# stored in bf16; the forward).
#
# Template v16 (issue 35's goal fwd+bwd <= 3x the forward; not yet timed). The v12-v14 rows (the
# v14 bucket's chunk backward and two-kernel pass, `pass` "split" and row blocks of 32 under the
# split backward, `cb` "input") went: measured in the thirty-first session (docs/LOG.md). In the
# order most likely to win by the head-iteration count of the split backward's dx and dB/dC
# kernels (docs/LOG.md, helper-74's note): `split_dbc` "one" (dC and dB in one launch, each block
# pair's M formed once) at 16 warps uncapped with split chunks of 128; split chunks of 128
# (STATE_CHUNKS 2: the block pairs per 64-row block fall from 2.5 to 1.5; more stored states;
# forward and backward); dx and dB/dC at 16 warps uncapped (the sm_90 build: no spills at <= 128
# registers, against 112-216 spill bytes at 8 warps capped); "one" at 16 warps at split chunks of
# 256; 16 warps at 128; split chunks of 64 (forward and backward) and "one" there; "one" at 8
# warps capped (320 spill bytes); 16 warps with dx's N loop in one step of 128 (BLOCK_N 128: 164 KB
# of shared memory, no spills; also the C B^T kernels' N step). Last, the serial fused pass and pull
# (latency-bound chains of T / PASS_K steps, 256 programs of 4 warps at this shape): STATE_N 32
# (twice the programs, 88-116 registers) and PASS_K 128 (half the steps; 172-188 registers, 100 KB
# of shared memory, no spills), forward and forward + backward (v12's untimed variants).
# Template v18: the P <= 64 bucket's STATE_CHUNKS is 1 (split chunks of 64). h35_ssd8's H100 call
# (triton 3.6, one run, fwd+bwd by CUDA graph against v16's default of 4: 2.953 ms) gave 1: 2.224,
# 2: 2.412, 16 warps 3.594, "one" at 16 warps 3.351 (at chunks of 128 2.865, of 64 2.666), 16
# warps at 128 3.041, "one" at 8 warps 3.111, 16 warps with BLOCK_N 128 5.046 (no graph time;
# wall 5.046 against 3.969), STATE_N 32 2.909, PASS_K 128 2.797; the rows that lost to their
# own split chunk's plain row went. Kept: the former default (STATE_CHUNKS 4) and split chunks of
# 128, forward and backward, so that a call times them beside the new default; 16 warps (untimed
# at chunks of 64); and the fused pass's STATE_N 32 and PASS_K 128 (each faster by graph than v16's
# default; at chunks of 64 the pass has four times the chunks).
# Template v19 (not yet timed): `split_dbc` "fused" and "paired", dx, dC and dB in one launch per
# (split chunk of 64, group), each head's x, dy and two states loaded from HBM once (docs/LOG.md,
# helper-93's note: about 2.0 GB of the split kernels' HBM reads fall to about 0.84 GB), one
# program per (chunk, group) or two ("paired": a dx program and a dC / dB program next to each
# other in the grid, the second reading the inputs from L2). sm_90 builds, registers / spill bytes
# on triton 3.9 and 3.6: "paired" at 16 warps 128 / 4 and 132, at 8 warps 254-255 / 0 and 16;
# "fused" at 16 warps 128 / 332 and 556 (8 warps 255 / 412 and 896: no row). The likeliest winner
# first: the rows a cut call should keep.
#
# Template v20 (the backward no longer gets autograd's zeros of the chunk states: the 0.081 ms bf16
# fill of the H100 profile, thirty-fifth session's call 3). Call 3 timed v19's rows (ms by CUDA
# graph, H100): the default 2.372, "paired" at 16 warps 2.049, "fused" at 16 warps 3.064, "paired"
# at 8 warps uncapped 1.804 (3.75x its forward, 0.481), STATE_CHUNKS 4 2.857, 2 2.405, PASS_K 128
# 2.233, STATE_N 32 2.255. Gone: "fused" (slowest, spills), STATE_CHUNKS 4 (timed against 1 twice)
# and PASS_K 128 (at split chunks of 64 the pass's step is min(PASS_K, 64): the default's build;
# its 2.233 against 2.372 is this call's row-to-row spread). First, "paired" at 8 warps uncapped
# (P8, the best of call 3), then rows around it, each by its sm_90 build (bf16 at this shape;
# registers / spill bytes / shared memory on triton 3.6, then 3.9): P8 is 255 / 36 / 173 KB (254 /
# 0), one program per SM by its registers; num_stages 2 (bwd_stages) 255 / 16 / 123 KB (254 / 0):
# still one program per SM, less prefetch, fewer spills; STATE_N 32 halves the fused pull's (and
# the forward's fused pass's) tile per step and doubles their programs (512 of 4 warps), the two
# serial chains of 128 steps that take 0.42 ms of call 3's profile. Not rows: capped at 128 spills
# 1656-2080 bytes at 2-3 stages (1008-1120 on 3.9; two programs per SM only at one stage, 90 KB:
# 1412); at 168 still one program, 696 spill bytes; 4 warps uncapped 2088 (/tmp/h99/build.py in
# helper-99's note, docs/LOG.md). Then `bwd_sums` "kernel" (dA, dD, dt bias's gradient summed in one
# launch, d(dt) stored in bf16 by its kernel: call 3's three reductions took 0.026 ms, plus d(dt)'s
# cast; expected gain about 0.02-0.03 ms, under this call's row-to-row spread).
#
# The thirty-sixth session's H100 call (triton 3.6, `BUDGET=260 bash .ci/h200/h35_ssd10.sh` at 047b72b,
# ms by CUDA graph): the default 2.292 (forward 0.470), P8 1.755, with num_stages 2 1.810, with
# STATE_N 32 1.759 (its forward 0.504), with `bwd_sums` "kernel" 1.732 (3.69x the forward), "paired"
# at 16 warps 1.935, STATE_CHUNKS 2 2.398, 16 warps 2.723, STATE_N 32 2.166. P8 with `bwd_sums`
# "kernel" became the P <= 64 bucket's default; v20's default ("two" capped at 128, host sums) stays
# the row to compare with. Gone: the rows that lost to P8 (num_stages 2, "paired" at 16 warps,
# STATE_CHUNKS 2, 16 warps) and STATE_N 32, which slowed the forward (0.504 against 0.470) and gained
# the backward about 0.03 ms (1.759 - 0.504 against 1.755 - 0.470, within a run's row-to-row spread).
#
# Template v21 (not yet timed): `split_dbc` "triple", "paired"'s dC / dB program split in two (dC
# with the block pairs' terms of dL/dcs; dB, forming each head's M again): three programs per
# (chunk, group). The paired kernel (0.963 ms of the 1.72 ms of kernels in that call's P8 profile)
# reads and writes about 1.05 GB of HBM and does about 88 GFLOP by arithmetic (0.31 and 0.09 ms at
# the H100's peaks); its build runs one 8-warp program per SM (255 registers) whose head loops wait
# on 31-33 barriers each (sm_90 SASS, triton 3.6): latency-bound by this reasoning, not profiled. "triple" at 8 warps builds without spills (36 bytes
# under "paired") in 133 KB of shared memory (173), its dC / dB loops 24 and 13 barriers against 31,
# for 1.5x the programs; at 16 warps 128 registers / 20 spill bytes ("paired": 132). And PULL_N, the
# backward's pull over state tiles of 32 or 16 columns (512 or 1024 programs of 4 warps, 108 or 62
# registers, no spills on triton 3.6; the forward keeps STATE_N 64): the pull took 0.234 ms of that
# profile and moves about 0.42 GB (0.13 ms at HBM speed). First "triple" at 8 and at 16 warps, then
# PULL_N 32 and 16, then v20's default.
TWO = {"split_dbc": "two", "bwd_split_maxnreg": 128, "bwd_sums": "host"}
P8 = {"split_dbc": "paired", "bwd_split_maxnreg": 0}  # the bucket's split_dbc and register cap (h35_ssd10.sh)
TRIPLE = {"split_dbc": "triple"}
#
# Timed in the thirty-seventh session (H100, triton 3.6, h36_ssd11.sh, graph ms): the default 1.753
# (forward 0.462, 3.79x), "triple" 1.902 and 1.825 at 16 warps, PULL_N 32 1.683 (wall 2% slower:
# not adopted), PULL_N 16 1.882, v20's default 2.098. Those rows are gone from SWEEP.
#
# Template v22 (not yet timed), from the thirty-eighth session's ncu profile of "paired"'s
# ssd_bwd_split_fused_kernel (0.94 ms: one 8-warp program per SM, issue active 36%, FMUL / FADD
# the most issued opcodes; the top sampled instruction, cs_last - cs at each head's start, waits on
# that head's cs load): `bwd_exp` "exp2" (each exponential one MUFU.EX2 of cs in log2 units, not
# tl.exp's five instructions; head loops 823 / 1151 instructions against 914 / 1253 on triton
# 3.9), `bwd_prefetch` (each head's cs and dt loaded one head ahead) and both.
#
# Timed in the thirty-ninth session (H100, triton 3.6, `BUDGET=170 bash .ci/h200/h38_ssd12.sh` at
# bccc7ae, wall / graph ms): the default ("exp") 2.015 / 1.778 (forward 0.609 / 0.463), "exp2" 1.954 /
# 1.596, `bwd_prefetch` 2.141 / 1.739, both 1.973 / 1.536. "exp2" won by both clocks and is the P <= 64
# bucket's value since v23; `bwd_prefetch` (slower by wall alone and with "exp2") was removed in v23.
# Kept: "exp", the former default, to time the change on another card (the goal is stated
# for the H200).
#
# Template v24 (not yet timed): the split backward's pull (0.231 ms of the thirty-seventh session's
# 1.686 ms profile; about 0.42 GB moved, 0.13 ms at HBM speed) runs 256 programs of 4 warps at the
# bench shape, two 128-step serial chains per SM. `PULL_P` 32 splits P instead of N: 512 programs
# (four per SM, one wave), each reading its own rows of dy (PULL_N 32 read all of dy per program).
# `pull_scale` "dy" puts the step's weights on dy's columns (the dot's register operand) rather than on
# C's rows (scaled in registers and stored back to shared memory): its sm_90 loop (triton 3.6, PULL_P
# 32) 381 instructions against 475 ("dy" at the default's P tiles of 64 scales as many elements as
# "C": no row). And `bwd_qd` "dot", the fused backward's per-head sums <Gs, S_in> (q) and sum(dy x)
# (dD) as traces of tensor-core products rather than elementwise over upcast 16-bit tiles: "paired"'s
# head loops 1060 + 927 instructions against 1243 + 828 on triton 3.6, no spills (20 bytes). Rows:
# all three, the pull's two, `bwd_qd` "dot" alone, PULL_P 32 alone (the likeliest winner first: a run cut
# short keeps the first rows), then "exp".
PULL = {"PULL_P": 32, "pull_scale": "dy"}
#
# Template v27: `bwd_ahead`, the fused backward kernel with no synchronous global load in its head loops
# (the dx program of "paired" waited each head on x, S_in, cs, dt, cs_last and D; the dC / dB program
# on cs, dt, cs_last: Triton stages only dot operands). Timed on the H200 (fifty-third session): 1.505
# ms by graph against 1.549, so v28 makes it the P <= 64 bucket's; with v24's pull pair 1.529, under
# "triple" 1.645 (family.py). Rows: v27's default (`bwd_ahead` False) first, to time against on another
# card, then the pull pair and "triple" under the new default, PULL_P 32 alone and "exp". `bwd_qd`
# "dot" has no effect under `bwd_ahead`: its rows are gone.
#
# Template v29: `pull_ahead`, the split backward's fused pull (0.210 ms of the forty-eighth session's H100
# profile: 256 programs of 4 warps, each a 128-step serial chain, 1.64 us a step, against 0.43-0.56 GB
# of HBM traffic, 0.13-0.17 ms at 3.35 TB/s) with each step's cs row loaded one step ahead. Its sm_90
# TTGIR without it (triton 3.6 and 3.9) waits each step on a plain load of the step's cs row (loaded a
# second time, in the layout of cs_e's sum; the other loads are async copies).
# Timed on an H100 (fifty-fourth session): 1.510 ms by graph against 1.602, so v30 makes it the
# P <= 64 bucket's (family.py has the count, the build's registers and the rows); v29's default
# (`pull_ahead` False) is the first row, to time against on another card.
#
# Template v31: `bwd_dbc_ln`, the fused backward's dC and dB accumulated as [L, N], each head's row-scaled dy
# and x the state terms' register operand: the two state-term wgmmas of a head stay in flight behind the block
# pair's work instead of being waited on at once (family.py has the count and the build). Its row is first (a
# run cut short keeps it), then v29's default and the rest. On an H100 (fifty-fifth session, `.ci/h200/h55b.sh`,
# one run; wall / graph ms) the default 2.036 / 1.568, `bwd_dbc_ln` 2.151 / 1.533 (graph -2.2%, wall +5.6%),
# `pull_ahead` False 2.026 / 1.513 (v29's default, 3.5% under v30's by graph in this run, 5.7% over it in the
# fifty-fourth session's): differences of this size are within run-to-run spread here; none adopted.
SWEEP = (({"bwd_dbc_ln": True}, "bwd"), ({"pull_ahead": False}, "bwd"), ({"bwd_ahead": False}, "bwd"),
         (PULL, "bwd"), ({"split_dbc": "triple"}, "bwd"), ({"PULL_P": 32}, "bwd"),
         ({"bwd_exp": "exp"}, "bwd"))


def torch_path() -> tuple[str, Callable]:
    """("eager", transformers' chunked torch function) as (x, dt, A, B, C, D, dt_bias) -> y in x's
    dtype; ("reference", the rendered module's reference) when transformers has no such function."""
    try:
        from transformers.models.mamba2 import modeling_mamba2 as m
    except ImportError:
        m = None
    fn = getattr(m, "mamba2_chunk_scan", None)
    if fn is not None:
        fn = inspect.unwrap(fn)

        def call(x, dt, A, B, C, D, dt_bias):
            return fn(x, dt, A, B, C, chunk_size=MODEL_CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True).to(x.dtype)

        return "eager", call
    mod, _ = kernel("ssd", "scan", {"chunk_size": MODEL_CHUNK})

    def ref(x, dt, A, B, C, D, dt_bias):
        return mod.reference(x, dt, A, B, C, D, dt_bias, True, (0.0, math.inf))

    return "reference", ref


ANCHOR_ENV = "ONBOARD_ANCHOR_MAMBA_SSM"
ANCHOR_IMPLS = ("mamba_ssm", "mamba_ssm_fwd")


def mamba_ssm_module(submodule: str = "ops.triton.ssd_combined") -> types.ModuleType:
    """``mamba_ssm.<submodule>`` from the source tree ``$ONBOARD_ANCHOR_MAMBA_SSM`` (a folder
    holding ``mamba_ssm/``) or else an installed mamba_ssm, without running ``mamba_ssm/__init__``:
    a bare package module with that folder as its ``__path__`` stands in for it. Raises
    `Unavailable` when neither is there or the submodule's imports fail (einops not carried),
    RuntimeError when another mamba_ssm is imported already."""
    root = os.environ.get(ANCHOR_ENV)
    if root:
        where = Path(root).expanduser().resolve() / "mamba_ssm"
        if not where.is_dir():
            raise Unavailable(f"mamba_ssm: ${ANCHOR_ENV}={root} holds no mamba_ssm/ folder")
    else:
        loaded = sys.modules.get("mamba_ssm")
        spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            raise Unavailable(f"mamba_ssm: not installed, and ${ANCHOR_ENV} (a folder holding the "
                              "mamba_ssm/ source tree) is not set")
        where = Path(list(spec.submodule_search_locations)[0]).resolve()
    loaded = sys.modules.get("mamba_ssm")
    if loaded is None:
        spec = importlib.machinery.ModuleSpec("mamba_ssm", None, is_package=True)
        spec.submodule_search_locations = [str(where)]
        bare = importlib.util.module_from_spec(spec)  # its __init__ is never executed
        sys.modules["mamba_ssm"] = bare
    else:
        paths = [Path(x).resolve() for x in getattr(loaded, "__path__", [])]
        if where not in paths:
            raise RuntimeError(f"mamba_ssm: already imported from {paths}, not {where}")
    try:
        return importlib.import_module(f"mamba_ssm.{submodule}")
    except ImportError as exc:  # a dependency not carried (einops): the anchor is not there
        raise Unavailable(f"mamba_ssm: importing mamba_ssm.{submodule} from {where} failed: "
                          f"{type(exc).__name__}: {exc}") from exc


def mamba_ssm_path() -> Callable:
    """mamba-ssm's ``mamba_chunk_scan_combined`` as (x, dt, A, B, C, D, dt_bias) -> y, at the
    models' chunk, dt bias + softplus, no limit, no z."""
    fn = mamba_ssm_module().mamba_chunk_scan_combined

    def call(x, dt, A, B, C, D, dt_bias):
        return fn(x, dt, A, B, C, MODEL_CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True,
                  dt_limit=(0.0, math.inf))

    return call


def _anchor_steps(sets, grads) -> dict[str, Step]:
    """``mamba_ssm`` / ``mamba_ssm_fwd``: the anchor is loaded at the first call, so a case set
    up without them asked for never imports it."""
    loaded: list[Callable] = []

    def anchor(*args):
        if not loaded:
            loaded.append(mamba_ssm_path())
        return loaded[0](*args)

    return {"mamba_ssm": fwd_bwd(anchor, sets, grads), "mamba_ssm_fwd": fwd_only(anchor, sets)}


def _anchor_check(B: int, T: int, H: int, P: int, G: int, N: int
                  ) -> Callable[[torch.device], dict[str, float]]:
    """mamba_ssm against ours at the case's full shape, the same bf16 inputs and dy: y and every
    gradient; ``ok`` when within twice our bars."""
    def check(device: torch.device) -> dict[str, float]:
        anchor = mamba_ssm_path()
        _, ours = _ours()
        leaves = make_inputs(B, T, H, P, G, N, device, seed=0)
        gen = torch.Generator(device=device).manual_seed(7)
        dy = torch.randn(B, T, H, P, device=device, generator=gen).to(torch.bfloat16)
        y = ours(*leaves)
        grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
        ya = anchor(*leaves)
        grads_a = torch.autograd.grad(ya, leaves, dy.to(ya.dtype))
        res = {"y": rel_rms(ya, y)}
        res.update({n: rel_rms(a, b) for n, a, b in zip(NAMES, grads_a, grads, strict=True)})
        res["ok"] = float(res["y"] <= 2 * O_TOL and all(res[n] <= 2 * GRAD_TOL for n in NAMES))
        return res
    return check


def _ours(params: dict | None = None) -> tuple[object, Callable]:
    mod, entry = kernel("ssd", "scan", params or {"chunk_size": MODEL_CHUNK})
    return mod, lambda x, dt, A, B, C, D, dt_bias: entry(x, dt, A, B, C, D, dt_bias, True, (0.0, math.inf))


@shared_inputs
def make_inputs(B: int, T: int, H: int, P: int, G: int, N: int, device: torch.device, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """x, dt (raw, before bias and softplus), B, C, D, dt_bias in `dtype` and A fp32, in the ranges
    Mamba-2 initialises (A = -[1, 16], dt in [0.001, 0.1]), as leaves that require grad."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=device, generator=gen)).to(dtype)

    lo, hi = math.log(0.001), math.log(0.1)
    dt0 = torch.exp(torch.rand(H, device=device, generator=gen) * (hi - lo) + lo)
    A = -(1 + 15 * torch.rand(H, device=device, generator=gen))
    leaves = (r(B, T, H, P), r(B, T, H, scale=0.5), A, r(B, T, G, N), r(B, T, G, N),
              torch.ones(H, device=device).to(dtype), (dt0 + torch.log(-torch.expm1(-dt0))).to(dtype))
    return tuple(t.requires_grad_(True) for t in leaves)


NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias")


def _check(B: int, T: int, H: int, P: int, G: int, N: int) -> Callable[[torch.device], dict[str, float]]:
    def check(device: torch.device) -> dict[str, float]:
        _, ours = _ours()
        _, ref = torch_path()
        t = min(T, CHECK_MAX_T)
        leaves = make_inputs(B, t, H, P, G, N, device, seed=0)
        gen = torch.Generator(device=device).manual_seed(7)
        dy = torch.randn(B, t, H, P, device=device, generator=gen).to(torch.bfloat16).float()  # both sides' dy
        y = ours(*leaves)
        grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
        leaves32 = [t.detach().float().requires_grad_(True) for t in leaves]
        y32 = ref(*leaves32)
        grads32 = torch.autograd.grad(y32, leaves32, dy)
        res = {"y": rel_rms(y, y32)}
        res.update({n: rel_rms(a, b) for n, a, b in zip(NAMES, grads, grads32, strict=True)})
        res["ok"] = float(res["y"] <= O_TOL and all(res[n] <= GRAD_TOL for n in NAMES))
        return res
    return check


def _steps(B: int, T: int, H: int, P: int, G: int, N: int, device: torch.device, extras: bool
           ) -> dict[str, Step]:
    sets = [make_inputs(B, T, H, P, G, N, device, seed=s) for s in range(N_SETS)]
    grads = [torch.randn(B, T, H, P, device=device, dtype=torch.bfloat16)]
    mod, ours = _ours()
    label, eager = torch_path()
    steps = {"ours": fwd_bwd(ours, sets, grads), "ours_fwd": fwd_only(ours, sets)}
    if T <= EAGER_BWD_MAX_T:
        steps[label] = fwd_bwd(eager, sets, grads)
    steps[f"{label}_fwd"] = fwd_only(eager, sets)
    steps["compile_fwd"] = fwd_only(torch.compile(eager), sets)
    steps.update(_anchor_steps(sets, grads))
    if extras:
        steps.update(_sweep(mod, ours, sets, grads, P))
    return steps


def _sweep(mod, fn: Callable, sets, grads, size: int) -> dict[str, Step]:
    """``ours@cfg`` (forward + backward, `config_sweep`) and / or ``ours@cfg_fwd`` (`fwd_sweep`)
    steps per SWEEP entry, in SWEEP's order."""
    steps: dict[str, Step] = {}
    for cfg, rows in SWEEP:
        if rows in ("both", "bwd"):
            steps.update(config_sweep(mod, fn, sets, grads, size, [cfg]))
        if rows in ("both", "fwd"):
            steps.update({k + "_fwd": v for k, v in fwd_sweep(mod, fn, sets, size, [cfg]).items()})
    return steps


def ssd_case(B: int, T: int, H: int, P: int, G: int, N: int, note: str = "", *, extras: bool = False) -> BenchCase:
    """One case of the ``scan`` kernel; nothing touches a device until the harness calls `setup`
    or `check`."""
    # Bytes: x, dt, B, C (bf16) read in the forward and again in the backward, their gradients
    # written; y written and dy read.
    n_in = 2 * B * T * (H * P + H + 2 * G * N)
    n_y = 2 * B * T * H * P
    min_bytes = 3 * n_in + 2 * n_y
    # The chunked algorithm's matmul work per token and head (L: our chunk 64): C B^T (L N), the
    # intra-chunk output (L P), the chunk state and the state's output (2 P N). Multiply-adds x2;
    # the backward ~2x the forward.
    flops = 3 * 2 * B * T * H * (64 * N + 64 * P + 2 * P * N)
    return BenchCase(
        family="ssd", name=f"B{B}T{T}H{H}P{P}G{G}N{N}", shape={"B": B, "T": T, "H": H, "P": P, "G": G, "N": N},
        min_bytes=min_bytes, flops=flops,
        setup=lambda device: _steps(B, T, H, P, G, N, device, extras),
        check=_check(B, T, H, P, G, N), note=note, on_request=ANCHOR_IMPLS,
        anchor_checks={"mamba_ssm": _anchor_check(B, T, H, P, G, N)})


def cases() -> list[BenchCase]:
    return [ssd_case(*shape[:6], shape[6], extras=i == 0) for i, shape in enumerate(SHAPES)]


# The nightly regression suite's share: the first shape against the torch path, forward only.
NIGHTLY = NightlySpec(cases={"B1T8192H128P64G8N128": ("ours", "ours_fwd", "eager_fwd")}, min_threshold=0.05)
