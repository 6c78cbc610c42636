from onboarding.families import rmsnorm, swiglu, rope
FAMILIES = (rmsnorm.FAMILY, swiglu.FAMILY, rope.FAMILY)
