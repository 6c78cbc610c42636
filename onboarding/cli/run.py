"""``onboard run``: the agent pipeline on a model, resumable."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from onboarding.cli.common import (command_parser, gpu_sharing, gpu_sharing_options, model_options,
                                   model_spec, selected_kernels)
from onboarding.errors import EXIT_CHECK_FAILED, EXIT_OK, InputError
from onboarding.formatting import count
from onboarding.load.overrides import nonneg_int, positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    r = command_parser(sub, "run", help="run the agent pipeline on MODEL")
    model_options(r)
    r.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run")
    r.add_argument("--kernels", default="all",
                   help="kernel families patched for alignment: comma-separated, 'all', 'none' "
                        "('inductor': the Inductor fallback's block swaps, 'generated': the "
                        "LLM-written families; an explicit list without them leaves those "
                        "blocks eager)")
    r.add_argument("--tune-trials", type=nonneg_int, default=None, metavar="N",
                   help="Optuna trials per kernel and shape bucket (default: 20 on a GPU; "
                        "tuning is skipped on the CPU unless this is given)")
    r.add_argument("--tune-budget", type=float, default=None, metavar="SECONDS",
                   help="seconds for the whole tune stage, shared by its studies (kernel x "
                        "shape bucket); no trial starts once a study's share is spent (default "
                        "90; 0: no time limit, --tune-trials alone)")
    gpu_sharing_options(r, "tune-")
    r.add_argument("--tune-parallel", type=positive_int, default=None, metavar="N",
                   help="studies tuned at once, each compiling on its own workers while the "
                        "timings take the GPU in turn (default: three per four cores on a "
                        "GPU host, one on the CPU)")
    r.add_argument("--train-steps", type=nonneg_int, default=None, metavar="N",
                   help="LoRA training steps of the FSDP2 x EP setup and its reference "
                        "(default: 20 on a GPU; skipped on the CPU unless this is given)")
    r.add_argument("--train-nproc", type=positive_int, default=None, metavar="N",
                   help="training processes (default: the GPUs here, 2 on the CPU)")
    r.add_argument("--max-align-retries", type=nonneg_int, default=2, metavar="N",
                   help="a failed alignment loops back to generate without the culprit's kernel "
                        "at most N times (default 2; each retry must leave out a kernel)")
    r.add_argument("--strict", action="store_true",
                   help="fail (exit 3) when any coverable block was left unpatched (not checked)")
    add_generate_options(r)
    r.add_argument("--json", action="store_true",
                   help="print the outcome (run directory, exit code, verdict, the summary's "
                        "lines) as JSON to stdout; progress and tables go to stderr")
    r.add_argument("--review", action="store_true",
                   help="after the report, open the kernel PR (as onboard pr create) and stop "
                        "for a human's review; answer with onboard pr approve|reject RUN_DIR or "
                        "--resume RUN_DIR --approve|--reject")
    r.add_argument("--repo", metavar="PATH",
                   help="with --review: the git repository holding kernels/ (default: this "
                        "checkout)")
    r.add_argument("--base", metavar="BRANCH",
                   help="with --review: the branch the PR merges into (default: the repo's "
                        "current branch)")
    answer = r.add_mutually_exclusive_group()
    answer.add_argument("--approve", action="store_true",
                        help="with --resume: approve the kernel PR the run waits on (merge it)")
    answer.add_argument("--reject", action="store_true",
                        help="with --resume: reject it (delete its branch) and end the run")
    r.add_argument("--why", metavar="TEXT", help="with --reject: the reason, recorded")
    r.add_argument("--stop-after", choices=("load", "parse"), help=argparse.SUPPRESS)
    r.set_defaults(func=cmd_run)
    return r


def add_generate_options(r: argparse.ArgumentParser) -> None:
    """The decision loop's options for blocks no family serves (docs/generate.md)."""
    r.add_argument("--llm", default="off", metavar="URL|off",
                   help="an OpenAI-compatible server (vLLM, SGLang, ollama, OpenAI) asked to write "
                        "a kernel family for each uncovered block before the Inductor fallback; "
                        "key from ONBOARD_LLM_API_KEY or OPENAI_API_KEY (default off)")
    r.add_argument("--llm-model", metavar="NAME", help="the model name the server serves")
    r.add_argument("--llm-attempts", type=positive_int, default=3, metavar="N",
                   help="answers asked per block, each failure sent back with its reason "
                        "(default 3)")
    r.add_argument("--generate-budget", type=float, default=None, metavar="SECONDS",
                   help="wall time for the whole decision loop (LLM attempts, Inductor checks); "
                        "blocks left when it is spent stay uncovered (default: no limit)")


