"""`onboard plan`: the root's FSDP2 group (what `onboard train` leaves outside the decoder layers
it wraps one by one: the token embedding, the final norm, the head) is held unsharded from the
root's forward to the end of the backward, beside its shard; the plan counts that copy as a line
of its own, as FSDP2 on a fake process group holds it."""

from __future__ import annotations

import warnings

import pytest
import torch

from onboarding.plan import ClusterConfig, PlanConfig
from onboarding.plan.memory import BF16, ROOT_KEY, Layout, memory
from onboarding.plan.shapes import model_shape


def _graph(n_layers: int):
    """An op graph whose layer blocks sit in ``model.layers`` (as a capture of the proxy names
    them: `parallel.decoder_blocks` finds the list by them)."""
    from onboarding.graph.opgraph import Block, OpGraph

    blocks = [Block(path=f"model.layers.{i}.input_layernorm", kind="norm.rms", layer=i,
                    class_name="RMSNorm", params={"weight": [64]}) for i in range(n_layers)]
    return OpGraph(model="m", capture="dispatch", capture_note="", batch=1, seq=1,
                   dtype="float32", blocks=blocks, layer_pattern="", layer_kinds=[],
                   param_counts={}, total_flops=0)


def _build(device: str, tied: bool):
    from onboarding.load.model import load_model

    loaded = load_model("tiny_dense")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loaded.build(device=device, seed=None if device == "meta" else 0)
    if tied:  # one storage for the embedding and the head
        model.lm_head.weight = model.model.embed_tokens.weight
    return loaded, model


def _held_by_fsdp2(model, world: int) -> tuple[int, dict[str, int]]:
    """`onboard train`'s wrapping (`parallel.shard`: each decoder layer, then the root) over a
    fake process group of ``world`` ranks; a LoRA-like step (the root's parameters frozen, the
    layers' trained). Returns (rank 0's shard of the root group, elements, one per storage) and,
    at the end of the root's forward and at the last layer backward runs (the first layer's),
    the elements of the root group's unsharded storages (a plain tensor, not a DTensor; one
    count per storage: a tied head once)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layers = model.model.layers
    inside = {id(p) for p in layers.parameters()}
    root = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
            if id(p) not in inside]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        trained = {id(q) for q in layers.parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) in trained)
        mods = dict(model.named_modules())
        sharded = {id(t): t for t in (getattr(mods[n.rpartition(".")[0]], n.rpartition(".")[2])
                                      for n, _ in root)}
        shard = sum(t.to_local().numel() for t in sharded.values())
        held: dict[str, int] = {}

        def read(tag):
            storages = {}
            for n, _ in root:
                owner, _, attr = n.rpartition(".")
                t = getattr(mods[owner], attr)
                assert type(t).__name__ != "DTensor", (tag, n)
                storages[t.untyped_storage().data_ptr()] = \
                    t.untyped_storage().nbytes() // t.element_size()
            held[tag] = sum(storages.values())

        model.register_forward_hook(lambda m, a, o: read("end of the root's forward"))
        layers[0].register_full_backward_hook(lambda m, gi, go: read("first layer's backward"))
        out = model(input_ids=torch.randint(0, 256, (1, 8)), use_cache=False)
        out.logits.float().sum().backward()
    finally:
        dist.destroy_process_group()
    return shard, held


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("world,tied", [(4, False), (3, False), (4, True)])
def test_the_root_group_is_unsharded_through_the_step(world, tied):
    """FSDP2 keeps the root's group (embedding, final norm, head) unsharded from the root's
    forward to the end of the backward: its all-gather output (``world`` ceil-sized shards,
    padding included: 3 ranks) beside its shard. The plan counted the shard alone; now the
    unsharded copy is the line `ROOT_KEY`, on every layout with FSDP (EP x FSDP: the dense
    parameters are sharded over the whole world), the whole copy on the GPU when the weights are
    offloaded (the shard in host memory), nothing on one GPU (no FSDP: the weights once)."""
    loaded, meta = _build("meta", tied)
    shape = model_shape(meta, loaded.config, _graph(len(meta.model.layers)))
    _, model = _build("cpu", tied)
    shard, held = _held_by_fsdp2(model, world)
    unsharded = set(held.values())
    assert len(held) == 2 and len(unsharded) == 1, held
    [full] = unsharded
    whole = 256 * 64 * (1 if tied else 2) + 64
    assert full >= whole and shard * world == full

    assert shape.root == whole
    cfg = PlanConfig(gpus=world, seq=8)
    mem = memory(shape, cfg, Layout(ep=1, fsdp=world, recompute="none", offload="none"),
                 ClusterConfig())
    assert mem.components()[ROOT_KEY] == BF16 * full
    assert mem.weights_root == BF16 * full and mem.allocated >= mem.weights_dense + BF16 * full
    # the shard stays in the dense line: the dense line is unchanged by the root's copy
    assert mem.weights_dense >= BF16 * shard
    off = memory(shape, cfg, Layout(ep=1, fsdp=world, recompute="none", offload="params"),
                 ClusterConfig())
    assert off.weights_root == BF16 * full and off.host_root == BF16 * shard
    one = memory(shape, PlanConfig(gpus=1, seq=8),
                 Layout(ep=1, fsdp=1, recompute="none", offload="none"), ClusterConfig())
    assert one.weights_root == 0 and ROOT_KEY not in one.components()


def test_the_root_group_is_what_the_layers_leave_out():
    """The root group is every dense parameter outside the lists whose items `onboard train`
    wraps (`parallel.decoder_blocks`, by the graph's layer blocks); with no layer block in the
    graph, outside the longest list (the plan's layers)."""
    from onboarding.graph.opgraph import OpGraph

    loaded, meta = _build("meta", False)
    names = [n for n, _ in meta.named_parameters() if not n.startswith("model.layers.")]
    assert sorted(names) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    want = sum(meta.get_parameter(n).numel() for n in names)
    assert model_shape(meta, loaded.config, _graph(2)).root == want
    empty = OpGraph(model="m", capture="dispatch", capture_note="", batch=1, seq=1,
                    dtype="float32", blocks=[], layer_pattern="", layer_kinds=[],
                    param_counts={}, total_flops=0)
    assert model_shape(meta, loaded.config, empty).root == want
