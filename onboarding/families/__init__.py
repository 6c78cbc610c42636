"""Kernel family declarations (schema, variants, tuning space, buckets, block matching)."""

from onboarding.families import conv1d, rmsnorm, rope, swiglu

FAMILIES = (rmsnorm.FAMILY, swiglu.FAMILY, rope.FAMILY, conv1d.FAMILY)

__all__ = ["FAMILIES", "conv1d", "rmsnorm", "rope", "swiglu"]
