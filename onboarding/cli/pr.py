"""``onboard pr``: the kernel PR of a run: create, list, show, diff, approve, reject.

A run paused at the review gate (`onboard run --review`) is answered here too: `approve` and
`reject` on its RUN_DIR resume the agent, whose pr node merges or deletes the branch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from onboarding.cli.common import command_parser
from onboarding.errors import EXIT_OK

REPO_HELP = ("the git repository holding kernels/ (default: this checkout; a team's kernel "
             "repository with the same layout)")


def add_parser(sub) -> argparse.ArgumentParser:
    p = command_parser(sub, "pr", help="kernel PRs: a reviewable branch per run; approve merges")
    ops = p.add_subparsers(dest="pr_command", required=True, metavar="COMMAND")

    c = ops.add_parser("create", help="open the run's kernel PR: a branch with one commit per "
                                      "family and PR.md")
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("--repo", metavar="PATH", help=REPO_HELP)
    c.add_argument("--base", metavar="BRANCH",
                   help="the branch it merges into (default: the repo's current branch)")
    c.add_argument("--branch", metavar="NAME",
                   help="the PR branch (default onboard/<model>-<yyyymmdd-hhmm>)")
    c.add_argument("--push", metavar="REMOTE",
                   help="push the branch and open the PR with gh (when the remote and gh "
                        "exist; else print the commands)")
    c.set_defaults(func=cmd_create)

    ls = ops.add_parser("list", help="the PRs of a repository and their status")
    ls.add_argument("--repo", metavar="PATH", help=REPO_HELP)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)

    for name, helptext, fn in (("show", "print a PR's PR.md", cmd_show),
                               ("diff", "the PR's changes against its base", cmd_diff),
                               ("approve", "merge the PR into its base branch (resumes a run "
                                           "paused at review)", cmd_approve),
                               ("reject", "delete the PR branch and record why (ends a run "
                                          "paused at review)", cmd_reject)):
        o = ops.add_parser(name, help=helptext)
        o.add_argument("target", metavar="RUN_DIR|BRANCH")
        o.add_argument("--repo", metavar="PATH", help=REPO_HELP)
        if name == "diff":
            o.add_argument("--stat", action="store_true", help="files and line counts only")
        if name == "reject":
            o.add_argument("--why", default=None, metavar="TEXT", help="the reason, recorded")
        o.set_defaults(func=fn)
    return p


def run_command(run_dir: Path) -> str | None:
    """`onboard run ...` that re-creates the run, from the RunConfig in its checkpoint."""
    from agents.review import reproduce_command
    from onboarding.cli.run import run_config

    cfg = run_config(run_dir)
    return reproduce_command(cfg) if cfg is not None else None


def _repo(args) -> Path:
    from onboarding.pr import default_repo

    return Path(args.repo) if args.repo else default_repo()


def cmd_create(args: argparse.Namespace, console: Console) -> int:
    from onboarding.pr import create_pr
    from onboarding.pr.collect import check_run_dir

    run_dir = Path(args.run_dir)
    check_run_dir(run_dir)
    rec = create_pr(run_dir, _repo(args), base=args.base, branch=args.branch,
                    run_command=run_command(run_dir))
    console.print(f"created [bold]{escape(rec.branch)}[/bold] in {escape(rec.repo)} onto "
                  f"{escape(rec.base)}: {len(rec.commits)} commits, one per family "
                  f"({', '.join(c['family'] for c in rec.commits)}), then {rec.body_path}",
                  highlight=False)
    for label, why in rec.left_out:
        console.print(escape(f"  not proposed: {label}: {why}"), highlight=False)
    print_how_to_answer(rec, console)
    if args.push:
        _push(rec, args.push, console)
    return EXIT_OK


def print_how_to_answer(rec, console: Console) -> None:
    console.print(escape(f"review: onboard pr show {rec.branch}; onboard pr diff {rec.branch}"),
                  highlight=False)
    console.print(escape(f"answer: onboard pr approve {rec.branch}  |  onboard pr reject "
                         f"{rec.branch} --why \"...\""), highlight=False)


def _push(rec, remote: str, console: Console) -> None:
    from onboarding.pr import Git, push

    ran, lines = push(Git(rec.repo), rec, remote)
    if ran:
        console.print(f"pushed {escape(rec.branch)} to {escape(remote)} and opened the PR:",
                      highlight=False)
    else:
        console.print(f"not pushed (remote {escape(remote)} or the gh CLI missing); the "
                      "commands would be:", highlight=False)
    for ln in lines:
        console.print("  " + escape(ln), highlight=False, soft_wrap=True)


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    from onboarding.pr import Git, list_prs

    git = Git(_repo(args))
    rows = list_prs(git)
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    if not rows:
        console.print(f"no kernel PRs in {git.root}")
        return EXIT_OK
    for r in rows:
        extra = (f" (merged at {r['merged_commit'][:10]})" if r.get("merged_commit") else
                 f" ({r['why']})" if r.get("why") else "")
        console.print(escape(f"{r['status']:<9} {r['branch']}  {r.get('model', '')}  "
                             f"{r.get('run_dir', '')}{extra}"), highlight=False)
    return EXIT_OK


def cmd_show(args: argparse.Namespace, console: Console) -> int:
    from onboarding.pr import resolve, show_body

    git, rec = resolve(args.target, args.repo)
    print(show_body(git, rec))
    return EXIT_OK


def cmd_diff(args: argparse.Namespace, console: Console) -> int:
    from onboarding.pr import diff, resolve

    git, rec = resolve(args.target, args.repo)
    print(diff(git, rec, stat=args.stat), end="")
    return EXIT_OK


def _answer(args: argparse.Namespace, console: Console, decision: str) -> int | None:
    """A run paused at review: resume its agent with the decision (its pr node acts)."""
    from onboarding.cli import run

    path = Path(args.target)
    if not run.review_pending(path):
        return None
    console.print(f"{path}: resuming the run paused at review ({decision})")
    argv = ["run", "--resume", str(path), f"--{decision}"]
    if decision == "reject" and args.why:
        argv += ["--why", args.why]
    ap = argparse.ArgumentParser(prog="onboard")
    run.add_parser(ap.add_subparsers(dest="command", required=True))
    return run.cmd_run(ap.parse_args(argv), console)


def cmd_approve(args: argparse.Namespace, console: Console) -> int:
    from onboarding.pr import approve, resolve

    rc = _answer(args, console, "approve")
    if rc is not None:
        return rc
    git, rec = resolve(args.target, args.repo)
    rec = approve(git, rec)
    console.print(f"approved {escape(rec.branch)}: merged into {escape(rec.base)} at "
                  f"{rec.merged_commit[:10]}; the branch is deleted", highlight=False)
    return EXIT_OK


def cmd_reject(args: argparse.Namespace, console: Console) -> int:
    from onboarding.pr import reject, resolve

    rc = _answer(args, console, "reject")
    if rc is not None:
        return rc
    git, rec = resolve(args.target, args.repo)
    rec = reject(git, rec, args.why)
    console.print(f"rejected {escape(rec.branch)}: branch deleted; reason recorded: "
                  f"{escape(rec.why or '')}", highlight=False)
    return EXIT_OK
