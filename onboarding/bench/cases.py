"""Benchmark cases per kernel family, at real model shapes, with their anchors.

Each case times one forward + backward step of our rendered kernel (``ours``) against the
PyTorch eager formulation that transformers runs (``eager``), `torch.compile` of it
(``compile``), and Liger-Kernel's op where it is installed (``liger``). ``check`` reports the
bf16 kernel's relative RMS error against an fp32 reference, output and gradients. The
linear-attention families (``gated_delta``, ``kimi_delta``) live in `cases_linear_attention`,
``moe_experts`` and ``lora`` in `cases_moe`, ``grouped_linear`` in `cases_grouped_linear`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from onboarding.bench.harness import BenchCase
from onboarding.templating import load_module, render_to
from onboarding.testing.tolerance import rel_rms as _rel

N_SETS = 3  # input sets to rotate through (each case's set is far larger than the 60 MB L2)


# Where `_kernel` renders from: kernel_templates/ (None), or another revision's templates with a
# tag for their op names (`templates_from`, for `onboarding.bench.revision`).
_TEMPLATES: dict[str, Any] = {"template_dir": None, "tag": None}


@contextlib.contextmanager
def templates_from(template_dir: Path, tag: str):
    """Cases set up inside this block render our kernels from `template_dir`."""
    before = dict(_TEMPLATES)
    _TEMPLATES.update(template_dir=template_dir, tag=tag)
    try:
        yield
    finally:
        _TEMPLATES.update(before)


# Input sets built inside `sharing_inputs` (None outside), by builder and arguments.
_SHARED_INPUTS: dict[tuple, Any] | None = None


@contextlib.contextmanager
def sharing_inputs():
    """Inside this block, a case set up twice (`onboarding.bench.revision`: the tree's kernels and
    another revision's) gets the same input sets from every `shared_inputs` builder: one copy
    in GPU memory (DeepSeek-V3's expert weights alone are 22.5 GB), the same inputs for both."""
    global _SHARED_INPUTS
    before, _SHARED_INPUTS = _SHARED_INPUTS, {}
    try:
        yield
    finally:
        _SHARED_INPUTS = before


def shared_inputs(build: Callable) -> Callable:
    """An input-set builder (hashable arguments) whose results `sharing_inputs` reuses."""
    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        if _SHARED_INPUTS is None:
            return build(*args, **kwargs)
        key = (build.__module__, build.__qualname__, args, tuple(sorted(kwargs.items())))
        if key not in _SHARED_INPUTS:
            _SHARED_INPUTS[key] = build(*args, **kwargs)
        return _SHARED_INPUTS[key]
    return wrapper


def _kernel(family: str, variant: str, params: dict[str, Any] | None = None):
    root = Path(tempfile.mkdtemp(prefix="onboard-bench-"))
    mod = load_module(render_to(root, family, variant, params or {}, **_TEMPLATES))
    from onboarding.patching import entry_function

    return mod, entry_function(mod)


def _fwd_bwd(fn: Callable, sets: list[tuple], grads: list[torch.Tensor]):
    """One forward + backward step on input set i. Gradients come from `autograd.grad`, so no
    step pays for accumulating into `.grad` (which would add a read-modify-write per input)."""
    def step(i: int):
        args = sets[i % len(sets)]
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        # allow_unused: an anchor may own its weight (Liger's RMSNorm module) and ignore ours
        return torch.autograd.grad(outs, leaves, grads[: len(outs)], allow_unused=True)
    return step


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _check(ours: Callable, ref: Callable, make: Callable[[torch.dtype], tuple]
           ) -> Callable[[torch.device], dict[str, float]]:
    """bf16 kernel vs fp32 reference on the same random inputs: outputs and every gradient."""
    def check(device: torch.device) -> dict[str, float]:
        base = make(torch.float32)
        lo = tuple(_leaf(t.to(torch.bfloat16)) if t.is_floating_point() else t for t in base)
        hi = tuple(_leaf(t) if t.is_floating_point() else t for t in base)
        out, exp = ours(*lo), ref(*hi)
        outs = out if isinstance(out, tuple) else (out,)
        exps = exp if isinstance(exp, tuple) else (exp,)
        if len(outs) != len(exps):  # zip would judge only the outputs both have
            raise AssertionError(f"our kernel returned {len(outs)} outputs, the reference "
                                 f"{len(exps)}")
        gen = torch.Generator(device=device).manual_seed(7)
        gs = [torch.randn(e.shape, device=device, generator=gen) for e in exps]
        torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(gs, outs, strict=True)])
        torch.autograd.backward(exps, gs)
        res = {f"out{i}": _rel(o, e) for i, (o, e) in enumerate(zip(outs, exps, strict=True))}
        for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
            if isinstance(a, torch.Tensor) and a.grad is not None:
                res[f"grad{i}"] = _rel(a.grad, b.grad)
        return res
    return check


