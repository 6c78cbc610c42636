"""Modeling of the `tiny_dense` example model (Hugging Face remote code).

A small dense Llama-style decoder: pre-norm residual blocks of RMSNorm -> GQA causal attention
(half-split RoPE, `scaled_dot_product_attention(is_causal=True)`) and RMSNorm -> SwiGLU MLP,
then a final RMSNorm and an untied LM head.

Shape legend for suffixed names: B batch, T sequence, D hidden, H heads, K head dim.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_onboard_dense import OnboardDenseConfig


class OnboardDenseRMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


class OnboardDenseRotaryEmbedding(nn.Module):
    """cos/sin tables for half-split RoPE; stateless (frequencies recomputed in forward)."""

    def __init__(self, dim, theta):
        super().__init__()
        self.dim = dim
        self.theta = theta

    def forward(self, position_ids_BT, dtype):
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=position_ids_BT.device) / self.dim
        freqs = position_ids_BT.float()[..., None] / (self.theta**exponent)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_BHTK, cos_BTK, sin_BTK):
    """Half-split RoPE: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]."""
    x1, x2 = x_BHTK.chunk(2, dim=-1)
    return x_BHTK * cos_BTK[:, None] + torch.cat([-x2, x1], dim=-1) * sin_BTK[:, None]


class OnboardDenseAttention(nn.Module):
    def __init__(self, config: OnboardDenseConfig):
        super().__init__()
        D = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=False)

    def forward(self, x_BTD, cos, sin, attention_mask=None):
        B, T, _ = x_BTD.shape
        q_BHTK = self.q_proj(x_BTD).reshape(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k_BHTK = self.k_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BHTK = self.v_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_BHTK, k_BHTK = apply_rope(q_BHTK, cos, sin), apply_rope(k_BHTK, cos, sin)
        # Repeat kv heads explicitly: SDPA's `enable_gqa` flag is not taken by every backend.
        group = self.num_heads // self.num_kv_heads
        k_BHTK = k_BHTK.repeat_interleave(group, dim=1)
        v_BHTK = v_BHTK.repeat_interleave(group, dim=1)
        if attention_mask is None:
            o_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        else:
            # Causal and key-padding mask; a padded query keeps itself so no row is all -inf.
            eye_TT = torch.eye(T, dtype=torch.bool, device=x_BTD.device)
            allowed_BTT = (torch.tril(torch.ones_like(eye_TT)) & attention_mask[:, None, :].bool()) | eye_TT
            o_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, attn_mask=allowed_BTT[:, None])
        return self.o_proj(o_BHTK.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class OnboardDenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: OnboardDenseConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OnboardDenseDecoderLayer(nn.Module):
    def __init__(self, config: OnboardDenseConfig):
        super().__init__()
        self.input_layernorm = OnboardDenseRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = OnboardDenseAttention(config)
        self.post_attention_layernorm = OnboardDenseRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = OnboardDenseMLP(config)

    def forward(self, x_BTD, cos, sin, attention_mask=None):
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos, sin, attention_mask)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


class OnboardDensePreTrainedModel(PreTrainedModel):
    config_class = OnboardDenseConfig
    base_model_prefix = "model"
    _no_split_modules = ["OnboardDenseDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        # `transformers.initialization` functions skip tensors already loaded from a checkpoint.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, OnboardDenseRMSNorm):
            init.ones_(module.weight)


class OnboardDenseModel(OnboardDensePreTrainedModel):
    def __init__(self, config: OnboardDenseConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([OnboardDenseDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = OnboardDenseRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OnboardDenseRotaryEmbedding(config.head_dim, config.rope_theta)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=inputs_embeds.device)[None].expand(B, T)
        cos, sin = self.rotary_emb(position_ids, inputs_embeds.dtype)
        x_BTD = inputs_embeds
        for layer in self.layers:
            x_BTD = layer(x_BTD, cos, sin, attention_mask)
        return self.norm(x_BTD)


class OnboardDenseForCausalLM(OnboardDensePreTrainedModel, GenerationMixin):
    def __init__(self, config: OnboardDenseConfig):
        super().__init__(config)
        self.model = OnboardDenseModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.generation_config.use_cache = False  # no KV cache (see prepare_inputs_for_generation)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No KV cache: every step of `generate` runs the whole prefix (the default would feed
        only the new token once a cache exists)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=False,
        **kwargs,
    ):
        """Causal LM forward. `use_cache` is accepted and ignored (no KV cache).

        attention_mask: optional [B, T] with 1 for real tokens, 0 for padding (keys masked out).
        labels: [B, T] token ids (-100 ignored); the loss predicts labels[:, 1:] from logits[:, :-1].
        """
        hidden_BTD = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds
        )
        logits = self.lm_head(hidden_BTD)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, self.vocab_size),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


__all__ = ["OnboardDenseForCausalLM", "OnboardDenseModel", "OnboardDensePreTrainedModel"]
