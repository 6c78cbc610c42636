"""``onboard bench --suite nightly``: the regression suite, its baseline, history and dashboard.

Every input is checked before the GPU does anything: a baseline to compare with must load, an
existing baseline is replaced only with --yes or a confirmation at a terminal (off a terminal
without --yes: exit 2 before the run), a dashboard path must be new or an earlier dashboard.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from onboarding.cli.common import progress
from onboarding.errors import EXIT_CHECK_FAILED, EXIT_OK, InputError

DASHBOARD_MARK = "<title>onboard nightly</title>"
DEFAULT = "<default>"  # --compare / --update-baseline given without a path


def _confirm(path: Path) -> bool:
    try:
        answer = input(f"replace the baseline {path} with this run? [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def check_update(path: Path, yes: bool, interactive: bool) -> None:
    """An existing baseline is never replaced silently: --yes, or a terminal to ask at."""
    if path.exists() and not yes and not interactive:
        raise InputError(f"--update-baseline: {path} exists; pass --yes to replace it (or run at "
                         "a terminal to be asked)")


def check_dashboard(path: Path) -> None:
    if path.exists() and (not path.is_file() or DASHBOARD_MARK not in path.read_text(errors="replace")[:2000]):
        raise InputError(f"--dashboard {path}: exists and is not an onboard dashboard; "
                         "choose another path")


def cmd_nightly(args: argparse.Namespace, console: Console) -> int:
    from onboarding.bench import compare as C
    from onboarding.bench.suite import NightlyConfig, format_rows, run_nightly

    cli_default = DEFAULT
    if args.case or args.impl or args.profile:
        raise InputError("--case, --impl and --profile are for --suite kernels; the nightly's "
                         "cases are each family's NightlySpec")
    parts = tuple(p for p in args.parts.split(",") if p)
    against = None
    if args.against:
        from onboarding.bench.revision import resolve

        against = resolve(args.against)
    dashboard = Path(args.dashboard) if args.dashboard else None
    if dashboard is not None:
        check_dashboard(dashboard)
    base_path = Path(args.compare) if args.compare and args.compare != cli_default else None
    baseline = C.load_baseline(base_path) if base_path is not None else None
    update = Path(args.update_baseline) if args.update_baseline and \
        args.update_baseline != cli_default else None
    interactive = sys.stdin.isatty()
    if update is not None:
        check_update(update, args.yes, interactive)
    if not args.no_history:
        from onboarding.bench.history import check_url

        check_url(args.history)  # the store itself is opened after the GPU check: no file yet
    cfg = NightlyConfig(parts=parts, families=tuple(args.family) if args.family else None,
                        rounds=args.rounds, against=against,
                        trace_path=dashboard.with_name(dashboard.stem + "_trace.json")
                        if dashboard is not None else None)
    import torch

    if not torch.cuda.is_available():
        raise InputError("onboard bench needs a GPU (timings on the CPU interpreter mean "
                         "nothing); run it on the GPU machine")
    gpu = torch.cuda.get_device_name()
    history = None
    if not args.no_history:
        from onboarding.bench.history import History

        history = History(args.history)
    if args.compare == cli_default:
        base_path = C.default_baseline(gpu)
        baseline = C.load_baseline(base_path)
    if args.update_baseline == cli_default:
        update = C.default_baseline(gpu)
        check_update(update, args.yes, interactive)

    def save(result: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")

    with console.status("nightly benchmark") as status:
        result = run_nightly(cfg, log=progress(console, status), partial=save)
    if not args.json:  # --json: the whole result, once complete, below
        print(format_rows(result))
    verdicts = None
    if baseline is not None:
        verdicts = C.compare(result, baseline, result["min_thresholds"])
        result["compare"] = {"baseline": str(base_path),
                             "baseline_commit": baseline["metadata"].get("commit"),
                             "summary": C.summary(verdicts),
                             "verdicts": C.verdict_dicts(verdicts)}
        if not args.json:
            print(C.format_verdicts(verdicts))
    save(result)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    if args.out:
        console.print(f"wrote {args.out}")
    if history is not None:
        history.append(result, {v.key: v.verdict for v in verdicts or []})
        console.print(f"history: appended {len(result['rows'])} rows to {history.url}")
    if dashboard is not None:
        from onboarding.bench import dashboard as D

        series = history.series(gpu=gpu) if history is not None else {}
        D.write(dashboard, result, series, C.verdict_dicts(verdicts) if verdicts else None)
        console.print(f"wrote {dashboard}")
    if update is not None:
        if update.exists() and not args.yes and not _confirm(update):
            console.print(f"baseline {update} left as it was")
        else:
            from onboarding.regress import metadata

            meta = metadata(command="onboard " + " ".join(sys.argv[1:]))
            C.write_baseline(update, result, meta)
            console.print(f"wrote the baseline {update}")
    if verdicts is not None and any(v.verdict == "regression" for v in verdicts):
        bad = [v.key for v in verdicts if v.verdict == "regression"]
        console.print(f"[bold red]regression[/bold red]: {len(bad)} rows: {', '.join(bad[:6])}"
                      f"{' ...' if len(bad) > 6 else ''} (exit {EXIT_CHECK_FAILED})")
        return EXIT_CHECK_FAILED
    return EXIT_OK
