"""Onboard kernels inside the training model: render, check on this device, patch by structure.

Rank 0 renders a candidate for every coverable block of the op graph into
``<out>/train/kernels/`` and checks each against its reference on the device (forward and every
gradient); the other ranks wait and load the verdicts. Only passing candidates are patched, with
the same structural patcher that alignment uses, and every patch calibrates on its first call.
Blocks that expert parallelism owns (``moe.experts``, and the router whose outputs it taps) are
left to it, except experts written as a list of per-expert MLPs (``layout: module_list``), which it
never replaces: those get the stacked-weights patch alignment uses. `attach_expert_kernels` then
gives its modules with expert LoRA the grouped expert LoRA kernel, checked against the module's
own torch path, `attach_lora_kernels` gives training's LoRA layers the lora family's fused kernel,
`attach_swiglu_kernels` gives the other plain SwiGLU experts the fused routing-weighted
activation, `attach_pair_sum_kernels` gives every expert-parallel module a one-pass sum of each
token's k rows (its combine and its token gather's backward), and `attach_loss_kernel` gives the
training loss a fused cross-entropy kernel; each is checked against the torch path it replaces,
once per shape.
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


# bf16 bars of every check here (`compare_paths`): two bf16 paths (ours and the torch path it
# replaces), each within the families' 5e-3 / 1e-2 relative RMS of an fp32 reference; the LoRA
# kernel rounds A and B as dot operands and dA, dB as results, the weighted SwiGLU rounds once
# where the torch path rounds after each bf16 op: each a few 1e-3 from the exact values
CHECK_OUT_TOL, CHECK_GRAD_TOL = 1e-2, 2e-2
CHECK_ROWS = 131  # rows of the LoRA and SwiGLU checks' batches: odd, more than one row tile


def compare_paths(out, ref, grads, ref_grads, names, *, out_tol: float = CHECK_OUT_TOL,
                  grad_tol: float = CHECK_GRAD_TOL) -> str | None:
    """None when a kernel's output and gradients (``grads``, named ``names``) agree with the
    torch path's (``ref``, ``ref_grads``): the same shapes and dtypes, within ``out_tol`` /
    ``grad_tol`` relative RMS (NaN fails); else what differed."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, torch path {tuple(ref.shape)} {ref.dtype}"
    bad = [f"output {_rel(out, ref):.1e}"] if not _rel(out, ref) <= out_tol else []
    for n, g, want in zip(names, grads, ref_grads):
        if g is None or g.shape != want.shape or g.dtype != want.dtype:
            bad.append(f"d {n}: {None if g is None else (tuple(g.shape), g.dtype)}, torch path "
                       f"{(tuple(want.shape), want.dtype)}")
        elif not _rel(g, want) <= grad_tol:  # `not <=`: NaN fails
            bad.append(f"d {n} {_rel(g, want):.1e}")
    return "; ".join(bad) or None


def compare_runs(run, torch_path, kernel, names) -> str | None:
    """A check's verdict: ``run(fn)`` -> (output, gradients) once through ``torch_path`` and once
    through ``kernel``, compared by `compare_paths` (gradients named ``names``); the error's type
    and first line when the kernel raised."""
    ref, ref_grads = run(torch_path)
    try:
        out, grads = run(kernel)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails here keeps the torch path
        return f"the kernel raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return compare_paths(out, ref, grads, ref_grads, names)


def load_training_variant(served: tuple[str, str], root: Path, rank: int):
    """The family variant ``served`` (`families.training_kernel`'s (family, variant)) rendered at
    its default params into ``root/rank<rank>`` and loaded."""
    from onboarding.generate.templating import load_module, render_to

    return load_module(render_to(root / f"rank{rank}", *served, {}))


