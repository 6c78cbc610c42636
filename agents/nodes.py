"""Graph nodes: thin calls into the `onboarding` library, reporting progress as custom events."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.config import get_stream_writer

from agents.state import RunState
from onboarding.rundir import append_event
from onboarding.report import TRAIN_SKIPPED_FILE, build_report
from onboarding.graph.opgraph import OpGraph
from onboarding.coverage import Coverage
from onboarding.formatting import count
from onboarding.generate.candidates import load_candidates
from onboarding.policy import (next_exclusions, train_budget, train_plan, tune_budget,
                               tune_seconds)
from onboarding.stages import run_align, run_generate, run_load, run_map, run_parse


def _progress(node: str):
    try:
        writer = get_stream_writer()
    except RuntimeError:  # called outside a graph run
        writer = None

    def step(text: str) -> None:
        if writer is not None:
            writer({"node": node, "step": text})

    return step


def node_run_dir(state: RunState, config: dict | None) -> Path:
    """Where a node writes: the folder the run was opened from (`agents.graph.thread_config`:
    a copied or moved run writes into itself, from any working directory), else (a node called
    directly) the state's own."""
    where = ((config or {}).get("configurable") or {}).get("run_dir")
    return Path(where or state.run_dir)


def _done(state: RunState, node: str, config: dict | None, **updates: Any) -> dict[str, Any]:
    append_event(node_run_dir(state, config), {"node": node, "event": "done"})
    artifacts = {**state.artifacts, **updates.pop("artifacts", {})}
    summary = {**state.summary, **updates.pop("summary", {})}
    return {"completed": [*state.completed, node], "artifacts": artifacts, "summary": summary,
            **updates}


def load_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    _progress("load")("resolving MODEL, full-size accounting on meta")
    append_event(node_run_dir(state, config), {"node": "load", "event": "start"})
    c = state.config
    info = run_load(c.model, node_run_dir(state, config))
    return _done(state, "load", config, model_name=info.loaded.name,
                 artifacts={"model": "model.json"},
                 summary={"total_params": info.full.total, "active_params": info.full.active})


def parse_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    step = _progress("parse")
    step("building the proxy")
    append_event(node_run_dir(state, config), {"node": "parse", "event": "start"})
    c = state.config
    info = run_load(c.model)
    g = run_parse(info, node_run_dir(state, config), batch=c.batch, seq=c.seq, seed=c.seed,
                  on_step=step)
    return _done(state, "parse", config, artifacts={"opgraph": "opgraph.json"},
                 summary={"capture": g.capture, "layer_pattern": g.layer_pattern,
                          "blocks": len(g.blocks), "unknown_blocks": len(g.by_kind("unknown"))})


def plan_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    """Memory per GPU, communication and step time of the full-size model (on meta) for its
    FSDP x EP layouts (`onboarding.plan`); writes plan.json, plan.md and plan.png. The block
    kinds come from the tiny proxy captured as `onboard plan` captures it
    (`onboarding.plan.capture.plan_graph`: again longer where an attention block's parameters
    sat idle at T = 64), not from the run's own graph; the capture's notes join the plan's."""
    from onboarding.plan import PlanConfig, load_cluster, run_plan
    from onboarding.plan.capture import plan_graph

    step = _progress("plan")
    run_dir, c = node_run_dir(state, config), state.config
    append_event(run_dir, {"node": "plan", "event": "start"})
    import torch

    gpus = c.plan_gpus or torch.cuda.device_count() or 8
    step(f"planning the full-size model on {count(gpus, 'GPU')} at {c.plan_seq} tokens")
    try:
        info = run_load(c.model)
        step("block kinds from the tiny proxy, as onboard plan captures it")
        graph, notes = plan_graph(info)
        plan = run_plan(info, graph, PlanConfig(gpus=gpus, seq=c.plan_seq), load_cluster(),
                        run_dir, notes=notes)
    except Exception as exc:  # a plan is advice: its failure is recorded, onboarding goes on
        why = f"plan failed: {type(exc).__name__}: {exc}"
        append_event(run_dir, {"node": "plan", "event": "error", "error": why})
        return _done(state, "plan", config, summary={"plan": why})
    return _done(state, "plan", config, artifacts={"plan": "plan.json"},
                 summary={"plan": plan.verdict})


