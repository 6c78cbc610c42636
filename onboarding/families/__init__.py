"""Kernel family declarations (schema, variants, tuning space, buckets, block matching)."""

from onboarding.families import conv1d, gated_delta, kimi_delta, rmsnorm, rope, swiglu

FAMILIES = (rmsnorm.FAMILY, swiglu.FAMILY, rope.FAMILY, conv1d.FAMILY, gated_delta.FAMILY,
            kimi_delta.FAMILY)

__all__ = ["FAMILIES", "conv1d", "gated_delta", "kimi_delta", "rmsnorm", "rope", "swiglu"]
