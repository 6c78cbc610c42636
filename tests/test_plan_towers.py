"""`onboard plan` of a multimodal model: the parts besides the language model that the model
`onboard train` builds holds (a causal LM that is the whole model, Gemma 3's) are lines of their
own in the memory table, counted as training holds them; a language model taken out alone trains
without its towers, and the plan says they are on no GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from onboarding.plan import ClusterConfig, PlanConfig
from onboarding.plan.memory import BF16, Layout, memory, tower_key
from onboarding.plan.shapes import model_shape

TEXT = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}


def _empty_graph(blocks=()):
    from onboarding.graph.opgraph import OpGraph

    return OpGraph(model="m", capture="dispatch", capture_note="", batch=1, seq=1,
                   dtype="float32", blocks=list(blocks), layer_pattern="", layer_kinds=[],
                   param_counts={}, total_flops=0)


def _tiny_gemma3():
    """A config whose causal LM (transformers' mapping) is the whole model: towers and all."""
    from transformers import CONFIG_MAPPING

    if "gemma3" not in CONFIG_MAPPING:
        pytest.skip("gemma3 is not in the installed transformers")
    return CONFIG_MAPPING["gemma3"](text_config=dict(TEXT), vision_config=dict(VISION),
                                    mm_tokens_per_image=4)


def _loaded(cfg):
    from onboarding.load.model import LoadedModel

    return LoadedModel(ref="tiny", name="tiny", source="hf", config=cfg)


def _language_ids(model, cfg) -> set[int]:
    """The language model's parameters, read off the model itself: the modules built from the
    text config, and the output embedding."""
    ids = {id(p) for m in model.modules() if getattr(m, "config", None) is cfg.text_config
           for p in m.parameters()}
    return ids | {id(p) for p in model.get_output_embeddings().parameters()}


def _tower_params(model, cfg) -> list[torch.nn.Parameter]:
    lang = _language_ids(model, cfg)
    return list({id(p): p for p in model.parameters() if id(p) not in lang}.values())


def _shard_the_way_train_does(model, world: int):
    """`onboard train`'s FSDP2 wrapping (`parallel.shard`): each decoder layer, then the root,
    over a fake process group of ``world`` ranks (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_a_causal_lm_that_holds_its_tower_plans_the_towers_weights():
    """Gemma 3's causal LM is the whole model: `onboard train` keeps its vision tower and
    projector, frozen, in the root's FSDP2 group, which holds them unsharded from the root's
    forward to the end of the backward. The plan counted them as sharded dense weights, under a
    note that said they were in none of its memory; now each part is its own line: rank 0's
    shard (read off FSDP2) and the whole part (counted from the model's own parameters)."""
    import torch.distributed as dist

    cfg = _tiny_gemma3()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = _loaded(cfg).build(device="meta", seed=None)
    shape = model_shape(meta, cfg, _empty_graph())
    whole = sum(p.numel() for p in _tower_params(meta, cfg))
    assert whole > 0 and set(shape.towers) == {"vision", "projector"}
    assert sum(shape.tower_params().values()) == whole
    assert shape.dense + whole == shape.total  # the language part's dense weights alone
    assert shape.towers_run == []  # no block of theirs ran: no activations of theirs

    world = 4
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _loaded(cfg).build(device="cpu", seed=0)
    towers = _tower_params(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    tower_names = [names[id(p)] for p in towers]
    _shard_the_way_train_does(model, world)
    try:
        params = dict(model.named_parameters())
        shard = sum(params[n].to_local().numel() for n in tower_names)
        held = {}

        def at_forward_end(mod, args, out):  # the peak: the end of the forward
            mods = dict(model.named_modules())
            for n in tower_names:
                owner, _, attr = n.rpartition(".")
                t = getattr(mods[owner], attr)
                held[n] = (type(t).__name__, t.numel())

        model.register_forward_hook(at_forward_end)
        for n, p in model.named_parameters():
            p.requires_grad_(False)
        model(input_ids=torch.randint(0, TEXT["vocab_size"], (1, 8)))
    finally:
        dist.destroy_process_group()
    # every tower parameter unsharded (a plain parameter of its full size) at the forward's end
    assert held and all(k != "DTensor" and n == params[p].numel() for p, (k, n) in
                        held.items()), held

    lay = Layout(ep=1, fsdp=world, recompute="none", offload="none")
    mem = memory(shape, PlanConfig(gpus=world, seq=8), lay, ClusterConfig())
    lines = mem.components()
    assert sum(lines[tower_key(k)] for k in shape.towers) == BF16 * (shard + whole)
    assert sum(mem.weights_towers.values()) == BF16 * (shard + whole)
    assert mem.allocated >= mem.weights_dense + BF16 * (shard + whole)

    # one GPU: no FSDP, the parts once; offloaded weights: the shard in host memory, the whole
    # part on the GPU for the step
    one = memory(shape, PlanConfig(gpus=1, seq=8), Layout(ep=1, fsdp=1, recompute="none",
                                                        offload="none"), ClusterConfig())
    assert sum(one.weights_towers.values()) == BF16 * whole
    off = memory(shape, PlanConfig(gpus=world, seq=8),
                 Layout(ep=1, fsdp=world, recompute="none", offload="params"), ClusterConfig())
    assert sum(off.weights_towers.values()) == BF16 * whole
    assert off.host_towers == BF16 * shard


def test_a_tower_block_that_ran_is_a_tower_that_runs():
    """Activations of a tower count only where the captured forward ran it: a block of the op
    graph (not `not_run`) that holds one of its parameters."""
    from onboarding.graph.opgraph import Block

    cfg = _tiny_gemma3()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = _loaded(cfg).build(device="meta", seed=None)
    path = next(n for n, m in meta.named_modules() if type(m).__name__.endswith("MLP")
                and getattr(m, "config", None) is cfg.vision_config)
    params = {n: list(p.shape) for n, p in meta.get_submodule(path).named_parameters()}
    ran = Block(path=path, kind="mlp.dense", layer=0, class_name="MLP", params=params)
    idle = Block(path=path, kind="unknown", layer=0, class_name="MLP", params=params,
                 attrs={"not_run": "ran no op"})
    assert model_shape(meta, cfg, _empty_graph([idle])).towers_run == []
    assert model_shape(meta, cfg, _empty_graph([ran])).towers_run == ["vision"]


def test_a_language_model_taken_out_alone_plans_no_tower():
    """Mllama's causal LM is over its text config alone (and Qwen2-VL's language model is taken
    out of the whole by `build_language_model`): `onboard train` builds no tower, so the plan
    has no tower line, and its note says those parts are on no GPU."""
    from types import SimpleNamespace

    from transformers import CONFIG_MAPPING

    from onboarding.load.multimodal import account
    from onboarding.plan.run import parts_left_out

    if "mllama" not in CONFIG_MAPPING:
        pytest.skip("mllama is not in the installed transformers")
    cfg = CONFIG_MAPPING["mllama"](
        text_config={**TEXT, "num_hidden_layers": 3, "cross_attention_layers": [1],
                     "pad_token_id": 0},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_global_layers": 1, "attention_heads": 2, "image_size": 28,
                       "patch_size": 14, "vision_output_dim": 64,
                       "intermediate_layers_indices": [0]})
    loaded = _loaded(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = loaded.build(device="meta", seed=None)
        shape = model_shape(meta, cfg, _empty_graph())
        full = account(meta, cfg)
    assert shape.towers == {} and shape.dense == sum(p.numel() for p in meta.parameters())
    mem = memory(shape, PlanConfig(gpus=4, seq=8),
                 Layout(ep=1, fsdp=4, recompute="none", offload="none"), ClusterConfig())
    assert not any("part (frozen)" in k for k in mem.components())
    [note] = parts_left_out(SimpleNamespace(full=full, loaded=loaded), shape)
    assert "builds no other part" in note and "vision" in note and "on no GPU" in note


def test_a_text_only_model_has_no_tower():
    from onboarding.load.model import load_model

    loaded = load_model("onboard_hybrid")
    shape = model_shape(loaded.build(device="meta", seed=None), loaded.config, _empty_graph())
    assert shape.towers == {} and shape.towers_run == []