def llm_url(args: argparse.Namespace) -> str | None:
    """--llm as a URL, or None for off; a bad value is an input error."""
    if args.generate_budget is not None and args.generate_budget < 0:
        raise InputError(f"--generate-budget {args.generate_budget}: expected seconds >= 0")
    value = (args.llm or "off").strip()
    if value.lower() == "off":
        if args.llm_model:
            raise InputError("--llm-model without --llm URL: the LLM path is off")
        return None
    if not value.startswith(("http://", "https://")):
        raise InputError(f"--llm {value}: expected an http(s):// URL of an OpenAI-compatible "
                         "server, or off")
    return value


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from agents.graph import NODES, compile_graph, run_thread, thread_config
    from agents.state import RunConfig, RunState
    from onboarding.cli.console import print_opgraph
    from onboarding.graph.opgraph import OpGraph
    from onboarding.rundir import new_run_dir, new_run_id, owned_dir
    from onboarding.stages import run_load

    _check_review_options(args)
    if args.resume:
        run_dir = Path(args.resume)
        if args.model is not None or args.out:
            raise InputError(f"--resume {run_dir} continues the run as it was set up; it takes "
                             "no MODEL or --out")
        if not run_dir.is_dir():
            raise InputError(f"--resume {run_dir}: no such directory")
        run_id = run_thread(run_dir)  # the run's identity is what its folder holds
        created = False
        inputs = None
    else:
        spec = model_spec(args)
        families = selected_kernels(args)
        if args.tune_budget is not None and args.tune_budget < 0:
            raise InputError(f"--tune-budget {args.tune_budget}: expected seconds >= 0 "
                             "(0: no time limit)")
        if args.max_align_retries < 0:
            raise InputError(f"--max-align-retries {args.max_align_retries}: expected >= 0")
        if spec.part == "vision" and args.train_steps:
            raise InputError("--part vision --train-steps: LoRA training takes the language model "
                             "(its towers frozen); run without --part vision to train")
        config = RunConfig(
            model=spec, batch=args.batch, seq=args.seq, seed=args.seed,
            align_kernels=families, max_align_retries=args.max_align_retries,
            strict=args.strict, llm=llm_url(args), llm_model=args.llm_model,
            llm_attempts=args.llm_attempts, generate_budget_s=args.generate_budget,
            tune_trials=args.tune_trials, tune_budget_s=args.tune_budget,
            tune_parallel=args.tune_parallel,
            **{f"tune_{k}": v for k, v in gpu_sharing(args, "tune-").items()},
            # the vision tower alone is not trained (training takes the language model)
            train_steps=0 if spec.part == "vision" else args.train_steps,
            train_nproc=args.train_nproc,
            review=args.review, review_repo=args.repo and str(Path(args.repo).resolve()),
            review_base=args.base)
        if args.out:  # an unusable --out fails before the model is loaded
            new_run_dir("", args.out)
        # Check the input before a run directory exists, so bad input leaves nothing behind.
        with console.status("checking MODEL"):
            info = run_load(spec)
        run_dir = new_run_dir(info.loaded.name, args.out)
        created = True
        inputs = RunState(config=config, run_dir=str(run_dir.resolve()))
    # resumable: an interrupted run keeps its folder; bad input found by a stage removes it
    with owned_dir(run_dir, created_here=created, resumable=True):
        if not args.resume:
            run_id = new_run_id(run_dir, model=info.loaded.name)
        app, conn = compile_graph(run_dir)
        try:
            cfg = thread_config(run_dir, run_id)
            if args.resume:
                done, pending = _resume_point(app, cfg, run_dir)
                waiting = review_waiting(app, cfg)
                if args.approve or args.reject:
                    if waiting is None:
                        raise InputError(f"--resume {run_dir}: no kernel PR awaits review in "
                                         "this run")
                    from langgraph.types import Command

                    inputs = Command(resume={"decision": "approve" if args.approve
                                             else "reject", "why": args.why})
                elif waiting is not None:  # still paused: say what awaits and how to answer
                    print_review(waiting, console)
                    return EXIT_OK
                if not pending and NODES[-1] in done:  # complete only once the last node ran
                    console.print(f"{run_dir}: run already complete")
                    values = app.get_state(cfg).values
                    return _json_outcome(args, values, run_dir, _run_verdict(values, console))
                console.print(f"resuming {run_dir} at: {pending or 'after ' + done[-1]}")
            stopping = False
            steps = _Steps(console)
            with console.status("starting") as status, _stop_on_signals(run_dir):
                steps.status = status
                for mode, chunk in app.stream(inputs, cfg, stream_mode=["updates", "custom"],
                                              durability="sync"):
                    if stopping:
                        # Test hook: die like a killed process once the next node has begun,
                        # i.e. after the stopped-after node's checkpoint is written.
                        os.kill(os.getpid(), signal.SIGKILL)
                    if mode == "custom":
                        steps.step(chunk["node"], chunk["step"])
                        continue
                    for node in chunk:
                        if node.startswith("__"):  # langgraph's own (a replayed step's metadata)
                            continue
                        steps.done(node)
                        stopping = stopping or node == args.stop_after
            final = app.get_state(cfg).values
            waiting = review_waiting(app, cfg)
        finally:
            conn.close()
    graph_file = run_dir / "opgraph.json"
    if graph_file.exists():
        print_opgraph(OpGraph.load(graph_file), console)
    print_summary(final, run_dir, console)
    if waiting is not None:
        print_review(waiting, console)
    return _json_outcome(args, final, run_dir, _run_verdict(final, console))


