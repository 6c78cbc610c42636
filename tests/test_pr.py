"""Kernel PRs (`onboard pr`, `onboarding.pr`): a branch per run with one commit per family and
PR.md, its tests passing from a clean clone, approve / reject / bad input, the review gate.

Everything runs in temporary git repositories; the run directory is made once per module from
the tiny dense model's real coverage (a passing RMSNorm candidate, and a SwiGLU candidate broken
on purpose so that it fails its check)."""

from __future__ import annotations

import json
import os
import re
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
    (path / "notes.md").write_text("the user's own file\n")
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "kernels/README.md", "notes.md")
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
    # template, or kernel where this checkout's kernels/ holds the reviewed module already
    keep = [e for e in cov.entries if e.status in ("template", "kernel")
            and e.family in ("rmsnorm", "swiglu")]
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


def test_reviewed_modules_are_their_templates_rendered(tmp_path):
    """Every module in kernels/ is its template rendered at its parameters, at the template's
    current version (an edit without a version bump would serve unreviewed code as reviewed);
    one from an older version is stale: coverage leaves it out until a new PR reviews it."""
    from onboarding.coverage import KERNELS_DIR
    from onboarding.generate.templating import render

    found = reviewed_kernels(KERNELS_DIR)
    for (family, variant, params), path in found.items():
        assert render(family, variant, json.loads(params)) == path.read_text(), path
    assert len(found) == len(list(KERNELS_DIR.glob("*/*.py")))
    if found:
        path = next(iter(found.values()))
        stale = tmp_path / path.parent.name / path.name
        stale.parent.mkdir()
        text = path.read_text()
        stale.write_text(re.sub(r"\(template version \d+\)", "(template version 0)", text,
                                count=1))
        assert reviewed_kernels(tmp_path) == {}
        stale.write_text(text)
        assert list(reviewed_kernels(tmp_path).values()) == [stale]


def test_reviewed_tests_run_the_checks_kernel_prs_write():
    """tests/reviewed_kernels/conftest.py is the harness `onboard pr create` writes beside the
    tests it adds (an edit to one without the other would test this repo's modules differently
    from a PR's clean clone)."""
    from onboarding.pr.testgen import HARNESS, HARNESS_PATH

    assert (Path(__file__).resolve().parents[1] / HARNESS_PATH).read_text() == HARNESS


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
    # the base moves meanwhile (a merge commit, not a fast-forward), and the user has
    # uncommitted work elsewhere: it stays as it is, staged and unstaged
    (repo / "other.md").write_text("committed after the PR was opened\n")
    git(repo, "add", "other.md")
    git(repo, "commit", "-q", "-m", "other work")
    (repo / "notes.md").write_text("edited, not committed\n")
    (repo / "staged.md").write_text("staged\n")
    git(repo, "add", "staged.md")
    status = git(repo, "status", "--porcelain")
    rc, out = onboard(capsys, "pr", "approve", branch, "--repo", repo)
    assert rc == 0, out
    assert "merged into main" in out
    assert git(repo, "branch", "--list", branch).strip() == ""
    assert git(repo, "log", "-1", "--format=%s").startswith(f"Merge kernel PR {branch}")
    assert git(repo, "status", "--porcelain") == status
    tracked = git(repo, "ls-files", "kernels").split()
    module = repo / next(f for f in tracked if f.startswith("kernels/rmsnorm/"))
    assert module.is_file() and git(repo, "diff", "HEAD", "--stat", "--", "kernels") == ""
    rc, out = onboard(capsys, "pr", "list", "--repo", repo)
    assert rc == 0 and f"approved  {branch}" in out
    # a later run finds the reviewed module: coverage says `kernel`, with its path (this
    # checkout's own kernels/ out of the way: it may hold the same module)
    monkeypatch.setattr("onboarding.coverage.KERNELS_DIR", tmp_path / "no-kernels")
    monkeypatch.setenv("ONBOARD_KERNELS", str(repo / "kernels"))
    assert module in reviewed_kernels().values()
    cov = build_coverage(tiny_graph)
    norms = [e for e in cov.entries if e.family == "rmsnorm"]
    assert norms and all(e.status == "kernel" and e.module == str(module) for e in norms)
    assert all(e.status == "template" for e in cov.entries if e.family == "swiglu")
    monkeypatch.delenv("ONBOARD_KERNELS")
    assert not any(e.status == "kernel" for e in build_coverage(tiny_graph).entries)
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
    assert git(repo, "status", "--porcelain") == ""
    rc, out = onboard(capsys, "pr", "list", "--repo", repo)
    assert "rejected" in out and "(tiles too small)" in out
    rc, out = onboard(capsys, "pr", "approve", run_dir)
    assert rc == 2 and "already rejected" in out


