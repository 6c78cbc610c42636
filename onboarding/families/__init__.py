"""Kernel families as plugins: the `FamilySpec` a family folder declares, and the registry of the
folders found (built-in `kernel_templates/<family>/`, `--families DIR`, `ONBOARD_FAMILIES`, the
`onboard.families` entry points). Stages iterate over `families()`; none names a family.
"""

from onboarding.families.discover import (ENV_VAR, Family, FamilyWarning, Skipped, add_dirs,
                                          families, family_module, get_family, training_kernel,
                                          match_block, refused_by, registry, reset, skipped,
                                          subprocess_env)
from onboarding.families.spec import FamilySpec, NightlySpec, Param, ShapeBucket

__all__ = ["ENV_VAR", "Family", "FamilySpec", "FamilyWarning", "Param", "ShapeBucket", "Skipped",
           "add_dirs", "families", "family_module", "get_family", "training_kernel",
           "match_block", "NightlySpec", "refused_by", "registry", "reset", "skipped", "subprocess_env"]
