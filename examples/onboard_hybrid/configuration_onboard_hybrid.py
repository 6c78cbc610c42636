"""Configuration of the `onboard_hybrid` example model (Hugging Face remote code).

A miniature of a modern hybrid flagship: about 3/4 of the layers are gated delta nets
(linear attention), the rest DeepSeek-V3.2-style top-k sparse attention with a light indexer,
and every layer's MLP is a sparse mixture of experts with a shared expert.
"""

from transformers import PretrainedConfig
from transformers import configuration_utils

# Layer-type names. `transformers` validates `layer_types` against a fixed vocabulary, and the
# name of a DSA-style layer moved between releases: 5.17 accepts "deepseek_sparse_attention",
# 5.24 accepts "indexed_attention" only (it remaps the old name in `__init__`, but not on
# attribute assignment or in `validate`). A plain "sparse_attention" is refused by both. So every
# alias is stored as the name the installed release accepts.
LINEAR_ATTENTION = "linear_attention"
SPARSE_ATTENTION_NAMES = ("sparse_attention", "deepseek_sparse_attention", "indexed_attention")
_ACCEPTED = getattr(configuration_utils, "ALLOWED_LAYER_TYPES", ())
SPARSE_ATTENTION = "indexed_attention" if "indexed_attention" in _ACCEPTED else "deepseek_sparse_attention"


def is_sparse_attention(layer_type: str) -> bool:
    """Whether a `layer_types` entry names a top-k sparse attention layer."""
    return layer_type in SPARSE_ATTENTION_NAMES


def _canonical_layer_types(layer_types):
    if layer_types is None:
        return None
    layer_types = [SPARSE_ATTENTION if is_sparse_attention(t) else t for t in layer_types]
    bad = sorted({t for t in layer_types if t != LINEAR_ATTENTION and not is_sparse_attention(t)})
    if bad:
        raise ValueError(
            f"layer_types entries must be 'linear_attention' or one of {SPARSE_ATTENTION_NAMES}, got {bad}"
        )
    return layer_types


def resolve_layer_types(config) -> list[str]:
    """The per-layer types of `config`: its `layer_types`, or the default pattern when None.

    The default puts a sparse attention layer every `full_attention_interval` layers (L L L S for
    4). Raises ValueError when the list does not have `num_hidden_layers` entries.
    """
    layer_types = config.layer_types
    if layer_types is None:
        interval = config.full_attention_interval
        layer_types = [
            SPARSE_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(config.num_hidden_layers)
        ]
    if len(layer_types) != config.num_hidden_layers:
        raise ValueError(
            f"len(layer_types)={len(layer_types)} != num_hidden_layers={config.num_hidden_layers}: "
            "set both together when shrinking or growing the model"
        )
    return list(layer_types)


class OnboardHybridConfig(PretrainedConfig):
    r"""Configuration of [`OnboardHybridForCausalLM`].

    Args:
        vocab_size: number of tokens.
        hidden_size: residual stream width D.
        num_hidden_layers: number of decoder layers.
        layer_types: one entry per layer, "linear_attention" (gated delta net) or
            "sparse_attention" (aliases "deepseek_sparse_attention", "indexed_attention"; stored
            as the name the installed `transformers` accepts). Default: every
            `full_attention_interval`-th layer sparse, the others linear.
        full_attention_interval: period of the default pattern (4 gives L L L S).
        max_position_embeddings: longest sequence the RoPE tables are meant for.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base (half-split rotation over the whole head dimension).
        initializer_range: std of the normal init of linear and embedding weights.
        num_attention_heads, num_key_value_heads, head_dim: GQA layout of sparse attention.
        attention_bias: bias on q/k/v/o projections of sparse attention.
        qk_norm: per-head RMSNorm on queries and keys of sparse attention.
        index_n_heads, index_head_dim: indexer layout (keys are shared across index heads).
        index_topk: keys kept per query (min(index_topk, T) at run time).
        linear_num_key_heads, linear_num_value_heads: gated delta net heads; value heads are a
            multiple of key heads (each key head serves consecutive value heads).
        linear_key_head_dim, linear_value_head_dim: gated delta net head sizes.
        linear_conv_kernel_dim: kernel of the causal depthwise conv1d before the delta rule.
        linear_chunk_size: chunk length of the chunked gated delta rule.
        num_experts, num_experts_per_tok: routed experts and top-k.
        moe_intermediate_size: FFN width F of one routed expert.
        shared_expert_intermediate_size: FFN width of the shared expert (0 disables it).
        scoring_func: router scoring, "softmax" or "sigmoid".
        norm_topk_prob: renormalise the top-k weights to sum to 1.
        routed_scaling_factor: multiplier on the routed weights.
        moe_dispatch: "masked" (per-expert loop over fixed-shape masks; any device and dtype) or
            "grouped_mm" (argsort permute + `torch._grouped_mm`; needs bf16 on CUDA).
    """

    model_type = "onboard_hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 256,
        num_hidden_layers: int = 8,
        layer_types: list[str] | None = None,
        full_attention_interval: int = 4,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        initializer_range: float = 0.02,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int = 64,
        attention_bias: bool = False,
        qk_norm: bool = True,
        index_n_heads: int = 2,
        index_head_dim: int = 32,
        index_topk: int = 64,
        linear_num_key_heads: int = 2,
        linear_num_value_heads: int = 4,
        linear_key_head_dim: int = 64,
        linear_value_head_dim: int = 64,
        linear_conv_kernel_dim: int = 4,
        linear_chunk_size: int = 64,
        num_experts: int = 16,
        num_experts_per_tok: int = 4,
        moe_intermediate_size: int = 128,
        shared_expert_intermediate_size: int = 256,
        scoring_func: str = "softmax",
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        moe_dispatch: str = "masked",
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        layer_types = _canonical_layer_types(layer_types)
        if layer_types is None:
            layer_types = [
                SPARSE_ATTENTION if (i + 1) % full_attention_interval == 0 else LINEAR_ATTENTION
                for i in range(num_hidden_layers)
            ]
        if len(layer_types) != num_hidden_layers:
            raise ValueError(f"len(layer_types)={len(layer_types)} != num_hidden_layers={num_hidden_layers}")
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not a multiple of "
                f"num_key_value_heads={num_key_value_heads}"
            )
        if linear_num_value_heads % linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={linear_num_key_heads}"
            )
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
        if moe_dispatch not in ("masked", "grouped_mm"):
            raise ValueError(f"moe_dispatch must be 'masked' or 'grouped_mm', got {moe_dispatch!r}")
        if not 0 < num_experts_per_tok <= num_experts:
            raise ValueError(f"need 0 < num_experts_per_tok={num_experts_per_tok} <= num_experts={num_experts}")

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.layer_types = layer_types
        self.full_attention_interval = full_attention_interval
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.linear_chunk_size = linear_chunk_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_dispatch = moe_dispatch
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def __setattr__(self, key, value):
        # `from_pretrained(..., layer_types=[...])` and `--set` style overrides assign attributes
        # after `__init__`; keep the stored names valid for `validate()` / `save_pretrained`.
        if key == "layer_types":
            value = _canonical_layer_types(value)
        super().__setattr__(key, value)


__all__ = ["OnboardHybridConfig", "is_sparse_attention", "resolve_layer_types"]