def map_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    _progress("map")("registry lookup per block")
    run_dir = node_run_dir(state, config)
    append_event(run_dir, {"node": "map", "event": "start"})
    cov = run_map(OpGraph.load(run_dir / "opgraph.json"), run_dir)
    counts = cov.to_dict()["counts"]
    return _done(state, "map", config, artifacts={"coverage": "coverage.json"},
                 summary={"coverage": counts})


def generate_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    step = _progress("generate")
    run_dir = node_run_dir(state, config)
    append_event(run_dir, {"node": "generate", "event": "start"})
    updates: dict[str, Any] = {}
    if not state.generate_decisions and "generate" not in state.completed:
        # first pass only: a retry after a failed alignment keeps the decisions
        decisions = _decide(state, run_dir, step)
        updates["generate_decisions"] = [asdict(d) for d in decisions]
    else:
        from onboarding.generate.decide import Decision, retry_blocks
        from onboarding.stages import use_generated_families

        use_generated_families(run_dir)
        # a retry after a failed alignment: a block whose family was left out is a kernel task
        # now (the LLM, then Inductor); swaps that failed are not decided again
        failed = retry_blocks([Decision.from_dict(d) for d in state.generate_decisions],
                              state.excluded_kernels, len(state.align_attempts))
        if failed:
            decisions = _decide(state, run_dir, step, failed=failed)
            updates["generate_decisions"] = [asdict(d) for d in decisions]
    step("rendering candidates")
    # a kernel alignment left out at every block it serves is rendered, never checked again
    cands = run_generate(Coverage.load(run_dir / "coverage.json"), run_dir, on_step=step,
                         exclude=state.excluded_kernels)
    passed = sum(c.status == "passed" for c in cands)
    # each block's last decision (a retry decides a block again after its family was left out)
    decided = list({d["path"]: d for d in updates.get("generate_decisions",
                                                      state.generate_decisions)}.values())
    served = {k: sum(d["decision"] == k for d in decided) for k in ("generated", "inductor")}
    return _done(state, "generate", config, artifacts={"candidates": "candidates.json"},
                 summary={"candidates": len(cands), "candidates_passed": passed,
                          "uncovered_decided": len(decided), **served}, **updates)


def _decide(state: RunState, run_dir: Path, step, failed: dict[str, str] | None = None
            ) -> list:
    """The decision loop over the uncovered blocks (`onboarding.stages.run_decide`), the LLM
    client built once from the run's options and injected (None with --llm off)."""
    from onboarding.generate.decide import GenerateOptions
    from onboarding.stages import run_decide

    c = state.config
    client = None
    if c.llm:
        from onboarding.generate.llm import LLMClient, LLMConfig

        client = LLMClient(LLMConfig(url=c.llm, model=c.llm_model))  # None: the server's first listed model
    opts = GenerateOptions(llm=c.llm, llm_model=c.llm_model, llm_attempts=c.llm_attempts,
                           budget_s=c.generate_budget_s, batch=c.batch, seq=c.seq, seed=c.seed)

    def record(d) -> None:
        append_event(run_dir, {"node": "generate", "event": "decision", "path": d.path,
                               "decision": d.decision, "why": d.why(),
                               "evidence": [asdict(e) for e in d.evidence]})

    from onboarding.generate.decide import Decision

    earlier = [Decision.from_dict(d) for d in state.generate_decisions] if failed else None
    return run_decide(c.model, OpGraph.load(run_dir / "opgraph.json"),
                      Coverage.load(run_dir / "coverage.json"), run_dir, opts=opts,
                      client=client, on_step=step, on_decision=record, failed=failed,
                      earlier=earlier)


