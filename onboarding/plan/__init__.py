"""The plan stage: per-GPU memory, communication and step time of FSDP x EP layouts of the
full-size model (on ``meta``), the layouts that fit ranked, the others with the reason.

The names below are imported at first use (`onboarding.lazy`): `onboard plan --help` reads
`plan.config` without torch."""

from onboarding.lazy import lazy_exports

_EXPORTS = {
    "onboarding.plan.config": ["ClusterConfig", "PlanConfig", "Rates", "load_cluster", "parse_gib"],
    "onboarding.plan.run": ["run_plan", "shape_of"],
    "onboarding.plan.search": ["PLAN_FILE", "Plan", "build_plan"]}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
