"""The `onboard` command line.

Exit codes: 0 success, 1 internal failure, 2 bad input, 3 a check failed (alignment, or a
regression against a golden reference).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from onboarding import __version__
from onboarding.backend import ensure_triton_backend
from onboarding.errors import (
    EXIT_BAD_INPUT,
    EXIT_CHECK_FAILED,
    EXIT_INTERNAL,
    EXIT_OK,
    InputError,
)
from onboarding.load.model import DEFAULT_EXAMPLE
from onboarding.load.overrides import int_list, parse_assignments

err = Console(stderr=True)


def _model_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("model", nargs="?" if optional else None, default=None,
                   help="model directory, hf:<model_type>, file.py:Name, module:Name, or a "
                        f"built-in example (default: {DEFAULT_EXAMPLE})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (JSON value); repeatable")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow running the model's own modeling_*.py (read it first)")
    p.add_argument("--proxy", choices=("tiny", "small"), default="tiny",
                   help="proxy size for real execution: tiny (CPU) or small (one GPU)")
    p.add_argument("--seq", type=int, default=64, help="proxy sequence length")
    p.add_argument("--batch", type=int, default=1, help="proxy batch size")
    p.add_argument("--seed", type=int, default=0)


_FAMILIES_HELP = ("a folder of kernel families (or one family folder) to use beside the built-in "
                  "ones; repeatable. Also: the ONBOARD_FAMILIES path list and installed packages' "
                  "onboard.families entry points")


def _command(sub, name: str, **kw) -> argparse.ArgumentParser:
    """A subcommand's parser. It takes `--families` too (`onboard map X --families DIR`);
    SUPPRESS keeps a value given before the command when none comes after it."""
    p = sub.add_parser(name, **kw)
    p.add_argument("--families", action="append", default=argparse.SUPPRESS, metavar="DIR",
                   help=_FAMILIES_HELP)
    return p


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="onboard", description=__doc__)
    ap.add_argument("--debug", action="store_true", help="print tracebacks")
    ap.add_argument("--version", action="version", version=f"onboard {__version__}")
    ap.add_argument("--families", action="append", default=[], metavar="DIR", help=_FAMILIES_HELP)
    sub = ap.add_subparsers(dest="command", required=True)

    p = _command(sub, "parse", help="capture the proxy and classify its blocks")
    _model_args(p, optional=True)
    p.add_argument("--out", help="write model.json and opgraph.json here")
    p.add_argument("--json", action="store_true", help="print opgraph.json to stdout")

    m = _command(sub, "map", help="coverage: which ops have kernels, templates, fast paths")
    _model_args(m, optional=True)
    m.add_argument("--out", help="write model.json, opgraph.json and coverage.json here")
    m.add_argument("--json", action="store_true", help="print coverage.json to stdout")

    g = _command(sub, "generate", help="render and check candidate kernels for coverable ops")
    _model_args(g, optional=True)
    g.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    g.add_argument("--promote", action="store_true",
                   help="copy candidates that pass their checks into kernels/")

    a = _command(sub, "align", help="layer-by-layer fwd+bwd check of the patched proxy "
                                     "against the eager reference")
    _model_args(a, optional=True)
    a.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    a.add_argument("--kernels", default="all",
                   help="comma-separated kernel families to patch, 'all' or 'none'")
    a.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32",
                   help="candidate precision")
    a.add_argument("--reference", choices=("fp32", "fp64"), default="fp64")
    a.add_argument("--mode", choices=("percentile", "bitwise"), default="percentile")

    t = _command(sub, "tune", help="Optuna tile search: every kernel of MODEL at its op-graph "
                                    "shapes, or one family (--kernel F --shapes N)")
    _model_args(t, optional=True)
    t.add_argument("--kernel", metavar="FAMILY",
                   help="one family: alone with --shapes, or with MODEL to tune only that family")
    t.add_argument("--variant", help="family variant (default: the first)")
    t.add_argument("--shapes", type=int_list, metavar="N[,N...]",
                   help="without MODEL: sizes of the family's bucketed dimension (its shape "
                        "buckets' dim, e.g. D: a norm's width)")
    t.add_argument("--dims", type=_dims, metavar="K=V[,K=V...]",
                   help="without MODEL: real problem dims for GPU timing, the family's "
                        "timing dims (e.g. N=8192,E=64,TOPK=8,F=512 for MoE experts); the "
                        "bucketed one comes from --shapes")
    t.add_argument("--space", action="append", default=[], metavar="KEY=V1,V2",
                   help="search only these values of a tile parameter (repeatable); the "
                        "bucket's default is always kept")
    t.add_argument("--space-only", action="store_true",
                   help="search only the keys --space names; the others stay at the bucket's "
                        "default (keeps a --compare-grid grid small)")
    t.add_argument("--trials", type=int, default=30, help="trials per study")
    t.add_argument("--workers", type=int, default=1,
                   help="worker processes that check/compile concurrently (timing is serial)")
    t.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="timing precision")
    t.add_argument("--repeats", type=int, default=20, help="timed repeats per trial")
    t.add_argument("--final-rounds", type=int, default=3,
                   help="after the search, re-time the fastest few configs and the default "
                        "alone in this many interleaved rounds and pick by their medians "
                        "(GPU only; 0: off)")
    t.add_argument("--timeout", type=float, default=120.0, help="seconds per trial request")
    t.add_argument("--no-aot", action="store_true", help="skip the sm_90 ahead-of-time gate")
    t.add_argument("--compare-grid", action="store_true",
                   help="instead of --trials: run the exhaustive grid of the space and a "
                        "TPE study with --tpe-fraction of the grid's trials (separate, "
                        "resumable studies), compare them, write the better to tuned.json")
    t.add_argument("--tpe-fraction", type=float, default=0.15,
                   help="TPE's trials as a fraction of the grid's (default 0.15)")
    t.add_argument("--storage", help="Optuna storage URL (default: SQLite tune.db in --out)")
    t.add_argument("--out", help="run directory: reused if it holds a generated run, else "
                                 "created (default runs/<model>-<time> or runs/tune-<family>)")

    b = _command(sub, "bench", help="kernel benchmarks vs eager, torch.compile and anchors (GPU)")
    b.add_argument("--suite", choices=("kernels",), default="kernels")
    b.add_argument("--family", action="append", default=None,
                   help="only these kernel families (repeatable)")
    b.add_argument("--case", action="append", default=None, metavar="SUBSTR",
                   help="only cases whose name contains SUBSTR (repeatable)")
    b.add_argument("--impl", default=None, metavar="A,B",
                   help="only these implementations (e.g. ours,ours_fwd,fla_fwd; tile sweeps "
                        "'ours@...' count as 'ours')")
    b.add_argument("--profile", action="store_true",
                   help="also break our steps down by kernel (torch.profiler): time, share, calls")
    b.add_argument("--against", metavar="REV",
                   help="also time our kernels as the templates of git revision REV render them "
                        "(rows rev:<sha>, rev:<sha>_fwd; their ratio > 1: the tree is faster); "
                        "REV may be a folder of templates instead (rows tpl:<folder name>)")
    b.add_argument("--out", help="write the result rows as JSON here")

    r = _command(sub, "run", help="run the agent pipeline on MODEL")
    _model_args(r, optional=True)
    r.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run")
    r.add_argument("--kernels", default="all",
                   help="kernel families patched for alignment: comma-separated, 'all', 'none'")
    r.add_argument("--tune-trials", type=int, default=None, metavar="N",
                   help="Optuna trials per kernel and shape bucket (default: 20 on a GPU; "
                        "tuning is skipped on the CPU unless this is given)")
    r.add_argument("--train-steps", type=int, default=None, metavar="N",
                   help="LoRA training steps of the FSDP2 x EP setup and its reference "
                        "(default: 20 on a GPU; skipped on the CPU unless this is given)")
    r.add_argument("--train-nproc", type=int, default=None, metavar="N",
                   help="training processes (default: the GPUs here, 2 on the CPU)")
    r.add_argument("--max-align-retries", type=int, default=2, metavar="N",
                   help="a failed alignment loops back to generate without the culprit's kernel "
                        "at most N times (default 2; each retry must leave out a kernel)")
    r.add_argument("--stop-after", choices=("load", "parse"), help=argparse.SUPPRESS)

    rg = _command(sub, "regress", help="compare a finished run (default: a fresh run of the "
                                        "built-in example) with its golden reference")
    rg.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                    help="a finished `onboard run` directory (default: run the built-in "
                         "example now, into runs/regress-<NAME>-<time>)")
    rg.add_argument("--reference", default="example", metavar="NAME",
                    help="the golden in reference_runs/NAME/golden.json (default: example)")
    rg.add_argument("--update", action="store_true",
                    help="write (or overwrite) the golden from this run; without it nothing "
                         "is written into reference_runs/")

    from onboarding.cli.train import add_scale_parser, add_train_parser

    add_train_parser(sub)
    add_scale_parser(sub)
    return ap


def _progress(console: Console, status) -> Callable[[str], None]:
    """Progress into a rich status line; a log file gets it as timed lines on stderr."""
    def step(text: str) -> None:
        status.update(text)
        if not console.is_terminal:
            err.print(f"{time.strftime('%H:%M:%S')} {text}", highlight=False)
    return step


def cmd_analyse(args: argparse.Namespace, console: Console) -> int:
    """parse, map and generate: the stages up to the one named by the command."""
    from onboarding.cli.console import print_candidates, print_coverage, print_opgraph
    from onboarding.rundir import new_run_dir, owned_dir
    from onboarding.stages import (
        run_align,
        run_generate,
        run_load,
        run_map,
        run_parse,
        save_model_json,
    )

    overrides = parse_assignments(args.set)
    stage = args.command
    families = _families(args) if stage == "align" else None  # bad --kernels fails first
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and any(out.iterdir()):
        raise InputError(f"--out {out}: directory exists and is not empty")
    with console.status(f"{stage}: loading") as status:
        step = _progress(console, status)
        info = run_load(args.model, overrides, args.trust_remote_code, args.proxy)
        if out is None and stage in ("generate", "align"):
            out = new_run_dir(info.loaded.name, None)
        with owned_dir(out, created_here=True) if out is not None else _nothing():
            if out is not None:  # the model was loaded above, before the directory existed
                save_model_json(info, out, overrides)
            graph = run_parse(info, out, batch=args.batch, seq=args.seq, seed=args.seed,
                              on_step=lambda s: step(f"{stage}: {s}"))
            coverage = run_map(graph, out) if stage in ("map", "generate", "align") else None
            cands = run_generate(coverage, out, promote_passing=getattr(args, "promote", False),
                                 on_step=lambda s: step(f"generate: {s}")) \
                if stage in ("generate", "align") else None
            result = run_align(info, graph, coverage, cands, out, families=families,
                               dtype=args.dtype, reference=args.reference, mode=args.mode,
                               batch=args.batch, seq=args.seq, seed=args.seed,
                               on_step=lambda s: step(f"align: {s}")) \
                if stage == "align" else None
    if getattr(args, "json", False):
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
        console.print(result.summary())
        return EXIT_OK if result.passed else EXIT_CHECK_FAILED
    return EXIT_OK


def _families(args: argparse.Namespace) -> list[str] | None:
    from onboarding.families import families

    if args.kernels == "all":
        return None
    if args.kernels == "none":
        return []
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    unknown = sorted(set(names) - set(families()))
    if unknown:
        raise InputError(f"--kernels: unknown families {unknown}; known: {sorted(families())}")
    return names


@contextlib.contextmanager
def _nothing():
    yield


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    import torch

    from onboarding.bench.cases import cases_for, select_cases
    from onboarding.bench.harness import format_table, run_cases

    cases = select_cases(cases_for(args.family), args.case,
                         args.impl.split(",") if args.impl else None)
    if args.against:
        from onboarding.bench.revision import against, resolve

        cases = against(cases, *resolve(args.against))
    if not torch.cuda.is_available():
        raise InputError("onboard bench needs a GPU (timings on the CPU interpreter mean "
                         "nothing); run it on the GPU machine")

    def save(result: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    with console.status("benchmarking") as status:
        result = run_cases(cases, log=_progress(console, status), partial=save,
                           profile=args.profile)
    print(format_table(result))
    save(result)
    if args.out:
        console.print(f"wrote {args.out}")
    return EXIT_OK


def _dims(v: str) -> dict[str, int]:
    try:
        return {k.strip(): int(x) for k, x in (item.split("=") for item in v.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K=V[,K=V...] with integer values, got "
                                         f"{v!r}") from None


def _space(items: list[str]) -> dict[str, list]:
    out: dict[str, list] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise InputError(f"--space {item!r}: expected KEY=V1,V2")
        out[key.strip()] = [json.loads(x) if x.strip().lstrip("-").isdigit() else x.strip()
                            for x in values.split(",")]
    return out


def cmd_tune(args: argparse.Namespace, console: Console) -> int:
    import optuna

    from onboarding.tune.search import TuneConfig

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bar says it all

    if args.tpe_fraction <= 0 or args.tpe_fraction > 1:
        raise InputError(f"--tpe-fraction {args.tpe_fraction}: must be in (0, 1]")
    if args.trials < 1 or args.workers < 1 or args.repeats < 1 or args.final_rounds < 0:
        raise InputError("--trials, --workers and --repeats must be >= 1, --final-rounds >= 0")
    if args.space_only and not args.space:
        raise InputError("--space-only needs --space KEY=V1,V2 to search")
    cfg = TuneConfig(n_trials=args.trials, n_workers=args.workers, storage=args.storage,
                     dtype=args.dtype, repeats=args.repeats, trial_timeout_s=args.timeout,
                     aot=not args.no_aot, space=_space(args.space) or None,
                     space_only=args.space_only, final_rounds=args.final_rounds,
                     seed=args.seed)
    model_mode = args.model is not None or (args.kernel is None and args.out is not None)
    if model_mode:
        if args.shapes or args.dims or args.compare_grid:
            raise InputError("--shapes, --dims and --compare-grid tune one family: give "
                             "--kernel FAMILY --shapes N without MODEL")
        return _tune_model(args, cfg, console)
    if args.kernel is None or not args.shapes:
        raise InputError("tune: give MODEL (tunes every kernel of the run), or --kernel "
                         "FAMILY --shapes N[,N...]")
    return _tune_family(args, cfg, console)


def _tune_family(args: argparse.Namespace, cfg, console: Console) -> int:
    from onboarding.families import families, get_family

    spec = get_family(args.kernel)
    variant = args.variant or next(iter(spec.variants))
    if variant not in spec.variants:
        raise InputError(f"--variant {variant!r}: {args.kernel} has {sorted(spec.variants)}")
    dim = spec.shape_buckets[0].dim
    if args.dims is not None:
        need = spec.timing_dims
        if spec.timing_inputs is None:
            timed = {n: list(s.timing_dims) for n, s in families().items() if s.timing_inputs}
            raise InputError(f"--dims: no real-shape timing inputs for {spec.name}; families "
                             f"with them, and their dims: {timed}")
        missing = sorted(set(need) - set(args.dims) - {dim})
        if missing:
            raise InputError(f"--dims: {spec.name} needs {list(need)} ({dim} from --shapes); "
                             f"missing {missing}")

    def dims_for(size: int) -> dict[str, int] | None:
        return None if args.dims is None else {**args.dims, dim: size}

    for key, values in (cfg.space or {}).items():  # bad --space fails before any file exists
        if key not in spec.tuning_space or not set(values) <= set(spec.tuning_space[key]):
            raise InputError(f"--space {key}={values}: {spec.name} searches "
                             f"{ {k: list(v) for k, v in spec.tuning_space.items()} }")
    out = Path(args.out) if args.out else Path("runs") / f"tune-{args.kernel}-{variant}"
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _tune_family_in(args, cfg, console, spec, variant, out, dims_for)
    except InputError:  # found late (e.g. a grid too large): leave no run directory behind
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _tune_family_in(args: argparse.Namespace, cfg, console: Console, spec, variant: str,
                    out: Path, dims_for) -> int:
    from onboarding.tune.grid import compare_grid, plot_comparison
    from onboarding.generate.templating import render_to
    from onboarding.tune.search import (
        markdown_table,
        plot_history,
        progress_bar,
        tune_buckets,
        tuned_path,
        write_tuned,
    )

    module = render_to(out / "kernels", spec.name, variant, {})
    cfg.storage_dir = out
    if torch_cuda_available() and args.dims is None:
        console.print("[yellow]no --dims: timing at the family's small sample shapes; give "
                      "--dims for real ones[/yellow]")
    if args.compare_grid:
        prog = progress_bar()
        with prog:
            cmps = [compare_grid(module, size=s, dims=dims_for(s), config=cfg,
                                 tpe_fraction=args.tpe_fraction, progress=prog)
                    for s in args.shapes]
        for c in cmps:
            stem = out / f"compare-{c.family}-{c.bucket}"
            stem.with_suffix(".json").write_text(json.dumps(c.to_dict(), indent=1) + "\n")
            stem.with_suffix(".md").write_text(c.markdown())
            plot_comparison(c, stem.with_suffix(".png"))
            console.print(c.markdown())
            best = c.best()
            if best is not None:
                write_tuned(module, [best], dtype=cfg.dtype)
        console.print(f"wrote {out}/compare-*.json|md|png, {tuned_path(module)}")
    else:
        results = tune_buckets(module, args.shapes, dims_for=dims_for, config=cfg)
        plot_history(results, out / "tune_best.png")
        console.print(markdown_table(results))
        console.print(f"wrote {tuned_path(module)}, {out / 'tune_best.png'}")
    if not torch_cuda_available():
        console.print("[yellow]no GPU: times are Triton-interpreter wall clock, not kernel "
                      "speed[/yellow]")
    return EXIT_OK


def _tune_model(args: argparse.Namespace, cfg, console: Console) -> int:
    from onboarding.rundir import new_run_dir, owned_dir
    from onboarding.stages import (
        run_generate,
        run_load,
        run_map,
        run_parse,
        save_model_json,
    )
    from onboarding.tune.search import markdown_table, result_from_dict
    from onboarding.tune.run import PLOT_FILE, RESULTS_FILE, RUN_ARTIFACTS, tune_run

    families = [args.kernel] if args.kernel else None
    if args.kernel:
        from onboarding.families import get_family

        get_family(args.kernel)  # an unknown family fails before any work
    out = Path(args.out) if args.out else None
    reuse = out is not None and all((out / a).is_file() for a in RUN_ARTIFACTS)
    if reuse:
        console.print(f"reusing the generated run in {out}")
    else:
        if args.model is None:
            raise InputError(f"--out {out}: no generated run there ({', '.join(RUN_ARTIFACTS)}); "
                             "give MODEL")
        overrides = parse_assignments(args.set)
        with console.status("tune: loading") as status:
            info = run_load(args.model, overrides, args.trust_remote_code, args.proxy)
            out = new_run_dir(info.loaded.name, args.out)
            with owned_dir(out, created_here=True):
                save_model_json(info, out, overrides)
                graph = run_parse(info, out, batch=args.batch, seq=args.seq, seed=args.seed,
                                  on_step=lambda s: status.update(f"parse: {s}"))
                run_generate(run_map(graph, out), out,
                             on_step=lambda s: status.update(f"generate: {s}"))
    data = tune_run(out, cfg, families=families, progress=True)
    for s in data["studies"]:
        console.print(f"[bold]{s['family']}/{s['variant']}[/bold] `{s['module']}` "
                      f"({len(s['blocks'])} blocks, {s['size_source']} = {s['size']})")
        console.print(markdown_table([result_from_dict(s["result"])]))
    for note in data["notes"]:
        console.print(f"[yellow]{note}[/yellow]")
    if not data["studies"]:
        console.print("[yellow]nothing to tune: no passing candidate kernels[/yellow]")
    if not torch_cuda_available():
        console.print("[yellow]no GPU: times are Triton-interpreter wall clock, not kernel "
                      "speed[/yellow]")
    console.print(f"wrote {out / RESULTS_FILE}, {out / PLOT_FILE}, tuned.json beside each "
                  f"candidate")
    return EXIT_OK


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from agents.graph import compile_graph, thread_config
    from agents.state import RunConfig, RunState
    from onboarding.cli.console import print_opgraph
    from onboarding.graph.opgraph import OpGraph
    from onboarding.rundir import new_run_dir, owned_dir
    from onboarding.stages import run_load

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "checkpoint.sqlite").is_file():
            raise InputError(f"--resume {run_dir}: not a run directory (no checkpoint.sqlite)")
        created = False
        inputs = None
    else:
        overrides = parse_assignments(args.set)
        families = _families(args)
        if args.max_align_retries < 0:
            raise InputError(f"--max-align-retries {args.max_align_retries}: expected >= 0")
        # Check the input before a run directory exists, so bad input leaves nothing behind.
        with console.status("checking MODEL"):
            info = run_load(args.model, overrides, args.trust_remote_code, args.proxy)
        run_dir = new_run_dir(info.loaded.name, args.out)
        created = True
        inputs = RunState(config=RunConfig(
            model_ref=args.model, overrides=overrides, trust_remote_code=args.trust_remote_code,
            proxy=args.proxy, batch=args.batch, seq=args.seq, seed=args.seed,
            align_kernels=families, max_align_retries=args.max_align_retries,
            tune_trials=args.tune_trials,
            train_steps=args.train_steps, train_nproc=args.train_nproc),
            run_dir=str(run_dir))
    with owned_dir(run_dir, created_here=created):
        app, conn = compile_graph(run_dir)
        try:
            cfg = thread_config(run_dir)
            if args.resume:
                snap = app.get_state(cfg)
                if not snap.next:
                    console.print(f"{run_dir}: run already complete")
                    return _run_verdict(snap.values, console)
                console.print(f"resuming {run_dir} at: {', '.join(snap.next)}")
            stopping = False
            with console.status("starting") as status:
                for mode, chunk in app.stream(inputs, cfg, stream_mode=["updates", "custom"],
                                              durability="sync"):
                    if stopping:
                        # Test hook: die like a killed process once the next node has begun,
                        # i.e. after the stopped-after node's checkpoint is written.
                        os.kill(os.getpid(), signal.SIGKILL)
                    if mode == "custom":
                        status.update(f"[bold]{chunk['node']}[/bold]: {chunk['step']}")
                        continue
                    for node in chunk:
                        console.print(f"[green]done[/green] {node}")
                        stopping = stopping or node == args.stop_after
            final = app.get_state(cfg).values
        finally:
            conn.close()
    graph_file = run_dir / "opgraph.json"
    if graph_file.exists():
        print_opgraph(OpGraph.load(graph_file), console)
    console.print(f"report: {run_dir / 'report.md'}")
    return _run_verdict(final, console)


def _run_verdict(values: dict, console: Console) -> int:
    """The run's last screen line: what its checks said; exit 3 when one failed."""
    from agents.state import RunState

    passed, line = RunState.model_validate(values).verdict()
    if passed:
        console.print(escape(line), highlight=False)
        return EXIT_OK
    console.print(f"[bold red]check failed[/bold red]: {escape(line)} (exit {EXIT_CHECK_FAILED})",
                  highlight=False)
    return EXIT_CHECK_FAILED


