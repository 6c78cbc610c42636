"""``onboard parse``, ``map``, ``generate`` and ``align``: the stages up to the one named."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from rich.console import Console

from onboarding.cli.common import command_parser, model_options, model_spec, progress, selected_kernels
from onboarding.errors import EXIT_CHECK_FAILED, EXIT_OK


def add_parser(sub) -> None:
    p = command_parser(sub, "parse", help="capture the proxy and classify its blocks")
    model_options(p)
    p.add_argument("--out", help="write model.json and opgraph.json here")
    p.add_argument("--json", action="store_true", help="print opgraph.json to stdout")
    p.set_defaults(func=cmd_analyse)

    m = command_parser(sub, "map", help="coverage: which ops have kernels, templates, fast paths")
    model_options(m)
    m.add_argument("--out", help="write model.json, opgraph.json and coverage.json here")
    m.add_argument("--json", action="store_true", help="print coverage.json to stdout")
    m.set_defaults(func=cmd_analyse)

    g = command_parser(sub, "generate", help="render and check candidate kernels for coverable ops")
    model_options(g)
    g.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    g.add_argument("--promote", action="store_true",
                   help="copy candidates that pass their checks into kernels/")
    g.add_argument("--json", action="store_true",
                   help="print candidates.json to stdout (the tables go to stderr)")
    _decision_options(g)
    g.set_defaults(func=cmd_analyse)

    a = command_parser(sub, "align", help="layer-by-layer fwd+bwd check of the patched proxy "
                                           "against the eager reference")
    model_options(a)
    a.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    a.add_argument("--kernels", default="all",
                   help="comma-separated kernel families to patch, 'all' or 'none' "
                        "('inductor': the Inductor fallback's block swaps, 'generated': the "
                        "LLM-written families)")
    a.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32",
                   help="candidate precision")
    a.add_argument("--reference", choices=("fp32", "fp64"), default="fp64",
                   help="precision of the eager reference the patched proxy is compared with "
                        "(default fp64)")
    a.add_argument("--mode", choices=("percentile", "bitwise"), default="percentile",
                   help="percentile: error statistics against the documented tolerances; "
                        "bitwise: ULP distance in the candidate dtype (default percentile)")
    a.add_argument("--strict", action="store_true",
                   help="fail (exit 3) when any coverable block was left unpatched (not checked)")
    a.add_argument("--json", action="store_true",
                   help="print alignment.json to stdout (the tables go to stderr)")
    _decision_options(a)
    a.set_defaults(func=cmd_analyse)


def _decision_options(p: argparse.ArgumentParser) -> None:
    """The decision loop for blocks no family serves (docs/generate.md): off in these commands
    unless --llm URL or --inductor asks for it (onboard run always runs it)."""
    from onboarding.cli.run import add_generate_options

    add_generate_options(p)
    p.add_argument("--inductor", action="store_true",
                   help="try torch.compile (Inductor), gated by the block check, for blocks no "
                        "family serves (after the LLM when --llm is given); align patches the "
                        "ones that pass")


def _decide(args: argparse.Namespace, spec, graph, coverage, out: Path, step) -> list:
    """The decision loop when --llm URL or --inductor asks for it (else nothing)."""
    from onboarding.cli.run import llm_url
    from onboarding.generate.decide import GenerateOptions
    from onboarding.stages import run_decide

    url = llm_url(args)
    if url is None and not args.inductor:
        return []
    client = None
    if url is not None:
        from onboarding.generate.llm import LLMClient, LLMConfig

        client = LLMClient(LLMConfig(url=url, model=args.llm_model))
    opts = GenerateOptions(llm=url, llm_model=args.llm_model, llm_attempts=args.llm_attempts,
                           budget_s=args.generate_budget, inductor=args.inductor,
                           batch=args.batch, seq=args.seq, seed=args.seed)
    return run_decide(spec, graph, coverage, out, opts=opts, client=client,
                      on_step=lambda s: step(f"generate: {s}"))


def cmd_analyse(args: argparse.Namespace, console: Console) -> int:
    """parse, map and generate: the stages up to the one named by the command."""
    from rich.markup import escape

    from onboarding.align.verdicts import strict_line
    from onboarding.cli.console import print_candidates, print_coverage, print_opgraph
    from onboarding.generate.decide import swaps
    from onboarding.rundir import new_run_dir, owned_dir
    from onboarding.stages import (
        run_align,
        run_generate,
        run_load,
        run_map,
        run_parse,
        save_model_json,
    )

    spec = model_spec(args)
    stage = args.command
    families = selected_kernels(args) if stage == "align" else None  # bad --kernels fails first
    out = Path(args.out) if args.out else None
    if out is not None:  # a file, below a file, not writable, not empty: before any work
        new_run_dir("", args.out)
    with console.status(f"{stage}: loading") as status:
        step = progress(console, status)
        info = run_load(spec)
        shims = info.loaded.compat_shims
        if shims and not getattr(args, "json", False):
            console.print(f"remote code: {len(shims)} compatibility shims for an older "
                          f"transformers: {', '.join(s['name'].rsplit('.', 1)[-1] for s in shims)}"
                          " (model.json compat_shims says why)")
        if out is None and stage in ("generate", "align"):
            out = new_run_dir(info.loaded.name, None)
        with owned_dir(out, created_here=True) if out is not None else _nothing():
            if out is not None:  # the model was loaded above, before the directory existed
                save_model_json(info, out, spec.overrides)
            graph = run_parse(info, out, batch=args.batch, seq=args.seq, seed=args.seed,
                              on_step=lambda s: step(f"{stage}: {s}"))
            coverage = run_map(graph, out) if stage in ("map", "generate", "align") else None
            decisions = _decide(args, spec, graph, coverage, out, step) \
                if stage in ("generate", "align") else []
            cands = run_generate(coverage, out, promote_passing=getattr(args, "promote", False),
                                 on_step=lambda s: step(f"generate: {s}")) \
                if stage in ("generate", "align") else None
            result = run_align(info, graph, coverage, cands, out, families=families,
                               dtype=args.dtype, reference=args.reference, mode=args.mode,
                               batch=args.batch, seq=args.seq, seed=args.seed,
                               strict=args.strict, swaps=swaps(decisions),
                               on_step=lambda s: step(f"align: {s}")) \
                if stage == "align" else None
    if getattr(args, "json", False) and stage in ("parse", "map"):
        data = coverage.to_dict() if coverage is not None else graph.to_dict()
        print(json.dumps(data, indent=1))
        return EXIT_OK
    if coverage is None:
        print_opgraph(graph, console)
    else:
        console.print(f"layer pattern: [bold]{graph.layer_pattern}[/bold] "
                      f"({len(graph.blocks)} blocks, {graph.capture} capture)")
        print_coverage(coverage, console)
    if cands is not None:
        print_candidates(cands, console)
    if out is not None:
        console.print(f"wrote {out}")
    if result is not None:
        console.print(result.to_markdown(only_failing=len(graph.blocks) > 40))
        console.print(escape(result.summary()), highlight=False)
        if result.strict_failed:  # the last line names every block left unpatched
            console.print(f"[bold red]check failed[/bold red]: --strict: "
                          f"{escape(strict_line(result.not_checked))} "
                          f"(exit {EXIT_CHECK_FAILED})", highlight=False)
    if getattr(args, "json", False):  # generate, align: what they wrote in the run directory
        written = out / ("alignment.json" if stage == "align" else "candidates.json")
        print(written.read_text().rstrip("\n"))
    if result is not None:
        return EXIT_OK if result.verdict_passed else EXIT_CHECK_FAILED
    return EXIT_OK


@contextlib.contextmanager
def _nothing():
    yield
