"""Configuration of the `tiny_dense` example model (`model_type = "onboard_dense"`).

A small dense Llama-style decoder: RMSNorm, RoPE, GQA full causal attention, SwiGLU MLP,
untied LM head.
"""

from transformers import PretrainedConfig


class OnboardDenseConfig(PretrainedConfig):
    r"""Configuration of [`OnboardDenseForCausalLM`].

    Args:
        vocab_size: number of tokens.
        hidden_size: residual stream width.
        intermediate_size: SwiGLU MLP width.
        num_hidden_layers: number of decoder layers.
        num_attention_heads, num_key_value_heads, head_dim: GQA attention layout.
        max_position_embeddings: longest sequence the RoPE tables are meant for.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base (half-split rotation over the whole head dimension).
        initializer_range: std of the normal init of linear and embedding weights.
    """

    model_type = "onboard_dense"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int = 16,
        max_position_embeddings: int = 1024,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not a multiple of "
                f"num_key_value_heads={num_key_value_heads}"
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


__all__ = ["OnboardDenseConfig"]
