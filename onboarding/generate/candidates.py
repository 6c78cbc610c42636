"""The generate stage: render a candidate kernel module for every coverable op and check it.

Candidates are written under ``<run_dir>/candidates/<family>/<variant>_<hash>.py`` (the hash of
the parameters, so two parameter sets of one variant live side by side). Each candidate runs its
correctness checks — forward and every gradient against its own ``reference`` on fresh random
inputs at the block's real shapes, in fp32 — before anything uses it. Only a passing candidate
can be promoted into the reviewed ``kernels/`` folder, and promotion never overwrites a
different file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from onboarding.backend import kernel_device
from onboarding.errors import InputError
from onboarding.patching.core import entry_function
from onboarding.coverage import KERNELS_DIR, Coverage
from onboarding.families import get_family
from onboarding.families.render import params_hash
from onboarding.generate.templating import load_module, render, write_module
from onboarding.testing.tolerance import compare, tolerance_for


@dataclass(kw_only=True)
class Candidate:
    family: str
    variant: str
    params: dict[str, Any]
    path: str
    blocks: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    # rendered -> passed | failed; left_out: alignment left it out at every block it serves, so
    # it is not checked (nor tuned, nor proposed); `blocks` are those blocks then
    status: str = "rendered"
    checks: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    promoted_to: str | None = None
    sha256: str = ""  # of the module as rendered: `load_candidates` refuses an edited file
    # the blocks a failed alignment left it out at (not in `blocks`, unless all were): it runs
    # at the others, but is never proposed for review (a reviewed module serves every block of
    # its family and params, these included)
    left_out_at: list[str] = field(default_factory=list)


def candidate_name(family: str, variant: str, params: dict[str, Any]) -> str:
    spec = get_family(family)
    return f"{variant}_{params_hash(family, variant, spec.template_version, params)[:8]}"


LEFT_OUT = "left out after alignment: not checked, not tuned"


def render_candidates(coverage: Coverage, root: Path,
                      exclude: Iterable[tuple[str, str]] = ()) -> list[Candidate]:
    """Render every distinct (family, variant, params) that coverage marks coverable; each
    candidate keeps the input shapes of the first block that needs it. ``exclude``: the (block
    path, family) pairs a failed alignment left out (`RunState.excluded_kernels`): those blocks
    are not the candidate's (its ``left_out_at``), and a candidate left with none is
    ``left_out`` (its check would be spent on a kernel nothing runs)."""
    exclude = {tuple(x) for x in exclude}
    out: dict[str, Candidate] = {}
    left: dict[str, list[str]] = {}
    for e in coverage.served():
        if e.status not in ("template", "kernel", "generated"):
            continue
        name = candidate_name(e.family, e.variant, e.params)
        path = root / e.family / f"{name}.py"
        key = str(path)
        if (e.path, e.family) in exclude:
            left.setdefault(key, []).append(e.path)
        if key not in out:
            source = render(e.family, e.variant, e.params)
            write_module(source, path)
            out[key] = Candidate(family=e.family, variant=e.variant, params=e.params,
                                 path=str(path), sha256=_sha256(source))
        if (e.path, e.family) not in exclude:
            if not out[key].blocks:  # the first block it serves
                out[key].shapes = e.shapes
            out[key].blocks.append(e.path)
    for key, c in out.items():
        c.left_out_at = list(left.get(key, []))
        if not c.blocks:
            c.blocks, c.status, c.error = left[key], "left_out", LEFT_OUT
    return list(out.values())


def check_candidate(cand: Candidate, shapes: list[list[int]], seed: int = 0) -> Candidate:
    """Forward and every gradient vs the module's ``reference`` in fp32, on fresh random inputs
    at the block's widths (``shapes``: the first matching block's input shapes)."""
    t0 = time.perf_counter()
    try:
        mod = load_module(cand.path)
        spec = get_family(cand.family)
        if spec.sample_inputs is None and spec.folder and (Path(spec.folder) / "gate.json").is_file():
            # an LLM-written family (onboarding.generate.llm): its check is the gate it passed,
            # the block's own forward and every gradient at the block's and odd sizes
            from onboarding.generate.llm.review import gate_checks

            cand.checks = gate_checks(Path(spec.folder)) or []
            cand.status = "passed" if cand.checks and all(c["passed"] for c in cand.checks) \
                else "failed"
            cand.seconds = round(time.perf_counter() - t0, 3)
            return cand
        if spec.sample_inputs is None:
            raise InputError(f"family {cand.family} declares no sample_inputs")
        gen = torch.Generator().manual_seed(seed)
        device = kernel_device()
        args = [a.to(device) if isinstance(a, torch.Tensor) else a
                for a in spec.sample_inputs(cand.variant, cand.params, shapes, gen)]
        cand.checks = _check_one(entry_function(mod), mod.reference, tuple(args), "sample")
        cand.status = "passed" if cand.checks and all(c["passed"] for c in cand.checks) \
            else "failed"
    except Exception as exc:  # a broken candidate is recorded, never fatal to the run
        cand.status, cand.error = "failed", f"{type(exc).__name__}: {exc}"[:500]
    cand.seconds = round(time.perf_counter() - t0, 3)
    return cand


def _check_one(entry, ref, args: tuple, label: str) -> list[dict[str, Any]]:
    def prep():
        return [a.detach().clone().requires_grad_(a.is_floating_point())
                if isinstance(a, torch.Tensor) else a for a in args]

    a_args, r_args = prep(), prep()
    out, expect = entry(*a_args), ref(*r_args)
    # Optional outputs (a final state not asked for) come back as None on both sides.
    outs = tuple(o for o in (out if isinstance(out, tuple) else (out,)) if o is not None)
    exps = tuple(e for e in (expect if isinstance(expect, tuple) else (expect,))
                 if e is not None)
    if len(outs) != len(exps):  # pairing them would judge only the outputs both have
        return [{"name": f"{label}.outputs", "passed": False,
                 "message": f"candidate returned {len(outs)} outputs, the reference {len(exps)}"}]
    results = []
    gen = torch.Generator().manual_seed(1)
    for i, (o, e) in enumerate(zip(outs, exps, strict=True)):
        if not o.is_floating_point():  # indices, counts: exactly equal or wrong
            same = torch.equal(o.cpu(), e.cpu())
            results.append({"name": f"{label}.out{i}", "passed": same,
                            "message": "exact" if same else "integer output differs"})
            continue
        c = compare(o.detach().float(), e.detach().float(), tolerance_for(torch.float32),
                    f"{label}.out{i}")
        results.append(c.as_dict())
    # Back-propagate the same random cotangents through every differentiable output.
    pairs = [(o, e) for o, e in zip(outs, exps, strict=True)
             if o.requires_grad and e.requires_grad]
    grads_out = [torch.randn(e.shape, generator=gen).to(e.device, e.dtype) for _, e in pairs]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for (o, _), g in
                                                          zip(pairs, grads_out, strict=True)])
        torch.autograd.backward([e for _, e in pairs], grads_out)
    for i, (a, r) in enumerate(zip(a_args, r_args, strict=True)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            if a.grad is None or r.grad is None:
                results.append({"name": f"{label}.grad{i}", "passed": a.grad is None and
                                r.grad is None, "message": "gradient missing on one side"})
                continue
            c = compare(a.grad.float(), r.grad.float(), tolerance_for(torch.float32,
                                                                      "reduction"),
                        f"{label}.grad{i}")
            results.append(c.as_dict())
    return results


def promote(cand: Candidate, kernels_root: Path = KERNELS_DIR, *, overwrite: bool = False
            ) -> Path:
    """Copy a passing candidate into the reviewed ``kernels/`` folder."""
    if cand.status != "passed":
        raise InputError(f"{cand.path}: only a candidate that passed its checks can be "
                         f"promoted (status {cand.status})")
    src = Path(cand.path)
    dest = kernels_root / cand.family / src.name
    if dest.exists() and dest.read_text() != src.read_text() and not overwrite:
        raise InputError(f"{dest} exists with different content; not overwriting")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    cand.promoted_to = str(dest)
    return dest


def kernels_for(coverage: Coverage, candidates: list[Candidate]
                ) -> dict[tuple[str, str], ModuleType]:
    """(block path, family) -> loaded module, for reviewed kernels and passing candidates.

    A module with a `<variant>.tuned.json` beside it (written by `onboard tune` or the agent's
    tune node) dispatches its buckets to the tuned configs (`apply_tuned`).
    """
    from onboarding.tune.store import load_tuned

    by_file = {c.path: c for c in candidates if c.status == "passed"}
    out: dict[tuple[str, str], ModuleType] = {}

    def put(e, module: ModuleType) -> None:
        # A block served by several variants of one family (sparse attention: gathered, then the
        # indexer) keeps its first under (path, family), the others under (path, family:variant).
        key = (e.path, e.family)
        out[key if key not in out else (e.path, f"{e.family}:{e.variant}")] = module

    for e in coverage.served():
        if e.status == "kernel" and e.module:
            put(e, load_tuned(e.module))
            continue
        for c in by_file.values():
            if c.family == e.family and c.variant == e.variant and c.params == e.params:
                put(e, load_tuned(c.path))
    return out


def save_candidates(cands: list[Candidate], path: Path) -> None:
    path.write_text(json.dumps([asdict(c) for c in cands], indent=1, default=str) + "\n")


def load_candidates(path: Path) -> list[Candidate]:
    """The candidates of ``candidates.json``, each module the copy in that run folder (a moved or
    copied run imports its own) and verified to be the file onboard rendered: its sha256 as
    recorded at rendering (older runs: the family's rendering again). An edited candidate is
    refused (bad input), never imported."""
    path = Path(path)
    out = []
    for d in json.loads(path.read_text()):
        c = Candidate(**d)
        local = path.parent / "candidates" / c.family / Path(c.path).name
        if local.is_file():
            c.path = str(local)
        _verify_source(c)
        out.append(c)
    return out


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _verify_source(c: Candidate) -> None:
    file = Path(c.path)
    if not file.is_file():
        return  # nothing to import: whoever needs it says so
    text = file.read_text()
    if c.sha256:
        ok, what = _sha256(text) == c.sha256, f"sha256 {c.sha256[:12]} recorded at rendering"
    else:
        ok, what = text == render(c.family, c.variant, c.params), "the family's rendering"
    if not ok:
        raise InputError(f"{file}: the {c.family}/{c.variant} candidate differs from {what} "
                         "(edited?); onboard does not import it: restore it or generate the "
                         "run again")
