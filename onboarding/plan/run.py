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


def parts_left_out(info, shape: ModelShape | None = None) -> list[str]:
    """What a multimodal model's plan leaves out: the plan is of the model `onboard train`
    builds (the language model, and where its causal LM is the whole model the parts it holds:
    ``shape.towers``, lines of their own), while the report's totals count every part. The
    parts it does not build are on no GPU; the plan's memory rows said "the full-size model"
    with no word of them."""
    full = info.full
    parts = dict(getattr(full, "by_part", None) or {})
    planned = getattr(info.loaded, "part", None) or "language"
    if len(parts) < 2 or planned not in parts:
        return []
    from onboarding.formatting import human

    held = set(shape.towers) if shape is not None else set()
    rest = {k: v for k, v in parts.items() if k != planned and k not in held}
    if not rest:
        return []
    return [f"the plan is of the model `onboard train` builds, the {planned} part "
            f"({human(parts[planned])} of the model's {human(sum(parts.values()))} parameters)"
            + "".join(f" and the {k} part" for k in parts if k in held)
            + "; it builds no other part (its batches are token ids): "
            + ", ".join(f"{k} {human(v)}" for k, v in rest.items())
            + f" parameters ({sum(rest.values()) * 2 / 2**30:.2f} GiB of weights in bf16, "
            "unsharded) are on no GPU, in none of the plan's memory, communication or step time"]


def run_plan(info, graph: OpGraph, cfg: PlanConfig, cluster: ClusterConfig,
             out_dir: Path | None = None, *, config=None, notes: list[str] | None = None
             ) -> Plan:
    """The plan of ``info``'s model (``config``: another size of it); writes ``plan.json`` and
    its chart and its report section (``plan.png``, ``plan.md``) in ``out_dir``. ``notes``: what
    the plan should also say (how ``graph`` was captured, `onboarding.plan.capture`)."""
    shape = shape_of(info, graph, config=config)
    plan = build_plan(shape, cfg, cluster)
    plan.notes[:0] = (notes or []) + ([] if config is not None else parts_left_out(info, shape))
    if out_dir is not None:
        from onboarding.plan.render import MARKDOWN_FILE, PLOT_FILE, markdown, plot
        from onboarding.rundir import write_json

        write_json(out_dir / PLAN_FILE, plan.to_dict())
        drawn = plot(plan, out_dir / PLOT_FILE)
        (out_dir / MARKDOWN_FILE).write_text(markdown(plan, PLOT_FILE if drawn else None) + "\n")
    return plan
