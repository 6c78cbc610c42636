"""Kernel PRs as git branches: create (one commit per family, then PR.md), list, show, diff,
approve (merge into the base branch), reject (delete the branch, keep the reason), push.

Every operation checks its input before it changes anything: an unknown run, a path that is not
a git repository, a work tree with uncommitted changes where kernel PRs write (`kernels/`,
`tests/reviewed_kernels/`, `prs/`, a generated family's folder), a branch that exists, a run with
nothing that passed to propose are each an `InputError` (exit 2) with the repository untouched.
Branches are built in a temporary worktree, so the user's checkout and current branch never
move. Approving merges with plumbing (`merge-tree`, `commit-tree`, a compare-and-swap
`update-ref`): the base branch moves to the merge, and where it is checked out only the PR's own
files are written into the work tree and index; the user's other changes, staged or not, stay.

Each PR's record (branch, base, run directory, status, the reason of a rejection) is kept in the
repository's git directory, `<git dir>/onboard/prs.json`, and in the run directory's `pr.json`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onboarding.errors import InputError
from onboarding.families.discover import families
from onboarding.pr.body import build_body
from onboarding.pr.collect import FamilyChange, Proposal, check_run_dir, collect
from onboarding.pr.git import Git
from onboarding.pr.testgen import (
    HARNESS,
    HARNESS_PATH,
    sample_inputs_bytes,
    test_paths,
    test_source,
)

BRANCH_PREFIX = "onboard/"
# where kernel PRs write: uncommitted changes here refuse create and approve
KERNEL_PATHS = ("kernels", "tests/reviewed_kernels", "prs")
RECORD_FILE = "pr.json"  # in the run directory
PR_DIR = "prs"  # PR bodies on the branch: prs/<model>-<stamp>/PR.md
TEMPLATES_DIR = "kernel_templates"  # where a generated family's folder goes


@dataclass(kw_only=True)
class PRRecord:
    branch: str
    base: str
    base_commit: str
    repo: str
    run_dir: str
    model: str
    body_path: str
    created: str
    status: str = "open"  # open -> approved | rejected
    commits: list[dict[str, Any]] = field(default_factory=list)  # family, sha, files
    left_out: list[list[str]] = field(default_factory=list)
    why: str | None = None
    merged_commit: str | None = None
    decided: str | None = None


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _records_file(git: Git) -> Path:
    return git.git_dir() / "onboard" / "prs.json"


def load_records(git: Git) -> dict[str, PRRecord]:
    f = _records_file(git)
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{f}: unreadable PR records ({exc})") from None
    return {b: PRRecord(**r) for b, r in data.items()}


def _save(git: Git, rec: PRRecord) -> None:
    recs = load_records(git)
    recs[rec.branch] = rec
    f = _records_file(git)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps({b: asdict(r) for b, r in recs.items()}, indent=1) + "\n")
    tmp.replace(f)
    run_dir = Path(rec.run_dir)
    if run_dir.is_dir():
        (run_dir / RECORD_FILE).write_text(json.dumps(asdict(rec), indent=1) + "\n")


def branch_name(model: str, when: float | None = None) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model).strip("_.") or "model"
    return f"{BRANCH_PREFIX}{safe}-{time.strftime('%Y%m%d-%H%M', time.localtime(when))}"


def _refuse_dirty(git: Git, paths: list[str]) -> None:
    """Refuse uncommitted changes (staged, unstaged or untracked) under `paths` in every work
    tree where it matters: the repository's own and the base branch's."""
    lines = git.dirty(paths)
    if lines:
        shown = "; ".join(ln.strip() for ln in lines[:3]) + (" ..." if len(lines) > 3 else "")
        raise InputError(f"{git.root}: the work tree has uncommitted changes where the kernel PR "
                         f"writes ({len(lines)}: {shown}); commit or stash them first (nothing "
                         "was changed)")


def _template_paths(prop: Proposal) -> list[str]:
    """The repository folders the proposal's template families render from: each family's own,
    the one it extends, and the shared partials. A family the run generated has no folder in
    the repository yet (the PR writes it) and adds none."""
    names = {fam.family for fam in prop.families if fam.folder is None}
    loaded = families()
    out = set()
    for name in names & loaded.keys():
        out.add(f"{TEMPLATES_DIR}/{name}")
        if loaded[name].extends:
            out.add(f"{TEMPLATES_DIR}/{loaded[name].extends}")
    return sorted(out | {f"{TEMPLATES_DIR}/_common"}) if out else []


def _refuse_uncommitted_templates(git: Git, prop: Proposal) -> None:
    """A reviewed module must be what the base branch's templates render (the reviewed-kernel
    tests check it): refuse modules rendered while their templates had uncommitted changes in
    this work tree (say, another change in progress that the run picked up)."""
    lines = git.dirty(_template_paths(prop))
    if lines:
        shown = "; ".join(ln.strip() for ln in lines[:3]) + (" ..." if len(lines) > 3 else "")
        raise InputError(f"{git.root}: the proposed modules render templates with uncommitted "
                         f"changes ({len(lines)}: {shown}); commit the template change first, "
                         "or run `onboard run` from a clean checkout (nothing was changed)")


def _family_files(fam: FamilyChange, prop: Proposal) -> dict[str, bytes]:
    """Repository path -> content of one family's commit."""
    files: dict[str, bytes] = {HARNESS_PATH: HARNESS.encode()}
    for m in fam.modules:
        files[f"kernels/{m.family}/{m.name}"] = m.source.read_bytes()
        if m.tuned is not None:
            files[f"kernels/{m.family}/{m.tuned.name}"] = m.tuned.read_bytes()
        test_file, inputs_file = test_paths(m)
        files[test_file] = test_source(m, prop.model).encode()
        try:
            files[inputs_file] = sample_inputs_bytes(m)
        except Exception as exc:  # noqa: BLE001 - the family's own code: say which and why
            raise InputError(f"{m.label}: cannot make its test inputs (the family's "
                             f"sample_inputs raised {type(exc).__name__}: {exc})") from None
    if fam.folder is not None:
        for p in sorted(fam.folder.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                rel = p.relative_to(fam.folder).as_posix()
                files[f"{TEMPLATES_DIR}/{fam.family}/{rel}"] = p.read_bytes()
        for t in fam.tests:
            files[f"tests/kernel_tests/{t.name}"] = t.read_bytes()
    return files


def _commit_message(fam: FamilyChange, model: str) -> str:
    n_blocks = sum(len(m.blocks) for m in fam.modules)
    head = (f"kernels: {fam.family} for {model} ({len(fam.modules)} module"
            f"{'s' if len(fam.modules) != 1 else ''}, {n_blocks} blocks)")
    body = []
    for m in fam.modules:
        checks = m.checks
        worst = max((c.get("rel_rms") or 0.0 for c in checks), default=0.0)
        body.append(f"{m.label}: {m.variant} {json.dumps(m.params, sort_keys=True)}; "
                    f"{sum(bool(c.get('passed')) for c in checks)}/{len(checks)} checks passed "
                    f"(worst relative RMS {worst:.1e})"
                    + (f"; tuned on {m.tuned_gpu}" if m.tuned else ""))
    if fam.folder is not None:
        body.append(f"generated family folder: {TEMPLATES_DIR}/{fam.family}/")
    return head + "\n\n" + "\n".join(body) + "\n"


def create_pr(run_dir: Path | str, repo: Path | str, *, base: str | None = None,
              branch: str | None = None, run_command: str | None = None) -> PRRecord:
    """Open the run's kernel PR in `repo`: a branch off `base` (default: the current branch)
    with one commit per family and `prs/<name>/PR.md`. The repository is unchanged when it
    raises."""
    run_dir = Path(run_dir).resolve()
    check_run_dir(run_dir)
    git = Git(repo)
    base = base or git.current_branch()
    if base is None:
        raise InputError(f"{git.root}: HEAD is detached; name the branch to merge into with "
                         "--base BRANCH")
    if not git.branch_exists(base):
        raise InputError(f"--base {base}: no such branch in {git.root}")
    generated = [f"{TEMPLATES_DIR}/{p.name}" for p in
                 sorted((run_dir / "generated" / "families").glob("*")) if p.is_dir()]
    _refuse_dirty(git, [*KERNEL_PATHS, *generated])
    wt = git.worktree_of(base)
    if wt is not None and wt != git.root:
        _refuse_dirty(Git(wt), [*KERNEL_PATHS, *generated])
    base_commit = git.rev(base)
    prop = collect(run_dir, reviewed=lambda path: git.file_at(base_commit, path))
    if not prop.modules:
        why = "; ".join(f"{label}: {w}" for label, w in prop.left_out[:4]) or "no candidates"
        raise InputError(f"{run_dir}: no passing candidate to propose ({why})")
    _refuse_uncommitted_templates(git, prop)
    branch = branch or branch_name(prop.model)
    if not git.ok("check-ref-format", "--branch", branch):
        raise InputError(f"{branch!r} is not a valid branch name")
    if git.branch_exists(branch):
        raise InputError(f"branch {branch} already exists in {git.root}; approve or reject it "
                         "first (onboard pr list)")
    commits_files = [(fam, _family_files(fam, prop)) for fam in prop.families]
    leaf = branch[len(BRANCH_PREFIX):] if branch.startswith(BRANCH_PREFIX) else branch
    body_path = f"{PR_DIR}/{leaf.replace('/', '_')}/PR.md"
    body = build_body(prop, branch=branch, base=base, base_commit=base_commit,
                      run_command=run_command,
                      repo_hint="." if git.root == Path.cwd().resolve() else str(git.root))
    commits: list[dict[str, Any]] = []
    try:
        with git.temp_worktree("-b", branch, base_commit) as wt:
            for fam, files in commits_files:
                for rel, data in files.items():
                    dest = wt / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
                git.run("add", "--", *files, cwd=wt)
                git.run("commit", "--quiet", "-F", "-", cwd=wt,
                        input=_commit_message(fam, prop.model))
                commits.append({"family": fam.family, "sha": git.run("rev-parse", "HEAD",
                                                                      cwd=wt).strip(),
                                "files": sorted(files)})
            dest = wt / body_path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(body)
            git.run("add", "--", body_path, cwd=wt)
            git.run("commit", "--quiet", "-m", f"PR: kernels for {prop.model} ({body_path})",
                    cwd=wt)
    except BaseException:
        if git.branch_exists(branch):
            git.run("branch", "-D", branch, check=False)
        raise
    rec = PRRecord(branch=branch, base=base, base_commit=base_commit, repo=str(git.root),
                   run_dir=str(run_dir), model=prop.model, body_path=body_path, created=_now(),
                   commits=commits, left_out=[list(x) for x in prop.left_out])
    _save(git, rec)
    return rec


# ---- finding a PR ------------------------------------------------------------------------------

def resolve(target: str, repo: Path | str | None = None) -> tuple[Git, PRRecord]:
    """A PR by its run directory (its pr.json names the repo) or by branch name in `repo`."""
    path = Path(target)
    if (path / RECORD_FILE).is_file():
        data = json.loads((path / RECORD_FILE).read_text())
        git = Git(repo or data["repo"])
        rec = load_records(git).get(data["branch"]) or PRRecord(**data)
        return git, rec
    if path.is_dir() and (path / "candidates.json").is_file():
        raise InputError(f"{target}: no kernel PR opened from this run yet "
                         f"(onboard pr create {target})")
    if repo is None and os.sep in target and not target.startswith(BRANCH_PREFIX):
        raise InputError(f"unknown RUN_DIR {target}: no such run directory")
    git = Git(repo or default_repo())
    recs = load_records(git)
    if target in recs:
        return git, recs[target]
    if git.branch_exists(target):
        raise InputError(f"branch {target} has no onboard PR record in {git.root}")
    raise InputError(f"{target}: neither a run directory with a PR nor a PR branch of "
                     f"{git.root} (onboard pr list)")


def default_repo() -> Path:
    """The repository holding this checkout's kernels/."""
    from onboarding.coverage import KERNELS_DIR

    return KERNELS_DIR.parent


def list_prs(git: Git) -> list[dict[str, Any]]:
    """Every recorded PR and every `onboard/*` branch without a record."""
    recs = load_records(git)
    rows = [{**asdict(r), "branch_exists": git.branch_exists(r.branch)} for r in recs.values()]
    for ln in git.run("for-each-ref", "--format=%(refname:short)",
                      f"refs/heads/{BRANCH_PREFIX}").splitlines():
        if ln and ln not in recs:
            rows.append({"branch": ln, "status": "no record", "branch_exists": True})
    return rows


def show_body(git: Git, rec: PRRecord) -> str:
    ref = rec.branch if git.branch_exists(rec.branch) else rec.merged_commit
    text = git.file_at(ref, rec.body_path) if ref else None
    if text is None:
        raise InputError(f"{rec.branch}: {rec.status}, its branch is gone"
                         + (f" ({rec.why})" if rec.why else ""))
    return text


def diff(git: Git, rec: PRRecord, *, stat: bool = False) -> str:
    _need_open(git, rec)
    return git.run("diff", *(["--stat"] if stat else []), f"{rec.base}...{rec.branch}")


def _need_open(git: Git, rec: PRRecord) -> None:
    if rec.status != "open":
        raise InputError(f"{rec.branch}: already {rec.status}" + (f" ({rec.why})" if rec.why
                                                                   else ""))
    if not git.branch_exists(rec.branch):
        raise InputError(f"{rec.branch}: the branch no longer exists in {git.root}")


# ---- answering ---------------------------------------------------------------------------------

def approve(git: Git, rec: PRRecord) -> PRRecord:
    """Merge the PR branch into its base (a fast-forward when the base has not moved, else a
    merge commit), then delete the branch. Where the base is checked out, only the PR's files
    are written (those paths must hold no uncommitted change)."""
    _need_open(git, rec)
    if not git.branch_exists(rec.base):
        raise InputError(f"{rec.branch}: its base branch {rec.base} no longer exists")
    if git.worktree_of(rec.branch) is not None:
        raise InputError(f"{rec.branch} is checked out at {git.worktree_of(rec.branch)}; "
                         "switch that work tree away from it first")
    where = git.worktree_of(rec.base)
    files = git.run("diff", "--name-only", f"{rec.base}...{rec.branch}").split()
    if where is not None:
        _refuse_dirty(Git(where), [*KERNEL_PATHS, *files])
    msg = f"Merge kernel PR {rec.branch}: kernels for {rec.model}"
    for _ in range(5):  # the base may move under us (a commit elsewhere): compute again
        old, tip = git.rev(rec.base), git.rev(rec.branch)
        if git.ok("merge-base", "--is-ancestor", old, tip):
            new = tip
        else:
            res = git.run("merge-tree", "--write-tree", "--no-messages", old, tip, check=False)
            tree = res.split()[0] if res.strip() else ""
            if not git.ok("cat-file", "-e", f"{tree}^{{tree}}") or len(res.split()) > 1:
                raise InputError(f"{rec.branch} does not merge cleanly into {rec.base} "
                                 f"({' '.join(res.split()[1:4])}); nothing was changed "
                                 "(re-create the PR from the current base)")
            new = git.run("commit-tree", tree, "-p", old, "-p", tip, "-m", msg).strip()
        if git.ok("update-ref", f"refs/heads/{rec.base}", new, old):
            break
    else:
        raise InputError(f"{rec.base} kept moving while merging {rec.branch}; try again")
    if where is not None:  # bring the checked-out base's PR files up to the merge
        changed = git.run("diff", "--name-only", old, new).split()
        if changed:
            git.run("checkout", new, "--", *changed, cwd=where)
    rec.merged_commit = new
    git.run("branch", "-D", rec.branch)
    rec.status, rec.decided = "approved", _now()
    _save(git, rec)
    return rec


def reject(git: Git, rec: PRRecord, why: str | None) -> PRRecord:
    """Delete the PR branch; the record keeps the reason."""
    _need_open(git, rec)
    wt = git.worktree_of(rec.branch)
    if wt is not None:
        raise InputError(f"{rec.branch} is checked out at {wt}; switch that work tree away "
                         "from it first")
    git.run("branch", "-D", rec.branch)
    rec.status, rec.why, rec.decided = "rejected", why or "(no reason given)", _now()
    _save(git, rec)
    return rec


def push(git: Git, rec: PRRecord, remote: str) -> tuple[bool, list[str]]:
    """Push the branch to `remote` and open the PR with `gh` when both the remote and `gh`
    exist; else nothing runs. Returns (ran, the commands as shell lines)."""
    import subprocess
    import tempfile

    _need_open(git, rec)
    root, title = shlex.quote(str(git.root)), f"Kernels for {rec.model}"
    gh = ["gh", "pr", "create", "--base", rec.base, "--head", rec.branch, "--title", title,
          "--body-file"]
    lines = [f"git -C {root} push {shlex.quote(remote)} {rec.branch}:{rec.branch}",
             f"git -C {root} show {rec.branch}:{rec.body_path} > PR-body.md",
             f"(cd {root} && {shlex.join(gh)} \"$OLDPWD/PR-body.md\")"]
    if not (git.ok("remote", "get-url", remote) and shutil.which("gh")):
        return False, lines
    git.run("push", remote, f"{rec.branch}:{rec.branch}")
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "PR-body.md"
        body.write_text(show_body(git, rec))
        out = subprocess.run([*gh, str(body)], cwd=git.root, capture_output=True, text=True,
                             check=False)
    if out.returncode != 0:
        raise InputError(f"gh pr create failed: {out.stderr.strip() or out.stdout.strip()}")
    return True, [*lines, out.stdout.strip()]
