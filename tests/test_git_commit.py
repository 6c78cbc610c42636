"""Provenance: the commit a run or benchmark records says when the tree was not that commit."""

import subprocess

from onboarding.stages import git_commit


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_commit_is_marked_dirty_when_tracked_files_differ(tmp_path):
    assert git_commit(tmp_path) is None  # not a git checkout
    _git(tmp_path, "init", "-q")
    assert git_commit(tmp_path) is None  # no commit yet
    (tmp_path / "k.py").write_text("a = 1\n")
    _git(tmp_path, "add", "k.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "k")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked\n")  # untracked files are not the run's code
    assert git_commit(tmp_path) == head
    (tmp_path / "k.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == f"{head}-dirty"
