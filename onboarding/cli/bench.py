"""``onboard bench``: kernel benchmarks against eager, torch.compile and anchors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from onboarding.cli.common import progress, command_parser
from onboarding.cli.nightly import DEFAULT
from onboarding.errors import EXIT_OK, InputError
from onboarding.load.examples import model_forms


def add_parser(sub) -> argparse.ArgumentParser:
    b = command_parser(sub, "bench",
                       help="kernel benchmarks vs eager, torch.compile and anchors (GPU)")
    b.add_argument("action", nargs="?", choices=("history", "list"),
                   help="history: list the nightly history (--history URL, --key SUBSTR) with "
                        "its change points; list: the kernel cases --family / --case pick, with "
                        "their shapes, FLOPs and the rows each would time (--impl filters them; "
                        "built on the meta device: nothing allocated or timed); neither needs "
                        "a GPU")
    b.add_argument("--suite", choices=("kernels", "nightly"), default="kernels",
                   help="kernels: the chosen families' cases (default); nightly: the regression "
                        "suite (each family's nightly cases, two proxies' training step, the "
                        "example's alignment facts) with A/A noise per row")
    b.add_argument("--family", action="append", default=None,
                   help="only these kernel families (repeatable)")
    b.add_argument("--case", action="append", default=None, metavar="SUBSTR",
                   help="only cases whose name contains SUBSTR (repeatable; ^SUBSTR: at the start, "
                        "SUBSTR$: at the end, ^NAME$: exactly)")
    b.add_argument("--impl", default=None, metavar="A,B",
                   help="only these implementations (e.g. ours,ours_fwd,fla_fwd; tile sweeps "
                        "'ours@...' count as 'ours', and one named by itself keeps its own "
                        "commas: ours@BLOCK_M=64,num_warps=8; `bench list` names them)")
    b.add_argument("--profile", action="store_true",
                   help="also break our steps down by kernel (torch.profiler): time, share, calls; "
                        "ours, ours_fwd, their sweep rows (ours@...) and --against's rows")
    b.add_argument("--against", metavar="REV",
                   help="also time our kernels as the templates of git revision REV render them "
                        "(rows rev:<sha>, rev:<sha>_fwd; their ratio > 1: the tree is faster); "
                        "REV may be a folder of templates instead (rows tpl:<folder name>)")
    b.add_argument("--out", help="write the result rows as JSON here")
    u = b.add_argument_group("uncovered blocks (--blocks): the Inductor fallback against eager")
    u.add_argument("--blocks", action="append", default=None, metavar="MODEL",
                   help=f"time MODEL's distinct uncovered blocks (MODEL: {model_forms()}, or "
                        "a run directory; MODEL@PATH[,PATH]: those blocks, covered or not), "
                        "torch.compile as the fallback compiles it against the block's own "
                        "code, forward and forward + backward (repeatable; one process each)")
    u.add_argument("--proxy", choices=("tiny", "small"), default=None,
                   help="the proxy the blocks come from (default: small; a run's own)")
    u.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    u.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="dtype (default bf16; a block whose own code fails in it is timed in "
                        "fp32, with a note)")
    u.add_argument("--start", choices=("default", "safe", "regional"), default="default",
                   help="the compile ladder's first rung (default: Inductor's defaults)")
    u.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop models still compiling or timing after SECONDS (their records "
                        "so far are kept)")
    n = b.add_argument_group("nightly (--suite nightly)")
    n.add_argument("--parts", default="kernels,train,align", metavar="A,B",
                   help="which parts: kernels, train, align (default: all)")
    n.add_argument("--rounds", type=int, default=5, help="A/A rounds per row (default 5)")
    n.add_argument("--compare", nargs="?", const=DEFAULT, metavar="BASELINE",
                   help="judge every row against BASELINE (default: reference_runs/bench/<gpu>/"
                        "nightly.json): ok / regression / improvement / suspicious; exit 3 on "
                        "a regression")
    n.add_argument("--update-baseline", nargs="?", const=DEFAULT, metavar="PATH",
                   help="write this run as the baseline (default path as --compare); an existing "
                        "one is replaced only after a confirmation or with --yes")
    n.add_argument("--yes", action="store_true", help="replace the baseline without asking")
    n.add_argument("--history", metavar="URL",
                   help="the history store, any SQLAlchemy URL (default $ONBOARD_BENCH_HISTORY, "
                        "else sqlite:///runs/bench-history.sqlite)")
    n.add_argument("--no-history", action="store_true", help="do not append this run")
    n.add_argument("--dashboard", metavar="HTML",
                   help="write the dashboard here (one self-contained page) and the profiled "
                        "training step's Chrome trace beside it")
    n.add_argument("--key", metavar="SUBSTR", help="history: only rows whose key contains SUBSTR")
    b.add_argument("--json", action="store_true",
                   help="print the result rows (history: its rows) as JSON to stdout instead "
                        "of the table")
    b.set_defaults(func=cmd_bench)
    return b


NIGHTLY_ONLY = ("compare", "update_baseline", "yes", "no_history", "dashboard", "history")


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    if args.action == "history":
        return _history(args, console)
    if args.action == "list":
        return _list(args, console)
    if args.blocks and args.suite == "nightly":
        raise InputError("--blocks: not with --suite nightly")
    if args.suite == "nightly":
        from onboarding.cli.nightly import cmd_nightly

        return cmd_nightly(args, console)
    given = [f"--{k.replace('_', '-')}" for k in NIGHTLY_ONLY if getattr(args, k, None)]
    if given:
        raise InputError(f"{', '.join(given)}: only with --suite nightly")
    if args.blocks:
        return _blocks(args, console)
    import torch

    from onboarding.bench.cases import cases_for, select_cases, split_impls
    from onboarding.bench.harness import format_table, run_cases

    cases = select_cases(cases_for(args.family), args.case,
                         split_impls(args.impl))
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
        result = run_cases(cases, log=progress(console, status), partial=save,
                           profile=args.profile)
    print(json.dumps(result, indent=1, default=str) if args.json else format_table(result))
    save(result)
    if args.out:
        console.print(f"wrote {args.out}")
    return EXIT_OK


def _blocks(args: argparse.Namespace, console: Console) -> int:
    """``--blocks MODEL``: each model's uncovered blocks, Inductor against eager."""
    import torch

    from onboarding.bench.blocks import bench_blocks, summary_table

    mixed = [f for f, v in (("--family", args.family), ("--case", args.case),
                            ("--impl", args.impl), ("--against", args.against),
                            ("--profile", args.profile)) if v]
    if mixed:
        raise InputError(f"{', '.join(mixed)}: not with --blocks (its rows are blocks, not "
                         "kernel cases)")
    if args.seq < 1:
        raise InputError(f"--seq {args.seq}: must be >= 1")
    if not torch.cuda.is_available():
        raise InputError("onboard bench needs a GPU (timings on the CPU interpreter mean "
                         "nothing); run it on the GPU machine")
    with console.status("compiling and timing uncovered blocks"):
        result = bench_blocks(args.blocks, proxy=args.proxy, seq=args.seq, dtype=args.dtype,
                              start=args.start, timeout=args.timeout, log=console.print)
    print(json.dumps(result, indent=1, default=str) if args.json else summary_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        console.print(f"wrote {args.out}")
    return EXIT_OK


def _history(args: argparse.Namespace, console: Console) -> int:
    from onboarding.bench.history import History, default_url, format_history

    url = args.history or default_url()
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        raise InputError(f"--history {url}: no such database (a nightly run writes it)")
    series = History(url).series(args.key)
    if args.json:
        print(json.dumps(series, indent=1, default=str))
    else:
        print(format_history(series))
    return EXIT_OK


def _list(args: argparse.Namespace, console: Console) -> int:
    """``onboard bench list``: the cases `--family` / `--case` select and the implementation rows
    each would time (``ours@...`` sweeps included; `--impl` filters them as a run would). Cases
    are built on the meta device to name their rows: nothing is allocated or timed, no GPU."""
    from rich.table import Table

    from onboarding.bench.cases import cases_for, dry_rows, select_cases, split_impls

    impls = split_impls(args.impl)
    cases = select_cases(cases_for(args.family), args.case, impls)
    rows = []
    for c in cases:
        names, why = dry_rows(c)
        rows.append({"family": c.family, "case": c.name, "shape": c.shape,
                     "gflop": round(c.flops / 1e9, 3), "min_mb": round(c.min_bytes / 2**20, 1),
                     "rows": None if names is None else [n for n in names if n not in c.on_request],
                     "on_request": [n for n in c.on_request if names is None or n in names],
                     "rows_unknown": why, "note": c.note})
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    t = Table(title=f"{len(rows)} benchmark cases (onboard bench --family F --case NAME "
                    "[--impl A,B] runs them on a GPU)")
    for col in ("family", "case", "shape", "GFLOP", "min MiB", "rows timed", "sweep rows",
                "on request (--impl)", "note"):
        t.add_column(col, overflow="fold")
    sweeps = Table(title="sweep rows (ours@<config>: our kernel at another tuning config; "
                         "_fwd: forward only)")
    sweeps.add_column("case", no_wrap=True)
    sweeps.add_column("row", overflow="fold")
    sweeps.add_column("timed", no_wrap=True)
    for r in rows:
        own = [n for n in r["rows"] or () if "@" not in n]
        swept = [(n, "with ours") for n in r["rows"] or () if "@" in n]
        swept += [(n, "on request") for n in r["on_request"] if "@" in n]
        for n, when in swept:
            sweeps.add_row(f"{r['family']}/{r['case']}", n, when)
        timed = (", ".join(own) or "-") if r["rows"] is not None else \
            "only known on a GPU: " + r["rows_unknown"]
        asked = [n for n in r["on_request"] if "@" not in n]
        t.add_row(r["family"], r["case"], " ".join(f"{k}={v}" for k, v in r["shape"].items()),
                  f"{r['gflop']:g}", f"{r['min_mb']:g}", timed, str(len(swept)) if swept else "-",
                  ", ".join(asked) or "-", r["note"])
    console.print(t)
    if sweeps.row_count:
        console.print(sweeps)
    return EXIT_OK
    t = Table(title=f"{len(rows)} benchmark cases (onboard bench --family F --case NAME runs them on a GPU)")
    for col in ("family", "case", "shape", "GFLOP", "min MiB", "anchors on request", "note"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["family"], r["case"], " ".join(f"{k}={v}" for k, v in r["shape"].items()),
                  f"{r['gflop']:g}", f"{r['min_mb']:g}", ", ".join(r["on_request"]) or "-", r["note"])
    console.print(t)
    return EXIT_OK