def _config_sweep(mod, fn: Callable, sets, grads, size: int, configs: list[dict[str, int]]
                  ) -> dict[str, Callable]:
    """Extra ``ours@cfg`` steps, one per config (keys from the module's TUNING_SPACE, the rest
    from its bucket's config); each pins its config for the size's bucket while it runs."""
    bucket = mod.shape_bucket(size)
    base = mod.config_for(size)
    steps = {}
    for cfg in configs:
        full = {**base, **cfg}
        label = "ours@" + ",".join(f"{k}={v}" for k, v in cfg.items())

        def step(i, full=full):
            mod.set_config(full, bucket=bucket)
            try:
                return _fwd_bwd(fn, sets, grads)(i)
            finally:
                mod.set_config(None, bucket=bucket)

        steps[label] = step
    return steps


# The RMSNorm goal shape's sweep: backward rows per step x warps x programs per SM, and forward
# rows per program, around the d_le_4k defaults.
RMSNORM_SWEEP = [
    {"BWD_BLOCK_N": bn, "bwd_warps": w, "programs_per_sm": p}
    for bn in (1, 2, 4) for w in (4, 8) for p in (1, 2, 4, 8)
] + [{"BLOCK_N": bn, "num_warps": w} for bn in (1, 4) for w in (4, 8, 16)]


def _anchors(eager: Callable, ours: Callable, sets, grads, liger: Callable | None):
    steps = {"ours": _fwd_bwd(ours, sets, grads), "eager": _fwd_bwd(eager, sets, grads),
             "compile": _fwd_bwd(torch.compile(eager), sets, grads)}
    if liger is not None:
        steps["liger"] = _fwd_bwd(liger, sets, grads)
    return steps


def rmsnorm_cases() -> list[BenchCase]:
    def eager(x, w, eps=1e-6):  # transformers' RMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    cases = []
    for n, d in ((16384, 4096), (32768, 2048), (8192, 7168)):
        def setup(device, n=n, d=d):
            mod, ours = _kernel("rmsnorm", "plain")
            sets = [(_leaf(torch.randn(n, d, device=device, dtype=torch.bfloat16)),
                     _leaf(1 + 0.1 * torch.randn(d, device=device, dtype=torch.bfloat16)))
                    for _ in range(N_SETS)]
            grads = [torch.randn(n, d, device=device, dtype=torch.bfloat16)]
            liger = None
            try:
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                lmod = LigerRMSNorm(d, eps=1e-6).to(device, torch.bfloat16)
                liger = lambda x, w: lmod(x)  # noqa: E731  (its own weight, same shape)
            except ImportError:
                pass
            steps = _anchors(eager, lambda x, w: ours(x, w, 1e-6), sets, grads, liger)
            if (n, d) == (16384, 4096):  # the goal shape: look at the tile configs too
                steps.update(_config_sweep(mod, lambda x, w: ours(x, w, 1e-6), sets, grads, d,
                                           RMSNORM_SWEEP))
            return steps

        def make(dtype, n=n, d=d):
            g = torch.Generator(device="cuda").manual_seed(0)
            return (torch.randn(n, d, device="cuda", generator=g, dtype=dtype),
                    1 + 0.1 * torch.randn(d, device="cuda", generator=g, dtype=dtype))

        cases.append(BenchCase(
            family="rmsnorm", name=f"{n}x{d}", shape={"N": n, "D": d},
            min_bytes=5 * n * d * 2, flops=0, setup=setup,
            check=lambda device, make=make: _check(
                lambda x, w: _kernel("rmsnorm", "plain")[1](x, w, 1e-6), eager, make)(device)))
    return cases