def test_modules_rendered_from_uncommitted_templates_are_refused(run_dir, tmp_path, capsys):
    """A proposed module must be what the base branch's templates render: an uncommitted change
    under the proposed family's template folder (or the shared partials) refuses the PR, naming
    the file, and leaves the repository as it was; a change under another family's folder does
    not."""
    repo = make_repo(tmp_path / "repo")
    for rel in ("kernel_templates/rmsnorm/rmsnorm.py.j2", "kernel_templates/_common/part.py.j2",
                "kernel_templates/ssd/ssd.py.j2"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("committed\n")
        git(repo, "add", rel)
    git(repo, "commit", "-q", "-m", "templates")
    for rel in ("kernel_templates/rmsnorm/rmsnorm.py.j2", "kernel_templates/_common/part.py.j2"):
        (repo / rel).write_text("edited, not committed\n")
        before = repo_state(repo)
        rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo)
        assert rc == 2 and "render templates with uncommitted changes" in out and rel in out, out
        assert repo_state(repo) == before and not (run_dir / "pr.json").exists()
        git(repo, "checkout", "--", rel)
    # another family's template edited: not this PR's business
    (repo / "kernel_templates" / "ssd" / "ssd.py.j2").write_text("edited\n")
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo, "--branch", "onboard/t")
    assert rc == 0, out


def test_bad_input_exit_2_and_the_repo_unchanged(run_dir, tmp_path, capsys, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    plain = tmp_path / "plain"
    plain.mkdir()
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", plain)
    assert rc == 2 and "not a git repository" in out and not any(plain.iterdir())
    rc, out = onboard(capsys, "pr", "create", tmp_path / "nope", "--repo", repo)
    assert rc == 2 and "unknown RUN_DIR" in out
    # a dirty work tree where PRs write: refused, nothing touched (the edit stays, no branch);
    # an untracked file there too
    (repo / "kernels" / "README.md").write_text("edited\n")
    before = repo_state(repo)
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo)
    assert rc == 2 and "uncommitted changes where the kernel PR writes" in out
    assert repo_state(repo) == before and not (run_dir / "pr.json").exists()
    git(repo, "checkout", "--", "kernels/README.md")
    (repo / "tests" / "reviewed_kernels").mkdir(parents=True)
    (repo / "tests" / "reviewed_kernels" / "mine.py").write_text("x = 1\n")
    before = repo_state(repo)
    rc, out = onboard(capsys, "pr", "create", run_dir, "--repo", repo)
    assert rc == 2 and "?? tests/reviewed_kernels/mine.py" in out and repo_state(repo) == before
    shutil.rmtree(repo / "tests")
    # approving onto a base whose kernels/ was edited meanwhile: refused, nothing touched
    assert onboard(capsys, "pr", "create", run_dir, "--repo", repo, "--branch", "onboard/d")[0] == 0
    (repo / "kernels" / "README.md").write_text("edited\n")
    before = repo_state(repo)
    rc, out = onboard(capsys, "pr", "approve", "onboard/d", "--repo", repo)
    assert rc == 2 and "uncommitted changes" in out and repo_state(repo) == before
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


def _paused_at_review(run_dir: Path, repo: Path):
    """The agent's graph on `run_dir` as if its report had just finished, run on from there:
    the review gate opens the PR and interrupts. Returns the run's thread config."""
    from agents.graph import compile_graph, thread_config
    from agents.state import RunConfig, RunState
    from onboarding.load.spec import ModelSpec
    from onboarding.rundir import new_run_id

    run_id = new_run_id(run_dir, model="tiny_dense")
    state = RunState(config=RunConfig(model=ModelSpec(ref="tiny_dense"), review=True,
                                      review_repo=str(repo), align_kernels=["rmsnorm"]),
                     run_dir=str(run_dir), model_name="tiny_dense",
                     completed=["load", "parse", "map", "generate", "align", "tune", "train",
                                "report"])
    app, conn = compile_graph(run_dir)
    try:
        cfg = thread_config(run_dir, run_id)
        app.update_state(cfg, state.model_dump(), as_node="report")
        list(app.stream(None, cfg, durability="sync"))
        snap = app.get_state(cfg)
        assert snap.next == ("review",)
        assert [i.value["branch"] for t in snap.tasks for i in t.interrupts]
    finally:
        conn.close()
    return cfg


def _graph_state(run_dir: Path, cfg: dict):
    from agents.graph import compile_graph

    app, conn = compile_graph(run_dir)
    try:
        return app.get_state(cfg)
    finally:
        conn.close()


