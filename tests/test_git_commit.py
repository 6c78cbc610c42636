"""Provenance: the commit a run or benchmark records says when the tree was not that commit."""

import subprocess

from onboarding.stages import git_commit, git_state


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


def test_golden_metadata_asks_git_once_per_fact(monkeypatch):
    """A golden's metadata (full HEAD, the modified tracked files) and the environment's short
    commit come from one `git rev-parse` and one `git status`: git is not asked again for what
    environment() already asked."""
    from onboarding import gitinfo
    from onboarding.regress import metadata

    asked = []
    real_run = gitinfo.subprocess.run

    def run(cmd, *args, **kwargs):
        out = real_run(cmd, *args, **kwargs)
        if cmd and cmd[0] == "git":
            asked.append((cmd[1], out.stdout))
        return out

    monkeypatch.setattr(gitinfo.subprocess, "run", run)
    meta = metadata(command="onboard regress --update")
    monkeypatch.undo()
    assert [cmd for cmd, _ in asked] == ["rev-parse", "status"], asked
    heads, status = asked[0][1].split(), asked[1][1]
    if heads:  # onboard runs from a git checkout: the full HEAD, the modified tracked files
        assert meta["commit"] == heads[0] and len(heads[0]) >= 40
        assert meta["modified_files"] == [line[3:] for line in status.splitlines()]
    assert meta["device"] and meta["command"] == "onboard regress --update"


def test_git_state_full_and_short_head_and_modified_files(tmp_path):
    assert git_state(tmp_path) is None
    _git(tmp_path, "init", "-q")
    (tmp_path / "k.py").write_text("a = 1\n")
    (tmp_path / "m.py").write_text("b = 1\n")
    _git(tmp_path, "add", "k.py", "m.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "k")
    rev = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD", "--short", "HEAD"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert git_state(tmp_path) == (rev[0], rev[1], [])
    (tmp_path / "m.py").write_text("b = 2\n")
    (tmp_path / "new.txt").write_text("untracked\n")
    state = git_state(tmp_path)
    assert state == (rev[0], rev[1], ["m.py"]) and state.commit == f"{rev[1]}-dirty"
