"""Regional compilation (`TrainConfig.compile` = ``"blocks"``): ``torch.compile`` of each decoder layer.

The unit is the decoder layer `parallel.decoder_blocks` finds by structure, the same one FSDP2's
``fully_shard`` and ``recompute = "full"`` wrap. The order is torchtitan's: recompute's
checkpoint wrapper innermost, the compiled function around it, FSDP2 outside. The compiled
function replaces the layer's ``forward`` instance attribute (recompute's wrapper, or the
class's forward), and FSDP2's unshard / reshard hooks run on the module call around that
attribute, so they stay outside the compiled region (no graph break at a collective) and
parameter and module names do not change (no ``_orig_mod.`` in checkpoints or exports).
Everything a layer calls is traced: the model's own code, our LoRA layers, expert parallelism's
experts and our kernels, which are ``torch.library`` custom ops (opaque to the compiler, each
with its registered fake implementation), so inductor fuses the copies, casts and elementwise
ops between them.

Why the first step runs eagerly. The kernel patches calibrate on their first call
(`onboarding.patching.callswap`, `patching.core._Calibrated`, the sparse intercept): they run
the model's torch path and the kernel on the same input and keep the kernel only if the two
agree. That is a decision on tensor values, and it mutates the patch's state and the model's
globals; traced, it would either break the graph at every comparison or bake one outcome into
the graph without the check. So `compile_blocks` is called after the first training step, once
every patch has decided (`undecided_patches` must be empty); from the second step on, the
compiled code sees only the decided state (a bound swap calls the kernel, a kept one the torch
path), which dynamo guards on. Making the first-call logic ``torch.compiler.is_compiling()``-aware
instead would still need an eager first call to decide, in every patch type: the warm-up step
is that call, in one place. The first step's time is the eager model's; the second's includes
the compile.

Identical layers. The compiled function wraps one code object for all layers of a class (the
class's ``forward``, or recompute's wrapper), and dynamo caches per code object: parameters and
buffers are graph inputs (``inline_inbuilt_nn_modules``, always on since torch 2.6), so a layer
reuses the graph of an earlier layer of the same structure; each distinct structure (e.g.
linear-attention and full-attention layers) compiles once. `compile_stats` reports what
compiled, and `compile_blocks` makes dynamo raise when a compiled function would pass its
recompile limit (by default it would run the layer eagerly from then on, with a warning).

Failures. A compile that fails (dynamo, AOTAutograd, inductor; the backward compiles at its first
call) raises `CompileFailed` with the step and the cause: the run stops with exit code 1 and no
step row. There is no fallback to eager: a run asked to measure the compiled step would
otherwise report eager numbers under the compiled label.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from onboarding.errors import EXIT_INTERNAL, OnboardError
# compiled functions per code object before dynamo would give up and run the frame eagerly:
# each structure of layer compiles once, a few more per structure where guards split (a
# parameter's requires_grad, a first/last layer's own attributes); above this, fail loudly
RECOMPILE_LIMIT = 32
# torch.compile's backend for the run's layers; the CPU tests trace with a cheaper one
BACKEND = "inductor"


class CompileFailed(OnboardError):
    """``compile = "blocks"``: torch.compile failed; the run stops (no eager fallback)."""

    exit_code = EXIT_INTERNAL


@dataclass
class CompiledBlocks:
    """The decoder layers whose ``forward`` is compiled, and how to give them back."""

    paths: list[str] = field(default_factory=list)
    _undo: list = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Each layer's ``forward`` as before `compile_blocks` (the eager model again)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def undecided_patches(patches) -> list[str]:
    """Paths of kernel patches still waiting for their first-call calibration (status
    ``pending``); `compile_blocks` must not trace them."""
    if patches is None:
        return []
    return [r.path for r in patches.records if r.status == "pending"]


def compile_blocks(blocks: list[tuple[str, nn.Module]], *, patches=None,
                   backend: str | None = None) -> CompiledBlocks:
    """``torch.compile`` each decoder layer's ``forward`` in place (see the module docstring):
    after recompute (its wrapper is the forward compiled) and after FSDP2's ``fully_shard`` (its
    hooks stay around the compiled forward). Call after the first training step: a kernel patch
    still ``pending`` (``patches``: the run's `PatchSet`) raises `CompileFailed`. ``backend``:
    torch.compile's (default `BACKEND`)."""
    pending = undecided_patches(patches)
    if pending:
        raise CompileFailed(f"compile=blocks: kernel patches not yet calibrated ({', '.join(pending[:4])}"
                            f"{', ...' if len(pending) > 4 else ''}): compile after the first step")
    _configure()
    done = CompiledBlocks()
    from onboarding.patching.core import swap_forward

    for path, block in blocks:
        done.paths.append(path)
        done._undo.append(swap_forward(block, torch.compile(block.forward,
                                                            backend=backend or BACKEND)))
    return done


def _configure() -> None:
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(getattr(cfg, "recompile_limit", 8), RECOMPILE_LIMIT)
    cfg.cache_size_limit = cfg.recompile_limit  # the same setting's older name (torch <= 2.5)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):  # hitting it raises, not runs eagerly
        cfg.fail_on_recompile_limit_hit = True
    # Under recompute the compiled forward runs inside the checkpoint, where dynamo refuses a
    # Python side effect (a graph break that leaves the whole layer eager) unless told that the
    # recomputation need not replay it. Ours are records of the last forward, which the
    # recomputation would overwrite with the same values: expert parallelism's routed counts
    # (`EPExperts.last_counts`), the router taps of the aux loss, the patches' call counts.
    if hasattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        cfg.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_stats() -> dict[str, float | int]:
    """What dynamo did in this process so far (cumulative): ``graphs`` (distinct graphs
    compiled: one per structure of layer, not one per layer), ``frames`` (frames compiled, a
    recompile or a graph break's resume included), ``graph_breaks``, and ``compile_s``
    (seconds inside dynamo's compile entry, AOTAutograd and inductor's forward included; a
    backward compiles at its first call, outside it)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "frames": int(counters["frames"].get("ok", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "compile_s": round(sum(sum(v) for k, v in compilation_time_metrics.items()
                                   if k.endswith("compile_inner")), 3)}


@contextlib.contextmanager
def failures_named(step: int) -> Iterator[None]:
    """Inside: a torch.compile failure becomes `CompileFailed` naming ``step`` and the cause."""
    try:
        yield
    except Exception as exc:
        mod = type(exc).__module__ or ""
        if mod.startswith(("torch._dynamo", "torch._inductor", "torch._functorch")):
            raise CompileFailed(f"compile=blocks: torch.compile failed at step {step} "
                                f"({type(exc).__name__}: {' '.join(str(exc).split())[:600]}); the run "
                                "stops rather than fall back to eager (`--compile none` runs "
                                "it eagerly)") from exc
        raise
