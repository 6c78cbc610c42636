"""``onboard tune``: Optuna tile search, every kernel of a model or one family."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from rich.console import Console

from onboarding.cli.common import (command_parser, gpu_sharing, gpu_sharing_options, model_options,
                                   model_spec, torch_cuda_available)
from onboarding.errors import EXIT_OK, InputError
from onboarding.rundir import RUN_FILE, check_out, owned_dir, write_json
from onboarding.load.overrides import positive_int_list


def add_parser(sub) -> argparse.ArgumentParser:
    t = command_parser(sub, "tune", help="Optuna tile search: every kernel of MODEL at its "
                                          "op-graph shapes, or one family (--kernel F --shapes N)")
    model_options(t, without="no default: without it, --kernel FAMILY --shapes N tunes one "
                             "family, or --out RUN the kernels of a generated run")
    t.add_argument("--kernel", metavar="FAMILY",
                   help="one family: alone with --shapes, or with MODEL to tune only that family")
    t.add_argument("--variant", help="family variant (default: the first)")
    t.add_argument("--shapes", type=positive_int_list, metavar="N[,N...]",
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
    t.add_argument("--trials", type=int, default=30, help="trials per study (default 30)")
    t.add_argument("--tune-budget", type=float, default=None, metavar="SECONDS",
                   help="seconds for all of this command's tuning, split over its studies "
                        "(kernel x shape bucket; time one leaves passes on); no trial starts "
                        "once a study's share is spent (default: no time limit)")
    gpu_sharing_options(t)
    t.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="studies of a model's run tuned at once, each on its own workers "
                        "(default: three per four cores on a GPU host, one on the CPU)")
    t.add_argument("--workers", type=int, default=1,
                   help="worker processes that check/compile concurrently (timing is serial; "
                        "default 1)")
    t.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="precision of the timed and checked kernels (default bf16)")
    t.add_argument("--repeats", type=int, default=20,
                   help="timed repeats per trial (default 20)")
    t.add_argument("--final-rounds", type=int, default=3,
                   help="after the search, re-time the fastest few configs and the default "
                        "alone in this many interleaved rounds and pick by their medians "
                        "(GPU only; 0: off)")
    t.add_argument("--timeout", type=float, default=120.0,
                   help="seconds per trial request (default 120)")
    t.add_argument("--no-aot", action="store_true",
                   help="skip the sm_90 ahead-of-time gate (on a GPU host it is off anyway: the "
                        "check's own builds are judged by the same limits)")
    t.add_argument("--compare-grid", action="store_true",
                   help="instead of --trials: run the exhaustive grid of the space and a "
                        "TPE study with --tpe-fraction of the grid's trials (separate, "
                        "resumable studies), compare them, write the better to tuned.json")
    t.add_argument("--tpe-fraction", type=float, default=0.15,
                   help="TPE's trials as a fraction of the grid's (default 0.15)")
    t.add_argument("--storage", help="Optuna storage URL (default: SQLite tune.db in --out)")
    t.add_argument("--out", help="run directory: reused if it holds a generated run, else "
                                 "created (default runs/<model>-<time> or runs/tune-<family>)")
    t.add_argument("--json", action="store_true",
                   help="print the results (tune_results.json's content; per bucket for one "
                        "family) to stdout; tables and progress go to stderr")
    t.set_defaults(func=cmd_tune)
    return t


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
    if (args.trials < 1 or args.workers < 1 or args.repeats < 1 or args.final_rounds < 0
            or (args.parallel is not None and args.parallel < 1)):
        raise InputError("--trials, --workers, --parallel and --repeats must be >= 1, "
                         "--final-rounds >= 0")
    if args.tune_budget is not None and args.tune_budget <= 0:
        raise InputError(f"--tune-budget {args.tune_budget}: expected seconds > 0")
    if args.space_only and not args.space:
        raise InputError("--space-only needs --space KEY=V1,V2 to search")
    if args.storage:
        _check_storage(args.storage)
    cfg = TuneConfig(n_trials=args.trials, n_workers=args.workers, storage=args.storage,
                     dtype=args.dtype, repeats=args.repeats, trial_timeout_s=args.timeout,
                     aot=False if args.no_aot else None, space=_space(args.space) or None,
                     space_only=args.space_only, final_rounds=args.final_rounds,
                     seed=args.seed, parallel_studies=args.parallel,
                     **gpu_sharing(args))
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
    check_out(out)
    reuse = _earlier_tune(out, spec.name, variant)
    if not reuse and out.exists() and any(out.iterdir()):  # never among a user's files
        raise InputError(f"--out {out}: directory exists and is not empty (nor an earlier "
                         f"`onboard tune --kernel {spec.name}` folder); choose another")
    # found late (e.g. a grid too large): the directory made here is removed again
    with owned_dir(out, created_here=not reuse):
        if not reuse:
            write_json(out / RUN_FILE, {"kind": "tune", "family": spec.name, "variant": variant})
        return _tune_family_in(args, cfg, console, spec, variant, out, dims_for)


# what an `onboard tune --kernel F` folder holds: it may be tuned into again (its studies resume)
_TUNE_FILES = re.compile(r"^(kernels|tune\.db|tune_best\.png|compare-.*\.(json|md|png)|"
                         r"run\.json|run\.lock)$")


def _earlier_tune(out: Path, family: str, variant: str) -> bool:
    """Whether ``out`` is an earlier `onboard tune --kernel` folder of this family and variant
    (its run.json says so; older ones: only tune's own files, with kernels/<family>)."""
    if not out.is_dir():
        return False
    try:
        mark = json.loads((out / RUN_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        mark = None
    if isinstance(mark, dict) and mark.get("kind") == "tune":
        return (mark.get("family"), mark.get("variant")) == (family, variant)
    return (out / "kernels" / family).is_dir() and all(_TUNE_FILES.match(p.name)
                                                       for p in out.iterdir())


def _check_storage(url: str) -> None:
    """An Optuna storage URL that cannot be opened fails before any work: an unknown scheme, a
    SQLite file in a folder that does not exist."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        u = make_url(url)
        u.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise InputError(f"--storage {url}: not a database URL Optuna can open "
                         f"({type(exc).__name__}: {exc})") from None
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
        folder = Path(u.database).expanduser().parent
        if not folder.is_dir():
            raise InputError(f"--storage {url}: the SQLite file's folder {folder} does not "
                             "exist")


def _tune_family_in(args: argparse.Namespace, cfg, console: Console, spec, variant: str,
                    out: Path, dims_for) -> int:
    from onboarding.generate.templating import load_module as module_of
    from onboarding.generate.templating import render_to
    from onboarding.tune.grid import compare_grid, plot_comparison
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
        data = [c.to_dict() for c in cmps]
    else:
        if args.tune_budget is not None:  # an equal share per bucket
            n = len({module_of(module).shape_bucket(s) for s in args.shapes})
            cfg.budget_s = args.tune_budget / n
        results = tune_buckets(module, args.shapes, dims_for=dims_for, config=cfg)
        plot_history(results, out / "tune_best.png")
        console.print(markdown_table(results))
        console.print(f"wrote {tuned_path(module)}, {out / 'tune_best.png'}")
        from onboarding.tune.store import result_dict

        data = [result_dict(r) for r in results]
    if not torch_cuda_available():
        console.print("[yellow]no GPU: times are Triton-interpreter wall clock, not kernel "
                      "speed[/yellow]")
    if args.json:
        print(json.dumps(data, indent=1, default=str))
    return EXIT_OK


def _tune_model(args: argparse.Namespace, cfg, console: Console) -> int:
    from onboarding.rundir import new_run_dir
    from onboarding.stages import (
        run_generate,
        run_load,
        run_map,
        run_parse,
        save_model_json,
    )
    from onboarding.tune.run import PLOT_FILE, RESULTS_FILE, RUN_ARTIFACTS, tune_run
    from onboarding.tune.search import markdown_table, result_from_dict

    families = [args.kernel] if args.kernel else None
    if args.kernel:
        from onboarding.families import get_family

        get_family(args.kernel)  # an unknown family fails before any work
    out = Path(args.out) if args.out else None
    reuse = out is not None and all((out / a).is_file() for a in RUN_ARTIFACTS)
    if reuse:
        console.print(f"reusing the generated run in {out}")
        with owned_dir(out, created_here=False):  # locked: no run writes it meanwhile
            data = tune_run(out, cfg, families=families, progress=True,
                            budget_s=args.tune_budget)
    else:
        if args.model is None:
            raise InputError(f"--out {out}: no generated run there ({', '.join(RUN_ARTIFACTS)}); "
                             "give MODEL")
        spec = model_spec(args)
        if args.out:  # an unusable --out fails before the model is loaded
            new_run_dir("", args.out)
        with console.status("tune: loading") as status:
            info = run_load(spec)
            out = new_run_dir(info.loaded.name, args.out)
        with owned_dir(out, created_here=True), console.status("tune: parse") as status:
            save_model_json(info, out, spec.overrides)
            graph = run_parse(info, out, batch=args.batch, seq=args.seq, seed=args.seed,
                              on_step=lambda s: status.update(f"parse: {s}"))
            run_generate(run_map(graph, out), out,
                         on_step=lambda s: status.update(f"generate: {s}"))
            status.stop()
            data = tune_run(out, cfg, families=families, progress=True,
                            budget_s=args.tune_budget)
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
    if args.json:
        print(json.dumps(data, indent=1, default=str))
    return EXIT_OK
