"""Our kernels as another git revision rendered them, timed in the same run (``onboard bench
--against REV``): a kernel change's before/after on one machine, in one process. REV may also be
a folder of templates (``resolve``), for a machine that has the tree but not its history.

`templates_at` extracts ``kernel_templates/`` as of a revision of the source checkout;
`against` adds rows ``rev:<sha>`` and ``rev:<sha>_fwd`` to every case: the case's ``ours`` and
``ours_fwd`` steps set up again with the kernels rendered from those templates (under their own
custom op names). The harness treats them as anchors, so each case reports ``rev:<sha>`` time /
our time (above 1: the tree is faster) from the same interleaved rounds as every other anchor.
The family specs (parameters, tiles, shape buckets) and the shared runtime stay the tree's, so a
revision whose templates need other parameters fails to render: that case's rows say so.
"""

from __future__ import annotations

import dataclasses
import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

from onboarding.bench.harness import BenchCase
from onboarding.errors import InputError
from onboarding.generate.templating import TEMPLATE_DIR

OURS = ("ours", "ours_fwd")


def _git(repo: Path, *args: str) -> bytes:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    if proc.returncode != 0:
        raise InputError(f"git {' '.join(args)} in {repo} failed: "
                         f"{proc.stderr.decode(errors='replace').strip() or proc.returncode}")
    return proc.stdout


def templates_at(rev: str, repo: Path | None = None) -> tuple[Path, str]:
    """(a temporary copy of kernel_templates/ at git revision `rev`, its short sha)."""
    repo = Path(repo) if repo is not None else TEMPLATE_DIR.parent
    if not (repo / ".git").exists():
        raise InputError(f"--against {rev}: {repo} is not a git checkout (the templates of another "
                         "revision come from the source tree's history)")
    try:
        sha = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").decode().strip()
    except InputError:
        raise InputError(f"--against {rev}: no such revision in {repo}") from None
    archive = _git(repo, "archive", "--format=tar", sha, TEMPLATE_DIR.name)
    out = Path(tempfile.mkdtemp(prefix=f"onboard-templates-{sha[:8]}-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out, filter="data")
    return out / TEMPLATE_DIR.name, sha[:8]


def resolve(ref: str, repo: Path | None = None) -> tuple[Path, str]:
    """(templates directory, row label) of ``--against REF``: REF a folder holding ``*.j2``
    templates (e.g. a ``git archive`` of ``kernel_templates/`` carried to a machine without the
    history; label ``tpl:<folder name>``, the parent's name for a folder named kernel_templates)
    or a git revision (label ``rev:<short sha>``)."""
    path = Path(ref)
    if path.is_dir():
        if not any(path.glob("*.j2")) and not any(path.glob("*/*.j2")):  # flat or per-family
            raise InputError(f"--against {ref}: the folder holds no *.j2 templates (give a revision or "
                             "a copy of kernel_templates/)")
        path = path.resolve()
        return path, f"tpl:{path.parent.name if path.name == TEMPLATE_DIR.name else path.name}"
    template_dir, sha = templates_at(ref, repo)
    return template_dir, f"rev:{sha}"


def against(cases: list[BenchCase], template_dir: Path, label: str) -> list[BenchCase]:
    """`cases` with rows `label` / `label`_fwd: their ``ours`` / ``ours_fwd`` steps rendered
    from `template_dir` (op names tagged with `label`)."""
    from onboarding.bench.cases import sharing_inputs, templates_from

    def setup_both(setup):
        def run(device):
            with sharing_inputs():  # both setups time the same input sets, held once
                steps = setup(device)
                with templates_from(template_dir, label):
                    other = setup(device)
            for name in OURS:
                if name in other:
                    steps[label + name.removeprefix("ours")] = other[name]
            return steps
        return run

    return [dataclasses.replace(c, setup=setup_both(c.setup)) for c in cases]
