from onboarding.families import rmsnorm, swiglu
FAMILIES = (rmsnorm.FAMILY, swiglu.FAMILY)