def attach_checked(items, *, kind: str, key, check, attach, what: str,
                   counts: dict[str, int] | None = None) -> dict[str, int]:
    """For each ``(path, module)`` of ``items``: ``check(module)`` once per ``key(module)`` (None
    = passed, else what differed; a failure warns once, naming ``what``, and the modules of that
    key keep their torch path), then ``attach(module)`` where it passed. Returns ``counts``
    (default empty) with ``kind`` and ``rejected:<kind>`` added: the step row's summary."""
    import warnings

    counts = dict(counts or {})
    counts.setdefault(kind, 0)
    counts.setdefault(f"rejected:{kind}", 0)
    verdicts: dict = {}
    for path, m in items:
        k = key(m)
        if k not in verdicts:
            verdicts[k] = check(m)
            if verdicts[k]:
                warnings.warn(f"{path}: the {what} kernel differs from the torch path "
                              f"({verdicts[k]}); these keep the torch path", stacklevel=3)
        if verdicts[k]:
            counts[f"rejected:{kind}"] += 1
        else:
            attach(m)
            counts[kind] += 1
    return counts


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
    names = ["x"] + [n for n, _ in zip(("A_gate_up", "B_gate_up", "A_down", "B_down"), lora)]
    return compare_paths(out, ref, grads, ref_grads, names)


