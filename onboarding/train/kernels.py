"""Onboard kernels inside the training model: render, check on this device, patch by structure.

Rank 0 renders a candidate for every coverable block of the op graph into
``<out>/train/kernels/`` and checks each against its reference on the device (forward and every
gradient); the other ranks wait and load the verdicts. Only passing candidates are patched, with
the same structural patcher that alignment uses, and every patch calibrates on its first call.
Blocks that expert parallelism owns (``moe.experts``, and the router whose outputs it taps) are
left to it, except experts written as a list of per-expert MLPs (``layout: module_list``), which it
never replaces: those get the stacked-weights patch alignment uses. `attach_expert_kernels` then
gives its modules with expert LoRA the grouped expert LoRA kernel, checked against the module's
own torch path.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from onboarding.graph.opgraph import OpGraph
from onboarding.testing.tolerance import rel_rms as _rel

EP_OWNED = frozenset({"moe.experts", "moe.router"})


def patch_kernels(model: nn.Module, graph: OpGraph, root: Path, *, rank: int,
                  distributed: bool, exclude: frozenset[str] = EP_OWNED):
    """Patch passing candidates into ``model``; returns the `PatchSet`."""
    from onboarding.generate.candidates import (check_candidate, kernels_for, load_candidates,
                                     render_candidates, save_candidates)
    from onboarding.patching.core import patch_model
    from onboarding.coverage import build_coverage

    coverage = build_coverage(graph)
    verdicts = root / "candidates.json"
    if rank == 0 and not verdicts.exists():  # a resumed run keeps the first run's verdicts
        cands = [check_candidate(c, c.shapes) for c in render_candidates(coverage, root)]
        save_candidates(cands, verdicts)
    if distributed:
        dist.barrier()
    cands = load_candidates(verdicts)
    # Experts written as a list of per-expert MLPs are never expert parallelism's (it keeps the
    # model's own list, or refuses): they are patched here, member by member, as in alignment.
    blocks = [b for b in graph.blocks if b.kind not in exclude or _member_experts(b)]
    return patch_model(model, replace(graph, blocks=blocks), kernels_for(coverage, cands))


def _member_experts(block) -> bool:
    return block.kind == "moe.experts" and block.attrs.get("layout") == "module_list"


def summary(patches) -> dict[str, int]:
    """Active patches per block kind, and how many were rejected."""
    out: dict[str, int] = {}
    for r in patches.records:
        key = r.kind if r.status == "active" else f"{r.status}:{r.kind}"
        out[key] = out.get(key, 0) + 1
    return out


# bf16 bars of the experts-kernel check: two bf16 paths (ours and torch's grouped GEMMs), each
# within the families' 5e-3 / 1e-2 relative RMS of an fp32 reference
EXPERTS_OUT_TOL, EXPERTS_GRAD_TOL = 1e-2, 2e-2


def check_experts_kernel(module, kernel) -> str | None:
    """None when ``module`` (an `EPExperts`) computes the same through ``kernel`` as through its
    torch path on a random batch at its real widths: the output and the gradients of x and of
    every expert LoRA tensor (set to random values for the check, B included, then restored);
    else what differed."""
    dev = getattr(module, module.gate_up_name).device
    dtype = getattr(module, module.gate_up_name).dtype
    width = getattr(module, module.gate_up_name).shape[2]
    gen = torch.Generator(device=dev).manual_seed(0)
    counts = [(37 * e + 11) % 97 if e else 0 for e in range(module.n_local)]  # expert 0 empty
    x = torch.randn(sum(counts), width, device=dev, generator=gen).to(dtype).requires_grad_()
    lora = module.lora_parameters()
    kept = [p.detach().clone() for p in lora]
    with torch.no_grad():
        for p in lora:
            p.copy_(torch.randn(p.shape, device=dev, generator=gen) * p.shape[-1] ** -0.5)
    dy = None

    def run(fn):
        nonlocal dy
        module.kernel = fn
        y = module._compute(x, counts)
        dy = torch.randn(y.shape, device=dev, generator=gen).to(y.dtype) if dy is None else dy
        return y, torch.autograd.grad(y, [x, *lora], dy)

    try:
        ref, ref_grads = run(None)
        out, grads = run(kernel)
    finally:
        module.kernel = None
        with torch.no_grad():
            for p, k in zip(lora, kept):
                p.copy_(k)
    bad = [f"output {_rel(out, ref):.1e}"] if _rel(out, ref) > EXPERTS_OUT_TOL else []
    names = ["x"] + [n for n, _ in zip(("A_gate_up", "B_gate_up", "A_down", "B_down"), lora)]
    bad += [f"d {n} {_rel(g, r):.1e}" for n, g, r in zip(names, grads, ref_grads) if _rel(g, r) > EXPERTS_GRAD_TOL]
    return "; ".join(bad) or None


def attach_expert_kernels(ep_mods: list, root: Path, *, rank: int) -> dict[str, int]:
    """Render the family variant that serves ``moe.experts`` with LoRA (`families.lora_kernel`:
    the experts family's `swiglu_lora`) into ``root/rank<rank>`` and attach its grouped expert
    LoRA kernel (pre-sorted rows) to every plain SwiGLU `EPExperts` with expert LoRA whose check
    passes (one check per distinct widths and rank; `check_experts_kernel`). Experts without
    expert LoRA keep torch._grouped_mm: attaching the routed experts kernel did not change the
    step (H200, ninth session, `--proxy small` qwen3_next: 61,267 tokens/s with it, 61,921
    without, on two machines) while its backward still computed the base-weight gradients that
    frozen experts do not need. It skips them since template version 11: alone, its frozen-expert
    fwd+bwd then beats argsort + torch._grouped_mm 1.30-1.31x (eleventh session, `onboard bench
    --family moe_experts`, `fwdbwd_frozen` rows); not yet timed inside a training step here.
    Returns counts for the summary: ``moe.experts`` (attached) and ``rejected:moe.experts``;
    none when no module has expert LoRA or no family offers the kernel."""
    import warnings

    from onboarding.families import lora_kernel
    from onboarding.generate.templating import load_module, render_to

    lora_mods = [m for m in ep_mods if m.plain and m.lora is not None]
    served = lora_kernel("moe.experts")
    if not lora_mods or served is None:
        return {}
    grouped = load_module(render_to(root / f"rank{rank}", *served, {})).grouped_experts_lora
    verdicts: dict[tuple, str | None] = {}
    counts = {"moe.experts": 0, "rejected:moe.experts": 0}
    for m in lora_mods:
        key = (tuple(getattr(m, m.gate_up_name).shape), tuple(getattr(m, m.down_name).shape), m.lora.rank)
        if key not in verdicts:
            verdicts[key] = check_experts_kernel(m, grouped)
            if verdicts[key]:
                warnings.warn(f"{m.path}: the experts kernel differs from the torch path "
                              f"({verdicts[key]}); these experts keep the torch path", stacklevel=2)
        if verdicts[key]:
            counts["rejected:moe.experts"] += 1
        else:
            m.use_kernel(grouped)
            counts["moe.experts"] += 1
    return counts


# What training's `LoRALinear` layers are to the families (`families.lora_kernel`: the family and
# variant that serve them, rendered at its default params) and the key of their counts: the lora
# family's fused linear + low-rank adapter (base GEMMs in cuBLAS, the rank-r term in one Triton
# kernel per pass).
LORA_LINEAR_KIND = "lora.linear"
# bf16 bars of the LoRA-kernel check (as the experts'): the fused path rounds A and B to bf16 as
# dot operands and dA, dB to bf16 results; the torch path computes the adapter term in fp32
LORA_OUT_TOL, LORA_GRAD_TOL = 1e-2, 2e-2
LORA_CHECK_ROWS = 131  # rows of the check's batch: odd, more than one row tile


def check_lora_kernel(module, kernel, *, rows: int = LORA_CHECK_ROWS) -> str | None:
    """None when ``module`` (a `LoRALinear`) computes the same through ``kernel`` as through its
    torch path (`LoRALinear.compute`) on ``rows`` random rows at its real widths, with its real
    base weight and bias and random fp32 A and B (fresh tensors: the module's adapters are not
    touched; B scaled so the adapter term is as large as the base's): the output and the
    gradients of x, A and B (`LORA_OUT_TOL`, `LORA_GRAD_TOL`, relative RMS); else what differed,
    or the error the kernel raised. Draws from its own generator (the global RNG is untouched)."""
    w = module.base.weight
    dev, dtype = w.device, w.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    r, s = module.rank, module.scaling
    x = torch.randn(rows, module.in_features, device=dev, generator=gen).to(dtype).requires_grad_()
    a = (torch.randn(r, module.in_features, device=dev, generator=gen)
         * module.in_features ** -0.5).requires_grad_()
    b = (torch.randn(module.out_features, r, device=dev, generator=gen)
         / (r ** 0.5 * max(abs(s), 1e-12))).requires_grad_()
    dy = None

    def run(fn):
        nonlocal dy
        y = module.compute(x, a, b, fn)
        dy = torch.randn(y.shape, device=dev, generator=gen).to(y.dtype) if dy is None else dy
        return y, torch.autograd.grad(y, [x, a, b], dy)

    ref, ref_grads = run(None)
    try:
        out, grads = run(kernel)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails here keeps the torch path
        return f"the kernel raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, torch path {tuple(ref.shape)} {ref.dtype}"
    bad = [f"output {_rel(out, ref):.1e}"] if not _rel(out, ref) <= LORA_OUT_TOL else []
    for n, g, want in zip(("x", "A", "B"), grads, ref_grads):
        if g is None or g.shape != want.shape or g.dtype != want.dtype:
            bad.append(f"d {n}: {None if g is None else (tuple(g.shape), g.dtype)}, torch path "
                       f"{(tuple(want.shape), want.dtype)}")
        elif not _rel(g, want) <= LORA_GRAD_TOL:  # `not <=`: NaN fails
            bad.append(f"d {n} {_rel(g, want):.1e}")
    return "; ".join(bad) or None


def attach_lora_kernels(model: nn.Module, root: Path, *, rank: int, kernel=None,
                        dtypes=None) -> dict[str, int]:
    """Give every `LoRALinear` of ``model`` the fused kernel of the family variant that serves
    `LORA_LINEAR_KIND` (`families.lora_kernel`: the lora family's `linear`, rendered into
    ``root/rank<rank>`` and loaded; ``kernel``: another ``lora_linear``-like entry, for tests)
    where it passes `check_lora_kernel` (one check per distinct widths, rank, scaling,
    dtype and bias; a failure warns and keeps the torch path). Layers the kernel cannot serve
    (`LoRALinear.kernel_refusal`: dropout, a base dtype outside ``dtypes``, default
    `lora.KERNEL_DTYPES`) keep the torch path with a warning saying why. Called on CUDA only
    (`worker.prepare`): the CPU keeps `_LoRADelta`.

    Returns counts for the step row's ``kernels`` summary: ``lora.linear`` (attached),
    ``rejected:lora.linear`` (the check failed) and ``rejected:lora.linear (<why>)`` per reason
    the kernel was not tried; none when the model has no `LoRALinear` or no family serves it."""
    import warnings

    from onboarding.families import lora_kernel
    from onboarding.train.lora import KERNEL_DTYPES, LoRALinear

    mods = [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    served_by = lora_kernel(LORA_LINEAR_KIND)
    if not mods:
        return {}
    if served_by is None and kernel is None:
        warnings.warn(f"no kernel family serves {LORA_LINEAR_KIND} (`lora_variants`): the "
                      f"{len(mods)} LoRA layers keep the torch path", stacklevel=2)
        return {}
    dtypes = KERNEL_DTYPES if dtypes is None else tuple(dtypes)
    kind = LORA_LINEAR_KIND
    counts = {kind: 0, f"rejected:{kind}": 0}
    served = []
    for path, m in mods:
        why = m.kernel_refusal(dtypes=dtypes)
        if why:
            key = f"rejected:{kind} ({why.split(' (')[0]})"
            if key not in counts:
                warnings.warn(f"{path}: LoRA keeps the torch path: {why}", stacklevel=2)
            counts[key] = counts.get(key, 0) + 1
        else:
            served.append((path, m))
    if served and kernel is None:
        from onboarding.generate.templating import load_module, render_to

        kernel = load_module(render_to(root / f"rank{rank}", *served_by, {})).entry
    verdicts: dict[tuple, str | None] = {}
    for path, m in served:
        w = m.base.weight
        key = (tuple(w.shape), w.dtype, m.rank, m.scaling, m.base.bias is not None)
        if key not in verdicts:
            verdicts[key] = check_lora_kernel(m, kernel)
            if verdicts[key]:
                warnings.warn(f"{path}: the LoRA kernel differs from the torch path "
                              f"({verdicts[key]}); LoRA layers of this shape keep the torch path",
                              stacklevel=2)
        if verdicts[key]:
            counts[f"rejected:{kind}"] += 1
        else:
            m.use_kernel(kernel)
            counts[kind] += 1
    return counts
