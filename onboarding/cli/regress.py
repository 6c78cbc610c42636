"""``onboard regress``: a finished run compared with its golden reference."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console

from onboarding.cli import run
from onboarding.cli.common import command_parser, err
from onboarding.errors import EXIT_CHECK_FAILED, EXIT_OK, InputError


def add_parser(sub) -> argparse.ArgumentParser:
    rg = command_parser(sub, "regress", help="compare a finished run (default: a fresh run of the "
                                              "built-in example) with its golden reference")
    rg.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                    help="a finished `onboard run` directory (default: run the built-in "
                         "example now, into runs/regress-<NAME>-<time>)")
    rg.add_argument("--reference", default="example", metavar="NAME",
                    help="the golden in reference_runs/NAME/golden.json (default: example)")
    rg.add_argument("--update", action="store_true",
                    help="write (or overwrite) the golden from this run; without it nothing "
                         "is written into reference_runs/")
    rg.add_argument("--json", action="store_true",
                    help="print the facts (golden, this run, status) as JSON to stdout")
    rg.set_defaults(func=cmd_regress)
    return rg


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
    # `onboard run`'s own parser: main's build_parser would import this module back
    ap = argparse.ArgumentParser(prog="onboard")
    run.add_parser(ap.add_subparsers(dest="command", required=True))
    # a failed check (exit 3) is a fact the golden compares; anything else is not a run
    if run.cmd_run(ap.parse_args(argv), console) not in (EXIT_OK, EXIT_CHECK_FAILED):
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
    if old is not None and (other := regress.other_model(old["facts"], facts)):
        if not args.update:
            raise InputError(f"{run_dir} is a run of {other[1]}; the golden {ref_file} is of "
                             f"{other[0]}: the facts of two models do not compare. Make this "
                             f"model's golden with `onboard regress {run_dir} --reference NAME "
                             f"--update`, then compare its runs with --reference NAME")
        console.print(f"[yellow]the golden {ref_file} was of {other[0]}; --update makes it "
                      f"{other[1]}'s[/yellow]", highlight=False)
    findings = regress.compare(old["facts"], facts) if old is not None else []
    made = ""
    if old is not None:
        meta = old["metadata"]
        made = f"made at commit {(meta.get('commit') or '?')[:10]}, {meta.get('date')}"
        print_regression(regress.rows(old["facts"], facts, findings), console,
                         title=f"{run_dir} vs {ref_file} ({made})")
        here = regress.device()
        if meta.get("device") and meta["device"] != here:
            console.print(f"[yellow]the golden was made on {meta['device']}, this run is on "
                          f"{here}: error metrics compare within their tolerances[/yellow]")
    for f in findings:
        console.print(f"[red]changed[/red] {f.message}", highlight=False)
    if args.json:
        rows = regress.rows(old["facts"] if old is not None else {}, facts, findings)
        print(json.dumps({"run_dir": str(run_dir), "golden": str(ref_file), "golden_made": made,
                          "facts": [{"fact": f, "golden": g, "this_run": c, "status": st}
                                    for f, g, c, st in rows],
                          "changed": [f.message for f in findings]}, indent=1))
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
