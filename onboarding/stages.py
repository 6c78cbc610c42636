"""Stage functions with file outputs: what the CLI and the agent's nodes both call."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch

from onboarding import __version__, optional_kernels
from onboarding.generate.candidates import (Candidate, check_candidate, promote, render_candidates,
                                 save_candidates)
from onboarding.load.spec import ModelSpec
from onboarding.graph.opgraph import OpGraph
from onboarding.graph.parse import ModelInfo, load_shipped_weights, load_stage, parse_stage
from onboarding.load.proxy import text_config
from onboarding.coverage import Coverage, build_coverage
from onboarding.gitinfo import HERE, git
from onboarding.modpath import inside
from onboarding.rundir import write_json


class GitState(NamedTuple):
    """A checkout's HEAD (full and git's short form) and its tracked files modified on top of
    it (`git status --porcelain`'s paths; untracked files are not the run's code)."""

    head: str
    short: str
    modified: list[str]

    @property
    def commit(self) -> str:
        """The short HEAD, with "-dirty" when tracked files differ from it."""
        return self.short + ("-dirty" if self.modified else "")


def git_state(where: Path = HERE) -> GitState | None:
    """`GitState` of the checkout at ``where`` (onboard's own by default) in two git calls;
    None outside git or before the first commit."""
    heads = (git("rev-parse", "HEAD", "--short", "HEAD", cwd=where, timeout=5) or "").split()
    if len(heads) != 2:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=where, timeout=5)
    return GitState(heads[0], heads[1],
                    [line[3:] for line in (dirty or "").splitlines() if line.strip()])


def git_commit(where: Path = HERE) -> str | None:
    """The short HEAD of the checkout onboard runs from, with "-dirty" when its tracked files
    differ from HEAD: a benchmark or a run of an uncommitted tree is not that commit's (a copy
    of a working tree whose .git lags behind said a commit it did not run). None outside git."""
    state = git_state(where)
    return state.commit if state is not None else None


_ASK = object()


def environment(checkout: GitState | None | object = _ASK) -> dict[str, Any]:
    """Versions, GPU, date and commit of this process. ``checkout``: the `git_state` a caller
    already has (None: not in git), so that git is not asked twice; by default it is asked."""
    import transformers

    if checkout is _ASK:
        checkout = git_state()

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"onboard": __version__,
            "commit": checkout.commit if isinstance(checkout, GitState) else None,
            "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton_version,
            "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            # installed kernel packages and what was done with them (hidden from model code)
            "kernel_packages": optional_kernels.state()}


def _config_dict(config: Any, *, text: bool = True) -> dict[str, Any] | None:
    """The text config (``text=False``: the whole config, a multimodal model's towers and all)
    as a dict, every nested mapping's keys sorted: some configs build a field from a set (Dory's
    `rope_parameters`), whose order follows the hash seed, and ``model.json`` should not change
    from run to run."""
    if config is None or not hasattr(config, "to_dict"):
        return None
    return _keys_sorted((text_config(config) if text else config).to_dict())


def _keys_sorted(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _keys_sorted(v[k]) for k in sorted(v, key=str)}
    if isinstance(v, (list, tuple)):
        return [_keys_sorted(x) for x in v]
    return v


def run_load(spec: ModelSpec, out_dir: Path | None = None) -> ModelInfo:
    """Resolve MODEL, account the full size on meta, pick the proxy; writes ``model.json``."""
    from onboarding.load.weights import check_shipped

    t0 = time.perf_counter()
    info = load_stage(spec.load(), spec.proxy)
    check_shipped(info)  # unfit, truncated or corrupt weights: before any file is written
    if out_dir is not None:
        save_model_json(info, out_dir, spec.overrides, time.perf_counter() - t0)
    return info


def save_model_json(info: ModelInfo, out_dir: Path, overrides: dict[str, Any],
                    seconds: float | None = None) -> None:
    lm = info.loaded
    write_json(out_dir / "model.json", {
        "ref": lm.ref, "name": lm.name, "source": lm.source, "overrides": overrides,
        "trust_remote_code": lm.trust_remote_code, "weights": [str(w) for w in lm.weights],
        "compat_shims": lm.compat_shims, "impl_note": lm.impl_note, "part": lm.part,
        "params": info.full.to_dict(), "proxy": info.proxy_size, "proxy_note": info.proxy_note,
        # the whole config (a multimodal model's towers too); the proxy's stays its text config
        "full_config": _config_dict(lm.config, text=False),
        "proxy_config": _config_dict(info.proxy_config),
        "seconds": None if seconds is None else round(seconds, 3),
        "environment": environment()})


def run_parse(info: ModelInfo, out_dir: Path | None, *, batch: int = 1, seq: int = 64,
              seed: int = 0, on_step: Callable[[str], None] | None = None) -> OpGraph:
    graph = parse_stage(info, batch=batch, seq=seq, seed=seed, on_step=on_step)
    if out_dir is not None:
        graph.save(out_dir / "opgraph.json")
        model_json = out_dir / "model.json"
        if info.full.alternatives_note and model_json.is_file():
            # the parse found MoE blocks a token takes one of (`take_alternatives`): the active
            # parameters model.json (written before it, read by the report) gave counted them all
            data = json.loads(model_json.read_text())
            data["params"] = info.full.to_dict()
            write_json(model_json, data)
    return graph


def run_map(graph: OpGraph, out_dir: Path | None) -> Coverage:
    """Coverage of every block; writes ``coverage.json``."""
    coverage = build_coverage(graph)
    if out_dir is not None:
        coverage.save(out_dir / "coverage.json")
    return coverage


def run_generate(coverage: Coverage, out_dir: Path, *, promote_passing: bool = False,
                 on_step: Callable[[str], None] | None = None,
                 exclude: Iterable[tuple[str, str]] = ()) -> list[Candidate]:
    """Render candidates into ``out_dir/candidates``, check each; writes ``candidates.json``.

    Each verdict is kept as it comes (``candidates.progress.json``): a stage that was stopped
    (a killed run resumed) checks only what it had not, reusing a verdict only for the same
    rendered source (its sha256). ``exclude``: the (block path, family) pairs a failed alignment
    left out; a candidate left out at every block it serves is not checked
    (`render_candidates`)."""
    cands = render_candidates(coverage, out_dir / "candidates", exclude)
    progress = out_dir / GENERATE_PROGRESS
    before = _checked_before(progress)
    for i, cand in enumerate(cands):
        prev = before.get((cand.family, cand.variant, cand.sha256))
        if cand.status == "left_out":
            if on_step:
                on_step(f"{cand.family}/{cand.variant}: {cand.error}")
        elif prev is not None:
            cand.status, cand.checks, cand.error, cand.seconds = (
                prev.status, prev.checks, prev.error, prev.seconds)
        else:
            if on_step:
                on_step(f"checking {cand.family}/{cand.variant} ({i + 1}/{len(cands)})")
            check_candidate(cand, cand.shapes)
            write_json(progress, [asdict(c) for c in cands[: i + 1]])
        if promote_passing and cand.status == "passed":
            promote(cand)
    save_candidates(cands, out_dir / "candidates.json")
    progress.unlink(missing_ok=True)
    return cands


GENERATE_PROGRESS = "candidates.progress.json"


def _checked_before(progress: Path) -> dict[tuple[str, str, str], Candidate]:
    """The verdicts an earlier, stopped generate stage left (by family, variant and source)."""
    import json

    try:
        rows = json.loads(progress.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    for row in rows if isinstance(rows, list) else []:
        try:
            c = Candidate(**row)
        except TypeError:
            continue
        if c.sha256 and c.status in ("passed", "failed"):
            out[(c.family, c.variant, c.sha256)] = c
    return out


def run_decide(spec: ModelSpec, graph: OpGraph, coverage: Coverage, out_dir: Path, *,
               opts: Any = None, client: Any = None, failed: dict[str, str] | None = None,
               on_step: Callable[[str], None] | None = None,
               on_decision: Callable[[Any], None] | None = None,
               earlier: list[Any] | None = None) -> list[Any]:
    """The decision loop for the blocks no family serves (`onboarding.generate.decide`): kernel
    tasks (``tasks.json``), per block template -> LLM (with a client) -> Inductor -> uncovered,
    each with its evidence (``decisions.json``); coverage takes the decisions (rewrites
    ``coverage.json``). Families the LLM path wrote are registered for this process.
    ``earlier``: decisions of an earlier pass (a retry after a failed alignment decides the
    blocks in ``failed`` only, and keeps those; their tasks carry what that alignment,
    ``alignment.json``, measured at them, and the code of a left-out family the LLM path wrote,
    ``generated/families``)."""
    import json

    from onboarding.generate.decide import (DECISIONS_FILE, apply_to_coverage, decide,
                                            save_decisions)
    from onboarding.generate.tasks import build_tasks, save_tasks

    if on_step:
        on_step("kernel tasks for the uncovered blocks")
    aligned = out_dir / "alignment.json"
    tasks = build_tasks(graph=graph, coverage=coverage, spec=spec, failed=failed,
                        alignment=json.loads(aligned.read_text())
                        if failed and aligned.is_file() else None,
                        generated=out_dir / "generated" / "families")
    if earlier is not None:
        tasks = [t for t in tasks if t.failed_family]
    save_tasks(tasks, out_dir / ("tasks.json" if earlier is None else "tasks.retry.json"))
    decisions = [*(earlier or []),
                 *decide(tasks, spec, out_dir, graph=graph, opts=opts, client=client,
                         on_step=on_step, on_decision=on_decision)]
    use_generated_families(out_dir)
    _generated_params(decisions, graph)
    save_decisions(decisions, out_dir / DECISIONS_FILE)
    apply_to_coverage(coverage, decisions).save(out_dir / "coverage.json")
    return decisions


def _generated_params(decisions: list[Any], graph: OpGraph) -> None:
    """An accepted LLM-written family's variant and render parameters for each block it serves,
    from its own `match` (registered by now), so generate renders it like any template."""
    from onboarding.families import families

    blocks = {b.path: b for b in graph.blocks}
    registry = families()
    for d in decisions:
        spec = registry.get(d.family) if d.decision == "generated" else None
        if spec is None or spec.match is None or d.path not in blocks:
            continue
        m = spec.match(blocks[d.path])
        if m is not None:
            d.variant, d.params = m["variant"], dict(m["params"])


def use_generated_families(run_dir: Path) -> None:
    """Register the family folders the LLM path accepted in ``run_dir`` (``generated/families``)
    for this process and its subprocesses (a resumed run finds them again)."""
    folder = Path(run_dir) / "generated" / "families"
    if folder.is_dir() and any(folder.iterdir()):
        from onboarding.families import add_dirs

        add_dirs([folder])


def run_align(info: ModelInfo, graph: OpGraph, coverage: Coverage, candidates: list[Candidate],
              out_dir: Path | None, *, families: list[str] | None = None,
              dtype: str = "fp32", reference: str = "fp64", mode: str = "percentile",
              batch: int = 1, seq: int | None = None, seed: int = 0,
              exclude: set[tuple[str, str]] | None = None, strict: bool = False,
              swaps: list[Any] | None = None,
              on_step: Callable[[str], None] | None = None):
    """Align the proxy patched with the passing kernels against the eager reference.

    The result lists the coverable blocks the alignment did not check, by path and reason
    (`onboarding.align.verdicts`); ``strict`` makes any of them fail the verdict
    (`AlignmentResult.verdict_passed`).

    ``families`` limits which kernels are patched (None: all; []: none); ``exclude`` drops
    (block path, family) pairs, which is how the agent retries without a culprit's kernel.
    ``swaps``: whole-block replacements from the generate stage's decision loop
    (`onboarding.patching.core.BlockSwap`: Inductor), installed after the families' patches;
    an excluded (path, label) pair leaves its swap out too.
    A 16-bit ``dtype`` also runs the unpatched model in that dtype: its own error against the
    reference, block by block, sets the bounds (`onboarding.align.core.bounds_from_floor`).
    Writes ``alignment.json``, ``alignment.md`` (the report's table) and ``alignment.png``.
    """
    import copy

    from onboarding.align.core import align, as_dtype, build_pair
    from onboarding.align.verdicts import unchecked_blocks
    from onboarding.families import families as all_families
    from onboarding.backend import kernel_device
    from onboarding.generate.candidates import kernels_for
    from onboarding.graph.parse import example_inputs
    from onboarding.patching.core import patch_model, swap_blocks

    if families is not None and "generated" in families:  # every LLM-written family served
        families = [*families, *sorted({e.family for e in coverage.entries
                                        if e.status == "generated" and e.family})]
    available = kernels_for(coverage, candidates)
    kernels = {k: m for k, m in available.items()
               if (families is None or k[1] in families) and k not in (exclude or set())}
    device = kernel_device()
    model = info.loaded.build(info.proxy_config, seed=seed).eval()
    load_shipped_weights(model, info)
    reference_model, candidate = build_pair(model, reference_dtype=reference,
                                            candidate_dtype=dtype)
    reference_model.to(device)
    candidate.to(device)
    # 16-bit candidates: the unpatched model in the same dtype, run beside them, sets the bounds
    floor = None
    if mode == "percentile" and as_dtype(dtype).itemsize == 2:
        floor = copy.deepcopy(model).to(as_dtype(dtype)).eval().to(device)
    inputs, kwargs = example_inputs(model, info.proxy_config, batch, seq or graph.seq, seed)
    inputs = tuple(t.to(device) for t in inputs)
    # an explicit --kernels list patches those families only: the swaps need their label in it
    # ("inductor", accepted by --kernels beside the families)
    offered = list(swaps or ())  # before the selection: a swap left out is said so, by label
    swaps = [s for s in offered if (s.path, s.label) not in (exclude or set())
             and (families is None or s.label in families)]
    # a swapped block runs what the block check checked: its own code, children included, so
    # family patches at or inside it (the conv1d intercept on a Mamba mixer) are left out; the
    # swap's record names them (they count as checked inside the active swap)
    inner = {s.path: sorted({f"{f}@{p}" for p, f in kernels
                             if inside(p, s.path)}) for s in swaps}
    kernels = {(p, f): m for (p, f), m in kernels.items()
               if not any(inside(p, s.path) for s in swaps)}
    for s in swaps:
        if inner[s.path]:
            s.detail += "; compiled with the code of " + ", ".join(inner[s.path]) + \
                " (their family patches left out)"
    # blocks inside a swapped block are judged with it: hooks on them would be traced into the
    # compiled code, and their per-block guards recompile it for every instance (dynamo's limit
    # is 8; Zamba2 has 48 mixers)
    if swaps:
        import dataclasses

        graph = dataclasses.replace(graph, blocks=[
            b for b in graph.blocks if not any(b.path.startswith(s.path + ".") for s in swaps)])
    with patch_model(candidate, graph, kernels) as patches:
        swap_blocks(candidate, swaps, patches)
        result = align(reference_model, candidate, graph, inputs, kwargs, mode=mode, seed=seed,
                       patches=patches, floor=floor, on_step=on_step,
                       progress=out_dir / ALIGN_PROGRESS if out_dir is not None else None)
        # read while patched: a patch installed but never called is still "pending" here
        result.coverable, result.not_checked = unchecked_blocks(
            coverage, patches.records,
            available=[*available, *((s.path, s.label) for s in offered)],
            bindable=[n for n, f in all_families().items() if f.binding is not None]
            + sorted({s.label for s in offered}),
            families=families, exclude=exclude or ())
        result.strict = strict
    if out_dir is not None:
        result.save(out_dir / "alignment.json")
        result.plot(out_dir / "alignment.png")
        (out_dir / "alignment.md").write_text(  # its first line is the verdict: no summary()
            result.to_markdown(only_failing=len(result.blocks) > 150) + "\n")
        (out_dir / ALIGN_PROGRESS).unlink(missing_ok=True)
    return result


ALIGN_PROGRESS = "alignment.progress.jsonl"  # blocks judged so far (`align.core.BlockProgress`)