def align_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    step = _progress("align")
    step(f"aligning the patched proxy (attempt {len(state.align_attempts) + 1})")
    run_dir, c = node_run_dir(state, config), state.config
    append_event(run_dir, {"node": "align", "event": "start"})
    info = run_load(c.model)
    from onboarding.generate.decide import DECISIONS_FILE, load_decisions, swaps
    from onboarding.stages import use_generated_families

    use_generated_families(run_dir)
    result = run_align(info, OpGraph.load(run_dir / "opgraph.json"),
                       Coverage.load(run_dir / "coverage.json"),
                       load_candidates(run_dir / "candidates.json"), run_dir,
                       families=c.align_kernels, dtype=c.align_dtype,
                       reference=c.align_reference, batch=c.batch,
                       seq=c.seq, seed=c.seed,
                       exclude={tuple(x) for x in state.excluded_kernels}, strict=c.strict,
                       swaps=swaps(load_decisions(run_dir / DECISIONS_FILE)),
                       on_step=step)  # per-block progress on the run's screen
    culprits = [b.path for b in result.culprits("fwd") or result.culprits("bwd")]
    excluded, stop = next_exclusions(result, state.excluded_kernels)
    attempt = {"attempt": len(state.align_attempts) + 1, "passed": result.passed,
               "culprits": culprits, "excluded_before": state.excluded_kernels,
               "summary": result.summary(), "stop": stop,
               # what it did not check (`onboarding.align.verdicts`), for the run's verdict line
               "checked": result.checked(), "coverable": result.coverable,
               "not_checked": result.not_checked,
               "backward_not_checked": result.backward_not_checked}
    return _done(state, "align", config, artifacts={"alignment": "alignment.json"},
                 align_attempts=[*state.align_attempts, attempt], excluded_kernels=excluded,
                 summary={"alignment_passed": result.passed})


def after_align(state: RunState) -> str:
    """Back to generate while alignment fails, retries remain and the retry changes something
    (`next_exclusions`), else on to tuning."""
    last = state.align_attempts[-1]
    if (last["passed"] or last.get("stop")
            or len(state.align_attempts) > state.config.max_align_retries):
        return "tune"
    return "generate"


def tune_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    """Optuna tile search for every candidate kernel of the run, per shape bucket
    (`onboarding.tune.run`); skipped on the CPU unless `tune_trials` asks for it."""
    from onboarding.rundir import write_json
    from onboarding.tune.search import TuneConfig, gpu_name
    from onboarding.tune.run import RESULTS_FILE, tune_run

    step = _progress("tune")
    run_dir, c = node_run_dir(state, config), state.config
    append_event(run_dir, {"node": "tune", "event": "start"})
    budget = tune_budget(c.tune_trials, gpu=gpu_name())
    trials = budget.amount
    attempt: dict[str, Any] = {"attempt": len(state.tune_attempts) + 1,
                               "trials_per_study": trials, "gpu": gpu_name()}
    if budget.skipped:
        write_json(run_dir / RESULTS_FILE, {"skipped": budget.skipped, "gpu": gpu_name()})
        return _done(state, "tune", config, artifacts={"tune": RESULTS_FILE},
                     tune_attempts=[*state.tune_attempts, {**attempt, "skipped": budget.skipped}],
                     summary={"tuned_studies": 0})
    seconds = tune_seconds(c.tune_budget_s)
    step(f"tuning with {trials} trials per study"
         + (f" within {seconds:.0f} s" if seconds is not None else ""))
    cfg = TuneConfig(n_trials=trials, n_workers=c.tune_workers, aot=c.tune_aot, seed=c.seed,
                     progress=False, storage_dir=run_dir, parallel_studies=c.tune_parallel,
                     gpu_gate=c.tune_gpu_gate, compile_ahead=c.tune_compile_ahead,
                     join_studies=c.tune_join_studies, timing=c.tune_timing)
    # the kernels a failed alignment left out run nowhere: no study is spent on them, and the
    # notes say so (tune.json, the report, the run's summary)
    data = tune_run(run_dir, cfg, families=c.tune_kernels if c.tune_kernels is not None
                    else c.align_kernels, on_step=lambda s: step(f"tuning {s}"),
                    budget_s=seconds, exclude=state.excluded_kernels)
    best = [{"family": s["family"], "variant": s["variant"], "bucket": s["bucket"],
             "best_ms": s["result"]["best_ms"], "default_ms": s["result"]["default_ms"],
             "trials": s["result"]["n_trials"], "complete": s["result"]["n_complete"],
             "stopped": s["result"].get("stopped"), "seconds": s["result"].get("seconds")}
            for s in data["studies"]]
    attempt.update(studies=len(best), best=best, notes=data["notes"], budget_s=seconds,
                   seconds=data.get("seconds"))
    return _done(state, "tune", config, artifacts={"tune": RESULTS_FILE},
                 tune_attempts=[*state.tune_attempts, attempt],
                 summary={"tuned_studies": sum(b["complete"] > 0 for b in best)})


