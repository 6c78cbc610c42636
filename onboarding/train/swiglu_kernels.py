"""The fused routing-weighted SwiGLU of expert parallelism's grouped experts, on CUDA.

`EPExperts` applies each row's routing weight to the SwiGLU activation (``silu(g) * u * w``
for ``h = [g | u]``, `moe_ep._SwiGLUWeighted`). Its torch form is about six elementwise kernels
forward and a row-blocked loop of about six more backward; the swiglu family's `weighted` variant
(`kernel_templates/swiglu/_swiglu_weighted.py.j2`) does each direction in one pass: forward reads
h and w and writes the activation, backward reads h, w and the gradient and writes dh and dw (dw
summed over the row in fp32 inside the kernel, deterministic). `attach_swiglu_kernels` renders it
and attaches it to every plain SwiGLU `EPExperts` whose check passes; the CPU keeps the torch
path (nothing is attached there). Which family variant serves it is the family's say
(`families.lora_kernel(WEIGHTED_ACT_KIND)`, its `lora_variants`): no family is named here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from onboarding.testing.tolerance import rel_rms as _rel

# What the experts' routing-weighted activation is to the families: the kind a family's
# `lora_variants` serves it under (rendered at the variant's default params), and the key of
# the counts. Not an op-graph block kind: expert parallelism's own op, inside the LoRA step.
WEIGHTED_ACT_KIND = "moe.experts.weighted_act"
# bars against the torch path: ours rounds once (fp32 in registers), the torch path after each
# bf16 op; both sit within bf16's few 1e-3 of the exact values
SWIGLU_OUT_TOL, SWIGLU_GRAD_TOL = 1e-2, 2e-2
CHECK_ROWS = 131  # odd, more than one row block


def check_swiglu_kernel(kernel, f: int, dtype: torch.dtype, device, *, w_dtype=None,
                        rows: int = CHECK_ROWS) -> str | None:
    """None when ``kernel(h [rows, 2F], w [rows])`` agrees with `_SwiGLUWeighted` on random
    inputs at width ``f``: the output, dh and dw (relative RMS, `SWIGLU_OUT_TOL` /
    `SWIGLU_GRAD_TOL`), with the same shapes and dtypes; else what differed, or the error the
    kernel raised. Draws from its own generator."""
    from onboarding.train.moe_ep import _SwiGLUWeighted

    gen = torch.Generator(device=device).manual_seed(0)
    h = (2 * torch.randn(rows, 2 * f, device=device, generator=gen)).to(dtype).requires_grad_()
    w = torch.rand(rows, device=device, generator=gen).to(w_dtype or dtype).requires_grad_()
    dy = torch.randn(rows, f, device=device, generator=gen).to(dtype)

    def run(fn):
        y = fn(h, w)
        return y, torch.autograd.grad(y, [h, w], dy)

    ref, ref_grads = run(_SwiGLUWeighted.apply)
    try:
        out, grads = run(kernel)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails here keeps the torch path
        return f"the kernel raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, torch path {tuple(ref.shape)} {ref.dtype}"
    bad = [f"output {_rel(out, ref):.1e}"] if not _rel(out, ref) <= SWIGLU_OUT_TOL else []
    for n, g, want in zip(("h", "w"), grads, ref_grads):
        if g is None or g.shape != want.shape or g.dtype != want.dtype:
            bad.append(f"d {n}: {None if g is None else (tuple(g.shape), g.dtype)}, torch path "
                       f"{(tuple(want.shape), want.dtype)}")
        elif not _rel(g, want) <= SWIGLU_GRAD_TOL:  # `not <=`: NaN fails
            bad.append(f"d {n} {_rel(g, want):.1e}")
    return "; ".join(bad) or None


def attach_swiglu_kernels(ep_mods: list, root: Path, *, rank: int, kernel=None,
                          dtype: torch.dtype | None = None) -> dict[str, int]:
    """Render the family variant serving `WEIGHTED_ACT_KIND` (the swiglu family's `weighted`)
    into ``root/rank<rank>`` and attach its entry
    (`EPExperts.use_swiglu_kernel`) to every plain SwiGLU `EPExperts` (``plain``) that computes
    its experts in torch (no grouped expert LoRA kernel: call this after `attach_expert_kernels`,
    whose kernel applies the routing weight itself) where
    `check_swiglu_kernel` passes (one check per distinct width F; a failure warns and keeps
    `_SwiGLUWeighted`). ``kernel``: another ``swiglu_weighted``-like entry, for tests; ``dtype``:
    the activations' dtype to check in (default: the expert weights'; fp32 with expert LoRA
    on the torch path, whose h is fp32). Call it on CUDA only, as `attach_expert_kernels`: the
    CPU keeps the torch path.

    Returns counts for the step row's ``kernels`` summary: ``moe.experts.weighted_act``
    (attached) and ``rejected:moe.experts.weighted_act``; none when no module is plain SwiGLU on
    the torch path or no family serves the kind."""
    from onboarding.families import lora_kernel

    mods = [m for m in ep_mods if m.plain and m.kernel is None]
    served = lora_kernel(WEIGHTED_ACT_KIND)
    if not mods or (served is None and kernel is None):
        return {}
    if kernel is None:
        from onboarding.generate.templating import load_module, render_to

        kernel = load_module(render_to(root / f"rank{rank}", *served, {})).entry
    ok, rejected = WEIGHTED_ACT_KIND, f"rejected:{WEIGHTED_ACT_KIND}"
    counts = {ok: 0, rejected: 0}
    verdicts: dict[tuple, str | None] = {}
    for m in mods:
        dn = getattr(m, m.down_name)
        f = dn.shape[2]
        dt = dtype or (torch.float32 if m.lora is not None else dn.dtype)
        key = (f, dt, dn.device)
        if key not in verdicts:
            verdicts[key] = check_swiglu_kernel(kernel, f, dt, dn.device)
            if verdicts[key]:
                warnings.warn(f"{m.path}: the weighted SwiGLU kernel differs from the torch path "
                              f"({verdicts[key]}); experts of this width keep the torch path",
                              stacklevel=2)
        if verdicts[key]:
            counts[rejected] += 1
        else:
            m.use_swiglu_kernel(kernel)
            counts[ok] += 1
    return counts
