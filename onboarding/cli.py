"""The `onboard` command line. Exit codes: 0 success, 2 bad input, 1 internal failure."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from pathlib import Path

from rich.console import Console

from onboarding.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, InputError
from onboarding.loading import DEFAULT_EXAMPLE
from onboarding.overrides import parse_assignments

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="onboard", description=__doc__)
    ap.add_argument("--debug", action="store_true", help="print tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("parse", help="capture the proxy and classify its blocks")
    _model_args(p)
    p.add_argument("--out", help="write model.json and opgraph.json here")
    p.add_argument("--json", action="store_true", help="print opgraph.json to stdout")

    r = sub.add_parser("run", help="run the agent pipeline on MODEL")
    _model_args(r, optional=True)
    r.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run")
    r.add_argument("--stop-after", choices=("load", "parse"), help=argparse.SUPPRESS)
    return ap


def cmd_parse(args: argparse.Namespace, console: Console) -> int:
    from onboarding.console import print_opgraph
    from onboarding.rundir import owned_dir
    from onboarding.stages import run_load, run_parse

    overrides = parse_assignments(args.set)
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and any(out.iterdir()):
        raise InputError(f"--out {out}: directory exists and is not empty")
    if out is None:
        with console.status("parse: loading"):
            info = run_load(args.model, overrides, args.trust_remote_code, args.proxy)
            g = run_parse(info, None, batch=args.batch, seq=args.seq, seed=args.seed)
    else:
        with owned_dir(out, created_here=True), console.status("parse") as status:
            info = run_load(args.model, overrides, args.trust_remote_code, args.proxy, out)
            g = run_parse(info, out, batch=args.batch, seq=args.seq, seed=args.seed,
                          on_step=lambda s: status.update(f"parse: {s}"))
    if args.json:
        print(json.dumps(g.to_dict(), indent=1))
    else:
        print_opgraph(g, console)
        if out is not None:
            console.print(f"wrote {out / 'opgraph.json'}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from agents.graph import compile_graph, thread_config
    from agents.state import RunConfig, RunState
    from onboarding.console import print_opgraph
    from onboarding.opgraph import OpGraph
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
        # Check the input before a run directory exists, so bad input leaves nothing behind.
        with console.status("checking MODEL"):
            info = run_load(args.model, overrides, args.trust_remote_code, args.proxy)
        run_dir = new_run_dir(info.loaded.name, args.out)
        created = True
        inputs = RunState(config=RunConfig(
            model_ref=args.model, overrides=overrides, trust_remote_code=args.trust_remote_code,
            proxy=args.proxy, batch=args.batch, seq=args.seq, seed=args.seed),
            run_dir=str(run_dir))
    with owned_dir(run_dir, created_here=created):
        app, conn = compile_graph(run_dir)
        try:
            cfg = thread_config(run_dir)
            if args.resume:
                snap = app.get_state(cfg)
                if not snap.next:
                    console.print(f"{run_dir}: run already complete")
                    return EXIT_OK
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
        finally:
            conn.close()
    graph_file = run_dir / "opgraph.json"
    if graph_file.exists():
        print_opgraph(OpGraph.load(graph_file), console)
    console.print(f"report: {run_dir / 'report.md'}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        if args.command == "parse":
            return cmd_parse(args, console)
        return cmd_run(args, console)
    except InputError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        if args.debug:
            traceback.print_exc()
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERNAL
    except Exception as exc:  # internal failure: a bug in onboard, not the user's input
        err.print(f"[red]internal error:[/red] {type(exc).__name__}: {exc}", highlight=False)
        if args.debug:
            traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
