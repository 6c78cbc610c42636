"""The run report: one builder, one section per stage, each reading that stage's artifacts.

A stage adds its section by registering a function ``(run_dir) -> str | None`` in `SECTIONS`
(None when its artifact is absent). `build_report` writes ``report.md`` plus the plots it embeds,
and ``report.html``: the same sections as one self-contained page (`onboarding.report_html`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from onboarding.graph.opgraph import OpGraph
from onboarding.graph.parse import PATTERN_LEGEND
from onboarding.formatting import human, table

Section = Callable[[Path], "str | None"]


def _model_section(run_dir: Path) -> str | None:
    f = run_dir / "model.json"
    if not f.exists():
        return None
    m = json.loads(f.read_text())
    p = m["params"]
    rows = [["total", f"{p['total']:,}", human(p["total"])],
            ["active per token", f"{p['active']:,}", human(p["active"])],
            ["active, without embeddings and lm_head", f"{p['active_without_embeddings']:,}",
             human(p["active_without_embeddings"])],
            ["routed experts", f"{p['routed_experts']:,}", human(p["routed_experts"])]]
    out = [f"## Model\n\n`{m['ref']}` ({m['source']}); proxy: {m['proxy']} — {m['proxy_note']}.",
           "", "Full-size parameters, counted on the meta device:", "",
           table(["", "parameters", ""], rows)]
    if len(p.get("by_part") or {}) > 1:  # a multimodal model: the whole, by component
        part = m.get("part") or "language"
        rest = [k for k in p["by_part"] if k != part]
        # the op graph, coverage, kernels and alignment below are of that part alone
        other = ("; `--part vision` onboards the vision tower"
                 if part != "vision" and "vision" in p["by_part"] else "")
        out += ["", f"By component (the {part} part is what this run onboarded: its graph, "
                f"coverage, kernels and alignment below; not {', '.join(rest)}{other}):", "",
                table(["component", "parameters", ""],
                      [[k, f"{v:,}", human(v)] for k, v in p["by_part"].items()])]
        if p.get("parts_note"):
            out += ["", f"Components: {p['parts_note']}."]
    if p["moe"]:
        moe = p["moe"][0]
        out += ["", f"{len(p['moe'])} MoE blocks: {moe['n_experts']} experts, top-k "
                f"{moe['top_k']} ({moe['top_k_source']})."]
        if p.get("alternatives_note"):  # blocks a token takes one of: active counts one
            out += ["", f"Active per token: {p['alternatives_note']}."]
    if m.get("compat_shims"):
        out += ["", f"Remote code written for an older transformers ran through "
                f"{len(m['compat_shims'])} compatibility shims:", "",
                table(["name", "why", "used at"],
                      [[f"`{s['name']}`", s["why"], f"`{s['used_at']}`"]
                       for s in m["compat_shims"]])]
    env = m["environment"]
    out += ["", f"Environment: torch {env['torch']}, transformers {env['transformers']}, "
            f"triton {env['triton']}, commit {env['commit']}, {env['date']}."]
    return "\n".join(out)


def _params_plot(graph: OpGraph, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_kind = graph.param_counts.get("full_by_kind") or {}
    if not by_kind:
        return False
    kinds = sorted(by_kind, key=by_kind.get)
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(kinds) + 1.2))
    div, unit = next(((d, u) for d, u in ((1e9, "billions"), (1e6, "millions"))
                      if max(by_kind.values()) >= d), (1e3, "thousands"))
    ax.barh(kinds, [by_kind[k] / div for k in kinds], color="#4878a8")
    ax.set_xlabel(f"parameters ({unit}, full size)")
    ax.set_title(f"{graph.model}: parameters by block kind")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _opgraph_section(run_dir: Path) -> str | None:
    f = run_dir / "opgraph.json"
    if not f.exists():
        return None
    g = OpGraph.load(f)
    counts = Counter(b.kind for b in g.blocks)
    flops = Counter()
    for b in g.blocks:
        flops[b.kind] += b.flops
    rows = []
    for kind, n in sorted(counts.items()):
        example = next(b for b in g.blocks if b.kind == kind)
        shape = "x".join(map(str, example.inputs[0].shape)) if example.inputs else "-"
        rows.append([f"`{kind}`", n, f"`{example.path}`", shape, human(flops[kind])])
    out = [f"## Operator graph\n\nCaptured with **{g.capture}** ({g.capture_note}); proxy input "
           f"batch {g.batch} x seq {g.seq}, {g.dtype}.", "",
           f"Layer pattern: `{g.layer_pattern}`  ", f"({PATTERN_LEGEND})", "",
           table(["kind", "blocks", "example", "input shape", "FLOPs (proxy)"], rows)]
    if _params_plot(g, run_dir / "params_by_kind.png"):
        out += ["", "![parameters by block kind](params_by_kind.png)"]
    # an unknown block either ran ops no rule explains, or ran none in the proxy's forward (a
    # layer or branch taken only for inputs the run did not give: `parse.unrun_layers`)
    unknown = g.by_kind("unknown")
    unrun = [b for b in unknown if b.attrs.get("not_run")]
    unexplained = [b for b in unknown if not b.attrs.get("not_run")]
    if unexplained:
        out += ["", f"**{len(unexplained)} unknown blocks** (no rule explains them): " +
                ", ".join(f"`{b.path}`" for b in unexplained[:8])]
    if unrun:
        out += ["", f"**{len(unrun)} blocks never ran** in the proxy's forward (taken only for "
                "inputs this run did not give, such as another modality's; not captured, not "
                "checked): " + ", ".join(f"`{b.path}`" for b in unrun[:8])]
    return "\n".join(out)


def _plan_section(run_dir: Path) -> str | None:
    """The plan stage's section (`onboarding.plan.render.markdown`, written beside plan.json)."""
    from onboarding.plan.render import MARKDOWN_FILE

    f = run_dir / MARKDOWN_FILE
    if not f.exists():
        return None
    return "## Plan: the full-size model per GPU\n\n" + f.read_text().strip()


