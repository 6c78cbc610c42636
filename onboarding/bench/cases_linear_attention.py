"""The delta-rule benchmark case, shared by the scalar-gated (GDN) and the per-channel (KDA)
families: each family's `bench.py` lists its shapes (issue 5's for GDN, issue 32's for KDA) and
builds its cases with `delta_rule_case(family, ..., per_channel=...)`.

Impls per case (a ``_fwd`` suffix: forward only, under `torch.no_grad`; otherwise forward +
backward of the output ``o``):

- ``ours`` / ``ours_fwd``: our rendered ``chunk`` kernel (chunk 64, q/k l2norm in the kernel);
- ``eager`` / ``eager_fwd``: transformers' torch fallback (``torch_chunk_gated_delta_rule``,
  ``chunk_kimi_delta_attention``), unwrapped so that an installed fla does not take over;
- ``compile_fwd``: `torch.compile` of that fallback's forward, only for T <= COMPILE_MAX_T (the
  fwd+bwd compile did not finish inside 230 s at T=4096 on the H200);
- KDA's fallback materialises its per-channel decays as [B, H, T/64, 64, 64, D] fp32 (8.6 GB at
  T=8192 H=32 D=128; 34 GB at T=32768, more than that again for its backward): its rows are
  limited by KDA_EAGER_MAX_T (forward only, no compile) and its check by KDA_CHECK_MAX_T, so that
  the family's bench stays under a minute;
- ``fla`` / ``fla_fwd``: fla's ``chunk_gated_delta_rule`` / ``chunk_kda``, when fla is installed.
  A failing fla (its fwd+bwd refuses on triton < 3.7.1 on Hopper) gives an error row;
- ``ours@<key>=<value>[+...]`` (forward + backward) and ``..._fwd`` (forward): a family's sweep
  rows (`delta_rule_case`'s ``fwd_sweep`` / ``bwd_sweep``), each pinning its config on ``ours``'s
  module for the case's bucket while it runs, on ``ours``'s inputs; on request only (``--impl``
  names them; its list splits at commas, hence the "+").

``check``: the bf16 kernel against the fp32 fallback on the same (bf16-representable) values:
relative RMS error of ``o``, the final state ``ht`` and ``dq, dk, dv, dg, dbeta`` (backward of
``o`` only); ``ok`` is 1.0 when ``o`` is within O_TOL and every gradient within GRAD_TOL.

Shape legend: q, k [B, T, HK, D]; v [B, T, HV, D]; g [B, T, HV] (GDN) or [B, T, HV, D] (KDA),
fp32 as the models compute it; beta [B, T, HV]; ht [B, HV, D, D] fp32.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch.nn import functional as F

from onboarding.bench.cases import N_SETS, config_sweep, fwd_bwd, fwd_only, fwd_sweep, kernel, shared_inputs
from onboarding.bench.harness import BenchCase, Step
from onboarding.testing.tolerance import rel_rms

CHUNK = 64
COMPILE_MAX_T = 8192  # torch.compile unrolls the fallback's chunk loop: T/64 copies of the body
# KDA's fallback (see the module docstring): its forward timed up to this T (82 ms at T=8192 on
# the H200), its fwd+bwd (1.3 s a call there) and compile never; checked up to KDA_CHECK_MAX_T
KDA_EAGER_MAX_T = 8192
KDA_CHECK_MAX_T = 8192
O_TOL, GRAD_TOL = 0.005, 0.01  # bf16 vs fp32 relative RMS bounds used for issue 5


def transformers_fallback(per_channel: bool) -> Callable:
    """transformers' torch chunk function (KDA's when `per_channel`, else GDN's), called as
    (q, k, v, g, beta) -> (o, ht)."""
    if per_channel:
        from transformers.models.kimi_linear import modeling_kimi_linear as m

        fn = m.chunk_kimi_delta_attention
    else:
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        fn = m.torch_chunk_gated_delta_rule
    # transformers routes these through fla when it is importable: unwrap to the torch path
    fn = inspect.unwrap(fn)

    def call(q, k, v, g, beta):
        n = v.shape[2] // q.shape[2]
        if n > 1:  # older transformers do not expand grouped value heads themselves
            q, k = q.repeat_interleave(n, dim=2), k.repeat_interleave(n, dim=2)
        return fn(q, k, v, g=g, beta=beta, chunk_size=CHUNK, initial_state=None,
                  output_final_state=True, use_qk_l2norm_in_kernel=True)

    return call


def fla_function(per_channel: bool) -> Callable | None:
    """fla's chunk function (``chunk_kda`` when `per_channel`, else ``chunk_gated_delta_rule``) as
    (q, k, v, g, beta) -> (o, ht); None when fla is not installed.

    An fla that is installed but fails to import gives a function that raises that error, so
    the harness records it as the row's error.
    """
    try:
        if per_channel:
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    except ModuleNotFoundError as exc:
        if exc.name == "fla":
            return None
        err: Exception = exc
    except Exception as exc:  # noqa: BLE001 - an optional anchor: report, don't crash
        err = exc
    else:
        def call(q, k, v, g, beta):
            return fn(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)

        return call

    def broken(*args):
        raise RuntimeError(f"fla import failed: {type(err).__name__}: {err}")

    return broken


def _ours(family: str):
    """The rendered ``chunk`` module and its entry on (q, k, v, g, beta)."""
    mod, entry = kernel(family, "chunk", {"chunk_size": CHUNK, "qk_l2norm": True})
    return mod, lambda q, k, v, g, beta: entry(q, k, v, g, beta, None, None, True, True)


def sweep_label(cfg: dict) -> str:
    """A sweep row's name: ``ours@`` and the config's keys joined by "+"."""
    return "ours@" + "+".join(f"{k}={v}" for k, v in cfg.items())


def sweep_rows(fwd_sweep: tuple[dict, ...] = (), bwd_sweep: tuple[dict, ...] = ()) -> tuple[str, ...]:
    """The names of the sweep rows `delta_rule_case` adds (forward rows end in ``_fwd``)."""
    return (*(sweep_label(c) + "_fwd" for c in fwd_sweep), *(sweep_label(c) for c in bwd_sweep))


@shared_inputs
def make_inputs(per_channel: bool, B: int, T: int, HK: int, HV: int, D: int,
                device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 q, k, v, beta and an fp32 log decay g, as leaves that require grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16
    q = torch.randn(B, T, HK, D, device=device, generator=gen).to(bf16)
    k = torch.randn(B, T, HK, D, device=device, generator=gen).to(bf16)
    v = torch.randn(B, T, HV, D, device=device, generator=gen).to(bf16)
    g_shape = (B, T, HV, D) if per_channel else (B, T, HV)
    # fp32 log decays as the models compute them (-exp(A_log) softplus(...)): mostly mild, some
    # strong
    g = F.logsigmoid(torch.randn(g_shape, device=device, generator=gen) + 3.0).float()
    beta = torch.sigmoid(torch.randn(B, T, HV, device=device, generator=gen)).to(bf16)
    return tuple(t.requires_grad_(True) for t in (q, k, v, g, beta))


def _first(fn: Callable) -> Callable:
    """Only the output o: the benchmarked backward starts from do alone (no dht)."""
    return lambda *args: fn(*args)[0]


def _check(family: str, per_channel: bool, B: int, T: int, HK: int, HV: int, D: int
           ) -> Callable[[torch.device], dict[str, float]]:
    def check(device: torch.device) -> dict[str, float]:
        ours, ref = _ours(family)[1], transformers_fallback(per_channel)
        leaves = make_inputs(per_channel, B, T, HK, HV, D, device, seed=0)
        gen = torch.Generator(device=device).manual_seed(7)
        do = torch.randn(B, T, HV, D, device=device, generator=gen).to(torch.bfloat16)
        o, ht = ours(*leaves)
        grads = torch.autograd.grad(o, leaves, do)
        leaves32 = [x.detach().float().requires_grad_(True) for x in leaves]
        o32, ht32 = ref(*leaves32)
        grads32 = torch.autograd.grad(o32, leaves32, do.float())
        res = {"o": rel_rms(o, o32), "ht": rel_rms(ht, ht32)}
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads32, strict=True):
            res[name] = rel_rms(a, b)
        ok = res["o"] <= O_TOL and all(res[n] <= GRAD_TOL for n in ("dq", "dk", "dv", "dg",
                                                                        "dbeta"))
        res["ok"] = float(ok)
        return res
    return check


def _steps(family: str, per_channel: bool, B: int, T: int, HK: int, HV: int, D: int,
           device: torch.device, fwd_cfgs: tuple = (), bwd_cfgs: tuple = ()) -> dict[str, Step]:
    """The case's rows; ``fwd_cfgs`` / ``bwd_cfgs``: the sweeps' configs as item tuples (hashable,
    for `shared_inputs`)."""
    sets = [make_inputs(per_channel, B, T, HK, HV, D, device, seed=s) for s in range(N_SETS)]
    grads = [torch.randn(B, T, HV, D, device=device, dtype=torch.bfloat16)]
    (mod, ours), eager = _ours(family), transformers_fallback(per_channel)
    steps = {"ours": fwd_bwd(_first(ours), sets, grads), "ours_fwd": fwd_only(ours, sets)}
    for cfg in map(dict, fwd_cfgs):
        steps[sweep_label(cfg) + "_fwd"] = next(iter(fwd_sweep(mod, ours, sets, D, [cfg]).values()))
    for cfg in map(dict, bwd_cfgs):  # the output o only, as the `ours` row
        steps[sweep_label(cfg)] = next(iter(config_sweep(mod, _first(ours), sets, grads, D, [cfg]).values()))
    if not per_channel:
        steps["eager"] = fwd_bwd(_first(eager), sets, grads)
    if not per_channel or T <= KDA_EAGER_MAX_T:
        steps["eager_fwd"] = fwd_only(eager, sets)
    # forward only: compiling the unrolled backward takes minutes
    if T <= COMPILE_MAX_T and not per_channel:
        steps["compile_fwd"] = fwd_only(torch.compile(eager), sets)
    fla = fla_function(per_channel)
    if fla is not None:
        steps["fla"] = fwd_bwd(_first(fla), sets, grads)
        steps["fla_fwd"] = fwd_only(fla, sets)
    return steps


def delta_rule_case(family: str, B: int, T: int, HK: int, HV: int, D: int, note: str = "", *,
                    per_channel: bool, fwd_sweep: tuple[dict, ...] = (),
                    bwd_sweep: tuple[dict, ...] = ()) -> BenchCase:
    """One case of `family`'s ``chunk`` kernel (a [B, T, HV, D] decay when `per_channel`, else
    [B, T, HV]), with the sweep rows of `fwd_sweep` / `bwd_sweep` on request (`sweep_rows`);
    nothing touches a device until the harness calls `setup` or `check`."""
    fwd_cfgs, bwd_cfgs = (tuple(tuple(c.items()) for c in sweep) for sweep in (fwd_sweep, bwd_sweep))
    heads = f"H{HK}" if HK == HV else f"H{HK}/{HV}"
    G = D if per_channel else 1
    # Bytes: q, k, v, beta (bf16) and g (fp32) read in the forward and again in the backward,
    # their gradients written; o written and do read (bf16); ht written (fp32).
    n_in = 2 * B * T * (2 * HK * D + HV * D + HV) + 4 * B * T * HV * G
    n_o = 2 * B * T * HV * D
    min_bytes = 3 * n_in + 2 * n_o + 4 * B * HV * D * D
    # An estimate of the chunked algorithm's matmul work per token and value head (C = chunk):
    # k k^T, q k^T and w = A (beta k) (3 C D); u = A (beta v) and (q k^T) u (2 C D); the state
    # update k^T u and the reads q S, w S (3 D^2). Multiply-adds x2; the backward ~2x forward.
    flops = 3 * 2 * B * T * HV * (5 * CHUNK * D + 3 * D * D)
    return BenchCase(
        family=family, name=f"B{B}T{T}{heads}D{D}",
        shape={"B": B, "T": T, "HK": HK, "HV": HV, "D": D},
        min_bytes=min_bytes, flops=flops,
        setup=lambda device: _steps(family, per_channel, B, T, HK, HV, D, device, fwd_cfgs, bwd_cfgs),
        on_request=sweep_rows(fwd_sweep, bwd_sweep),
        check=None if per_channel and T > KDA_CHECK_MAX_T
        else _check(family, per_channel, B, T, HK, HV, D),
        note=note)
