"""Selective-scan benchmark cases (the spec's `bench_cases`): Mamba-1 layouts, state 16, bf16.

Impls per case (a ``_fwd`` suffix: forward only, under `torch.no_grad`; otherwise forward +
backward of y):

- ``ours`` / ``ours_fwd``: our rendered ``scan`` kernel;
- ``eager`` / ``eager_fwd``: transformers' Mamba-1 torch path (``mamba_selective_scan``, the
  token-by-token recurrence the mixer runs without mamba_ssm), unwrapped so that a hub kernel
  does not take over; its fwd+bwd only up to EAGER_BWD_MAX_T (one autograd node per step);
- ``compile_fwd`` / ``compile``: `torch.compile` of that function with its own compile-time
  form (``use_associative_scan``: an associative scan over [B, D, T, N], which it takes only
  under torch.compile); compiling the token loop would unroll T steps. A case of its own at the
  first shape (``...-compile``, beside ours), last: its compile took more than a minute on the
  H200 (seventeenth session);
- ``ours@...`` / ``ours@..._fwd``: our kernel at other configs (FWD_SWEEP, empty since template
  version 4; BWD_SWEEP), first shape: the backward's alternatives (``ours@bwd_order=tdn``: template version 3's backward;
  ``ours@bwd_maxnreg=128``: the "nt" backward capped at 128 registers;
  ``ours@BWD_BLOCK_D=4,BWD_BLOCK_T=64``: other "nt" tiles).

``check``: the bf16 kernel against the fp32 torch path on the same (bf16-representable) values:
relative RMS error of y and of the gradients of u, delta, A, B, C, D, z, delta_bias; ``ok`` is
1.0 when y is within O_TOL and every gradient within GRAD_TOL.
Shape legend: u, delta, z [B, D, T]; A [D, N]; B, C [B, N, T].
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from onboarding.bench.cases import (
    N_SETS,
    config_sweep,
    fwd_bwd,
    fwd_only,
    fwd_sweep,
    kernel,
    shared_inputs,
)
from onboarding.bench.harness import BenchCase, Step
from onboarding.families import NightlySpec
from onboarding.testing.tolerance import rel_rms

O_TOL, GRAD_TOL = 0.005, 0.01
EAGER_BWD_MAX_T = 4096
GRADS = ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias")
# (B, T, D, N, note)
SHAPES = (
    (1, 4096, 5120, 16, "Mamba-2.8B layout (d_inner 5120)"),
    (1, 8192, 4096, 16, "d_inner 4096, T 8192"),
)
# Configs timed beside the default at the first shape (rows ours@...; forward-only ones end in
# _fwd): the defaults are untimed (chosen from the sm_90 build: registers, spills and the loop's
# instructions per element, family.py). FWD_SWEEP is empty since template version 4: its rows
# (v2's "dnt" forward at BLOCK_T 32, "tdn" at BLOCK_T 32, 16 channels, 4 channels at 2 warps:
# 1.266-2.324 ms against the default's 1.206) and version 3's backward rows were timed in the
# eighteenth session's call C (docs/LOG.md); `--impl ours` runs every ours@ row, so rows that
# decided nothing new are left out. BWD_SWEEP, template version 4's
# alternatives to its "nt" backward (2 channels x 128 steps, 1 warp; 222 registers, 9 programs
# per SM): version 3's "tdn" backward (2 channels, 1 warp, now with relaxed atomics), "nt"
# capped at 128 registers (16 programs per SM; 280 bytes spilled) and "nt" at 4 channels x 64
# steps (the fewest instructions per element in the build, half the dB/dC atomics).
FWD_SWEEP: tuple[dict, ...] = ()
BWD_SWEEP = ({"bwd_order": "tdn"}, {"bwd_maxnreg": 128}, {"BWD_BLOCK_D": 4, "BWD_BLOCK_T": 64})


def transformers_scan(associative: bool = False) -> Callable:
    """transformers' Mamba-1 torch scan as (u, delta, A, B, C, D, z, delta_bias) -> y."""
    from transformers.models.mamba import modeling_mamba as m

    fn = inspect.unwrap(m.mamba_selective_scan)

    def call(u, delta, A, B, C, D, z, delta_bias):
        return fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True,
                  use_associative_scan=associative)

    return call


def _ours():
    mod, entry = kernel("selective_scan", "scan", {})
    return mod, lambda u, delta, A, B, C, D, z, bias: entry(u, delta, A, B, C, D, z, bias, True)


