"""What every family's benchmark cases share: rendering our kernel, input sets, timed steps,
the bf16-vs-fp32 check, and picking cases.

A family's cases live in its folder (`kernel_templates/<family>/bench.py`, the spec's
`bench_cases` hook): each times one forward (+ backward) step of our rendered kernel (``ours``)
against anchors such as the PyTorch eager formulation that transformers runs (``eager``),
`torch.compile` of it (``compile``) and Liger-Kernel's op where it is installed (``liger``).
``check`` reports the bf16 kernel's relative RMS error against an fp32 reference, output and
gradients. Builders several families share live here and in `cases_linear_attention` (the
delta-rule cases).
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

from onboarding.bench.harness import BenchCase, Step
from onboarding.errors import InputError
from onboarding.families import families
from onboarding.generate.templating import load_module, render_to
from onboarding.testing.tolerance import rel_rms

N_SETS = 3  # input sets to rotate through (each case's set is far larger than the 60 MB L2)


# Where `kernel` renders from: kernel_templates/ (None), or another revision's templates with a
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


# Where `kernel` renders (None: a new folder under the system's temp dir; `dry_rows` points it at
# a folder it removes afterwards).
_RENDER_DIR: str | None = None


def kernel(family: str, variant: str, params: dict[str, Any] | None = None):
    root = Path(tempfile.mkdtemp(prefix="onboard-bench-", dir=_RENDER_DIR))
    mod = load_module(render_to(root, family, variant, params or {}, **_TEMPLATES))
    from onboarding.patching.core import entry_function

    return mod, entry_function(mod)


def fwd_bwd(fn: Callable, sets: list[tuple], grads: list[torch.Tensor]):
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


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def bf16_check(ours: Callable, ref: Callable, make: Callable[[torch.dtype], tuple]
           ) -> Callable[[torch.device], dict[str, float]]:
    """bf16 kernel vs fp32 reference on the same random inputs: outputs and every gradient."""
    def check(device: torch.device) -> dict[str, float]:
        base = make(torch.float32)
        lo = tuple(leaf(t.to(torch.bfloat16)) if t.is_floating_point() else t for t in base)
        hi = tuple(leaf(t) if t.is_floating_point() else t for t in base)
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
        res = {f"out{i}": rel_rms(o, e) for i, (o, e) in enumerate(zip(outs, exps, strict=True))}
        for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
            if isinstance(a, torch.Tensor) and a.grad is not None:
                res[f"grad{i}"] = rel_rms(a.grad, b.grad)
        return res
    return check


def _pinned(mod, bucket: str, full: dict, step: Step) -> Step:
    """`step` with `full` pinned for `bucket` while it runs. The bucket's own pin from before (a
    tuned config `apply_tuned` set) is put back after, not cleared: `set_config(None, bucket)`
    alone would drop it for every row timed later."""
    def run(i: int):
        prev = mod._TUNED.get(bucket)
        mod.set_config(full, bucket=bucket)
        try:
            return step(i)
        finally:
            mod.set_config(prev, bucket=bucket)
    return run


def _sweep(mod, size: int, configs: list[dict], step: Step) -> dict[str, Step]:
    """``ours@cfg`` rows of `step`, one per config (keys from the module's TUNING_SPACE, the rest
    from the size's bucket), each pinning its config for that bucket while it runs (`_pinned`)."""
    bucket, base = mod.shape_bucket(size), mod.config_for(size)
    return {"ours@" + ",".join(f"{k}={v}" for k, v in cfg.items()): _pinned(mod, bucket, {**base, **cfg}, step)
            for cfg in configs}


def config_sweep(mod, fn: Callable, sets, grads, size: int, configs: list[dict[str, int]]
                 ) -> dict[str, Callable]:
    """Extra forward + backward ``ours@cfg`` steps (`_sweep`)."""
    return _sweep(mod, size, configs, fwd_bwd(fn, sets, grads))


def anchors(eager: Callable, ours: Callable, sets, grads, liger: Callable | None):
    steps = {"ours": fwd_bwd(ours, sets, grads), "eager": fwd_bwd(eager, sets, grads),
             "compile": fwd_bwd(torch.compile(eager), sets, grads)}
    if liger is not None:
        steps["liger"] = fwd_bwd(liger, sets, grads)
    return steps


def fwd_only(fn: Callable, sets: list[tuple]) -> Step:
    """A forward step on input set i, under `torch.no_grad`."""
    def step(i: int):
        with torch.no_grad():
            return fn(*sets[i % len(sets)])
    return step


def fwd_sweep(mod, fn: Callable, sets, size: int, configs: list[dict]) -> dict[str, Step]:
    """Forward-only ``ours@cfg`` steps (`_sweep`)."""
    return _sweep(mod, size, configs, fwd_only(fn, sets))


def routing(kind: str, n: int, e: int, k: int, device: torch.device,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_indices [n, k] (distinct experts per token) and routing weights [n, k] summing to 1:
    ``uniform``, or ``zipf`` (expert popularity ~ 1/rank)."""
    if kind == "zipf":
        probs = 1.0 / torch.arange(1, e + 1, device=device, dtype=torch.float32)
        probs = probs[torch.randperm(e, device=device, generator=gen)]  # popular experts anywhere
    else:
        probs = torch.ones(e, device=device)
    idx = torch.multinomial(probs.expand(n, e), k, replacement=False, generator=gen)
    w = torch.rand(n, k, device=device, generator=gen) + 0.05
    return idx, w / w.sum(-1, keepdim=True)


@contextlib.contextmanager
def _meta_generators():
    """`torch.Generator(device="meta")` raises, and cases seed their inputs with one: while a case
    is built on the meta device, a CPU generator stands in (a meta tensor draws nothing)."""
    real = torch.Generator

    class Generator(real):  # a type, as torch's own isinstance checks need
        def __new__(cls, device="cpu"):
            return real("cpu") if torch.device(device).type == "meta" else real(device)

    torch.Generator = Generator
    try:
        yield
    finally:
        torch.Generator = real


def dry_rows(case: BenchCase) -> tuple[list[str] | None, str]:
    """The implementation rows `case.setup` returns (sweeps and anchors included, in its order),
    found without a GPU: the case is built on PyTorch's meta device (shapes, no data, nothing
    run; our kernels rendered into a folder removed afterwards). (None, why) when its setup
    cannot run there (an op whose output shape depends on data, such as `bincount`)."""
    global _RENDER_DIR
    before = _RENDER_DIR
    with tempfile.TemporaryDirectory(prefix="onboard-bench-list-") as tmp, _meta_generators():
        _RENDER_DIR = tmp
        try:
            return list(case.setup(torch.device("meta"))), ""
        except Exception as exc:  # noqa: BLE001 - any failure: rows known only on a GPU
            first = (str(exc).splitlines() or [""])[0]
            return None, f"{type(exc).__name__}: {first[:72]}{'...' if len(first) > 72 else ''}"
        finally:
            _RENDER_DIR = before


def cases_for(names: list[str] | None = None) -> list[BenchCase]:
    """The benchmark cases of the families `names` (default: every family that has some), from
    each family's `bench_cases()` hook (no arguments; returns its `BenchCase` list)."""
    hooks = {n: f.bench_cases for n, f in families().items() if f.bench_cases is not None}
    names = names or list(hooks)
    unknown = [n for n in names if n not in hooks]
    if unknown:
        raise InputError(f"no benchmark cases for {unknown}; known: {sorted(hooks)}")
    return [c for n in names for c in hooks[n]()]


def name_matches(pattern: str, name: str) -> bool:
    """`pattern` in `name`; ``^PAT`` only at its start, ``PAT$`` only at its end, ``^PAT$`` the
    whole name (``.../fwd$`` picks the forward case without the ``.../fwdbwd`` one)."""
    start, end = pattern.startswith("^"), pattern.endswith("$") and len(pattern) > 1
    core = pattern[1 if start else 0:len(pattern) - 1 if end else None]
    if start and end:
        return name == core
    if start:
        return name.startswith(core)
    if end:
        return name.endswith(core)
    return core in name


def split_impls(text: str | None) -> list[str] | None:
    """`--impl`'s list: names split at commas, except that a sweep row's own ``key=value`` pairs
    (``ours@BLOCK_M=64,num_warps=8``) stay with it: a piece with "=" and no "@" continues the
    sweep row before it."""
    if not text:
        return None
    out: list[str] = []
    for piece in text.split(","):
        if out and "@" in out[-1] and "=" in piece and "@" not in piece:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def select_cases(cases: list[BenchCase], names: list[str] | None = None,
                 impls: list[str] | None = None) -> list[BenchCase]:
    """Cases whose name contains one of `names` (a name may be anchored: a leading ``^`` matches
    the start of the case name, a trailing ``$`` its end, both the whole name), timing only
    `impls` ("ours@<tiles>" rows count as "ours", and each runs too when named itself); None
    keeps everything but the cases' ``on_request`` impls, which run only when `impls` names them.
    Nothing left to run is an InputError."""
    picked = [c for c in cases if not names or any(name_matches(n, c.name) for n in names)]
    if not picked:
        raise InputError(f"no benchmark case matches {names}; cases: {[c.name for c in cases]}")
    if not impls:
        return picked
    keep = set(impls)

    def only(setup):
        return lambda device: {k: v for k, v in setup(device).items() if k in keep or k.split("@")[0] in keep}

    return [dataclasses.replace(c, setup=only(c.setup),
                                on_request=tuple(i for i in c.on_request if i not in keep))
            for c in picked]