def _coverage_section(run_dir: Path) -> str | None:
    f = run_dir / "coverage.json"
    if not f.exists():
        return None
    from onboarding.coverage import Coverage

    cov = Coverage.load(f)
    groups: dict[tuple, list] = {}
    for e in cov.entries:
        groups.setdefault((e.kind, e.status, e.op), []).append(e)
    rows = [[f"`{k}`", s, op, len(es), "x".join(map(str, es[0].shapes[0])) if es[0].shapes
             else "-", f"{es[0].family}/{es[0].variant}" if es[0].family else es[0].reason]
            for (k, s, op), es in sorted(groups.items())]
    counts = cov.to_dict()["counts"]
    return "\n".join([
        "## Coverage", "", ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", "",
        table(["kind", "status", "op", "blocks", "shape", "how"], rows)])


def _candidates_section(run_dir: Path) -> str | None:
    f = run_dir / "candidates.json"
    if not f.exists():
        return None
    cands = json.loads(f.read_text())
    rows = []
    for c in cands:
        worst = max((x.get("rel_rms") or 0.0 for x in c["checks"]), default=float("nan"))
        rows.append([f"{c['family']}/{c['variant']}", f"`{Path(c['path']).name}`",
                     len(c["blocks"]), c["status"] + (f" ({c['error']})" if c["error"] else ""),
                     f"{worst:.1e}", c["seconds"]])
    return "\n".join([
        "## Generated kernels", "",
        "Each candidate was rendered from its template and checked (forward and every gradient "
        "against its reference, fresh random inputs at the block's widths, fp32).", "",
        table(["family/variant", "file", "blocks", "status", "worst rel. RMS", "seconds"],
              rows)])


