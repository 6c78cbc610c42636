"""Kernel family declarations (schema, variants, tuning space, buckets, block matching)."""

from onboarding.families import (conv1d, gated_delta, grouped_linear, kimi_delta, layernorm, lora,
                                 moe_experts, moe_router, rmsnorm, rope, sparse_attention, swiglu)

FAMILIES = (rmsnorm.FAMILY, swiglu.FAMILY, rope.FAMILY, conv1d.FAMILY, gated_delta.FAMILY,
            kimi_delta.FAMILY, moe_router.FAMILY, moe_experts.FAMILY, lora.FAMILY,
            sparse_attention.FAMILY, grouped_linear.FAMILY, layernorm.FAMILY)

__all__ = ["FAMILIES", "conv1d", "gated_delta", "grouped_linear", "kimi_delta", "layernorm", "lora",
           "moe_experts", "moe_router", "rmsnorm", "rope", "sparse_attention", "swiglu"]
