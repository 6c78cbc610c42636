"""`onboard plan`'s activation bytes per block against what autograd keeps in a LoRA step of the
tiny proxies (`fixtures.lora_step`), with onboard's kernels patched in as a GPU run patches them
and with the torch paths a CPU run takes; and the structural rules the counts rest on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from onboarding.load.accounting import path_pattern
from onboarding.plan import PlanConfig
from onboarding.families import families, get_family
from onboarding.plan.memory import BF16, _counted_blocks, block_saved, delta_rule_intermediates
from onboarding.plan.shapes import BlockShape, ModelShape

from fixtures.lora_step import lora_step_kept, proxy_shape

# the families whose kernel keeps the chunked delta rule's intermediates
DELTA_RULE_FAMILIES = tuple(f for f in sorted(families()) if get_family(f).plan_saves == "delta_rule")

LINEAR = ["example", "hf:qwen3_next", "hf:kimi_linear", "hf:bailing_hybrid"]
# the blocks of a linear-attention layer whose kernels a GPU run patches
LINEAR_KINDS = ("linear_attention", "conv.causal1d", "norm.rms_gated")


def _shape(hidden: int, config=None) -> ModelShape:
    return ModelShape(name="m", hidden=hidden, vocab=0, n_layers=1, total=0, routed=0,
                      dense_tensors=[], experts=[], blocks=[], layer_dense_max=0,
                      dense_matmul=0, config=config)


def _per_instance(ref: str, kind: str, t: int, kept: dict[str, int], *, kernels: bool,
                  apart: tuple[str, ...] = ()):
    """[(measured, planned)] bytes per token for each instance of ``ref``'s ``kind`` blocks and
    the blocks inside it (a linear attention's conv, gated norm and decay gate): saved storages
    are put down to whichever module first saved them, so only the whole is the block's; those
    inside of a kind in ``apart`` (a top-k block's q/k norms, which keep their own input) left
    out of both. Planned at the proxy's widths, with the kernels' 16-bit intermediates in fp32
    where the hooks ran them (the CPU's dots are fp32)."""
    shape, graph = proxy_shape(ref)
    counted = _counted_blocks(shape)
    cfg = PlanConfig(gpus=1, ep=1, seq=t, micro_batch=1, kernels=kernels)

    def planned(x) -> float:
        b = next(s for s in shape.blocks if s.pattern == path_pattern(x.path)
                 and s.kind == x.kind)
        if b not in counted:
            return 0.0
        kb = block_saved(b, shape, cfg, 1)[0]
        family = next((f for f in DELTA_RULE_FAMILIES if f in b.kernels), None)
        if kernels and family:
            kb += BF16 * delta_rule_intermediates(b, shape, b.kernels[family])[0]
        return kb

    def under(p: str, path: str) -> bool:
        return p == path or p.startswith(path + ".")

    out = []
    for x in graph.blocks:
        if x.kind.startswith(kind):
            inside = [y for y in graph.blocks if y.path.startswith(x.path + ".")]
            left = [y.path for y in inside if y.kind.startswith(apart)] if apart else []
            inside = [y for y in inside if y.path not in left]
            measured = sum(n for p, n in kept.items() if under(p, x.path)
                           and not any(under(p, q) for q in left)) / t
            out.append((measured, planned(x) + sum(planned(y) for y in inside)))
    assert out
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ref", LINEAR)
def test_linear_attention_keeps_what_its_kernels_keep(ref, tmp_path):
    """A linear-attention layer (the block, its conv and gated norm) with onboard's kernels
    patched in (`delta_rule_kernel_saved`: the kernel's intermediates and inputs, the decay's
    tensors; the norm's bf16 input and gate), against the hooks over a LoRA step of the tiny
    proxy with those kernels patched (Triton's interpreter), within 10%. Before, the plan
    counted transformers' torch chunked form and an fp32 norm whatever ran: 21,968 bytes per
    token against 15,408 kept for the example's layer, 13,960 against 11,124 for Kimi's."""
    t = 64
    kept = lora_step_kept(ref, t, kernels=LINEAR_KINDS, root=tmp_path)
    for measured, planned in _per_instance(ref, "linear_attention", t, kept, kernels=True):
        assert planned == pytest.approx(measured, rel=0.10), (ref, planned, measured)


@pytest.mark.slow
@pytest.mark.parametrize("ref", LINEAR)
def test_linear_attention_torch_path_keeps_what_autograd_keeps(ref):
    """The same layer on its torch path (``kernels=False``: a CPU run), against the hooks over a
    LoRA step without our kernels, within 10%: the chunked form's fp32 copies, C x C matrices
    and states, and for a per-channel decay (Kimi's, Bailing's) its [C, C, d_k] pairwise decays.
    Two chunks of 64 tokens: one alone carries no state from chunk to chunk. Before: 21,968
    bytes per token planned for the example's layer against 27,290 kept, 13,960 for Kimi's
    against 134,991."""
    t = 128
    kept = lora_step_kept(ref, t)
    for measured, planned in _per_instance(ref, "linear_attention", t, kept, kernels=False):
        assert planned == pytest.approx(measured, rel=0.10), (ref, planned, measured)


@pytest.mark.slow
def test_top_k_attention_keeps_what_its_kernel_keeps(tmp_path):
    """The example's top-k attention with onboard's gathered kernel patched in (its q/k norms,
    which keep their own input, apart): q, k and v as handed over (k and v at the query heads),
    the int32 top-k positions, the output and its log-sum-exp, the gate; the indexer, which
    passes no gradient, nothing. Against the hooks over a LoRA step, within 10%. Before: 3,604
    bytes per token planned against 4,176 and 4,432 kept, the indexer's projections counted,
    the positions and the repeated k and v not."""
    t = 64
    kept = lora_step_kept("example", t, kernels=("sparse_attention", "norm.rms"), root=tmp_path)
    for measured, planned in _per_instance("example", "sparse_attention", t, kept,
                                           kernels=True, apart=("norm.",)):
        assert planned == pytest.approx(measured, rel=0.10), (planned, measured)


def test_delta_rule_layer_bytes_by_structure():
    """Per token and instance with the delta-rule kernel: its 16-bit intermediates (per value
    head 3 d_k + d_v + 3 BT, the state d_k d_v / BT), the fp32 log decay per chunk, q, k and v
    as handed over, three fp32 decay tensors and beta, and the fp32 copies of q and k where the
    block normalises them itself. The example's widths: H_k 2, H_v 4, d 64, BT 64."""
    from types import SimpleNamespace

    config = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=64, linear_value_head_dim=64)
    shape = _shape(256, config)
    b = BlockShape(pattern="layers.*.attn", kind="linear_attention.gated_delta", count=1,
                   params=0, linears=[("q", 256, 128), ("o", 256, 256)], attrs={"chunk": 64},
                   ops=1, nested=False, lora_targets=[("q", 256, 128), ("o", 256, 256)],
                   kernels={"gated_delta": {"chunk_size": 64, "qk_l2norm": True,
                                            "qk_l2norm_in_torch": True}})
    sixteen = 4 * (3 * 64 + 64 + 3 * 64 + 64 * 64 / 64)
    assert delta_rule_intermediates(b, shape, b.kernels["gated_delta"]) == (sixteen, 4 * 4 / 64)
    lora = 2 * (256 + 256) + 4 * 16 * 2  # the block's input, the output projection's, rank 16
    inputs = 2 * (2 * 128 + 256) + 4 * (3 * 4 + 4) + 4 * 2 * 128
    cfg = PlanConfig(gpus=1, seq=64)
    assert block_saved(b, shape, cfg, 1)[0] == lora + 2 * sixteen + 4 * 4 / 64 + inputs
    in_kernel = replace(b, kernels={"gated_delta": {"chunk_size": 64, "qk_l2norm": True,
                                                    "qk_l2norm_in_torch": False}})
    assert block_saved(b, shape, cfg, 1)[0] - block_saved(in_kernel, shape, cfg, 1)[0] \
        == 4 * 2 * 128
    # without the kernel, the torch chunked form
    torch_path = block_saved(b, shape, PlanConfig(gpus=1, seq=64, kernels=False), 1)[0]
    assert torch_path == lora + 4 * 4 * (6 * 64 + 6 * 64 + 5 * 64) + 3 * 4 * 4 * 64 * 64 / 64


@pytest.mark.parametrize("family", DELTA_RULE_FAMILIES)
def test_delta_rule_intermediates_are_the_kernels_saved_shapes(family, tmp_path):
    """`delta_rule_intermediates` against the rendered kernel's own `saved_shapes` (what its
    training forward returns for the backward), element for element per token: the example's
    widths (H_k 2, H_v 4, d 64) over two chunks of 64; the per-channel decay (kimi_delta) keeps
    its log decay per key channel."""
    import torch

    from onboarding.generate.templating import load_module, render_to

    module = load_module(render_to(tmp_path, family, "chunk", {"chunk_size": 64}))
    t = 128
    saved = module.saved_shapes(torch.empty(1, t, 2, 64, dtype=torch.bfloat16),
                                torch.empty(1, t, 4, 64, dtype=torch.bfloat16))
    kind = "linear_attention." + ("kimi_delta" if family == "kimi_delta" else "gated_delta")
    b = BlockShape(pattern="a", kind=kind, count=1, params=0, linears=[], attrs={}, ops=1,
                   nested=False)
    from types import SimpleNamespace

    shape = _shape(256, SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4,
                                        linear_key_head_dim=64, linear_value_head_dim=64))
    sixteen, fp32 = delta_rule_intermediates(b, shape, {"chunk_size": 64})
    elements = [torch.Size(s).numel() / t for s, _ in saved]
    assert sum(elements) == sixteen + fp32 / 4
    assert min(elements) == fp32 / 4  # the log decay at each chunk's end, fp32 on any device


def test_lora_inputs_by_adapter_not_by_width():
    """Adapters reading the block's input share one copy; the output projection's input is its
    own even as wide as the block's (H x d_v = D, the example's), and so is each low-rank
    pair's second half. Before, inputs were merged by width: the example's linear attention
    kept one D-wide input for both, a softmax block none (the core's output subtracted from
    the one merged copy)."""
    from onboarding.plan.memory import _lora_saved

    b = BlockShape(pattern="a", kind="linear_attention.gated_delta", count=1, params=0,
                   linears=[], attrs={}, ops=1, nested=False,
                   lora_targets=[("q", 64, 32), ("k", 64, 32), ("g_a", 64, 8), ("g_b", 8, 64),
                                 ("f_a", 64, 8), ("f_b", 8, 64), ("o", 64, 64)])
    b.linears = list(b.lora_targets)
    assert _lora_saved(b, 64, 4) == 2 * (64 + 8 + 8 + 64) + 4 * 4 * 7
    assert _lora_saved(b, 64, 4, output_input=False) == 2 * (64 + 8 + 8) + 4 * 4 * 7


def test_top_k_mla_with_an_adapter_on_its_latents_runs_its_own_attention():
    """The MLA layout of the gathered top-k kernel multiplies by the latents' up-projection
    itself and refuses one wrapped by an adapter: under LoRA (kv_b a default target) the block
    keeps its own attention's tensors, with full training the kernel's."""
    from onboarding.plan.memory import _topk_kernel

    b = BlockShape(pattern="a", kind="sparse_attention.topk", count=1, params=0,
                   linears=[("kv_b", 32, 256), ("o", 128, 64)],
                   attrs={"layout": "mla", "kv_latent": [32, 64], "topk": 16}, ops=1,
                   nested=False, lora_targets=[("kv_b", 32, 256), ("o", 128, 64)],
                   kernels={"sparse_attention": {}})
    assert not _topk_kernel(b, b.kernels, PlanConfig(gpus=1, seq=64))
    assert _topk_kernel(b, b.kernels, PlanConfig(gpus=1, seq=64, mode="full"))
    assert _topk_kernel(replace(b, lora_targets=[("o", 128, 64)]), b.kernels,
                        PlanConfig(gpus=1, seq=64))
    assert not _topk_kernel(replace(b, attrs={"layout": "mha"}, kernels={}), {},
                            PlanConfig(gpus=1, seq=64))


def test_a_norm_over_flattened_heads_has_the_heads_width():
    """A gated norm run on [B * T * H, d] rows (Qwen3-Next's: the core's output reshaped to one
    head a row) normalises H x d per token, at full size the output projection's input; before,
    d (the plan kept 448 bytes per token for hf:qwen3_next's proxy norm, 1,808 kept)."""
    import torch
    from torch import nn

    from onboarding.graph.opgraph import Block, OpGraph, TensorMeta
    from onboarding.plan.shapes import _per_token, _width

    assert _per_token([2 * 64 * 4, 32], 64, 2) == 128
    assert _per_token([64, 256], 64, 1) == 256  # [B * T, D]: one row a token
    graph = OpGraph(model="m", capture="dispatch", capture_note="", batch=1, seq=64,
                    dtype="float32", blocks=[], layer_pattern="", layer_kinds=[],
                    param_counts={}, total_flops=0)
    parent = Block(path="attn", kind="linear_attention.gated_delta", layer=None, class_name="",
                   params={"in_proj.weight": [384, 128], "out_proj.weight": [128, 128]},
                   inputs=[TensorMeta(shape=[1, 64, 128], dtype="float32")])
    norm = Block(path="attn.norm", kind="norm.rms_gated", layer=None, class_name="",
                 params={"weight": [32]}, inputs=[TensorMeta(shape=[256, 32], dtype="float32")])
    graph.blocks += [parent, norm]
    full = nn.Module()
    full.in_proj, full.out_proj = nn.Linear(2048, 12288), nn.Linear(4096, 2048)
    full.norm = nn.Module()
    full.norm.weight = nn.Parameter(torch.ones(128))
    modules = {"attn" + (f".{n}" if n else ""): m for n, m in full.named_modules()}
    assert _width(norm, full.norm, "attn.norm", graph, modules) == 4096


def _delta_rule(q, k, v, g, beta, scale=None):
    return v


def _delta_rule_l2(q, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=False):
    return v


def test_kernel_families_by_structure():
    """The kernel families a GPU run patches into a block, by what their `match` takes and
    whether they bind: a norm gets the rmsnorm kernel, routed experts stay expert parallelism's,
    a delta-rule block the kernel, normalising q and k in torch itself when the function it
    hands them to takes no l2 flag (with one, the kernel normalises)."""
    from torch import nn

    from onboarding.graph.opgraph import Block
    from onboarding.plan.shapes import kernel_families

    class Mixer(nn.Module):
        def forward(self, x):
            return _delta_rule(x, x, x, x, x)

    class FlagMixer(nn.Module):
        def forward(self, x):
            return _delta_rule_l2(x, x, x, x, x, use_qk_l2norm_in_kernel=True)

    norm = Block(path="n", kind="norm.rms", layer=0, class_name="", params={"weight": [8]},
                 attrs={"dim": 8, "eps": 1e-6, "unit_offset": False, "has_weight": True})
    assert set(kernel_families(norm, nn.Module())) == {"rmsnorm"}
    experts = Block(path="e", kind="moe.experts", layer=0, class_name="",
                    attrs={"layout": "packed"})
    assert kernel_families(experts, nn.Module()) == {}
    delta = Block(path="a", kind="linear_attention.gated_delta", layer=0, class_name="",
                  attrs={"chunk": 64, "per_channel_decay": False}, op_histogram={"rsqrt": 2})
    assert kernel_families(delta, Mixer())["gated_delta"]["qk_l2norm_in_torch"]
    assert not kernel_families(delta, FlagMixer())["gated_delta"]["qk_l2norm_in_torch"]