def attach_expert_kernels(ep_mods: list, root: Path, *, rank: int) -> dict[str, int]:
    """Render the family variant that serves ``moe.experts`` with LoRA (`families.training_kernel`:
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
    from onboarding.families import training_kernel

    lora_mods = [m for m in ep_mods if m.plain and m.lora is not None]
    served = training_kernel("moe.experts")
    if not lora_mods or served is None:
        return {}
    grouped = load_training_variant(served, root, rank).grouped_experts_lora
    return attach_checked(
        [(m.path, m) for m in lora_mods], kind="moe.experts", what="experts",
        key=lambda m: (tuple(getattr(m, m.gate_up_name).shape), tuple(getattr(m, m.down_name).shape),
                       m.lora.rank),
        check=lambda m: check_experts_kernel(m, grouped), attach=lambda m: m.use_kernel(grouped))


# What training's `LoRALinear` layers are to the families (`families.training_kernel`: the family and
# variant that serve them, rendered at its default params) and the key of their counts: the lora
# family's fused linear + low-rank adapter (base GEMMs in cuBLAS, the rank-r term in one Triton
# kernel per pass).
LORA_LINEAR_KIND = "lora.linear"


def check_lora_kernel(module, kernel, *, rows: int = CHECK_ROWS) -> str | None:
    """None when ``module`` (a `LoRALinear`) computes the same through ``kernel`` as through its
    torch path (`LoRALinear.compute`) on ``rows`` random rows at its real widths, with its real
    base weight and bias and random fp32 A and B (fresh tensors: the module's adapters are not
    touched; B scaled so the adapter term is as large as the base's): the output and the
    gradients of x, A and B (`compare_paths`); else what differed,
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

    return compare_runs(run, None, kernel, ("x", "A", "B"))


def attach_lora_kernels(model: nn.Module, root: Path, *, rank: int, kernel=None,
                        dtypes=None) -> dict[str, int]:
    """Give every `LoRALinear` of ``model`` the fused kernel of the family variant that serves
    `LORA_LINEAR_KIND` (`families.training_kernel`: the lora family's `linear`, rendered into
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

    from onboarding.families import training_kernel
    from onboarding.train.lora import KERNEL_DTYPES, LoRALinear

    mods = [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    served_by = training_kernel(LORA_LINEAR_KIND)
    if not mods:
        return {}
    if served_by is None and kernel is None:
        warnings.warn(f"no kernel family serves {LORA_LINEAR_KIND} (`training_variants`): the "
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
        kernel = load_training_variant(served_by, root, rank).entry
    return attach_checked(
        served, kind=kind, what="LoRA", counts=counts,
        key=lambda m: (tuple(m.base.weight.shape), m.base.weight.dtype, m.rank, m.scaling,
                       m.base.bias is not None),
        check=lambda m: check_lora_kernel(m, kernel), attach=lambda m: m.use_kernel(kernel))


# What the experts' routing-weighted activation (`_moe_ep_ops._SwiGLUWeighted`, silu(g) * u * w per
# row of h = [g | u]) is to the families: the kind a family's `training_variants` serves it under
# (the swiglu family's `weighted`: one Triton pass each way, dw summed over the row in fp32 in the
# kernel), and the key of its counts. Not an op-graph block kind: expert parallelism's own op.
WEIGHTED_ACT_KIND = "moe.experts.weighted_act"


def check_swiglu_kernel(kernel, f: int, dtype: torch.dtype, device, *, w_dtype=None,
                        rows: int = CHECK_ROWS) -> str | None:
    """None when ``kernel(h [rows, 2F], w [rows])`` agrees with `_SwiGLUWeighted` on random
    inputs at width ``f``: the output, dh and dw (`compare_paths`); else what differed, or the error the kernel raised. Draws from its own
    generator."""
    from onboarding.train._moe_ep_ops import _SwiGLUWeighted

    gen = torch.Generator(device=device).manual_seed(0)
    h = (2 * torch.randn(rows, 2 * f, device=device, generator=gen)).to(dtype).requires_grad_()
    w = torch.rand(rows, device=device, generator=gen).to(w_dtype or dtype).requires_grad_()
    dy = torch.randn(rows, f, device=device, generator=gen).to(dtype)

    def run(fn):
        y = fn(h, w)
        return y, torch.autograd.grad(y, [h, w], dy)

    return compare_runs(run, _SwiGLUWeighted.apply, kernel, ("h", "w"))


def attach_swiglu_kernels(ep_mods: list, root: Path, *, rank: int, kernel=None,
                          dtype: torch.dtype | None = None) -> dict[str, int]:
    """Render the family variant serving `WEIGHTED_ACT_KIND` into ``root/rank<rank>`` and attach
    its entry (`EPExperts.use_swiglu_kernel`) to every plain SwiGLU `EPExperts` that computes its
    experts in torch (no grouped expert LoRA kernel, whose kernel applies the routing weight
    itself: call this after `attach_expert_kernels`) where `check_swiglu_kernel` passes (one
    check per width F, dtype and device). ``kernel``: another ``swiglu_weighted``-like entry, for
    tests; ``dtype``: the activations' dtype to check in (default: the expert weights'; fp32 with
    expert LoRA on the torch path, whose h is fp32). On CUDA only (`worker.prepare`): the CPU
    keeps `_SwiGLUWeighted`.

    Returns counts for the step row's ``kernels`` summary: ``moe.experts.weighted_act`` and
    ``rejected:moe.experts.weighted_act``; none when no module is plain SwiGLU on the torch path
    or no family serves the kind."""
    from onboarding.families import training_kernel

    mods = [m for m in ep_mods if m.plain and m.kernel is None]
    served = training_kernel(WEIGHTED_ACT_KIND)
    if not mods or (served is None and kernel is None):
        return {}
    if kernel is None:
        kernel = load_training_variant(served, root, rank).entry

    def act_dtype(m):
        return dtype or (torch.float32 if m.lora is not None else getattr(m, m.down_name).dtype)

    return attach_checked(
        [(m.path, m) for m in mods], kind=WEIGHTED_ACT_KIND, what="weighted SwiGLU",
        key=lambda m: (getattr(m, m.down_name).shape[2], act_dtype(m), getattr(m, m.down_name).device),
        check=lambda m: check_swiglu_kernel(kernel, getattr(m, m.down_name).shape[2], act_dtype(m),
                                            getattr(m, m.down_name).device),
        attach=lambda m: m.use_swiglu_kernel(kernel))


# What expert parallelism's pair sums (`_moe_ep_ops._sum_pairs`: each token's k rows summed, in the
# combine and in the backward of the token-row gather) are to the families: the kind a family's
# `training_variants` serves them under (one Triton pass that reads each pair row once and writes
# each sum once, where the torch path gathers the rows into a temporary and sums it), and the key
# of their counts. Not an op-graph block kind.
PAIR_SUM_KIND = "moe.experts.pair_sum"
PAIR_SUM_CHECK_K = (3, 8)  # the k of the check: odd, and the proxies' top-8


def check_pair_sum_kernel(kernel, d: int, dtype: torch.dtype, device, *, tokens: int = CHECK_ROWS,
                          ks=PAIR_SUM_CHECK_K) -> str | None:
    """None when ``kernel(src [tokens * k, d], inverse, k) -> [tokens, d]`` agrees with
    `_sum_pairs`' torch path (`compare_paths`) on random rows in ``dtype`` gathered through a
    random permutation, for each k of ``ks``; else what differed at which k, or the error the
    kernel raised. Draws from its own generator."""
    from onboarding.train._moe_ep_ops import _sum_pairs

    gen = torch.Generator(device=device).manual_seed(0)
    for k in ks:
        src = torch.randn(tokens * k, d, device=device, generator=gen).to(dtype)
        inverse = torch.randperm(tokens * k, device=device, generator=gen)

        def run(fn, src=src, inverse=inverse, k=k):
            return fn(src, inverse, k), ()

        verdict = compare_runs(run, _sum_pairs, kernel, ())
        if verdict:
            return f"k={k}: {verdict}"
    return None


def attach_pair_sum_kernels(ep_mods: list, root: Path, *, rank: int, kernel=None,
                            dtype: torch.dtype | None = None) -> dict[str, int]:
    """Render the family variant serving `PAIR_SUM_KIND` into ``root/rank<rank>`` and attach its
    entry (`EPExperts.use_pair_sum_kernel`) to every `EPExperts` of ``ep_mods`` where
    `check_pair_sum_kernel` passes (one check per hidden width D, dtype and device; a failure
    warns and keeps the torch path). ``kernel``: another ``pair_sum``-like entry, for tests;
    ``dtype``: the rows' dtype to check in (default: the expert weights', which the experts'
    output rows and the token gradients have). On CUDA only (`worker.prepare`): the CPU keeps
    the torch path.

    Returns counts for the step row's ``kernels`` summary: ``moe.experts.pair_sum`` and
    ``rejected:moe.experts.pair_sum``; none when there is no module or no family serves the
    kind."""
    from onboarding.families import training_kernel

    served = training_kernel(PAIR_SUM_KIND)
    if not ep_mods or (served is None and kernel is None):
        return {}
    if kernel is None:
        kernel = load_training_variant(served, root, rank).entry

    def key(m):
        w = getattr(m, m.gate_up_name)
        return w.shape[2], dtype or w.dtype, w.device

    return attach_checked(
        [(m.path, m) for m in ep_mods], kind=PAIR_SUM_KIND, what="pair-sum", key=key,
        check=lambda m: check_pair_sum_kernel(kernel, *key(m)),
        attach=lambda m: m.use_pair_sum_kernel(kernel))


# What the training step's loss (`worker.chunked_cross_entropy`: the mean cross-entropy of the
# full-vocabulary logits, the gradient written in the forward) is to the families: the kind a
# family's `training_variants` serves it under (one Triton kernel reading each row's logits twice
# and writing its gradient once, where `_ChunkedCE` runs about ten aten passes per chunk), and the
# key of its counts. Not an op-graph block kind.
LOSS_KIND = "loss.cross_entropy"
# the model attribute `worker.lm_loss` reads the attached loss kernel from (a `LossKernel`)
LOSS_KERNEL_ATTR = "onboard_loss_kernel"


class LossKernel:
    """A loss kernel ``fn(logits [N, V], targets [N]) -> mean loss`` checked at one vocabulary
    and logits dtype: `serves` says whether it may take these logits (else `_ChunkedCE` does)."""

    def __init__(self, fn, vocab: int, dtype: torch.dtype) -> None:
        self.fn, self.vocab, self.dtype = fn, vocab, dtype

    def serves(self, logits: torch.Tensor) -> bool:
        return logits.dim() == 2 and logits.shape[1] == self.vocab and logits.dtype == self.dtype

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.fn(logits, targets)

    def __repr__(self) -> str:
        return f"LossKernel(V={self.vocab}, {self.dtype})"


def check_loss_kernel(kernel, torch_path, vocab: int, dtype: torch.dtype, device, *,
                      ignore_index: int = -100, rows: int = CHECK_ROWS) -> str | None:
    """None when ``kernel(logits [rows, vocab], targets [rows])`` agrees with ``torch_path`` (the
    same signature: `worker.chunked_cross_entropy`, i.e. `_ChunkedCE`) on random logits (2 randn,
    in ``dtype``) and targets with every seventh row ``ignore_index``: the loss and the logits'
    gradient under an incoming gradient of 0.75 (`compare_paths`); else what differed, or the
    error the kernel raised. Draws from its own generator."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = (2 * torch.randn(rows, vocab, device=device, generator=gen)).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    t[::7] = ignore_index
    dy = torch.full((), 0.75, device=device)

    def run(fn):
        y = fn(x, t)
        return y, torch.autograd.grad(y, [x], dy)

    return compare_runs(run, torch_path, kernel, ("logits",))


