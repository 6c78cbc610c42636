"""``onboard run``: the agent pipeline on a model, resumable."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from onboarding.cli.common import command_parser, model_options, model_spec, selected_kernels
from onboarding.errors import EXIT_CHECK_FAILED, EXIT_OK, InputError


def add_parser(sub) -> argparse.ArgumentParser:
    r = command_parser(sub, "run", help="run the agent pipeline on MODEL")
    model_options(r, optional=True)
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
    r.add_argument("--strict", action="store_true",
                   help="fail (exit 3) when any coverable block was left unpatched (not checked)")
    r.add_argument("--stop-after", choices=("load", "parse"), help=argparse.SUPPRESS)
    r.set_defaults(func=cmd_run)
    return r


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
        spec = model_spec(args)
        families = selected_kernels(args)
        if args.max_align_retries < 0:
            raise InputError(f"--max-align-retries {args.max_align_retries}: expected >= 0")
        # Check the input before a run directory exists, so bad input leaves nothing behind.
        with console.status("checking MODEL"):
            info = run_load(spec)
        run_dir = new_run_dir(info.loaded.name, args.out)
        created = True
        inputs = RunState(config=RunConfig(
            model=spec, batch=args.batch, seq=args.seq, seed=args.seed,
            align_kernels=families, max_align_retries=args.max_align_retries,
            strict=args.strict,
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

    state = RunState.model_validate(values)
    if state.align_attempts:  # what the last alignment did not check, block by block
        a = state.align_attempts[-1]
        for x in a.get("not_checked", []):
            console.print(escape(f"not checked: {x['path']} ({x['kind']}, {x['family']}): "
                                 f"{x['reason']}"), highlight=False)
        for x in a.get("backward_not_checked", []):
            console.print(escape(f"backward not checked: {x['path']} ({x['kind']}, "
                                 f"{x['family']}): {x['reason']}"), highlight=False)
    passed, line = state.verdict()
    if passed:
        console.print(escape(line), highlight=False)
        return EXIT_OK
    console.print(f"[bold red]check failed[/bold red]: {escape(line)} (exit {EXIT_CHECK_FAILED})",
                  highlight=False)
    return EXIT_CHECK_FAILED
