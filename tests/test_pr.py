"""Kernel PRs (`onboard pr`, `onboarding.pr`): a branch per run with one commit per family and
PR.md, its tests passing from a clean clone, approve / reject / bad input, the review gate.

Everything runs in temporary git repositories; the run directory is made once per module from
the tiny dense model's real coverage (a passing RMSNorm candidate, and a SwiGLU candidate broken
on purpose so that it fails its check)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onboarding.cli.main import main
from onboarding.coverage import Coverage, build_coverage, reviewed_kernels
from onboarding.generate.candidates import check_candidate, render_candidates, save_candidates
from onboarding.pr import foreign_imports
from onboarding.rundir import write_json
from onboarding.stages import environment

ROOT = Path(__file__).resolve().parents[1]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env={**os.environ, **GIT_ENV}).stdout


def make_repo(path: Path) -> Path:
    (path / "kernels").mkdir(parents=True)
    (path / "kernels" / "README.md").write_text("reviewed kernels\n")
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "kernels/README.md")
    git(path, "commit", "-q", "-m", "init")
    return path


def repo_state(repo: Path) -> tuple[str, ...]:
    """Everything a refused command must leave as it was: refs, HEAD, status, worktrees."""
    return (git(repo, "for-each-ref"), git(repo, "rev-parse", "HEAD"),
            git(repo, "symbolic-ref", "HEAD"), git(repo, "status", "--porcelain",
                                                   "--untracked-files=all"),
            git(repo, "worktree", "list", "--porcelain"))


def onboard(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture(scope="module")
def tiny_graph(parse_model):
    return parse_model("tiny_dense")


@pytest.fixture(scope="module")
def run_template(tmp_path_factory, tiny_graph):
    """A run directory as `onboard run` leaves it, for the tiny dense model's RMSNorm (passes)
    and SwiGLU (its entry scaled by 1.01: fails its check, so it must never be proposed)."""
    run = tmp_path_factory.mktemp("run") / "tiny_dense-run"
    run.mkdir()
    cov = build_coverage(tiny_graph)
    keep = [e for e in cov.entries if e.status == "template" and e.family in ("rmsnorm",
                                                                               "swiglu")]
    assert {e.family for e in keep} == {"rmsnorm", "swiglu"}
    cands = render_candidates(Coverage(model=cov.model, entries=keep), run / "candidates")
    for c in cands:
        if c.family == "swiglu":
            src = Path(c.path)
            src.write_text(src.read_text() + "\n_entry = entry\n\n\ndef entry(*a, **k):\n"
                           "    return _entry(*a, **k) * 1.01\n")
        check_candidate(c, c.shapes)
    assert sorted(c.status for c in cands) == ["failed", "passed"]
    save_candidates(cands, run / "candidates.json")
    write_json(run / "model.json", {"ref": "tiny_dense", "name": "tiny_dense", "overrides": {},
                                    "environment": environment()})
    tiny_graph.save(run / "opgraph.json")
    return run


@pytest.fixture
def run_dir(run_template, tmp_path):
    """A fresh copy per test (a PR writes pr.json into its run directory)."""
    dest = tmp_path / run_template.name
    shutil.copytree(run_template, dest)
    # the candidates' recorded paths point at the template; the copy is found by name
    return dest


def test_modules_are_self_contained():
    """The rule: torch, triton and the standard library only; every built-in template renders
    a module that keeps it."""
    from onboarding.families import families, get_family
    from onboarding.generate.templating import render

    assert foreign_imports("from __future__ import annotations\nimport os, math\nimport torch\n"
                           "import triton.language as tl\nfrom torch.nn import functional\n") == []
    assert foreign_imports("import numpy as np\nfrom onboarding.families import x\n"
                           "from . import y\ndef f():\n    import importlib\n"
                           "    return importlib.import_module('z')\n") == \
        ["numpy", "onboarding", ".", "<dynamic import>"]
    n = 0
    for name in families():
        for variant in get_family(name).variants:
            assert foreign_imports(render(name, variant, {})) == [], f"{name}/{variant}"
            n += 1
    assert n >= 20


def test_create_branch_per_family_and_body(run_dir, tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    head, status = git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain")
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo)
    assert rc == 0, out
    rec = json.loads((run_dir / "pr.json").read_text())
    branch = rec["branch"]
    assert branch.startswith("onboard/tiny_dense-") and len(branch.rsplit("-", 2)[-2]) == 8
    # the user's checkout did not move and no worktree is left behind
    assert git(repo, "symbolic-ref", "--short", "HEAD").strip() == "main"
    assert git(repo, "rev-parse", "HEAD") == head and git(repo, "status", "--porcelain") == status
    assert len(git(repo, "worktree", "list").splitlines()) == 1
    log = git(repo, "log", "--format=%s", f"main..{branch}").splitlines()
    assert len(log) == 2 and log[1].startswith("kernels: rmsnorm for tiny_dense")
    assert log[0].startswith("PR: kernels for tiny_dense")
    files = git(repo, "diff", "--name-only", f"main...{branch}").split()
    module = next(f for f in files if f.startswith("kernels/rmsnorm/"))
    assert f"tests/reviewed_kernels/test_rmsnorm_{Path(module).stem}.py" in files
    assert not any("swiglu" in f for f in files), "a failed candidate was committed"
    body = git(repo, "show", f"{branch}:{rec['body_path']}")
    for heading in ("## Kernels and the blocks they serve", "## How to call them",
                    "## Correctness", "## Speed against the anchors", "## Roofline",
                    "## Alignment", "## Not proposed", "## Environment", "## Reproduce"):
        assert heading in body
    assert f"| rmsnorm | `{module}` | plain |" in body
    assert "| rmsnorm/plain_" in body and "| out0 |" in body and "| grad1 |" in body
    assert "not measured on a GPU" in body and "alignment not run" in body
    assert "- swiglu/split_" in body and "failed its correctness check" in body
    # without a remote or gh, --push prints the commands it would run
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo, "--branch", "onboard/x",
                      "--push", "origin")
    assert rc == 0, out
    assert "not pushed" in out and "push origin onboard/x:onboard/x" in out
    assert "gh pr create --base main --head onboard/x" in out


def test_branch_tests_pass_from_a_clean_clone_and_catch_a_broken_module(run_dir, tmp_path,
                                                                         capsys):
    repo = make_repo(tmp_path / "repo")
    assert onboard(capsys, "pr", "create", run_dir, "--repo", repo, "--branch", "onboard/t")[0] == 0
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d in (good, bad):
        subprocess.run(["git", "clone", "-q", "-b", "onboard/t", str(repo), str(d)], check=True)
    module = next((bad / "kernels" / "rmsnorm").glob("*.py"))
    module.write_text(module.read_text() + "\nimport numpy\n_entry = entry\n\n\n"
                      "def entry(*a, **k):\n    return _entry(*a, **k) * (1 + 1e-3)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--import-mode=importlib", str(good / "tests"), str(bad / "tests")],
                         capture_output=True, text=True, cwd=tmp_path, env=env)
    text = out.stdout + out.stderr
    assert "2 failed, 2 passed" in text, text
    assert "bad/tests/reviewed_kernels" in text and "good/tests" not in text.split("short test summary")[-1]
    assert "imports ['numpy']" in text and "relative RMS error" in text


def test_approve_merges_and_coverage_says_kernel(run_dir, tmp_path, capsys, tiny_graph,
                                                 monkeypatch):
    repo = make_repo(tmp_path / "repo")
    assert onboard(capsys, "pr", "create", run_dir, "--repo", repo)[0] == 0
    branch = json.loads((run_dir / "pr.json").read_text())["branch"]
    rc, out = onboard(capsys, "pr", "approve", branch, "--repo", repo)
    assert rc == 0, out
    assert "merged into main" in out
    assert git(repo, "branch", "--list", branch).strip() == ""
    tracked = git(repo, "ls-files", "kernels").split()
    module = repo / next(f for f in tracked if f.startswith("kernels/rmsnorm/"))
    assert module.is_file() and git(repo, "status", "--porcelain") == ""
    rc, out = onboard(capsys, "pr", "list", "--repo", repo)
    assert rc == 0 and f"approved  {branch}" in out
    # a later run finds the reviewed module: coverage says `kernel`, with its path
    monkeypatch.setenv("ONBOARD_KERNELS", str(repo / "kernels"))
    assert module in reviewed_kernels().values()
    cov = build_coverage(tiny_graph)
    norms = [e for e in cov.entries if e.family == "rmsnorm"]
    assert norms and all(e.status == "kernel" and e.module == str(module) for e in norms)
    assert all(e.status == "template" for e in cov.entries if e.family == "swiglu")
    # proposing the same run again: nothing new passed
    before = repo_state(repo)
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo)
    assert rc == 2 and "no passing candidate" in out and "already reviewed" in out
    assert repo_state(repo) == before


def test_reject_deletes_the_branch_and_keeps_why(run_dir, tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    assert onboard(capsys, "pr", "create", run_dir, "--repo", repo)[0] == 0
    rc, out = onboard(capsys, "pr", "diff", run_dir, "--stat")
    assert rc == 0 and "kernels/rmsnorm/" in out
    rc, out = onboard(capsys, "pr", "reject", run_dir, "--why", "tiles too small")
    assert rc == 0, out
    assert git(repo, "branch", "--list", "onboard/*").strip() == ""
    assert git(repo, "log", "--all", "--format=%s").splitlines() == ["init"]
    rc, out = onboard(capsys, "pr", "list", "--repo", repo)
    assert "rejected" in out and "(tiles too small)" in out
    rc, out = onboard(capsys, "pr", "approve", run_dir)
    assert rc == 2 and "already rejected" in out


def test_bad_input_exit_2_and_the_repo_unchanged(run_dir, tmp_path, capsys, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    plain = tmp_path / "plain"
    plain.mkdir()
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", plain)
    assert rc == 2 and "not a git repository" in out and not any(plain.iterdir())
    rc, out = onboard(capsys, "pr", "create", tmp_path / "nope", "--repo", repo)
    assert rc == 2 and "unknown RUN_DIR" in out
    # a dirty work tree: refused, nothing touched (the edit is still there, no branch)
    (repo / "kernels" / "README.md").write_text("edited\n")
    before = repo_state(repo)
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo)
    assert rc == 2 and "uncommitted changes" in out
    assert repo_state(repo) == before and not (run_dir / "pr.json").exists()
    git(repo, "checkout", "--", "kernels/README.md")
    # a branch that exists
    assert onboard(capsys, "pr", "create", run_dir, "--repo", repo, "--branch", "onboard/b")[0] == 0
    before = repo_state(repo)
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo, "--branch", "onboard/b")
    assert rc == 2 and "already exists" in out and repo_state(repo) == before
    # a run with no passing candidate
    failed = tmp_path / "failed-run"
    shutil.copytree(run_dir, failed)
    (failed / "pr.json").unlink()
    cands = json.loads((failed / "candidates.json").read_text())
    write_json(failed / "candidates.json", [c for c in cands if c["status"] == "failed"])
    rc, out = onboard(capsys, "pr", "create", failed, "--repo", repo)
    assert rc == 2 and "no passing candidate" in out and "failed its correctness check" in out
    assert repo_state(repo) == before
    # no git on PATH
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo)
    assert rc == 2 and "git not found" in out
