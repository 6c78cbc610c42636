"""The plan stage: per-GPU memory, communication and step time of FSDP x EP layouts of the
full-size model (on ``meta``), the layouts that fit ranked, the others with the reason."""

from onboarding.plan.config import ClusterConfig, PlanConfig, Rates, load_cluster, parse_gib
from onboarding.plan.run import run_plan, shape_of
from onboarding.plan.search import PLAN_FILE, Plan, build_plan

__all__ = ["ClusterConfig", "PLAN_FILE", "Plan", "PlanConfig", "Rates", "build_plan",
           "load_cluster", "parse_gib", "run_plan", "shape_of"]
