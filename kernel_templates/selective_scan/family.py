"""Mamba-1 selective-scan family: the per-channel selective state-space scan of Mamba-1 mixers.

One variant, `scan`: u, delta, z [B, D, T], A [D, N], B and C [B, N, T] (or grouped
[B, G, N, T]), D skip and delta bias [D], initial / final state [B, D, N]; Triton forward and
backward (gradients to every tensor input) against a pure-PyTorch reference (the token-by-token
recurrence of transformers' torch path), and a one-token decode step. The binding serves the scan
core of a classified Mamba-1 mixer; its projections and conv stay the model's modules.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, ShapeBucket

from . import bench
from .binding import SELECTIVE_SCAN, bind
from .binding import refusal as binding_refusal

NAME = "selective_scan"


def _claims(block: Any) -> dict[str, Any] | None:
    """What `match` serves of a block by its structure alone (`match`)."""
    if block.kind != "linear_attention.mamba" or block.attrs.get("scan") != "selective":
        return None
    if not block.attrs.get("inner") or not block.attrs.get("state"):
        return None
    return FAMILY.served("scan", {})


def refusal(block: Any) -> dict[str, str] | None:
    """For a block `match` would serve by its structure: why the binding would leave it unpatched,
    by its own acceptance test (`binding.refusal`) on the core calls the parse stage recorded
    (attrs ``core_calls``, `FAMILY.probe`), as {"serves": None (the block's core), "reason"};
    None when it would take the block or nothing was recorded (a graph not probed: the match
    stands)."""
    if _claims(block) is None:
        return None
    found = (block.attrs.get("core_calls") or {}).get(SELECTIVE_SCAN.what)
    if found is None:
        return None
    why = binding_refusal(found)
    return None if why is None else {"serves": None, "reason": why}


def match(block: Any) -> dict[str, Any] | None:
    """A `linear_attention.mamba` block whose classification read a Mamba-1 mixer off its
    structure (`scan: selective`: a [inner, state] decay exponentiated per channel and state,
    softplus time step, x_proj to dt_rank + 2 state, dt_proj, depthwise causal conv) and that the
    binding can take (no `refusal`), else None. Normed B/C/dt (Falcon-Mamba, Jamba) change the
    mixer around the scan, not the scan."""
    m = _claims(block)
    return None if m is None or refusal(block) is not None else m


def sample_inputs(variant: str, params: dict[str, Any], shapes: list[list[int]],
                  gen: torch.Generator) -> list:
    """u, delta [1, 8, 11], A < 0 [8, 16], B, C [1, 16, 11], D, z, delta_bias, softplus: the
    block's input [B, T, hidden] does not give the inner width (and the check only needs the
    interface), so small fixed sizes."""
    d, n, t = 8, 16, 11
    return [torch.randn(1, d, t, generator=gen), torch.randn(1, d, t, generator=gen),
            -torch.exp(torch.rand(d, n, generator=gen)), torch.randn(1, n, t, generator=gen),
            torch.randn(1, n, t, generator=gen), torch.randn(d, generator=gen),
            torch.randn(1, d, t, generator=gen), torch.randn(d, generator=gen) - 1.0, True]


def problem_dims(entry: Any, block: Any) -> dict[str, int] | None:
    """Batch and tokens off x [B, T, hidden]; inner width D and state N off the block's attrs."""
    x = entry.shapes[0] if entry.shapes else None
    if block is None or not x or len(x) != 3 or not block.attrs.get("inner"):
        return None
    return {"B": x[0], "T": x[1], "D": block.attrs["inner"], "N": block.attrs["state"]}


def timing_inputs(variant: str, params: dict[str, Any], dims: dict[str, int], dtype,
                  gen: torch.Generator) -> list:
    """Entry arguments at the block's dims, as a mixer calls the scan (fp32 A, D, delta bias)."""
    from onboarding.tune.worker import randn

    b, t, d, n = (int(dims[k]) for k in ("B", "T", "D", "N"))
    return [randn(gen, b, d, t, dtype=dtype), randn(gen, b, d, t, dtype=dtype) - 2.0,
            -torch.exp(randn(gen, d, n, dtype=torch.float32)), randn(gen, b, n, t, dtype=dtype),
            randn(gen, b, n, t, dtype=dtype), randn(gen, d, dtype=torch.float32),
            randn(gen, b, d, t, dtype=dtype), randn(gen, d, dtype=torch.float32), True]


def checkpoint_steps(config: dict[str, Any], T: int) -> int:
    """Steps between the states the forward stores for the backward (the module's `_ck_steps`)."""
    if config["bwd_order"] != "nt":
        return config["BLOCK_T"]
    return max(config["BLOCK_T"], min(config["BWD_BLOCK_T"], 1 << (max(T, 1) - 1).bit_length()))


def saved_shapes(batch: int, T: int, inner: int, state: int, groups: int, dtype: torch.dtype,
                 config: dict[str, Any], *, gate: bool = True, skip: bool = True,
                 bias: bool = True, initial_state: bool = False,
                 weights: torch.dtype = torch.float32) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What the kernel's autograd Function keeps for its backward (`setup_context`'s
    `save_for_backward`), as (shape, dtype): its inputs u and delta [B, D, T], A [D, N], B and
    C [B, G, N, T], the gate z [B, D, T] where given (u, delta, B, C, z in ``dtype``; A, and the
    D skip and delta bias where given, in ``weights``), the initial state where given, and the
    fp32 states [B, D, cdiv(T, S), N] it stores every S steps (`checkpoint_steps` of
    ``config``): nothing of T x N per channel. The plan's count of a block the family serves
    (`onboarding.plan.memory`, `plan_saves` "scan"); tests/test_plan_scan.py checks it against
    the tensors the Function saves."""
    f32 = torch.float32
    nst = -(-max(T, 1) // checkpoint_steps(config, T))
    out = [((batch, inner, T), dtype), ((batch, inner, T), dtype), ((inner, state), weights),
           ((batch, groups, state, T), dtype), ((batch, groups, state, T), dtype)]
    out += [((inner,), weights)] * (int(skip) + int(bias))
    out += [((batch, inner, T), dtype)] * int(gate)
    if initial_state:
        out.append(((batch, inner, state), f32))
    return out + [((batch, inner, nst, state), f32)]


def plan_saved(widths: dict[str, int], seq: int) -> float | None:
    """Bytes per token the kernel keeps for a Mamba-1 mixer of ``widths`` (`memory._scan_widths`:
    inner, state) over ``seq`` tokens: bf16 u, delta, z, B and C (one group), fp32 A, D and delta
    bias (`saved_shapes` under the untuned config of its state size)."""
    if "rank" not in widths:  # not a Mamba-1 mixer's widths
        return None
    shapes = saved_shapes(1, seq, widths["inner"], widths["state"], 1, torch.bfloat16,
                          FAMILY.untuned_config(widths["state"]))
    return sum(math.prod(s) * d.itemsize for s, d in shapes) / seq


FAMILY = FamilySpec(
    name=NAME,
    template="selective_scan.py.j2",
    plan_saves="scan",
    # v5: the backward gets None, not autograd's zeros, for outputs without a gradient
    template_version=5,
    folder=Path(__file__).parent,
    variants={"scan": "Mamba-1 selective scan: per-channel decay exp(dt A), (grouped) B/C, D skip, "
                      "silu(z) gate, delta bias + softplus, initial/final state; decode step"},
    params=(),
    # BLOCK_D: channels per program (the [BLOCK_D, N] fp32 state in registers); BLOCK_T: steps
    # per scanned tile of the forward; BWD_BLOCK_D: the backward's channels per program;
    # BWD_BLOCK_T: the "nt" backward's chunk (the forward stores the state every chunk; the
    # "dnt" / "tdn" backwards run the forward's tiles and take a state per tile).
    tuning_space={
        "BLOCK_D": (2, 4, 8, 16, 32),
        "BLOCK_T": (8, 16, 32, 64),
        "num_warps": (1, 2, 4, 8),
        "BWD_BLOCK_D": (1, 2, 4, 8, 16),
        "bwd_warps": (1, 2, 4, 8),
        # the "nt" backward's chunk (steps between the states the forward stores for it)
        "BWD_BLOCK_T": (8, 16, 32, 64, 128, 256),
        # a register cap for the backward's kernel (Triton's `maxnreg`; 0: none): more one-warp
        # programs per SM against spills (the "nt" 2 x 128 kernel: 222 registers uncapped, at
        # 128 it spills 280 bytes and its state loop grows 58.6 -> 61.1 per element)
        "bwd_maxnreg": (0, 128, 168),
        # the tiles' order (the template's docstring): "dnt" [BLOCK_D, N, BLOCK_T], time across
        # lanes; "tdn" [BLOCK_T, BLOCK_D, N], time inside each thread
        "fwd_order": ("dnt", "tdn"),
        # "nt": [BLOCK_D, BWD_BLOCK_T] tiles with a loop over the states (the template's docstring)
        "bwd_order": ("dnt", "tdn", "nt"),
    },
    # Untimed, chosen from the sm_90 AOT build (bf16, N 16, the time strides specialized to 1 as
    # the JIT does for contiguous inputs; ptxas registers / spill bytes, and PTX instructions in
    # the tile loop per (channel, state, step)): forward "tdn" 8 x 16 at 4 warps 93 / 0, 25.1
    # (the "dnt" forward at 8 x 32, the version-2 default: 167 / 0, 59.2); backward "tdn" 8 x 16
    # at 4 warps 186 / 0, 85.2 (the "dnt" backward at 4 x 32, the version-2 default: 168 / 0,
    # 136.1). "tdn" wants BLOCK_D x N >= 32 x warps (its lanes sit on channels and states: at
    # 4 x 16, 4 warps the backward costs 244.6). docs/LOG.md, issue 35 (h35), has the table.
    # Timed on the H200 (docs/LOG.md, eighteenth session, call C; B1 T4096 D5120 N16, bf16):
    # forward 1.206 ms (v2's default 2.461 in call B), fwd+bwd 8.687 ms with the backward at
    # 8 channels / 4 warps, 6.225 ms at 2 channels / 1 warp (the best of 7 backward rows; 4 / 2
    # warps 7.828): the backward's default since.
    # Template version 4: the "nt" backward (the template's docstring), untimed, chosen from the
    # sm_90 build (bf16, N 16, every size a multiple of 16 as at the bench's shape; SASS
    # instructions per (channel, state, step) in the state loop, plus the chunk loop's share):
    # "nt" 2 x 128 at 1 warp 232 registers / 0 spills, 61.6 + 10.4; "tdn" 2 x 16 at 1 warp (v3's
    # default) 168 / 0, 84.1; forward "tdn" 8 x 16 at 4 warps 93 / 0, 30.1. docs/LOG.md, the
    # nineteenth session's selective_scan section, has the table; the bench's ours@ rows time
    # the alternatives (v3's "tdn" backward, "nt" capped at 128 registers, "nt" 4 x 64).
    default_config={"BLOCK_D": 8, "BLOCK_T": 16, "num_warps": 4, "BWD_BLOCK_D": 2, "bwd_warps": 1,
                    "BWD_BLOCK_T": 128, "bwd_maxnreg": 0, "fwd_order": "tdn", "bwd_order": "nt"},
    shape_buckets=(
        ShapeBucket(name="n_le_16", dim="N", lo=1, hi=16),
        # Untimed, sm_90 build at N 64: forward "tdn" 8 x 16 242 / 0, 24.7; backward "dnt" 2 x 16
        # 219 / 0, 132.0 ("tdn" spills there: 8 x 16 1624 bytes, 4 x 16 at 2 warps 1720). The
        # "nt" backward loops over the states, so its registers do not grow with N (v4: the
        # default's "nt" backward here too)
        ShapeBucket(name="n_big", dim="N", lo=17, hi=2**31 - 1,
                    config={"BLOCK_D": 8, "BLOCK_T": 16, "BWD_BLOCK_D": 2}),
    ),
    match=match,
    sample_inputs=sample_inputs,
    problem_dims=problem_dims,
    timing_dims=("B", "T", "D", "N"),
    timing_inputs=timing_inputs,
    bench_cases=bench.cases,
    bench_nightly=bench.NIGHTLY,
    binding=bind,
    probe=SELECTIVE_SCAN,
    refusal=refusal,
)