def train_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    """LoRA fine-tuning of the proxy with FSDP2 x EP against its single-process reference
    (`onboarding.train.launch`); skipped on the CPU unless `train_steps` asks for it."""
    import torch
    from rich.console import Console

    from onboarding.train.config import TrainConfig
    from onboarding.train.launch import launch

    step = _progress("train")
    run_dir, c = node_run_dir(state, config), state.config
    append_event(run_dir, {"node": "train", "event": "start"})
    gpus = torch.cuda.device_count()
    budget = train_budget(c.train_steps, gpus=gpus)
    steps = budget.amount
    attempt: dict[str, Any] = {"attempt": len(state.train_attempts) + 1, "steps": steps}
    if budget.skipped:
        from onboarding.rundir import write_json

        write_json(run_dir / TRAIN_SKIPPED_FILE, {"skipped": budget.skipped})
        return _done(state, "train", config, train_attempts=[*state.train_attempts,
                                                     {**attempt, "skipped": budget.skipped}])
    plan = train_plan(OpGraph.load(run_dir / "opgraph.json"), gpus=gpus, nproc=c.train_nproc)
    nproc, ep, fsdp = plan.nproc, plan.ep, plan.fsdp
    cfg = TrainConfig.for_model(c.model, out=str(run_dir.resolve()), nproc=nproc, ep=ep, fsdp=fsdp, steps=steps,
                      seq_len=c.seq, seed=c.seed, dtype=plan.dtype, device=plan.device)
    step(f"training {steps} steps on {count(nproc, 'process', 'processes')} (fsdp {fsdp} x ep {ep})")
    # `onboard -q` sets the onboarding logger above INFO: the launcher's lines stay quiet too
    rc = launch(cfg, console=Console(stderr=True,
                                     quiet=logging.getLogger("onboarding").level > logging.INFO))
    compare = run_dir / "train" / "compare.json"
    verdict = json.loads(compare.read_text()) if compare.exists() else {}
    attempt.update(nproc=nproc, ep=ep, fsdp=fsdp, exit_code=rc,
                   passed=verdict.get("passed"), summary=verdict.get("summary"))
    if nproc == 1 and rc == 0 and not verdict:  # `launch` runs the reference alone
        attempt["single"] = "one process: no parallel run to compare its loss with"
    return _done(state, "train", config, artifacts={"train": "train/compare.json"},
                 train_attempts=[*state.train_attempts, attempt],
                 summary={"train_loss_matches_reference": verdict.get("passed")})


def report_node(state: RunState, config: RunnableConfig = None) -> dict[str, Any]:
    _progress("report")("writing report.md")
    append_event(node_run_dir(state, config), {"node": "report", "event": "start"})
    path = build_report(node_run_dir(state, config), title=state.model_name or "model",
                        attempts=[*state.completed, "report"],
                        align_attempts=state.align_attempts)
    return _done(state, "report", config, artifacts={"report": path.name})