def _json_outcome(args: argparse.Namespace, values: dict, run_dir: Path, rc: int) -> int:
    """`onboard run --json`: the outcome on stdout (the screen went to stderr); returns rc."""
    if getattr(args, "json", False):
        from agents.state import RunState

        passed, line = RunState.model_validate(values).verdict()
        print(json.dumps({"run_dir": str(run_dir), "exit": rc, "passed": passed,
                          "verdict": line, "summary": [{"stage": st, "verdict": text} for st, text
                                                       in summary_lines(values, run_dir)]},
                         indent=1))
    return rc


def _check_review_options(args: argparse.Namespace) -> None:
    """The review gate's options, checked before anything runs: answers only on --resume, a
    repository that is a git repository with the base branch (bad input leaves nothing)."""
    if (args.approve or args.reject) and not args.resume:
        raise InputError("--approve/--reject answer a run paused at review: give --resume "
                         "RUN_DIR")
    if args.why and not args.reject:
        raise InputError("--why goes with --reject")
    if (args.repo or args.base) and not args.review:
        raise InputError("--repo/--base go with --review")
    if args.review and not args.resume:
        from onboarding.pr import Git, default_repo

        git = Git(args.repo or default_repo())
        if args.base and not git.branch_exists(args.base):
            raise InputError(f"--base {args.base}: no such branch in {git.root}")
        if not args.base and git.current_branch() is None:
            raise InputError(f"{git.root}: HEAD is detached; name the branch to merge into "
                             "with --base BRANCH")


def review_waiting(app, cfg: dict) -> dict | None:
    """What a run paused at the review gate shows (its interrupt's value), else None."""
    for task in app.get_state(cfg).tasks:
        for it in task.interrupts:
            return it.value
    return None


