"""``onboard bench``: kernel benchmarks against eager, torch.compile and anchors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from onboarding.cli.common import progress, command_parser
from onboarding.errors import EXIT_OK, InputError


def add_parser(sub) -> argparse.ArgumentParser:
    b = command_parser(sub, "bench",
                       help="kernel benchmarks vs eager, torch.compile and anchors (GPU)")
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
    b.set_defaults(func=cmd_bench)
    return b


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
        result = run_cases(cases, log=progress(console, status), partial=save,
                           profile=args.profile)
    print(format_table(result))
    save(result)
    if args.out:
        console.print(f"wrote {args.out}")
    return EXIT_OK