def swiglu_cases() -> list[BenchCase]:
    def eager(g, u):
        return F.silu(g) * u

    cases = []
    for n, f in ((8192, 14336), (16384, 5632)):
        def setup(device, n=n, f=f):
            _, ours = _kernel("swiglu", "split")
            sets = [tuple(_leaf(torch.randn(n, f, device=device, dtype=torch.bfloat16))
                          for _ in range(2)) for _ in range(N_SETS)]
            grads = [torch.randn(n, f, device=device, dtype=torch.bfloat16)]
            liger = None
            try:
                from liger_kernel.ops.swiglu import LigerSiLUMulFunction

                liger = LigerSiLUMulFunction.apply
            except ImportError:
                pass
            return _anchors(eager, ours, sets, grads, liger)

        def make(dtype, n=n, f=f):
            g = torch.Generator(device="cuda").manual_seed(0)
            return tuple(torch.randn(n, f, device="cuda", generator=g, dtype=dtype)
                         for _ in range(2))

        cases.append(BenchCase(
            family="swiglu", name=f"{n}x{f}", shape={"N": n, "F": f},
            min_bytes=(3 + 3) * n * f * 2, flops=0, setup=setup,
            check=lambda device, make=make: _check(_kernel("swiglu", "split")[1], eager,
                                                   make)(device)))
    return cases


def rope_cases() -> list[BenchCase]:
    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    def eager(q, k, cos, sin):  # transformers' apply_rotary_pos_emb on [B, T, H, D]
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    cases = []
    for b, t, h, hk, d in ((1, 8192, 32, 8, 128), (4, 4096, 16, 2, 256)):
        def setup(device, b=b, t=t, h=h, hk=hk, d=d):
            _, ours = _kernel("rope", "half")
            sets = []
            for _ in range(N_SETS):
                theta = torch.rand(t, d, device=device) * 10
                sets.append((_leaf(torch.randn(b, t, h, d, device=device, dtype=torch.bfloat16)),
                             _leaf(torch.randn(b, t, hk, d, device=device,
                                               dtype=torch.bfloat16)),
                             theta.cos().to(torch.bfloat16), theta.sin().to(torch.bfloat16)))
            grads = [torch.randn(b, t, h, d, device=device, dtype=torch.bfloat16),
                     torch.randn(b, t, hk, d, device=device, dtype=torch.bfloat16)]
            liger = None
            try:
                from liger_kernel.ops.rope import LigerRopeFunction

                def liger(q, k, cos, sin):  # Liger wants [B, H, T, D] and [1, T, D] tables
                    oq, ok = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2),
                                                     cos[None], sin[None])
                    return oq.transpose(1, 2), ok.transpose(1, 2)
            except ImportError:
                pass
            return _anchors(eager, ours, sets, grads, liger)

        def make(dtype, b=b, t=t, h=h, hk=hk, d=d):
            g = torch.Generator(device="cuda").manual_seed(0)
            theta = torch.rand(t, d, device="cuda", generator=g) * 10
            return (torch.randn(b, t, h, d, device="cuda", generator=g, dtype=dtype),
                    torch.randn(b, t, hk, d, device="cuda", generator=g, dtype=dtype),
                    theta.cos().to(dtype), theta.sin().to(dtype))

        cases.append(BenchCase(
            family="rope", name=f"B{b}T{t}H{h}/{hk}D{d}",
            shape={"B": b, "T": t, "H": h, "Hk": hk, "D": d},
            min_bytes=2 * 2 * b * t * (h + hk) * d * 2, flops=0, setup=setup,
            check=lambda device, make=make: _check(_kernel("rope", "half")[1], eager,
                                                   make)(device)))
    return cases


