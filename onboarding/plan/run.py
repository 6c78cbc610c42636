"""The plan stage: the model on ``meta`` joined to its op graph, the layout search, plan.json."""

from __future__ import annotations

from pathlib import Path

from onboarding.graph.opgraph import OpGraph
from onboarding.plan.config import ClusterConfig, PlanConfig
from onboarding.plan.search import PLAN_FILE, Plan, build_plan
from onboarding.plan.shapes import ModelShape, model_shape


def shape_of(info, graph: OpGraph, *, config=None) -> ModelShape:
    """The shapes of ``info``'s full-size model (or of ``config``: a proxy that trains), built
    on ``meta``: no weight is allocated."""
    cfg = config if config is not None else info.loaded.config
    model = info.loaded.build(config, device="meta", seed=None)
    return model_shape(model, cfg, graph, name=info.loaded.name)


def run_plan(info, graph: OpGraph, cfg: PlanConfig, cluster: ClusterConfig,
             out_dir: Path | None = None, *, config=None, notes: list[str] | None = None
             ) -> Plan:
    """The plan of ``info``'s model (``config``: another size of it); writes ``plan.json`` and
    its chart and its report section (``plan.png``, ``plan.md``) in ``out_dir``. ``notes``: what
    the plan should also say (how ``graph`` was captured, `onboarding.plan.capture`)."""
    plan = build_plan(shape_of(info, graph, config=config), cfg, cluster)
    plan.notes[:0] = notes or []
    if out_dir is not None:
        from onboarding.plan.render import MARKDOWN_FILE, PLOT_FILE, markdown, plot
        from onboarding.rundir import write_json

        write_json(out_dir / PLAN_FILE, plan.to_dict())
        drawn = plot(plan, out_dir / PLOT_FILE)
        (out_dir / MARKDOWN_FILE).write_text(markdown(plan, PLOT_FILE if drawn else None) + "\n")
    return plan
