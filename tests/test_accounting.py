"""Full-size parameter accounting on the meta device, against counts found independently of it:
published model sizes, and parameter counts written out by hand from each architecture's
layers and its config (not the accounting's own sum over the module tree)."""

from __future__ import annotations

import pytest

from onboarding.load.accounting import count_parameters
from onboarding.load.model import load_model


def _full(ref: str, **overrides):
    lm = load_model(ref, overrides=overrides)
    model = lm.build(device="meta", seed=None)
    return model, count_parameters(model, lm.config), lm.config


def _mixtral_by_hand(cfg) -> dict[str, int]:
    """Mixtral's parameters per category, from its layers: q/o [H, heads*hd], k/v [H, kv*hd],
    two norms a layer and a final one, a router [E, H], E SwiGLU experts (3 H F each)."""
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = cfg.head_dim or H // cfg.num_attention_heads
    attn = 2 * H * cfg.num_attention_heads * hd + 2 * H * cfg.num_key_value_heads * hd
    return {"embedding": V * H, "lm_head": V * H, "dense": L * attn, "norm": (2 * L + 1) * H,
            "moe.router": L * cfg.num_local_experts * H,
            "moe.experts": L * cfg.num_local_experts * 3 * H * cfg.intermediate_size}


def _deepseek_v3_by_hand(cfg) -> dict[str, int]:
    """DeepSeek-V3's parameters per category: MLA (q_a [r_q, H], its norm, q_b [heads (nope +
    rope), r_q], kv_a [r_kv + rope, H], its norm, kv_b [heads (nope + v), r_kv], o [H, heads v]);
    `first_k_dense_replace` dense SwiGLU layers (3 H F), then MoE layers: a router [E, H],
    E routed and n_shared shared SwiGLU experts of width F_moe."""
    H, L, V, n = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.num_attention_heads
    rq, rkv, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    attn = H * rq + rq * n * (nope + rope) + H * (rkv + rope) + rkv * n * (nope + v) + n * v * H
    dense_layers = cfg.first_k_dense_replace
    moe_layers = L - dense_layers
    expert = 3 * H * cfg.moe_intermediate_size
    E = cfg.n_routed_experts
    return {"embedding": V * H, "lm_head": V * H,
            "dense": L * attn + dense_layers * 3 * H * cfg.intermediate_size,
            "norm": L * (rq + rkv) + (2 * L + 1) * H, "moe.router": moe_layers * E * H,
            "moe.experts": moe_layers * E * expert,
            "moe.shared_expert": moe_layers * cfg.n_shared_experts * expert}


def _active_by_hand(by_cat: dict[str, int], top_k: int, n_experts: int) -> int:
    """Every parameter but the routed experts a token does not use."""
    return sum(by_cat.values()) - by_cat["moe.experts"] * (n_experts - top_k) // n_experts


SMALL_MIXTRAL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100,
                     num_local_experts=4, num_experts_per_tok=2)
SMALL_DEEPSEEK = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                      kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                      intermediate_size=40, moe_intermediate_size=12, n_routed_experts=4,
                      num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=3,
                      first_k_dense_replace=1, vocab_size=50, n_group=1, topk_group=1)


def test_small_mixtral_counts_written_out():
    _, c, _ = _full("hf:mixtral", **SMALL_MIXTRAL)
    # per layer: attention 2*32*32 + 2*32*16 = 3072, norms 64, router 4*32 = 128,
    # experts 4 * 3*32*48 = 18432; two layers, embedding and head 100*32 each, final norm 32
    assert c.total == 2 * (3072 + 64 + 128 + 18432) + 2 * 3200 + 32 == 49824
    assert c.active == 49824 - 2 * (4 - 2) * 3 * 32 * 48 == 31392  # 2 of 4 experts a token
    assert c.active_without_embeddings == 31392 - 6400
    assert c.by_category == {"embedding": 3200, "lm_head": 3200, "dense": 6144, "norm": 160,
                             "moe.router": 256, "moe.experts": 36864}
    assert [(m.n_experts, m.top_k) for m in c.moe] == [(4, 2), (4, 2)]