def print_review(waiting: dict, console: Console) -> None:
    console.print(f"[bold yellow]awaiting review[/bold yellow]: kernel PR "
                  f"[bold]{escape(waiting['branch'])}[/bold] in {escape(waiting['repo'])} onto "
                  f"{escape(waiting['base'])} ({', '.join(waiting['families'])}); PR.md at "
                  f"{escape(waiting['body'])} on the branch", highlight=False)
    for key in ("show", "diff", "approve", "reject"):
        console.print(f"  {key + ':':<8} " + escape(waiting[key]), highlight=False,
                      soft_wrap=True)


def _snapshot(run_dir: Path):
    from agents.graph import CHECKPOINT_DB, compile_graph, run_thread, thread_config

    if not (run_dir / CHECKPOINT_DB).is_file():
        return None, None
    run_id = run_thread(run_dir)
    app, conn = compile_graph(run_dir)
    try:
        cfg = thread_config(run_dir, run_id)
        return app.get_state(cfg), review_waiting(app, cfg)
    finally:
        conn.close()


def run_config(run_dir: Path):
    """The RunConfig in a run's checkpoint (None: no checkpoint, or one that cannot be read)."""
    from agents.state import RunState

    try:
        snap, _ = _snapshot(Path(run_dir))
        return RunState.model_validate(snap.values).config if snap is not None else None
    except Exception:  # noqa: BLE001 - PR.md then says less; the PR does not depend on it
        return None


def review_pending(run_dir: Path) -> bool:
    """Whether the run in `run_dir` is paused at the review gate."""
    if not Path(run_dir).is_dir():
        return False
    return _snapshot(Path(run_dir))[1] is not None