def _regress_example(name: str, console: Console) -> tuple[Path, str]:
    """Run the built-in example the way `onboard run` does; the run directory stays in runs/
    so that a regression can be looked into."""
    from onboarding.rundir import new_run_dir

    run_dir = new_run_dir(f"regress-{name}", None)
    # Tuning and training off on every machine: their results are timings and losses of the
    # device at hand, which no golden holds (on a CPU both skip by default anyway).
    argv = ["run", "--out", str(run_dir), "--tune-trials", "0", "--train-steps", "0"]
    command = "onboard " + " ".join(argv)
    console.print(f"running the built-in example: {command}", highlight=False)
    # a failed check (exit 3) is a fact the golden compares; anything else is not a run
    if cmd_run(build_parser().parse_args(argv), console) not in (EXIT_OK, EXIT_CHECK_FAILED):
        raise RuntimeError(f"{command} did not finish")
    return run_dir, command


def cmd_regress(args: argparse.Namespace, console: Console) -> int:
    from onboarding import regress
    from onboarding.cli.console import print_regression

    ref_file = regress.reference_dir(args.reference) / regress.GOLDEN_FILE
    old = None
    if ref_file.is_file():
        try:
            old = regress.load_golden(ref_file)
        except InputError:
            if not args.update:  # --update replaces a broken golden
                raise
    given = f" {args.run_dir}" if args.run_dir else ""
    ref_opt = f" --reference {args.reference}" if args.reference != "example" else ""
    if old is None and not args.update:
        raise InputError(f"no golden reference {ref_file}: make it with `onboard regress"
                         f"{given}{ref_opt} --update`")
    run_command = None
    if args.run_dir:
        run_dir = Path(args.run_dir)
        regress.check_run_dir(run_dir)
    else:
        t0 = time.perf_counter()
        run_dir, run_command = _regress_example(args.reference, console)
        console.print(f"ran the example in {time.perf_counter() - t0:.0f} s")
    facts = regress.golden(run_dir)
    findings = regress.compare(old["facts"], facts) if old is not None else []
    made = ""
    if old is not None:
        meta = old["metadata"]
        made = f"made at commit {(meta.get('commit') or '?')[:10]}, {meta.get('date')}"
        print_regression(regress.rows(old["facts"], facts, findings), console,
                         title=f"{run_dir} vs {ref_file} ({made})")
        here = regress.metadata(command="", run_command=None)["device"]
        if meta.get("device") and meta["device"] != here:
            console.print(f"[yellow]the golden was made on {meta['device']}, this run is on "
                          f"{here}: error metrics compare within their tolerances[/yellow]")
    for f in findings:
        console.print(f"[red]changed[/red] {f.message}", highlight=False)
    if args.update:
        meta = regress.metadata(command=f"onboard regress{given}{ref_opt} --update",
                                run_command=run_command)
        regress.write_golden(ref_file, facts, meta)
        if old is None:
            print_regression(regress.rows({}, facts, []), console, title=f"new golden: {run_dir}")
        if facts["alignment.verdict"] != "passed" or any(
                not s.startswith("passed") for s in facts["candidates.status"].values()):
            console.print("[yellow]this golden records a failed alignment or candidate[/yellow]")
        console.print(f"wrote {ref_file} ({len(facts)} facts; {len(findings)} differences from "
                      f"the previous golden)")
        return EXIT_OK
    if findings:
        names = ", ".join(dict.fromkeys(f.fact for f in findings))
        err.print(f"[red]regression:[/red] {len(findings)} differences in {names} against "
                  f"{ref_file} ({made}); if the change is intended, re-run with --update",
                  highlight=False)
        return EXIT_CHECK_FAILED
    console.print(f"[green]all {len(facts)} facts ok[/green] against {ref_file} ({made})")
    return EXIT_OK