def _decisions_section(run_dir: Path) -> str | None:
    """"Why this kernel": per uncovered block (blocks of one structure together), what the
    generate stage's decision loop chose and why the earlier options were not taken
    (`onboarding.generate.decide`), with the block's alignment verdict when there is one."""
    from onboarding.generate.decide import DECISIONS_FILE, load_decisions

    decisions = load_decisions(run_dir / DECISIONS_FILE)
    if not decisions:
        return None
    verdicts: dict[str, str] = {}
    f = run_dir / "alignment.json"
    if f.exists():
        aligned = json.loads(f.read_text())
        # a block the alignment did not patch (left uncovered, or its swap not asked for by
        # --kernels) ran its own code there: its verdict says nothing of a kernel
        active = {p["path"] for p in aligned.get("patches", []) if p.get("status") == "active"}
        for b in aligned.get("blocks", []):
            verdicts[b["path"]] = f"fwd {b['fwd']['verdict']}, bwd {b['bwd']['verdict']}" + (
                "" if "patches" not in aligned or b["path"] in active
                else " (not patched: its own code)")
    # a retry decides a block again after its family failed alignment: the last decision holds,
    # and the block's alignment verdict is that decision's
    last = {d.path: d for d in decisions}
    groups: dict[tuple, list] = {}
    for d in decisions:
        groups.setdefault((d.key, d.decision, d.inside is not None, last[d.path] is not d),
                          []).append(d)
    rows = []
    for (_, decision, _, replaced), ds in groups.items():
        first = ds[0]
        paths = f"`{first.path}`" + (f" and {len(ds) - 1} more like it" if len(ds) > 1 else "")
        where = ", ".join(sorted({verdicts[d.path] for d in ds if d.path in verdicts}))
        if replaced:
            decision, where = f"{decision}, left out", "failed alignment (decided again)"
        if not where and first.inside:  # judged with the block it is compiled in
            outer = sorted({verdicts[d.inside] for d in ds if d.inside in verdicts})
            where = f"{', '.join(outer)} (with the enclosing block)" if outer else ""
        where = where or "-"
        secs = sum(e.seconds for e in first.evidence)
        code = f"`{Path(first.code_dir).relative_to(run_dir)}`" if first.code_dir and \
            Path(first.code_dir).is_relative_to(run_dir) else "-"
        rows.append([paths, f"`{first.kind}`", first.op, decision,
                     first.why().replace("|", "/"), f"{secs:.1f}", code, where])
    served = sum(d.decision != "uncovered" for d in last.values())
    return "\n".join([
        "## Why this kernel", "",
        f"{served} of {len(last)} blocks that no family served are now served "
        "(template, then the LLM with --llm, then torch.compile with Inductor, each gated by "
        "the block check: forward and every gradient against the block's own eager forward at "
        "the captured and odd sizes); the rest stay in the model's own code.", "",
        table(["blocks", "kind", "op", "decision", "why (evidence per option)", "seconds",
               "code", "alignment"], rows)])


SECTIONS: list[Section] = [_model_section, _opgraph_section, _plan_section, _coverage_section,
                           _decisions_section, _candidates_section]


def _alignment_section(run_dir: Path) -> str | None:
    f = run_dir / "alignment.md"
    if not f.exists():
        return None
    out = ["## Alignment", "", f.read_text().strip()]
    if (run_dir / "alignment.png").exists():
        out += ["", "![error per block](alignment.png)"]
    return "\n".join(out)


SECTIONS.append(_alignment_section)


def _llm_section(run_dir: Path) -> str | None:
    """LLM-written kernel families and which are kernel-PR candidates (after alignment); writes
    ``generated/pr_candidates.json`` (`onboarding.generate.llm.review`)."""
    from onboarding.generate.llm.review import report_section

    return report_section(run_dir)


SECTIONS.append(_llm_section)


def _tuning_section(run_dir: Path) -> str | None:
    """One table per study (kernel x shape bucket) and the best-so-far-vs-trials plot."""
    from onboarding.tune.search import markdown_table, result_from_dict
    from onboarding.tune.run import PLOT_FILE, load_results

    data = load_results(run_dir)
    if data is None:
        return None
    out = ["## Tuning", ""]
    if data.get("skipped"):
        return "\n".join(out + [f"Tuning {data['skipped']}."])
    out += [f"Optuna (TPE, warm-started from the bucket default and neighbouring tuned "
            f"buckets), {data['trials_per_study']} trials per study on {data['gpu']}, "
            f"{data['dtype']}; every trial checked against the reference before timing. "
            f"Studies are in `tune.db` (optuna-dashboard reads it).", ""]
    if data["gpu"] == "cpu-interpreter":
        out += ["*No GPU: times are Triton-interpreter wall clock, not kernel speed.*", ""]
    for s in data["studies"]:
        dims = ", ".join(f"{k}={v}" for k, v in (s["dims"] or {}).items()
                         if data["gpu"] != "cpu-interpreter") or "the family's sample shapes"
        out += [f"### {s['family']}/{s['variant']} — bucket `{s['bucket']}`", "",
                f"`{s['module']}`, {len(s['blocks'])} blocks; {s['size_source']} = "
                f"{s['size']}; timed at {dims}.", "",
                markdown_table([result_from_dict(s["result"])]).strip(), ""]
    if not data["studies"]:
        out += ["Nothing to tune: no passing candidate kernels.", ""]
    out += [f"- {n}" for n in data.get("notes", [])]
    if (run_dir / PLOT_FILE).exists():
        out += [f"![best so far vs trials]({PLOT_FILE})"]
    return "\n".join(out).rstrip()