def _resume_point(app, cfg: dict, run_dir: Path) -> tuple[list[str], str]:
    """(the nodes done, the nodes to run next) of a run's checkpoint. A stage that finished but
    whose step was not closed (killed between its writes and the next checkpoint) counts as
    done: its writes are saved, and the graph applies them when it resumes. A checkpoint that
    cannot be read back is bad input, never a finished run."""
    from pydantic import ValidationError

    from agents.state import RunState

    try:
        snap = app.get_state(cfg)
        state = RunState.model_validate(snap.values)
    except ValidationError as exc:
        raise InputError(f"--resume {run_dir}: checkpoint unreadable: the run state does not "
                         f"validate ({exc.error_count()} errors, first: "
                         f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']})") from None
    except Exception as exc:  # noqa: BLE001 - sqlite, msgpack, ...: the file is not a checkpoint
        first = (str(exc).strip().splitlines() or [""])[0]
        raise InputError(f"--resume {run_dir}: checkpoint unreadable: {type(exc).__name__}: "
                         f"{first}") from None
    if not state.completed and not snap.next:
        raise InputError(f"--resume {run_dir}: checkpoint unreadable: it holds no stage done "
                         "and none to run")
    return state.completed, ", ".join(snap.next)


@contextlib.contextmanager
def _stop_on_signals(run_dir: Path):
    """SIGINT or SIGTERM while the graph runs: stop now, not when the running stage ends (the
    graph runs its node in a worker thread and would wait for it). The checkpoint written
    before that stage is on disk (durability "sync"), so ending here leaves a run that
    ``--resume`` continues from that stage; the processes it started go first."""
    def stop(signum, _frame) -> None:
        from onboarding.cli.common import err
        from onboarding.rundir import append_event

        name = signal.Signals(signum).name
        try:
            append_event(run_dir, {"event": "interrupted", "signal": name})
        except OSError:
            pass
        err.print(f"{name}: stopped; continue with: onboard run --resume {run_dir}",
                  highlight=False, markup=False, emoji=False, soft_wrap=True)
        _end_children()
        if sys.stdout.isatty():
            sys.stdout.write("\x1b[?25h")  # the status spinner hid the cursor
        for f in (sys.stdout, sys.stderr):  # os._exit skips Python's buffers
            f.flush()
        os._exit(128 + signum)

    try:
        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: no handlers there
        old = {}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _end_children() -> None:
    """SIGTERM to every process this one started (training ranks, tuning workers), found by
    parent pid in /proc, deepest first; on a system without /proc, nothing."""
    children: dict[int, list[int]] = {}
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = Path(f"/proc/{d}/stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
    except OSError:
        return
    order, todo = [], [os.getpid()]
    while todo:
        for c in children.get(todo.pop(), []):
            order.append(c)
            todo.append(c)
    for pid in reversed(order):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


class _Steps:
    """What the running stage is doing: a spinner line on a terminal; elsewhere (a pipe, a log
    file, CI) plain lines, at most one per `PLAIN_EVERY_S` within a stage. Each finished stage
    gets a line with its wall time."""

    PLAIN_EVERY_S = 2.0

    def __init__(self, console: Console) -> None:
        self.console, self.status = console, None
        self.plain = not console.is_terminal
        self.node, self.printed = None, 0.0
        self.started = time.monotonic()

    def step(self, node: str, text: str) -> None:
        if not self.plain:
            if self.status is not None:
                self.status.update(f"[bold]{escape(node)}[/bold]: {escape(text)}")
            return
        now = time.monotonic()
        if node != self.node or now - self.printed >= self.PLAIN_EVERY_S:
            self.console.print(escape(f"{node}: {text}"), highlight=False, emoji=False)
            self.node, self.printed = node, now

    def done(self, node: str) -> None:
        now = time.monotonic()
        self.console.print(f"[green]done[/green] {escape(node)} ({now - self.started:.1f} s)",
                           highlight=False)
        self.started, self.node = now, None


def stage_seconds(run_dir: Path) -> dict[str, float]:
    """Wall seconds of each stage's last run, from `events.jsonl` (start to done)."""
    out: dict[str, float] = {}
    start: dict[str, float] = {}
    f = run_dir / "events.jsonl"
    if not f.is_file():
        return out
    for line in f.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("event") == "start":
            start[e["node"]] = e["time"]
        elif e.get("event") == "done" and e.get("node") in start:
            out[e["node"]] = e["time"] - start[e["node"]]
    return out


def summary_lines(values: dict, run_dir: Path) -> list[tuple[str, str]]:
    """(stage, verdict) per stage of a finished run: coverage counts, the alignment verdict with
    what it did not check, tuning's best against the default, training's tok/s, MFU and loss
    verdict, each skip with its reason; then the report and the run directory."""
    from agents.state import RunState
    from onboarding.formatting import human
    from onboarding.tune.run import LEFT_OUT_NOTE

    state = RunState.model_validate(values)
    secs = stage_seconds(run_dir)
    s = state.summary
    rows: list[tuple[str, str]] = []

    def add(stage: str, text: str) -> None:
        t = secs.get(stage)
        rows.append((stage, text + (f" [{t:.1f} s]" if t is not None else "")))

    if "load" in state.completed:
        add("load", f"{state.model_name}: {human(s.get('total_params', 0))} parameters, "
                    f"{human(s.get('active_params', 0))} active")
    if "parse" in state.completed:
        add("parse", f"{s.get('blocks')} blocks ({s.get('capture')} capture), "
                     f"{s.get('unknown_blocks', 0)} unknown; layer pattern "
                     f"{s.get('layer_pattern')}")
    if "plan" in state.completed and s.get("plan"):  # the full-size model's layout verdict
        add("plan", str(s["plan"]))
    if "coverage" in s:
        add("map", "coverage: " + ", ".join(f"{k} {v}" for k, v in s["coverage"].items()))
    if "candidates" in s:
        text = f"{s['candidates_passed']} of {s['candidates']} candidate kernels passed " \
            "their checks"
        if s.get("uncovered_decided"):  # the decision loop (docs/generate.md)
            served = ", ".join(f"{s[k]} {k}" for k in ("generated", "inductor") if s.get(k))
            text += f"; of {s['uncovered_decided']} uncovered blocks: {served or 'none served'}"
        add("generate", text)
    if state.align_attempts:
        a = state.align_attempts[-1]
        verdict = "passed" if a["passed"] else "FAILED"
        text = f"{verdict} (attempt {a['attempt']})"
        if not a["passed"]:
            text += ": " + (", ".join(a["culprits"]) or "no single block to blame")
        nc = a.get("not_checked") or []
        if a.get("coverable") is not None:
            text += (f"; {a['coverable'] - len(nc)} of {a['coverable']} coverable blocks "
                     "checked")
        if nc:
            text += "; not checked: " + "; ".join(f"{x['path']} ({x['reason']})"
                                                   for x in nc[:3])
            text += f" and {len(nc) - 3} more" if len(nc) > 3 else ""
        add("align", text)
    if state.tune_attempts:
        t = state.tune_attempts[-1]
        if t.get("skipped"):
            add("tune", f"not run ({t['skipped']})")
        else:
            parts = []
            for b in t.get("best", []):
                gain = (f" ({b['default_ms'] / b['best_ms']:.2f}x)"
                        if b.get("best_ms") and b.get("default_ms") else "")
                fmt = (lambda v: "-" if v is None else f"{v:.4g} ms")
                parts.append(f"{b['family']} {b['bucket']} {fmt(b.get('best_ms'))} vs default "
                             f"{fmt(b.get('default_ms'))}{gain}, {count(b.get('trials'), 'trial')}"
                             + (" (stopped at budget)" if "stopped at budget" in
                                (b.get("stopped") or "") else "")
                             + (", not re-timed" if "not re-timed" in (b.get("stopped") or "")
                                else ""))
            budget = (f" within {t['budget_s']:.0f} s" if t.get("budget_s") else "")
            left = [n for n in t.get("notes", []) if n.endswith(LEFT_OUT_NOTE)]
            add("tune", f"{count(t.get('studies', 0), 'study', 'studies')}{budget}"
                        + (": " + "; ".join(parts) if parts else "")
                        + ("; " + "; ".join(left) if left else ""))
    if state.train_attempts:
        t = state.train_attempts[-1]
        if t.get("skipped"):
            add("train", f"not run ({t['skipped']})")
        else:
            m = {}
            cmp_file = run_dir / "train" / "compare.json"
            if cmp_file.is_file():
                try:
                    m = json.loads(cmp_file.read_text()).get("metrics", {}).get("parallel", {})
                except json.JSONDecodeError:
                    m = {}
            elif (run_dir / "train" / "reference.jsonl").is_file():  # one process: its rows
                from onboarding.train.compare import read_rows, summarize

                m = summarize(read_rows(run_dir / "train" / "reference.jsonl"))
            tps, mfu = m.get("tokens_per_s"), m.get("mfu")
            loss = (f"loss not compared ({t['single']})" if t.get("single") else
                    "loss matches its reference" if t.get("passed") else
                    "loss check FAILED" + (f": {t['summary']}" if t.get("summary") else
                                           f" (exit code {t.get('exit_code')})"))
            add("train", f"{count(t.get('steps'), 'step')} on {count(t.get('nproc'), 'process', 'processes')}: "
                         + (f"{tps:,.0f} tok/s" if tps else "tok/s -") + ", MFU "
                         + (f"{100 * mfu:.1f}%" if mfu is not None else "-") + f"; {loss}")
    r = state.review
    if r:
        if r.get("status") == "not opened":
            add("review", f"no kernel PR opened: {r.get('error')}")
        elif r.get("status") == "approved":
            add("review", f"approved: {r.get('branch')} merged at "
                          f"{(r.get('merged_commit') or '?')[:10]}")
        elif r.get("status") == "rejected":
            add("review", f"rejected: {r.get('branch')} deleted ({r.get('why')})")
    if (run_dir / "report.md").is_file():
        html = run_dir / "report.html"
        add("report", str(run_dir / "report.md") + (f", {html}" if html.is_file() else ""))
    rows.append(("run dir", str(run_dir)))
    return rows


def print_summary(values: dict, run_dir: Path, console: Console) -> None:
    """The run's summary screen: one verdict line per stage, then the report and run dir."""
    console.print("[bold]summary[/bold]")
    for stage, text in summary_lines(values, run_dir):
        console.print(f"  {stage + ':':<10}" + escape(text), highlight=False, emoji=False,
                      soft_wrap=not console.is_terminal)


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