@shared_inputs
def make_inputs(B: int, T: int, D: int, N: int, device: torch.device, seed: int = 0
                ) -> tuple[torch.Tensor, ...]:
    """bf16 u, delta, B, C, z and fp32 A, D, delta_bias as a Mamba-1 mixer makes them (A = -[1..N]
    per channel, dt = softplus(delta + bias) in [1e-3, 0.1]), leaves that require grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16

    def r(*s):
        return torch.randn(*s, device=device, generator=gen)

    u, z = r(B, D, T).to(bf16), r(B, D, T).to(bf16)
    delta = (0.1 * r(B, D, T)).to(bf16)
    A = -torch.arange(1, N + 1, device=device, dtype=torch.float32).repeat(D, 1)
    A = A * torch.exp(0.1 * r(D, N))
    Bm, Cm = r(B, N, T).to(bf16), r(B, N, T).to(bf16)
    Dv = torch.ones(D, device=device) + 0.1 * r(D)
    dt = torch.exp(torch.rand(D, device=device, generator=gen) * (torch.log(torch.tensor(0.1))
                                                                   - torch.log(torch.tensor(1e-3)))
                   + torch.log(torch.tensor(1e-3))).to(device)
    bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    return tuple(t.requires_grad_(True) for t in (u, delta, A, Bm, Cm, Dv, z, bias))


def _check(B: int, T: int, D: int, N: int) -> Callable[[torch.device], dict[str, float]]:
    def check(device: torch.device) -> dict[str, float]:
        leaves = make_inputs(B, T, D, N, device, seed=0)
        gen = torch.Generator(device=device).manual_seed(7)
        dy = torch.randn(B, D, T, device=device, generator=gen)
        y = _ours()[1](*leaves)
        grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
        leaves32 = [x.detach().float().requires_grad_(True) for x in leaves]
        y32 = transformers_scan()(*leaves32)
        grads32 = torch.autograd.grad(y32, leaves32, dy)
        res = {"y": rel_rms(y, y32)}
        for name, a, b in zip(GRADS, grads, grads32, strict=True):
            res[name] = rel_rms(a, b)
        res["ok"] = float(res["y"] <= O_TOL and all(res[n] <= GRAD_TOL for n in GRADS))
        return res
    return check


def _steps(B: int, T: int, D: int, N: int, device: torch.device, kind: str) -> dict[str, Step]:
    """kind "plain": ours, the torch path (and the tile sweeps at the first shape); "compile":
    ours and torch.compile of the torch path, a case of its own so that a slow compile (more than
    60 s on the H200, seventeenth session) never costs the plain case its rows."""
    sets = [make_inputs(B, T, D, N, device, seed=s) for s in range(N_SETS)]
    grads = [torch.randn(B, D, T, device=device, dtype=torch.bfloat16)]
    mod, ours = _ours()
    steps = {"ours": fwd_bwd(ours, sets, grads), "ours_fwd": fwd_only(ours, sets)}
    if kind == "compile":
        # one compiled function per step (grad mode changes the graph)
        steps["compile_fwd"] = fwd_only(torch.compile(transformers_scan(associative=True)), sets)
        steps["compile"] = fwd_bwd(torch.compile(transformers_scan(associative=True)), sets, grads)
        return steps
    eager = transformers_scan()
    steps["eager_fwd"] = fwd_only(eager, sets)
    if T <= EAGER_BWD_MAX_T:
        steps["eager"] = fwd_bwd(eager, sets, grads)
    if kind == "sweep":
        steps.update({k + "_fwd": v for k, v in fwd_sweep(mod, ours, sets, N, list(FWD_SWEEP)).items()})
        steps.update(config_sweep(mod, ours, sets, grads, N, list(BWD_SWEEP)))
    return steps


def scan_case(B: int, T: int, D: int, N: int, note: str = "", kind: str = "plain") -> BenchCase:
    # Bytes: u, delta, z (bf16) read by the forward and again by the backward, y written, dy read,
    # du, ddelta, dz written (11 [B, D, T] bf16 passes); B, C read twice, dB, dC written (fp32).
    min_bytes = 11 * 2 * B * D * T + (2 * 2 * 2 + 2 * 4) * B * N * T
    # per (b, d, t, n): exp, the state's multiply-add, the output's multiply-add in the forward;
    # the backward re-runs it and adds the adjoint scan and five products (~3x)
    flops = 4 * 5 * B * D * T * N
    return BenchCase(
        family="selective_scan", name=f"B{B}T{T}D{D}N{N}" + ("-compile" if kind == "compile" else ""),
        shape={"B": B, "T": T, "D": D, "N": N}, min_bytes=min_bytes, flops=flops,
        setup=lambda device: _steps(B, T, D, N, device, kind),
        check=None if kind == "compile" else _check(B, T, D, N), note=note)


def cases() -> list[BenchCase]:
    """Each shape's plain case (the first one with the tile sweeps), then the compile case of the
    first shape."""
    out = [scan_case(*shape, kind="sweep" if i == 0 else "plain") for i, shape in enumerate(SHAPES)]
    return out + [scan_case(*SHAPES[0][:4], note="torch.compile anchor", kind="compile")]


# The nightly regression suite's share: the Mamba-2.8B layout, ours against the token loop's
# forward (320 ms on the H200: its fwd+bwd and the compile stay out of the nightly).
NIGHTLY = NightlySpec(cases={"B1T4096D5120N16": ("ours", "ours_fwd", "eager_fwd")}, min_threshold=0.05)