def attach_loss_kernel(model: nn.Module, root: Path, *, rank: int, torch_path,
                       ignore_index: int = -100, kernel=None,
                       dtype: torch.dtype | None = None) -> dict[str, int]:
    """Render the family variant serving `LOSS_KIND` into ``root/rank<rank>`` and attach its entry
    to ``model`` (`LOSS_KERNEL_ATTR`, a `LossKernel`; `worker.lm_loss` hands it to
    `chunked_cross_entropy`) where `check_loss_kernel` against ``torch_path`` (the worker's
    `chunked_cross_entropy`, passed in: this module does not import the worker) passes at the
    vocabulary of the model's output embedding and ``dtype`` (default: its weight's, the logits'
    dtype); a failure warns and keeps `_ChunkedCE`. The family's variant is rendered at its
    defaults: ``ignore_index`` must be its -100. ``kernel``: another ``cross_entropy``-like entry,
    for tests. On CUDA only (`worker.prepare`): the CPU keeps `_ChunkedCE`.

    Returns counts for the step row's ``kernels`` summary: ``loss.cross_entropy`` and
    ``rejected:loss.cross_entropy``; none when the model has no output embedding or no family
    serves the kind."""
    from onboarding.families import training_kernel

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    served = training_kernel(LOSS_KIND)
    if weight is None or weight.dim() != 2 or (served is None and kernel is None):
        return {}
    if kernel is None:
        kernel = load_training_variant(served, root, rank).entry
    vocab, dt, dev = weight.shape[0], dtype or weight.dtype, weight.device
    return attach_checked(
        [("the loss", model)], kind=LOSS_KIND, what="cross-entropy", key=lambda m: (vocab, dt),
        check=lambda m: check_loss_kernel(kernel, torch_path, vocab, dt, dev,
                                          ignore_index=ignore_index),
        attach=lambda m: setattr(m, LOSS_KERNEL_ATTR, LossKernel(kernel, vocab, dt)))