def test_small_deepseek_v3_counts_written_out():
    """MLA, one dense layer, then MoE with a shared expert (counted fully) and a router."""
    _, c, cfg = _full("hf:deepseek_v3", **SMALL_DEEPSEEK)
    # attention 32*16 + 16*2*12 + 32*16 + 12*2*16 + 2*8*32 = 2304 and norms 16 + 12 a layer;
    # layer 0's MLP 3*32*40 = 3840; layers 1-2: router 128, experts 4 * 1152, shared 1152
    assert c.by_category == {"embedding": 1600, "lm_head": 1600, "dense": 3 * 2304 + 3840,
                             "norm": 3 * 28 + 7 * 32, "moe.router": 2 * 128,
                             "moe.experts": 2 * 4608, "moe.shared_expert": 2 * 1152}
    assert c.by_category == _deepseek_v3_by_hand(cfg)
    assert c.total == 26036 and c.active == 26036 - 2 * 2 * 1152 == 21428
    assert [(m.n_experts, m.top_k, len(m.shared_paths)) for m in c.moe] == [(4, 2, 1)] * 2


def test_qwen3_next_default_counts():
    _, c, _ = _full("hf:qwen3_next")
    assert round(c.total / 1e9, 2) == 79.67  # Qwen3-Next-80B-A3B
    assert 3.8e9 < c.active < 3.95e9  # ~3.9B active with embeddings and lm_head
    assert 3.15e9 < c.active_without_embeddings < 3.3e9  # ~3.2B without them
    assert c.moe[0].n_experts == 512 and c.moe[0].top_k == 10
    assert c.moe[0].shared_paths, "the shared expert must be found (counted fully)"


def test_deepseek_v3_default_counts():
    _, c, cfg = _full("hf:deepseek_v3")
    assert round(c.total / 1e9, 2) == 671.03  # DeepSeek-V3's 671B (its MTP layer not built)
    by_hand = _deepseek_v3_by_hand(cfg)
    assert c.by_category == by_hand
    assert c.active == _active_by_hand(by_hand, 8, 256)
    assert 37e9 < c.active < 38.5e9  # "37B activated" (with embeddings and head)


def test_mixtral_default_counts():
    _, c, cfg = _full("hf:mixtral")
    assert c.by_category == _mixtral_by_hand(cfg)
    assert round(c.total / 1e9, 1) == 46.7 and round(c.active / 1e9, 1) == 12.9  # 8x7B: 46.7B, 12.9B
    assert c.active == _active_by_hand(c.by_category, 2, 8)


# (MoE layers, experts, top-k, expert width F, shared experts' total width): from each model's
# config, none from the accounting
MOE_LAYOUT = {
    "hf:qwen3_next": (48, 512, 10, 512, 512),
    "hf:deepseek_v32": (58, 256, 8, 2048, 2048),  # 61 layers, the first 3 dense
    "hf:kimi_linear": (26, 256, 8, 1024, 1024),  # 27 layers, the first dense
    "hf:qwen3_moe": (24, 128, 8, 768, 0),
    "hf:mixtral": (32, 8, 2, 14336, 0),
    "onboard_hybrid": (8, 16, 4, 128, 256),
    "tiny_dense": (0, 0, 0, 0, 0),
}


@pytest.mark.parametrize("ref", list(MOE_LAYOUT))
def test_meta_counts_match_the_config(ref):
    """On meta, for every dev target: embedding and head V x H each, one MoE block per MoE layer
    with the config's experts and top-k, routed experts n_layers E 3 H F, shared experts
    n_layers 3 H F_shared, and the active count short of exactly the unused experts."""
    model, c, cfg = _full(ref)
    assert all(p.device.type == "meta" for p in model.parameters()) or ref == "tiny_dense"
    H, V = cfg.hidden_size, cfg.vocab_size
    layers, E, k, F, F_shared = MOE_LAYOUT[ref]
    assert (c.embedding, c.lm_head, c.tied_embeddings) == (V * H, V * H, False)
    assert [(m.n_experts, m.top_k) for m in c.moe] == [(E, k)] * layers
    assert c.routed_experts == layers * E * 3 * H * F
    assert c.by_category.get("moe.shared_expert", 0) == layers * 3 * H * F_shared
    assert c.by_category.get("moe.router", 0) == layers * E * H
    assert c.active == c.total - layers * (E - k) * 3 * H * F
    assert c.active_without_embeddings == c.active - 2 * V * H