def conv1d_cases() -> list[BenchCase]:
    def eager(x, w, bias):  # what transformers' torch fallback does, on [B, T, C]
        k = w.shape[-1]
        y = F.conv1d(x.transpose(1, 2), w[:, None, :], bias, padding=k - 1,
                     groups=w.shape[0])[..., : x.shape[1]]
        return y.transpose(1, 2)

    cases = []
    for b, t, c, k in ((2, 4096, 8192, 4), (1, 8192, 12288, 4)):
        def setup(device, b=b, t=t, c=c, k=k):
            _, ours = _kernel("conv1d", "causal", {"kernel_size": k})
            sets = [(_leaf(torch.randn(b, t, c, device=device, dtype=torch.bfloat16)),
                     _leaf(0.5 * torch.randn(c, k, device=device, dtype=torch.bfloat16)),
                     _leaf(torch.randn(c, device=device, dtype=torch.bfloat16)))
                    for _ in range(N_SETS)]
            grads = [torch.randn(b, t, c, device=device, dtype=torch.bfloat16)]
            return _anchors(eager, ours, sets, grads, None)

        def make(dtype, b=b, t=t, c=c, k=k):
            g = torch.Generator(device="cuda").manual_seed(0)
            return (torch.randn(b, t, c, device="cuda", generator=g, dtype=dtype),
                    0.5 * torch.randn(c, k, device="cuda", generator=g, dtype=dtype),
                    torch.randn(c, device="cuda", generator=g, dtype=dtype))

        cases.append(BenchCase(
            family="conv1d", name=f"B{b}T{t}C{c}W{k}", shape={"B": b, "T": t, "C": c, "W": k},
            min_bytes=5 * b * t * c * 2, flops=2 * 2 * b * t * c * k * 2, setup=setup,
            check=lambda device, make=make, k=k: _check(
                _kernel("conv1d", "causal", {"kernel_size": k})[1], eager, make)(device)))
    return cases


def gated_delta_cases() -> list[BenchCase]:
    # Imported on use: cases_linear_attention imports the helpers above from this module.
    from onboarding.bench.cases_linear_attention import gated_delta_cases as cases

    return cases()


def kimi_delta_cases() -> list[BenchCase]:
    from onboarding.bench.cases_linear_attention import kimi_delta_cases as cases

    return cases()


def moe_experts_cases() -> list[BenchCase]:
    from onboarding.bench.cases_moe import moe_experts_cases as cases

    return cases()


def lora_cases() -> list[BenchCase]:
    from onboarding.bench.cases_moe import lora_cases as cases

    return cases()


def grouped_linear_cases() -> list[BenchCase]:
    from onboarding.bench.cases_grouped_linear import grouped_linear_cases as cases

    return cases()


def sparse_attention_cases() -> list[BenchCase]:
    from onboarding.bench.cases_sparse import sparse_attention_cases as cases

    return cases()


CASES: dict[str, Callable[[], list[BenchCase]]] = {
    "rmsnorm": rmsnorm_cases, "swiglu": swiglu_cases, "rope": rope_cases,
    "conv1d": conv1d_cases, "gated_delta": gated_delta_cases, "kimi_delta": kimi_delta_cases,
    "moe_experts": moe_experts_cases, "lora": lora_cases, "grouped_linear": grouped_linear_cases,
    "sparse_attention": sparse_attention_cases,
}


def cases_for(families: list[str] | None = None) -> list[BenchCase]:
    names = families or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        from onboarding.errors import InputError

        raise InputError(f"no benchmark cases for {unknown}; known: {sorted(CASES)}")
    return [c for n in names for c in CASES[n]()]


def select_cases(cases: list[BenchCase], names: list[str] | None = None,
                 impls: list[str] | None = None) -> list[BenchCase]:
    """Cases whose name contains one of `names`, timing only `impls` ("ours@<tiles>" rows count
    as "ours"); None keeps everything. Nothing left to run is an InputError."""
    from onboarding.errors import InputError

    picked = [c for c in cases if not names or any(n in c.name for n in names)]
    if not picked:
        raise InputError(f"no benchmark case matches {names}; cases: {[c.name for c in cases]}")
    if not impls:
        return picked
    keep = set(impls)

    def only(setup):
        return lambda device: {k: v for k, v in setup(device).items() if k.split("@")[0] in keep}

    return [dataclasses.replace(c, setup=only(c.setup)) for c in picked]