def attach_training_kernels(model: nn.Module, graph: OpGraph, ep_mods: list, root: Path, *,
                            rank: int, distributed: bool, torch_loss, ignore_index: int):
    """Every onboard kernel training puts into ``model`` (the worker on CUDA, and the CPU
    fixtures that measure a step as CUDA runs it): the op graph's blocks (`patch_kernels`), then
    the grouped expert LoRA, the weighted SwiGLU, the pair sums, the LoRA layers and the loss
    (``torch_loss``: the torch path the loss kernel replaces), each under its own folder of
    ``root``. Returns (the `PatchSet`, the attached kernels' counts)."""
    patches = patch_kernels(model, graph, root, rank=rank, distributed=distributed)
    attached = attach_expert_kernels(ep_mods, root / "experts", rank=rank)
    # the other plain SwiGLU experts: the routing-weighted activation in one pass each way
    attached.update(attach_swiglu_kernels(ep_mods, root / "weighted_act", rank=rank))
    # every experts module's pair sums (combine, gather backward): one Triton pass each
    attached.update(attach_pair_sum_kernels(ep_mods, root / "pair_sums", rank=rank))
    # training's LoRALinear layers on the lora family's fused kernel; counts join the summary
    attached.update(attach_lora_kernels(model, root / "lora_linear", rank=rank))
    # the loss (`lm_loss`, chunked): one fused cross-entropy kernel instead of `_ChunkedCE`
    attached.update(attach_loss_kernel(model, root / "loss", rank=rank, torch_path=torch_loss,
                                       ignore_index=ignore_index))
    return patches, attached