def _load_families(dirs: list[str]) -> None:
    """Register `--families` folders and load every family now, so that a folder skipped as
    broken is reported once, here, with its path and reason (the run goes on without it)."""
    import warnings

    from onboarding.families import FamilyWarning, add_dirs, registry

    add_dirs(dirs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FamilyWarning)
        registry()
    for w in caught:
        if issubclass(w.category, FamilyWarning):
            err.print(f"[yellow]warning:[/yellow] {escape(str(w.message))}", highlight=False,
                      soft_wrap=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    ensure_triton_backend()
    try:
        _load_families(args.families)
        if args.command == "run":
            return cmd_run(args, console)
        if args.command == "bench":
            return cmd_bench(args, console)
        if args.command == "tune":
            return cmd_tune(args, console)
        if args.command == "regress":
            return cmd_regress(args, console)
        if args.command in ("train", "scale"):
            from onboarding.cli.train import cmd_scale, cmd_train

            return (cmd_train if args.command == "train" else cmd_scale)(args, console)
        return cmd_analyse(args, console)
    except InputError as exc:
        # the message as written (no markup: "[E, out, in]" is text), one line the terminal wraps
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        if args.debug:
            traceback.print_exc()
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERNAL
    except Exception as exc:  # internal failure: a bug in onboard, not the user's input
        err.print(f"[red]internal error:[/red] {type(exc).__name__}: {escape(str(exc))}", highlight=False,
                  soft_wrap=True)
        if args.debug:
            traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