def onboard_process(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onboarding.cli.main", *map(str, argv)],
                          capture_output=True, text=True, env={**os.environ, **GIT_ENV})


@pytest.mark.parametrize("answer", ["approve", pytest.param("reject", marks=pytest.mark.slow)])  # ~29 s each
def test_review_gate_pauses_and_resumes_in_a_new_process(run_dir, tmp_path, answer):
    """`--review`: the graph stops before the pr node (interrupt, checkpointed in SQLite) with
    the PR branch open; another process answers (`onboard pr approve RUN_DIR`, `onboard run
    --resume RUN_DIR --reject`) and the pr node merges or deletes the branch."""
    repo = make_repo(tmp_path / "repo")
    cfg = _paused_at_review(run_dir, repo)
    rec = json.loads((run_dir / "pr.json").read_text())
    assert git(repo, "branch", "--list", rec["branch"]).strip()
    if answer == "approve":
        # asked again without an answer: it says what awaits, and stays paused
        out = onboard_process("run", "--resume", run_dir)
        assert out.returncode == 0 and "awaiting review" in out.stdout, out.stdout + out.stderr
        assert f"onboard pr approve {run_dir}" in out.stdout
        out = onboard_process("pr", "approve", run_dir)
    else:
        out = onboard_process("run", "--resume", run_dir, "--reject", "--why", "not now")
    assert out.returncode == 0, out.stdout + out.stderr
    snap = _graph_state(run_dir, cfg)
    assert snap.next == () and snap.values["completed"][-2:] == ["review", "pr"]
    review = snap.values["review"]
    assert git(repo, "branch", "--list", rec["branch"]).strip() == ""
    tracked = git(repo, "ls-files", "kernels")
    if answer == "approve":
        assert review["status"] == "approved" and "kernels/rmsnorm/" in tracked
        assert "approved:" in out.stdout
    else:
        assert review["status"] == "rejected" and review["why"] == "not now"
        assert tracked.split() == ["kernels/README.md"] and "rejected:" in out.stdout
        # answered once: a second answer is bad input
        out = onboard_process("run", "--resume", run_dir, "--approve")
        assert out.returncode == 2 and "no kernel PR awaits review" in out.stderr


@pytest.mark.slow
def test_example_run_review_approve_end_to_end(tmp_path):
    """The built-in example on the CPU: `onboard run --review` stops before the pr node with a
    branch of one commit per family and PR.md; the branch's tests pass from a clean clone;
    `onboard pr approve RUN_DIR` (a new process) merges it, after which coverage finds every
    merged module as `kernel`. The cheapest run that still aligns: two families patched."""
    from onboarding.graph.opgraph import OpGraph

    repo = make_repo(tmp_path / "repo")
    run = tmp_path / "run"
    out = onboard_process("run", "--review", "--repo", repo, "--kernels", "rmsnorm,swiglu",
                          "--out", run)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "awaiting review" in out.stdout and f"onboard pr approve {run}" in out.stdout
    rec = json.loads((run / "pr.json").read_text())
    families = [c["family"] for c in rec["commits"]]
    cands = json.loads((run / "candidates.json").read_text())
    assert set(families) == {c["family"] for c in cands if c["status"] == "passed"}
    subjects = git(repo, "log", "--reverse", "--format=%s", f"main..{rec['branch']}").splitlines()
    assert [s.split()[1] for s in subjects[:-1]] == families and subjects[-1].startswith("PR:")
    body = git(repo, "show", f"{rec['branch']}:{rec['body_path']}")
    assert "| rmsnorm | `kernels/rmsnorm/" in body and "| out0 |" in body
    assert "**passed**" in body and "not measured on a GPU" in body
    assert "onboard run --kernels rmsnorm,swiglu" in body
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "-b", rec["branch"], str(repo), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = sorted(str(p) for p in (clone / "tests" / "reviewed_kernels").glob("test_*.py")
                   if p.name.startswith(("test_rmsnorm", "test_swiglu")))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                         capture_output=True, text=True, cwd=clone, env=env)
    assert res.returncode == 0 and f"{2 * len(tests)} passed" in res.stdout, res.stdout[-3000:]
    out = onboard_process("pr", "approve", run)
    assert out.returncode == 0 and "approved:" in out.stdout, out.stdout[-3000:] + out.stderr
    cov = build_coverage(OpGraph.load(run / "opgraph.json"), kernels_root=repo / "kernels")
    served = [e for e in cov.entries if e.family in families]
    assert served and all(e.status == "kernel" and e.module.startswith(str(repo))
                          for e in served)
