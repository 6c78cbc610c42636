"""sparse_attention declines an absorbed-MLA top-k block whose attention has no rope part (Mistral
Large 4's layer 3, ``no_rope_layers``): the kernel's shared KV is [latent | rope] (D_QK > D_V),
and with q/k no wider than the latent columns of the expansion the binding rejects every layout
("q/k width 32 leaves no rope part after 32 latent columns"). Coverage said template; it reads
the widths the family's probe recorded (`binding.SPARSE`: the attention call's q/k/v, the latent
expansions before it) and says uncovered, why. A layer with a rope part stays served."""

from __future__ import annotations

from onboarding.coverage import build_coverage
from onboarding.graph.opgraph import Block, OpGraph

ATTRS = {"layout": "mla", "kv_latent": [32], "topk": 16, "indexer_relu": True,
         "topk_inputs": [{"shape": [1, 64, 64], "dtype": "float32", "dim": -1, "largest": True}]}


def _found(expansion_rows: int) -> dict:
    # what the probe records at the attention call: q/k [B, H, T, D_QK], v [B, H, S, D_V] and the
    # [H (d_nope + d_v), latent] expansion; mistral_large4's tiny proxy, 4 heads, latent 32
    return {"attention": [{"q": [1, 4, 64, 32], "k": [1, 4, 64, 32], "v": [1, 4, 64, 32],
                           "latent": [[expansion_rows, 32]]}]}


def test_mla_layer_without_rope_is_not_claimed():
    blocks = [Block(path=f"layers.{i}.self_attn", kind="sparse_attention.topk", layer=i, class_name="",
                    attrs={**ATTRS, "core_calls": {"sparse-attention": _found(rows)}})
              for i, rows in ((0, 192), (3, 256))]  # d_nope 16 + d_v 32 (rope 16); d_nope 32 (none)
    graph = OpGraph(model="m", capture="export", capture_note="", batch=1, seq=64, dtype="float32",
                    blocks=blocks, layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)
    entries = {e.path: e for e in build_coverage(graph).entries
               if e.op in ("sparse_attention", "indexer + top-k + gathered attention")
               or e.family == "sparse_attention"}
    served = entries["layers.0.self_attn"]
    assert served.family == "sparse_attention" and served.status in ("template", "kernel"), served
    refused = entries["layers.3.self_attn"]
    assert refused.status == "uncovered" and refused.family is None, refused
    assert "its binding would leave this block unpatched" in refused.reason, refused.reason
    assert "q/k width 32 leaves no rope part after 32 latent columns" in refused.reason, refused.reason