def test_trillion_parameter_config_counts_on_meta():
    """A Kimi-K2-like configuration (384 experts, 61 layers, the first dense): counted without
    allocating (every parameter stays on meta), and counted right."""
    model, c, cfg = _full("hf:deepseek_v3", n_routed_experts=384, num_attention_heads=64,
                          vocab_size=163840, first_k_dense_replace=1)
    assert not any(p.device.type != "meta" for p in model.parameters())
    by_hand = _deepseek_v3_by_hand(cfg)
    assert c.by_category == by_hand
    assert c.routed_experts == 60 * 384 * 3 * 7168 * 2048
    assert c.active == _active_by_hand(by_hand, 8, 384)
    assert 1.02e12 < c.total < 1.04e12 and 32e9 < c.active < 33.5e9  # K2: ~1T total, 32B active


def test_tied_embeddings_counted_once():
    """Llama (2 layers): tied, the head's matrix is the embedding's and counts once; untied, it
    adds V x H as lm_head."""
    _, tied, cfg = _full("hf:llama", tie_word_embeddings=True, num_hidden_layers=2)
    _, untied, _ = _full("hf:llama", tie_word_embeddings=False, num_hidden_layers=2)
    H, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_layer = 2 * H * H + 2 * H * cfg.num_key_value_heads * H // cfg.num_attention_heads \
        + 3 * H * F
    assert tied.tied_embeddings and not untied.tied_embeddings
    assert tied.by_category == {"embedding": V * H, "dense": 2 * per_layer, "norm": 5 * H}
    assert tied.total == V * H + 2 * per_layer + 5 * H == 535842816
    assert (tied.embedding, tied.lm_head) == (V * H, 0)
    assert untied.total == tied.total + V * H and untied.lm_head == V * H


def test_a_layer_stack_at_the_root_is_not_routed_by_a_projection_inside_its_layers():
    """A root-level ModuleList of 2 identical layers whose attention holds a Linear with 2
    outputs (a per-head weight): the router search skips the stack's own modules, also when the
    stack's parent is the model itself (its paths were joined as ".layers.0..." and escaped the
    skip, so the layers read as 2 experts with that Linear as their router)."""
    from torch import nn

    from onboarding.load.accounting import find_moe

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.head_weights = nn.Linear(8, 2)

    class Stack(nn.Module):
        def __init__(self, router: bool):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))
            if router:
                self.gate = nn.Linear(8, 2)

    assert find_moe(Stack(router=False)) == []
    counts = count_parameters(Stack(router=False))
    assert counts.routed_experts == 0 and counts.active == counts.total
    # a real router beside the stack is still found, at the root too
    (moe,) = find_moe(Stack(router=True))
    assert (moe.experts_path, moe.router_path, moe.n_experts) == ("layers", "gate", 2)


def test_per_head_block_diagonal_weights_with_no_routing_are_not_experts():
    """[H, bw, bw] gate weights applied per head (RecurrentGemma's RG-LRU block-diagonal
    linears) with no router and no top-k anywhere are dense parameters every token uses: they
    counted as H routed experts (hf:recurrent_gemma: 18 MoE blocks, 23.7M routed experts, and
    the plan chose EP 2 for a dense model). Packed experts whose router is held elsewhere still
    count when a top-k or the config's expert count says they are routed."""
    import torch
    from torch import nn

    from onboarding.load.accounting import find_moe

    class BlockDiagonal(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_weight = nn.Parameter(torch.zeros(4, 8, 8))
            self.gate_bias = nn.Parameter(torch.zeros(4, 8))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.lru = BlockDiagonal()

    class Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    model = nn.Sequential(Layer(), Layer())
    assert find_moe(model, Cfg()) == []
    counts = count_parameters(model, Cfg())
    assert counts.routed_experts == 0 and counts.active == counts.total and not counts.moe
    # the same packed weights are experts where the config routes tokens over them
    (a, b) = find_moe(model, Cfg(num_experts_per_tok=2))
    assert (a.experts_path, a.n_experts, a.top_k, a.router_path) == ("0.lru", 4, 2, None)
    assert len(find_moe(model, Cfg(num_experts=4))) == 2
    assert find_moe(model, Cfg(num_experts=6)) == []