SECTIONS.append(_tuning_section)


def build_report(run_dir: Path, *, title: str, attempts: list[str] | None = None,
                 align_attempts: list[dict] | None = None) -> Path:
    parts = [f"# onboard run: {title}", ""]
    if attempts:
        parts += ["Stages run: " + " -> ".join(attempts), ""]
    for section in SECTIONS:
        text = section(run_dir)
        if text:
            parts += [text, ""]
    if align_attempts:
        rows = [[a["attempt"], ("pass" if a["passed"] else "FAIL")
                 + (f" ({len(a['not_checked'])} coverable not checked)"
                    if a.get("not_checked") else ""),
                 ", ".join(f"`{c}`" for c in a["culprits"]) or "-",
                 ", ".join(f"`{p}` ({f})" for p, f in a["excluded_before"]) or "-"]
                for a in align_attempts]
        parts += ["### Alignment attempts", "",
                  table(["attempt", "verdict", "culprits", "kernels left out"], rows), ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(parts))
    from onboarding.report_html import write_html

    write_html(path)  # report.html beside it: the same sections, one self-contained page
    return path


TRAIN_SKIPPED_FILE = "train_skipped.json"  # written by the agent's train node when it skips


TRAIN_METRICS_HEADER = ["run", "tokens/s", "step ms", "MFU", "all-to-all", "a2a exposed",
                        "peak GiB", "max expert load / mean", "steps"]


def train_metrics(run_dir: Path) -> tuple[list[str], list[list]]:
    """Header and one row per training run (reference, parallel, baseline) of a run directory:
    medians of the per-step metrics, the first step left out (the report and the terminal)."""
    from onboarding.train.compare import read_rows, summarize

    train = run_dir / "train"
    cmp_file = train / "compare.json"
    if cmp_file.exists():
        runs = json.loads(cmp_file.read_text())["metrics"]
    else:  # a single-process run (no comparison): whatever rows there are
        runs = {role: summarize(read_rows(train / f"{role}.jsonl"))
                for role in ("reference", "parallel", "baseline")
                if (train / f"{role}.jsonl").exists()}

    def fmt(v, kind):
        if v is None:
            return "—"
        return {"pct": f"{100 * v:.1f}%", "gib": f"{v / 2 ** 30:.2f}",
                "num": f"{v:,.0f}", "x": f"{v:.2f}", "s": f"{v * 1e3:.1f}"}[kind]

    rows = [[role, fmt(m.get("tokens_per_s"), "num"), fmt(m.get("step_time_s"), "s"),
             fmt(m.get("mfu"), "pct"), fmt(m.get("a2a_share"), "pct"),
             fmt(m.get("a2a_exposed_share"), "pct"), fmt(m.get("peak_mem_bytes"), "gib"),
             fmt(m.get("expert_max_imbalance"), "x"), m.get("steps", "—")]
            for role, m in runs.items() if m]
    return TRAIN_METRICS_HEADER, rows


def baseline_runs(run_dir: Path) -> str | None:
    """What the run directory's ``--baseline`` ran, as its rows say (`lm.baseline_label`:
    transformers + PEFT, or the eager model + PEFT for a plain nn.Module); None without a
    baseline or from a run whose rows do not say."""
    from onboarding.train.compare import read_rows

    path = run_dir / "train" / "baseline.jsonl"
    rows = read_rows(path).values() if path.exists() else []
    return next((r["runs"] for r in rows if isinstance(r.get("runs"), str)), None)


