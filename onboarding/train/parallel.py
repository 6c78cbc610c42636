"""The FSDP2 x EP layout: device mesh, per-block sharding, gradient scaling, clipping.

Mesh ``("fsdp", "ep")`` with ``world = fsdp * ep``; rank ``r = f * ep + e``. Dense parameters
(attention of every kind, norms, routers, embeddings, LoRA) are sharded with ``fully_shard`` over
the whole world (flattened mesh): every rank is a data-parallel rank for them. Routed experts
belong to EP: rank ``(f, e)`` holds experts slice ``e``; ranks with the same ``e`` (the "fsdp"
sub-mesh) hold the same experts and see different tokens.

Gradient scaling. Each rank's loss is the mean over its own tokens; the reference's loss is the
mean over the global batch, so every gradient must be ``(1/world) * sum over ranks``:
  - dense: FSDP's default reduce-scatter average over the world does exactly that;
  - expert LoRA: the all-to-all backward already sums the contributions of every rank of the EP
    group onto the owning rank; the ranks of the "fsdp" sub-mesh are then summed (all-reduce)
    and the total divided by ``world`` (not by the sub-mesh size: docs/design.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from onboarding.errors import InputError
from onboarding.graph.opgraph import OpGraph
from onboarding.train.moe_ep import EPGroup


@dataclass(kw_only=True)
class Layout:
    world: int = 1
    rank: int = 0
    fsdp: int = 1
    ep: int = 1
    mesh: object | None = None  # DeviceMesh ("fsdp", "ep")
    dense_mesh: object | None = None  # DeviceMesh over the whole world
    ep_group: EPGroup | None = None
    fsdp_group: dist.ProcessGroup | None = None  # ranks holding the same experts

    @property
    def distributed(self) -> bool:
        return self.world > 1


def single_layout() -> Layout:
    return Layout(ep_group=EPGroup())


def make_layout(fsdp: int, ep: int, device_type: str) -> Layout:
    """The mesh of an initialised process group of ``fsdp * ep`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if world != fsdp * ep:
        raise InputError(f"world size {world} != fsdp * ep = {fsdp} * {ep}")
    mesh = init_device_mesh(device_type, (fsdp, ep), mesh_dim_names=("fsdp", "ep"))
    try:
        dense = mesh._flatten("dp")  # reuses the world's ranks without a new group per call
    except (AttributeError, RuntimeError, NotImplementedError):
        dense = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    ep_pg = mesh["ep"].get_group() if ep > 1 else None
    return Layout(world=world, rank=rank, fsdp=fsdp, ep=ep, mesh=mesh, dense_mesh=dense,
                  ep_group=EPGroup(group=ep_pg, rank=mesh.get_local_rank("ep"), size=ep),
                  fsdp_group=mesh["fsdp"].get_group() if fsdp > 1 else None)


def decoder_blocks(model: nn.Module, graph: OpGraph) -> list[tuple[str, nn.Module]]:
    """The repeated decoder blocks: items of a ``ModuleList`` that own the graph's layer blocks."""
    modules = dict(model.named_modules())
    found: dict[str, nn.Module] = {}
    for b in graph.blocks:
        if b.layer is None:
            continue
        parts = b.path.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if part == str(b.layer) and isinstance(modules.get(owner), nn.ModuleList):
                found[".".join(parts[:i + 1])] = modules[".".join(parts[:i + 1])]
                break
    if not found and any(b.layer is not None for b in graph.blocks):
        raise InputError("no decoder block list found (blocks with a layer index are not "
                         "inside an nn.ModuleList)")
    return sorted(found.items(), key=lambda kv: [int(p) if p.isdigit() else 0
                                                 for p in kv[0].split(".")])


def apply_activation_checkpointing(blocks: list[tuple[str, nn.Module]]) -> None:
    """Recompute each block's forward in the backward (non-reentrant; keeps module paths)."""
    for _, block in blocks:
        _checkpoint_forward(block)


def _checkpoint_forward(module: nn.Module, attr: str = "forward") -> None:
    inner = getattr(module, attr)

    def forward(*args, _inner=inner, **kwargs):
        return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

    setattr(module, attr, forward)


# what `recompute = "selective"` re-runs: the MLP sub-blocks (`onboard plan`'s selective term),
# and a low-rank residual branch (Gemma 3n's LAuReL: two rank-r GEMMs, cheap to re-run, whose
# rank-r product and the norm inside its module are freed; it was an `mlp.dense` before it had a
# kind of its own)
SELECTIVE_KINDS = ("mlp.dense", "moe.shared_expert", "moe.experts", "residual.low_rank")


def apply_recompute(model: nn.Module, graph: OpGraph, blocks: list[tuple[str, nn.Module]],
                    mode: str) -> list[str]:
    """Activation recomputation; returns the paths of the modules that recompute.

    ``full``: every decoder layer keeps only its input and re-runs in the backward. ``selective``:
    each layer's MLP sub-blocks re-run (dense MLPs, shared experts, routed experts), which holds
    the 3F-wide gate/up/activation tensors per token: the cheap-to-recompute, memory-heavy part;
    so does a low-rank residual branch (`residual.low_rank`: two rank-r GEMMs);
    attention (and its core's softmax statistics), norms and routers keep their activations. A
    replaced expert-parallel module re-runs only its local expert compute, after the dispatch,
    so the backward repeats no all-to-all. Both are non-reentrant `torch.utils.checkpoint`
    around a module's forward, applied before `fully_shard` (FSDP2 hooks the module call).
    """
    from onboarding.train.moe_ep import EPExperts

    if mode == "none":
        return []
    if mode == "full":
        apply_activation_checkpointing(blocks)
        return [p for p, _ in blocks]
    modules = dict(model.named_modules())
    done = []
    for b in graph.blocks:
        mod = modules.get(b.path)
        if b.kind not in SELECTIVE_KINDS or mod is None or b.path in done:
            continue
        _checkpoint_forward(mod, "_compute" if isinstance(mod, EPExperts) else "forward")
        done.append(b.path)
    if not done:
        raise InputError("recompute='selective': the op graph has no MLP or expert blocks "
                         f"({', '.join(SELECTIVE_KINDS)}) to recompute; use 'full'")
    return done


def expert_params(ep_modules: list[nn.Module]) -> set[nn.Parameter]:
    return {p for m in ep_modules for p in m.parameters()}


def shard(model: nn.Module, layout: Layout, blocks: list[tuple[str, nn.Module]],
          ep_modules: list[nn.Module], *, mp_policy=None) -> None:
    """``fully_shard`` each decoder block's dense parameters, then the root, over the world.

    Expert parameters are left to EP (``ignored_params``): they are already split by expert.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not layout.distributed:
        return
    ignored = expert_params(ep_modules)
    kw = {"mesh": layout.dense_mesh, "ignored_params": ignored,
          "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for _, block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def finish_expert_grads(params: list[nn.Parameter], layout: Layout) -> None:
    """Expert-LoRA gradients to ``(1/world) * sum over ranks`` (see the module docstring).

    A local expert that got no token this step has no gradient: it counts as zero (the reference
    holds all experts in one tensor, so its gradient is never missing).
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not layout.distributed:
        return
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if layout.fsdp_group is not None:
        dist.all_reduce(flat, group=layout.fsdp_group)
    flat.div_(layout.world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sum_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    """Sum of the squared elements of ``grads`` in fp64, as one 0-dim tensor on ``device``: the
    per-tensor norms in one foreach launch per (device, dtype) group (`torch._foreach_norm`,
    fp64), squared and summed; no host read."""
    if not grads:
        return torch.zeros((), device=device, dtype=torch.float64)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def grad_norm(dense: list[nn.Parameter], experts: list[nn.Parameter], layout: Layout
              ) -> torch.Tensor:
    """Global L2 norm of all adapter gradients (dense shards over the world, experts over EP),
    a 0-dim fp64 tensor on the parameters' device (reading it is the caller's host sync)."""
    dev = (dense or experts)[0].device if (dense or experts) else torch.device("cpu")
    sq_dense = _sum_squares([_local(p.grad) for p in dense if p.grad is not None], dev)
    sq_exp = _sum_squares([p.grad for p in experts if p.grad is not None], dev)
    if layout.distributed:
        if any(hasattr(p, "to_local") for p in dense):
            dist.all_reduce(sq_dense)
        else:  # unsharded dense parameters are replicated: every rank has the full gradient
            pass
        if layout.ep_group is not None and layout.ep_group.group is not None:
            dist.all_reduce(sq_exp, group=layout.ep_group.group)
    return (sq_dense + sq_exp).sqrt()


def clip_grads(dense: list[nn.Parameter], experts: list[nn.Parameter], layout: Layout,
               max_norm: float) -> torch.Tensor:
    """Scale every adapter gradient so the global norm is at most ``max_norm``; returns the norm
    before clipping as a 0-dim device tensor (`grad_norm`).

    Nothing is read on the host: the step's launches keep queueing behind the backward (the
    worker reads the norm after the step). The scale ``max_norm / (norm + 1e-6)``, computed in
    fp64 as before, applies where the norm is finite and above ``max_norm`` and is 1 elsewhere
    (an exact no-op), rounded to the gradients' dtype as a Python scalar was; one foreach
    multiply per dtype."""
    norm = grad_norm(dense, experts, layout)
    if max_norm > 0:
        # a true division (``max_norm / tensor`` would be a reciprocal times max_norm), and
        # `norm != inf` for the host's isfinite (a NaN norm already fails `norm > max_norm`)
        scale = torch.where((norm > max_norm) & (norm != math.inf),
                            torch.full_like(norm, max_norm) / (norm + 1e-6), torch.ones_like(norm))
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in (*dense, *experts):
            if p.grad is not None:
                g = _local(p.grad)
                by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, scale.to(dtype))
    return norm
