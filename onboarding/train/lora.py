"""LoRA adapters on frozen linear layers, and where they go by default.

`LoRALinear` computes ``y = base(x) + scaling * B(A(dropout(x)))`` with ``scaling = alpha / r``;
A is Kaiming-uniform, B zeros (the wrapped model equals the original at init), both fp32 whatever
the base dtype. Default targets are found from the op graph's block kinds (every attention kind:
full, gated, sliding, MLA, top-k sparse, and linear attention's in/out projections; a selective
state-space mixer's projections except its output one), never from class names. Routers,
experts and the LM head are left out, and so are the linears of a module that passes no gradient
out (a top-k indexer returning positions, or a mask built from them: `no_gradient_names`).

On CUDA with ``kernels``, the training stage gives each `LoRALinear` the lora family's fused
kernel (`onboarding.train.kernels.attach_lora_kernels`, after a check against the torch path per
shape; `LoRALinear.use_kernel` states the numeric difference); layers with dropout or an fp32
base, the CPU, and layers whose check failed keep the torch path (`_LoRADelta`), each counted.

Expert adapters live in the expert module itself (training/moe_ep.py). Such a module exposes
``peft_tensors(prefix)`` and ``peft_target()``; its adapter parameters are named ``lora_*``, which
is how `inject_lora` leaves them trainable and `lora_parameters` finds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.nn import functional as F

from onboarding.errors import InputError
from onboarding.graph.opgraph import OpGraph
from onboarding.modpath import inside

ATTENTION_PREFIXES = ("attention.", "sparse_attention.", "linear_attention.")
# selective state-space mixers (classified by structure): their output projection is no default
SCAN_MIXER_KINDS = ("linear_attention.mamba",)
EXCLUDED_KINDS = ("moe.router", "moe.experts", "moe.shared_expert", "lm_head", "embedding")
ADAPTER_PREFIX = "lora_"
# base weight dtypes the fused kernel serves (`LoRALinear.kernel_refusal`): the 16-bit ones it was
# measured on (H200, o_proj 4096 -> 4096 r16 bf16); an fp32 base keeps the torch path
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_ANY_DTYPE = (torch.bfloat16, torch.float16, torch.float32)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (fp32 adapters)."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if rank <= 0:
            raise InputError(f"lora_rank={rank}: must be positive")
        self.base = base
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev,
                                dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev,
                                dtype=torch.float32)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = float(alpha) / rank
        self.kernel: Callable | None = None  # see `use_kernel`
        self.reset_adapters(generator)
        for p in self.base.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def reset_adapters(self, generator: torch.Generator | None = None) -> None:
        # Same init as nn.Linear's weight (kaiming uniform, a=sqrt(5)); drawn on the CPU from
        # ``generator`` so every process gets the same A wherever the layer lives.
        bound = 1.0 / math.sqrt(self.lora_A.in_features)
        a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A.weight.copy_(a)
        self.lora_B.weight.zero_()

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # code that reads ``layer.weight`` sees the base weight
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute(x, self.lora_A.weight, self.lora_B.weight, self.kernel)

    def compute(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                kernel: Callable | None) -> torch.Tensor:
        """The forward with adapters ``a`` [r, in], ``b`` [out, r] through ``kernel`` (the lora
        family's fused ``lora_linear(x, weight, a, b, scaling)``; see `use_kernel`) or, when
        None, the torch path (`_LoRADelta`, or the plain expression under dropout)."""
        if kernel is not None:
            y = kernel(x, self.base.weight, a, b, self.scaling)
            return y if self.base.bias is None else y + self.base.bias
        y = self.base(x)
        if isinstance(self.dropout, nn.Identity):
            delta = _LoRADelta.apply(x, a, b, self.scaling)
        else:  # the dropped-out fp32 input is what A's gradient needs: autograd keeps it
            delta = self.scaling * F.linear(F.linear(self.dropout(x.to(torch.float32)), a), b)
        return y + delta.to(y.dtype)

    def kernel_refusal(self, dtypes=KERNEL_DTYPES) -> str | None:
        """Why the fused kernel cannot serve this layer (None: it can): dropout (the kernel has
        none), a base weight dtype outside ``dtypes``, adapters that are not 2-D fp32."""
        if not isinstance(self.dropout, nn.Identity):
            return f"dropout {self.dropout.p:g} (the fused kernel has no dropout)"
        if self.base.weight.dtype not in dtypes:
            return (f"{str(self.base.weight.dtype).removeprefix('torch.')} base weight (the fused "
                    f"kernel serves {', '.join(str(d).removeprefix('torch.') for d in dtypes)})")
        if self.lora_A.weight.dtype != torch.float32 or self.lora_B.weight.dtype != torch.float32:
            return "adapters not fp32"
        return None

    def use_kernel(self, kernel: Callable | None) -> None:
        """Compute this layer with ``kernel`` (the lora family's fused ``lora_linear``, attached
        by `onboarding.train.kernels.attach_lora_kernels` after its check) from now on; None:
        the torch path again. Refuses (ValueError) a layer `kernel_refusal` names.

        Numerics against the torch path (`_LoRADelta`, everything in fp32 from the 16-bit x):
        on a GPU with a bf16/fp16 base the fused kernel takes the fp32 A and B as 16-bit dot
        operands (rounded to the base dtype inside the kernel) with fp32 accumulation; x A^T is
        kept in fp32; the rank-r term is rounded to the base dtype before cuBLAS adds x W^T onto
        it (beta = 1); dA and dB are GEMMs of 16-bit operands whose result is rounded to the base
        dtype before it becomes the fp32 gradient. The parameters and their gradients stay fp32
        (the optimizer updates the same fp32 adapters; names, dtypes and the PEFT export are
        unchanged). In bf16 that is 3e-3 to 4e-3 relative RMS in y and d x, about 3e-3 in d A and
        d B, where the adapter term is as large as the base's (the check's batch; emulated with
        bf16 roundings on the CPU at the proxy's widths, not measured on a GPU), under the
        check's 1e-2 / 2e-2 bars; with fp32 inputs (the CPU interpreter) the two paths agree to
        fp32 rounding."""
        if kernel is not None and (why := self.kernel_refusal(dtypes=_ANY_DTYPE)):
            raise ValueError(f"LoRALinear: the fused kernel cannot serve this layer: {why}")
        self.kernel = kernel

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"


class _LoRADelta(torch.autograd.Function):
    """``scaling * B(A(x.float()))`` with the fp32 adapters A [r, in], B [out, r].

    Autograd on the plain expression keeps an fp32 copy of x per adapter for A's gradient (q, k
    and v each hold their own, twice the size of the 16-bit input they share); this keeps x as it
    came (one storage for every adapter on the same input, often saved for the backward anyway)
    and the [.., r] product, and casts x again in the backward. The same operations in the same
    order as the plain expression, so the same numbers.
    """

    @staticmethod
    def forward(ctx, x, a, b, scaling):
        xa = torch.nn.functional.linear(x.to(torch.float32), a)
        ctx.save_for_backward(x, a, b, xa)
        ctx.scaling = scaling
        return scaling * torch.nn.functional.linear(xa, b)

    @staticmethod
    def backward(ctx, grad):
        x, a, b, xa = ctx.saved_tensors
        g = (grad * ctx.scaling).reshape(-1, b.shape[0])
        gxa = g @ b
        gb = g.t() @ xa.reshape(-1, b.shape[1])
        ga = gxa.t() @ x.reshape(-1, a.shape[1]).to(torch.float32)
        gx = (gxa @ a).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        return gx, ga, gb, None


def _linear_paths(model: nn.Module) -> dict[str, nn.Linear]:
    """Plain ``nn.Linear`` modules, leaving out those inside a `LoRALinear` (base, A, B)."""
    wrapped = [p for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    return {p: m for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and not any(p.startswith(w + ".") for w in wrapped)}


def mixer_output_names(block) -> set[str]:
    """Module names, relative to ``block``, of a selective state-space mixer's output projections
    (``SCAN_MIXER_KINDS``; empty for other kinds): a 2-D weight that maps another width back to
    the block's output width (Mamba's inner -> hidden ``out_proj``; its in_proj reads the hidden
    width, x_proj / dt_proj write neither). Read from the block's captured parameter shapes, so
    the memory plan (full size, on meta) and the trainer apply one rule."""
    if block.kind not in SCAN_MIXER_KINDS or not block.inputs or not block.outputs:
        return set()
    width_in, width_out = block.inputs[0].shape[-1], block.outputs[0].shape[-1]
    return {name.rsplit(".", 1)[0] for name, shape in block.params.items()
            if name.endswith(".weight") and len(shape) == 2 and shape[0] == width_out
            and shape[1] != width_in}


def scan_mixer_outputs(graph: OpGraph, linears: dict[str, nn.Linear]) -> set[str]:
    """Paths of the linears that `mixer_output_names` names in ``graph``'s blocks. PEFT refuses
    LoRA there (peft 0.21 ``_check_lora_target_modules_mamba``), so the default leaves them out
    and both our run and the PEFT baseline train the same adapters."""
    return {p for b in graph.blocks for n in mixer_output_names(b)
            if (p := f"{b.path}.{n}" if b.path else n) in linears}


def no_gradient_names(block) -> list[str]:
    """Modules, relative to ``block``, that pass no gradient out to their parameters
    (``no_gradient_modules``, read by the classifier: a top-k indexer handing back the positions
    it picked, or a float mask it built from them). A LoRA adapter on a linear inside one would
    never train (its B gets no gradient), so none is a default target."""
    return list(block.attrs.get("no_gradient_modules", ()))


def default_targets(model: nn.Module, graph: OpGraph) -> list[str]:
    """Paths of the ``nn.Linear`` modules inside every attention-kind block of ``graph``, less
    the output projections of selective state-space mixers (`scan_mixer_outputs`) and the
    linears of modules that pass no gradient out (`no_gradient_names`)."""
    linears = _linear_paths(model)
    attn = [b.path for b in graph.blocks if b.kind.startswith(ATTENTION_PREFIXES)]
    # Nested blocks of excluded kinds (a router inside an attention wrapper...) stay out.
    excluded = [b.path for b in graph.blocks if b.kind in EXCLUDED_KINDS]
    excluded += [f"{b.path}.{n}" if b.path else n for b in graph.blocks
                 for n in no_gradient_names(b)]
    mixer_outputs = scan_mixer_outputs(graph, linears)
    out = []
    for path in linears:
        if any(inside(path, a) for a in attn) and not any(inside(path, e) for e in excluded) \
                and path not in mixer_outputs:
            out.append(path)
    return sorted(out, key=_path_key)


def check_peft_accepts(build, targets: list[str], *, rank: int, alpha: float) -> None:
    """Raise `InputError` naming every target the installed PEFT refuses (its own check, run by
    injecting its LoRA into fresh meta builds from ``build()``), before any baseline trains."""
    from peft import LoraConfig, inject_adapter_in_model

    def refusal(paths: list[str]) -> str | None:
        try:
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=paths),
                                    build(), low_cpu_mem_usage=True)
        except ValueError as exc:
            return str(exc)
        return None

    if not targets or refusal(targets) is None:
        return
    by_leaf: dict[str, list[str]] = {}
    for p in targets:
        by_leaf.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    refused = {leaf: why for leaf, paths in by_leaf.items() if (why := refusal(paths[:1]))}
    if not refused:  # only the combination fails: say what PEFT said
        refused = {"(together)": refusal(targets) or "refused"}
    names = ", ".join(f"{leaf} ({len(by_leaf.get(leaf, targets))} modules, e.g. "
                      f"{by_leaf.get(leaf, targets)[0]})" for leaf in refused)
    why = next(iter(refused.values())).replace("\n", " ")
    raise InputError(f"lora_targets: PEFT (the --baseline) refuses LoRA on {names}; PEFT says: "
                     f"{why} Leave them out of --lora-targets, or drop --baseline")


def _path_key(path: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def _matches(path: str, pattern: str) -> bool:
    leaf = path.rsplit(".", 1)[-1]
    return fnmatchcase(path, pattern) or fnmatchcase(leaf, pattern) or \
        path.endswith("." + pattern)


def resolve_targets(model: nn.Module, graph: OpGraph, targets: list[str]) -> list[str]:
    """``targets`` (``"auto"`` and/or fnmatch patterns) -> the matching ``nn.Linear`` paths."""
    linears = _linear_paths(model)
    chosen: set[str] = set()
    for pattern in targets:
        if pattern == "auto":
            chosen.update(default_targets(model, graph))
            continue
        hits = [p for p in linears if _matches(p, pattern)]
        if not hits:
            raise InputError(f"lora_targets: pattern {pattern!r} matches no nn.Linear module "
                             f"(e.g. {', '.join(list(linears)[:4]) or 'none in the model'})")
        chosen.update(hits)
    if not chosen:
        raise InputError(f"lora_targets={targets!r}: no nn.Linear module matched (the op graph "
                         "has no attention-kind block with linear projections)")
    return sorted(chosen, key=_path_key)


def inject_lora(model: nn.Module, graph: OpGraph, *, targets: list[str], rank: int,
                alpha: float, dropout: float, seed: int = 0) -> list[str]:
    """Wrap the target linears in `LoRALinear` (in place); freeze every base parameter.

    Returns the wrapped module paths. Adapter A matrices are drawn from ``seed`` in path order,
    so every process that injects into the same model gets the same adapters.
    """
    paths = resolve_targets(model, graph, targets)
    gen = torch.Generator().manual_seed(seed)
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, name)
        setattr(parent, name, LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout,
                                         generator=gen))
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[-1].startswith(ADAPTER_PREFIX)
                         or _is_adapter_param(name))
    return paths


def _is_adapter_param(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B")


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every trainable adapter parameter: `LoRALinear` A/B and ``lora_*`` params (expert LoRA)."""
    out, seen = [], set()
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if (_is_adapter_param(name) or leaf.startswith(ADAPTER_PREFIX)) and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def adapter_modules(model: nn.Module) -> dict[str, nn.Module]:
    """`LoRALinear` layers and modules exporting their own adapters (``peft_tensors``)."""
    return {p: m for p, m in model.named_modules()
            if isinstance(m, LoRALinear) or callable(getattr(m, "peft_tensors", None))}