def _train_section(run_dir: Path) -> str | None:
    """Setup, loss comparison (parallel vs single-process reference) and per-step metrics."""
    train = run_dir / "train"
    if not (train / "reference.jsonl").exists():
        skipped = run_dir / TRAIN_SKIPPED_FILE
        if skipped.exists():
            why = json.loads(skipped.read_text()).get("skipped", "skipped")
            return "\n".join(["## Training (FSDP2 + EP LoRA)", "", f"Training {why}."])
        return None
    from onboarding.train.config import TrainConfig
    from onboarding.train.launch import describe

    out = ["## Training (FSDP2 + EP LoRA)", ""]
    toml = run_dir / "train.toml"
    if toml.exists():
        cfg = TrainConfig.from_toml(toml)
        g = run_dir / "opgraph.json"
        experts = {b.attrs.get("n_experts") for b in OpGraph.load(g).by_kind("moe.experts")} \
            if g.exists() else set()
        n_exp = next(iter(experts)) if len(experts) == 1 else None
        out += [table(["setup", ""], describe(cfg, n_exp)), ""]
    cmp_file = train / "compare.json"
    if cmp_file.exists():
        cmp = json.loads(cmp_file.read_text())
        out += [f"**{cmp['summary']}**", ""]
        if (train / "loss.png").exists():
            out += ["![loss: parallel vs reference](train/loss.png)", ""]
    else:
        out += ["Single-process run only (no parallel run to compare).", ""]
    out += ["Per-step metrics (medians, first step left out; MFU with LoRA-correct FLOPs):", "",
            table(*train_metrics(run_dir))]
    if runs := baseline_runs(run_dir):
        out += ["", f"The baseline ran the {runs}: the model's own forward as it stands (no "
                "onboard kernels, no expert parallelism) with PEFT's LoRA on the same targets, "
                "one device."]
    if (train / "metrics.png").exists():
        out += ["", "![training metrics](train/metrics.png)"]
    trained = train / ("parallel.jsonl" if (train / "parallel.jsonl").exists()
                       else "reference.jsonl")
    from onboarding.train.compare import read_rows as _read, summarize as _summ

    m = _summ(_read(trained)) if trained.exists() else {}
    if m.get("dropped_tokens") is not None:
        out += ["", f"Capacity factor: {m['dropped_tokens']:,} (token, expert) pairs dropped "
                f"over {m['steps']} steps ({100 * (m['dropped_share'] or 0):.1f}% of the routed "
                "pairs on average)."]
    out += _kernel_lines(train)
    if (train / "balance.png").exists():
        out += ["", "![expert load balance](train/balance.png)"]
    if (train / "adapter" / "adapter_config.json").exists():
        out += ["", "Adapters exported in PEFT format: `train/adapter/`."]
    return "\n".join(out)


def _kernel_lines(train: Path) -> list[str]:
    """Which kernels each run patched, and why a patch fell back to the model's torch path (the
    first step's row: patches calibrate on their first call)."""
    out = []
    for role in ("reference", "parallel"):
        path = train / f"{role}.jsonl"
        if not path.exists():
            continue
        row = next((r for r in map(json.loads, path.read_text().splitlines()) if "kernels" in r), None)
        if row is None:
            continue
        used = ", ".join(f"{k} {n}" for k, n in sorted(row["kernels"].items()) if not k.startswith("rejected:"))
        out += ["", f"Kernels patched in the {role} run: {used or 'none'}."]
        rejected = row.get("kernels_rejected") or {}
        if rejected:
            out += [f"Rejected at their first call (these blocks ran the model's torch path), "
                    f"{len(rejected)}:", ""]
            out += [f"- `{path_}`: {why}" for path_, why in sorted(rejected.items())]
    return out


SECTIONS.append(_train_section)


def _scaling_section(run_dir: Path) -> str | None:
    """The weak-scaling table and plot of `onboard scale`."""
    from onboarding.train.scaling import PLOT_FILE, RESULTS_FILE, markdown

    path = run_dir / RESULTS_FILE
    if not path.exists():
        return None
    out = ["## Weak scaling (FSDP2 x EP)", "", markdown(json.loads(path.read_text()))]
    if (run_dir / PLOT_FILE).exists():
        out += [f"![weak scaling]({PLOT_FILE})"]
    return "\n".join(out)


SECTIONS.append(_scaling_section)


def _seq_sweep_section(run_dir: Path) -> str | None:
    """The sequence-length table and plot of `onboard train --seq-sweep`."""
    from onboarding.train.seqsweep import PLOT_FILE, RESULTS_FILE, markdown

    path = run_dir / RESULTS_FILE
    if not path.exists():
        return None
    out = ["## Sequence length", "", markdown(json.loads(path.read_text()))]
    if (run_dir / PLOT_FILE).exists():
        out += [f"![sequence sweep]({PLOT_FILE})"]
    return "\n".join(out)


SECTIONS.append(_seq_sweep_section)
