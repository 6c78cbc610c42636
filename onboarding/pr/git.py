"""git through subprocess, always as `git -C <repo>`: the user's checkout and current branch are
never switched (branches are built in a temporary worktree)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from onboarding.errors import InputError

# Commits made where the repo has no identity configured (a fresh CI clone, a temp repo).
FALLBACK_IDENTITY = ("onboard", "onboard@localhost")


class GitError(InputError):
    """A git command failed; the message holds the command and git's own stderr."""


def git_exe() -> str:
    exe = shutil.which("git")
    if exe is None:
        raise InputError("git not found on PATH: onboard pr works on a git repository "
                         "through the git command; install git")
    return exe


class Git:
    """One repository: `run(...)` is `git -C <root> ...`, raising `GitError` on failure."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        if not path.is_dir():
            raise InputError(f"--repo {path}: no such directory")
        out = subprocess.run([git_exe(), "-C", str(path), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise InputError(f"{path}: not a git repository (git rev-parse: "
                             f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'failed'})")
        self.root = Path(out.stdout.strip()).resolve()

    def run(self, *args: str, check: bool = True, cwd: Path | None = None,
            input: str | None = None) -> str:
        cmd = [git_exe(), "-C", str(cwd or self.root), *self._identity(args), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, input=input,
                             check=False)
        if check and out.returncode != 0:
            raise GitError(f"git {' '.join(args)} failed in {cwd or self.root}: "
                           f"{out.stderr.strip() or out.stdout.strip()}")
        return out.stdout

    def ok(self, *args: str) -> bool:
        return subprocess.run([git_exe(), "-C", str(self.root), *args], capture_output=True,
                              check=False).returncode == 0

    def _identity(self, args: tuple[str, ...]) -> list[str]:
        if not args or args[0] not in ("commit", "merge"):
            return []
        have = subprocess.run([git_exe(), "-C", str(self.root), "config", "user.email"],
                              capture_output=True, text=True, check=False).stdout.strip()
        if have:
            return []
        name, email = FALLBACK_IDENTITY
        return ["-c", f"user.name={name}", "-c", f"user.email={email}"]

    # ---- questions ---------------------------------------------------------------------------

    def current_branch(self) -> str | None:
        out = subprocess.run([git_exe(), "-C", str(self.root), "symbolic-ref", "--quiet",
                              "--short", "HEAD"], capture_output=True, text=True, check=False)
        return out.stdout.strip() or None

    def branch_exists(self, name: str) -> bool:
        return self.ok("rev-parse", "--verify", "--quiet", f"refs/heads/{name}")

    def rev(self, ref: str) -> str:
        return self.run("rev-parse", "--verify", f"{ref}^{{commit}}").strip()

    def dirty(self, paths: list[str]) -> list[str]:
        """Uncommitted changes under `paths` (staged, unstaged, untracked), as `git status
        --porcelain` lines."""
        return [ln for ln in self.run("status", "--porcelain", "--untracked-files=all", "--",
                                      *paths).splitlines() if ln.strip()]

    def file_at(self, ref: str, path: str) -> str | None:
        out = subprocess.run([git_exe(), "-C", str(self.root), "show", f"{ref}:{path}"],
                             capture_output=True, text=True, check=False)
        return out.stdout if out.returncode == 0 else None

    def worktree_of(self, branch: str) -> Path | None:
        """The worktree where `branch` is checked out, if any."""
        wt = None
        for line in self.run("worktree", "list", "--porcelain").splitlines():
            if line.startswith("worktree "):
                wt = Path(line[len("worktree "):])
            elif line == f"branch refs/heads/{branch}" and wt is not None:
                return wt
        return None

    def git_dir(self) -> Path:
        d = Path(self.run("rev-parse", "--git-common-dir").strip())
        return (d if d.is_absolute() else self.root / d).resolve()

    # ---- worktrees ---------------------------------------------------------------------------

    @contextmanager
    def temp_worktree(self, *args: str) -> Iterator[Path]:
        """`git worktree add <tmp> ARGS...`, removed (and pruned) afterwards."""
        tmp = Path(tempfile.mkdtemp(prefix="onboard-pr-"))
        path = tmp / "wt"
        self.run("worktree", "add", "--quiet", str(path), *args)
        try:
            yield path
        finally:
            self.run("worktree", "remove", "--force", str(path), check=False)
            shutil.rmtree(tmp, ignore_errors=True)
            self.run("worktree", "prune", check=False)
