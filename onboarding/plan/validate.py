"""Predicted against measured: the plan's peak memory and step time for one GPU against
``onboard train --nproc 1`` on that GPU, at several proxy sizes and sequence lengths.

    python -m onboarding.plan.validate --out DIR            # GPU: calibrate, train, compare
    python -m onboarding.plan.validate --measured DIR       # re-predict from DIR's measurements

Each case trains a few LoRA steps of a proxy in bf16 (`onboard train`, single process: the
reference role, every expert local) and reads its ``train/reference.jsonl``: the peak compared
is the steady state's, the largest step's own ``peak_mem_bytes`` after the first step
(``torch.cuda.max_memory_allocated``, reset as each step starts), and the run's peak
(``run_peak_mem_bytes``: step 1's calibrations and compiles, the set-up) is shown beside it; the
step time is the median ``step_time_s`` after the first step. Rows written before per-step peaks
(every row the run's peak so far) give the run's peak for both. The first case of each model
runs under ``--first-timeout`` (its kernels' first compiles), the others under ``--timeout``.
The plan is computed for the same config
(the proxy built on ``meta``, EP 1, no recompute, no offload) with the rates measured on the GPU
(`onboarding.plan.calibrate`) and compared with the plan's *allocated* bytes (no slack: the
allocator's peak is what was measured). Targets: memory within 10%, step time within 25%.

The plan models the training step of the code it runs with; measurements are of the step of the
commit they were taken at (``meta.json``). ``--measured`` says how many commits have changed the
training step since then (`step_paths`: onboarding/train, onboarding/patching and the kernel
families the runs used): a comparison with a step that has changed since validates nothing
about the plan (it models the newer step) and needs measuring again (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from onboarding.gitinfo import git

MEM_TARGET, TIME_TARGET = 0.10, 0.25
REPO = Path(__file__).resolve().parents[2]
# the code a training step's memory and time come from (the plan models the one at HEAD);
# `step_paths` narrows kernel_templates to the families the measured runs used
STEP_PATHS = ("onboarding/train", "onboarding/patching", "kernel_templates")
FIRST_TIMEOUT = 600.0  # seconds for the first case of each model: its kernels' first compiles


@dataclass(kw_only=True, slots=True)
class Case:
    model: str
    seq: int
    micro_batch: int = 2
    proxy: str = "small"
    recompute: str = "none"
    # onboard's kernels where a family matches (onboard train's default on a GPU); False:
    # --no-kernels, the torch paths. Cases stored before this field ran the default.
    kernels: bool = True
    dtype: str = "bf16"
    sets: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        extra = "".join("_" + s.split("=")[0].split(".")[-1] + s.split("=")[1] for s in self.sets)
        return f"{self.model.removeprefix('hf:')}-{self.proxy}-T{self.seq}-B{self.micro_batch}" \
            + {"full": "-ckpt", "selective": "-selective"}.get(self.recompute, "") \
            + ("" if self.kernels else "-torch") \
            + ("" if self.dtype == "bf16" else "-" + self.dtype) + extra

    def train_args(self) -> list[str]:
        """``onboard train``'s options for this case on one GPU (the measured side)."""
        args = [self.model, "--proxy", self.proxy, "--seq", str(self.seq), "--micro-batch",
                str(self.micro_batch), "--nproc", "1", "--dtype", self.dtype, "--device", "cuda",
                "--recompute", self.recompute]
        for s in self.sets:
            args += ["--set", s]
        return args + ([] if self.kernels else ["--no-kernels"])

    def plan_config(self):
        """The plan of the same step (the predicted side): every setting `train_args` passes
        that changes what the step keeps or runs, so the two sides compare like with like."""
        from onboarding.plan.config import PlanConfig

        return PlanConfig(gpus=1, ep=1, seq=self.seq, micro_batch=self.micro_batch,
                          recompute=self.recompute, offload="none", kernels=self.kernels,
                          dtype=self.dtype)


CASES = [Case(model="hf:qwen3_moe", seq=2048), Case(model="hf:qwen3_moe", seq=8192),
         Case(model="hf:qwen3_moe", seq=32768, micro_batch=1),
         Case(model="hf:qwen3_moe", seq=8192, recompute="full"),
         Case(model="hf:qwen3_next", seq=4096),
         Case(model="hf:qwen3_next", seq=16384, micro_batch=1)]


def peaks(rows: list[dict]) -> dict:
    """The peaks of a run's step rows: ``peak_bytes``, the steady state's (the largest step's own
    peak after step 1; step 1's where it is the only step), which the plan is compared with;
    ``run_peak_bytes``, the run's (step 1's calibrations and compiles, the set-up); ``peak_of``,
    what ``peak_bytes`` is. Rows without ``run_peak_mem_bytes`` predate per-step peaks (each row
    the run's peak so far): their peak is the run's for both."""
    from onboarding.train.compare import run_peak

    run = run_peak(rows)
    if not all("run_peak_mem_bytes" in r for r in rows):
        return {"peak_bytes": run, "run_peak_bytes": run,
                "peak_of": "the run's (rows before per-step peaks)"}
    later = rows[1:] or rows
    return {"peak_bytes": max(r["peak_mem_bytes"] for r in later), "run_peak_bytes": run,
            "peak_of": f"steps {rows[1]['step']}-{rows[-1]['step']}" if len(rows) > 1
            else f"step {rows[0]['step']} (the only step)"}


def measure(case: Case, runs: Path, steps: int, timeout: float) -> dict:
    """Train ``case`` for ``steps`` steps in ``runs``; the peaks (`peaks`) and median step time
    of its rows, the kernels its first row says ran (``kernels``: which blocks had onboard's
    kernels, which were rejected, and why: what the plan's kernel path assumed; the worker
    writes them once, in the row of the step where the patches calibrate), and where the run did
    not exit 0, the end of its output (``error``), rows or not: a run that wrote its steps and
    then failed says why."""
    run = runs / case.name
    cmd = [sys.executable, "-m", "onboarding", "train", *case.train_args(), "--steps", str(steps),
           "--out", str(run)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
    except subprocess.TimeoutExpired as exc:  # what it had printed, then the timeout (last)
        said = "".join(x if isinstance(x, str) else x.decode(errors="replace")
                       for x in (exc.stdout, exc.stderr) if x)
        rc, tail = 124, (said[-1200:] + "\n" if said else "") + f"timed out after {timeout:.0f} s"
    rows_file = run / "train" / "reference.jsonl"
    rows = [json.loads(x) for x in rows_file.read_text().splitlines() if x.strip()] \
        if rows_file.exists() else []
    res = {"case": asdict(case), "name": case.name, "command": " ".join(cmd[2:]),
           "exit_code": rc, "steps": len(rows), "timeout_s": timeout}
    if rows:
        res.update(peaks(rows))
        later = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]
        res["step_s"] = statistics.median(later)
        res["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rows[1:] or rows)
        res["rows"] = [{k: r[k] for k in ("step", "step_time_s", "peak_mem_bytes",
                                          "run_peak_mem_bytes") if k in r} for r in rows]
        first = next((r for r in rows if r.get("kernels") is not None), None)
        if first is not None:
            res["kernels"] = first["kernels"]
            if first.get("kernels_rejected"):
                res["kernels_rejected"] = first["kernels_rejected"]
    if rc != 0 or not rows:
        res["error"] = tail
    return res


def measure_cases(cases: list[Case], runs: Path, steps: int, timeout: float,
                  first_timeout: float = FIRST_TIMEOUT):
    """`measure` each case in turn (a generator of results): the first case of each model with
    ``first_timeout`` seconds (at least ``timeout``), its kernels' first compiles (Triton's
    cache then serves the model's later cases), the others with ``timeout``. Step 1 is left out
    of the step time and of the steady-state peak anyway: the allowance only keeps the case
    from being cut off."""
    seen: set[str] = set()
    for case in cases:
        first = case.model not in seen
        seen.add(case.model)
        yield measure(case, runs, steps, max(first_timeout, timeout) if first else timeout)


def predict(case: Case, rates=None) -> dict:
    """The plan's peak (allocated) bytes and step time for ``case`` on one GPU."""
    from onboarding.families import match_block
    from onboarding.graph.parse import load_stage
    from onboarding.load.overrides import parse_assignments
    from onboarding.load.spec import ModelSpec
    from onboarding.plan.capture import plan_graph
    from onboarding.plan.config import ClusterConfig
    from onboarding.plan.run import run_plan

    loaded = ModelSpec(ref=case.model, overrides=parse_assignments(case.sets)).load()
    info = load_stage(loaded, case.proxy)
    graph, notes = plan_graph(info)  # the block kinds as `onboard plan`: the tiny proxy's
    cluster = ClusterConfig()
    if rates is not None:
        cluster.rates = rates
    plan = run_plan(info, graph, case.plan_config(), cluster, config=info.proxy_config,
                    notes=notes)
    c = plan.chosen
    kinds: dict[str, set[str]] = {}  # block kind -> the families whose `match` takes such a block
    for block in graph.blocks:
        kinds.setdefault(block.kind, set()).update(f for f, _ in match_block(block))
    return {"allocated": c.memory.allocated, "components": c.memory.components(),
            "step_s": c.time.overlap_s, "host_s": c.time.host_s, "gpu_parts_s": {
                "gemm": c.time.gemm_s, "attn": c.time.attn_s, "memory": c.time.memory_s},
            "params": plan.shape["total_params"],
            "kind_families": {k: sorted(v) for k, v in sorted(kinds.items())}}


def _git(*args: str, repo: Path = REPO) -> str | None:
    out = git(*args, cwd=repo, timeout=30)
    return None if out is None else out.strip()


def families_used(result: dict) -> set[str] | None:
    """The kernel families a measured case's run used: those behind each kind its ``kernels``
    summary counts active (a training kind by `families.training_kernel`, a block kind by the
    families whose `match` takes blocks of that kind in the case's graph, ``kind_families`` of
    its prediction), with the families they extend. None when that is unknown (no summary, no
    prediction, a kind no family is known to serve): then every family counts. A case run
    with ``--no-kernels`` used none. A kind whose kernel was tried and rejected
    (``rejected:<kind>`` counted: its check against the torch path failed) ran its torch path,
    but its family's templates decided that: a change to them may make the check pass, and the
    step would run the kernel, so that family counts too. A kind the kernel was not tried on
    (``rejected:<kind> (<why>)``, refused in onboarding/train, counted anyway) adds none."""
    from onboarding.families import families, training_kernel

    if not result.get("case", {}).get("kernels", True):
        return set()
    summary, pred = result.get("kernels"), result.get("predicted") or {}
    by_kind = pred.get("kind_families")
    if summary is None or by_kind is None:
        return None
    used: set[str] = set()
    for kind, n in summary.items():
        if kind.startswith("rejected:"):
            kind = kind.removeprefix("rejected:")
            if " (" in kind:  # not tried: the refusal is onboarding/train's
                continue
        if not n:
            continue
        served = training_kernel(kind)
        fams = [served[0]] if served is not None else by_kind.get(kind) or []
        if not fams:
            return None
        used.update(fams)
    specs = families()
    for f in list(used):
        while f in specs and specs[f].extends:  # a family's templates include its base's
            f = specs[f].extends
            used.add(f)
    return used


def step_paths(results: list[dict] | None = None) -> tuple[str, ...]:
    """The paths whose commits change the measured training step: onboarding/train,
    onboarding/patching and of kernel_templates, the folders of the families the cases' runs
    used (`families_used`) with the shared ``_common``; all of kernel_templates where any case's
    families are unknown, or with no results."""
    used: set[str] = set()
    for r in results or [None]:
        fams = families_used(r) if r is not None else None
        if fams is None:
            return STEP_PATHS
        used |= fams
    kernels = ("kernel_templates/_common", *(f"kernel_templates/{f}" for f in sorted(used))) \
        if used else ()
    return (*STEP_PATHS[:2], *kernels)


def provenance(src: Path, repo: Path = REPO, results: list[dict] | None = None) -> list[str]:
    """What the measurements in ``src`` are (its meta.json) and whether the training step they
    measured is still the one the plan models: the commits since theirs that changed the
    `step_paths` of ``results`` (the first line names them), where git knows their commit. The
    plan at 458972e followed issue 34's leaner step while these H200 numbers stayed those of
    83f63f6's, and the validation went on comparing the two for days without saying so (-37%
    to -66% on memory)."""
    meta_file = src / "meta.json"
    if not meta_file.is_file():
        return [f"measurements: {src} has no meta.json (which code they measured is unknown)"]
    meta = json.loads(meta_file.read_text())
    commit = (meta.get("commit") or "").split(" ")[0]
    paths = step_paths(results)
    lines = [f"measurements: {meta.get('what', '?')}; {meta.get('device', '?')}; "
             f"commit {commit or '?'}; {meta.get('date', '?')}; the step's code counted: "
             f"{', '.join(paths)}"]
    head = _git("rev-parse", "--short", "HEAD", repo=repo)
    changed = _git("rev-list", "--count", f"{commit}..HEAD", "--", *paths, repo=repo) \
        if commit and head else None
    if changed is None:
        lines.append(f"the plan's code: git does not know {commit or 'their commit'} here: "
                     "whether the training step has changed since is unknown")
    elif int(changed):
        lines.append(f"STALE: {changed} commits to {', '.join(paths)} between {commit} and "
                     f"the plan's code ({head}): the plan models today's training step, these "
                     "numbers an older one; measure again (--out) before reading the memory and "
                     "time errors as the plan's")
    return lines


def table(results: list[dict]) -> str:
    """The comparison, one row a case: the plan against the steady state's peak (``measured
    GiB``, `peaks`) with the run's beside it (``run peak GiB``: a first-step transient shows
    there, not in the error), and against the median step time; a line under the table for
    each case whose measured peak is not the steady state's."""
    head = ("| case | params | predicted GiB | measured GiB | run peak GiB | error | within 10% "
            "| predicted ms | measured ms | error | within 25% |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines, notes = [head], []
    for r in results:
        p, m = r.get("predicted"), r
        if p is None or "peak_bytes" not in m:
            lines.append(f"| {r['name']} | | | | | | | | | | not measured: "
                         f"{(r.get('error') or '').splitlines()[-1:]} |")
            continue
        em = p["allocated"] / m["peak_bytes"] - 1
        et = p["step_s"] / m["step_s"] - 1
        run_peak = m.get("run_peak_bytes", m["peak_bytes"])
        lines.append(
            f"| {r['name']} | {p['params'] / 1e9:.2f}B | {p['allocated'] / 2**30:.2f} | "
            f"{m['peak_bytes'] / 2**30:.2f} | {run_peak / 2**30:.2f} | {em:+.1%} | "
            f"{'yes' if abs(em) <= MEM_TARGET else 'NO'} | {p['step_s'] * 1e3:.0f} | "
            f"{m['step_s'] * 1e3:.0f} | {et:+.1%} | {'yes' if abs(et) <= TIME_TARGET else 'NO'} |")
        of = m.get("peak_of", "the run's (rows before per-step peaks)")
        if not of.startswith("steps "):
            notes.append(f"{r['name']}: measured GiB is {of}")
    return "\n".join(lines + ([""] + notes if notes else []))  # a blank line ends the table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onboarding.plan.validate")
    ap.add_argument("--out", help="run the cases here (needs a GPU)")
    ap.add_argument("--runs", help="where the training runs go (default OUT/runs)")
    ap.add_argument("--measured", help="a folder a previous --out wrote: predict again only")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per case (the "
                    "first case of each model: --first-timeout)")
    ap.add_argument("--first-timeout", type=float, default=FIRST_TIMEOUT,
                    help="seconds for the first case of each model, which compiles its kernels "
                    "(Triton's cache serves the model's later cases); its step 1 is left out of "
                    "the step time and the steady-state peak in any case (default %(default).0f)")
    args = ap.parse_args(argv)
    from onboarding.plan.config import Rates

    if args.measured:
        src = Path(args.measured)
        results = json.loads((src / "measured.json").read_text())
        for r in results:  # the peaks as `measure` reads them today, from the stored rows
            if r.get("rows"):
                r.update(peaks(r["rows"]))
        rates = Rates(**json.loads((src / "rates.json").read_text()))
    else:
        from onboarding.plan.calibrate import calibrate

        import torch

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "meta.json").write_text(json.dumps({
            "what": "python -m onboarding.plan.validate " + " ".join(argv or sys.argv[1:]),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": _git("rev-parse", "--short", "HEAD") or "?",
            "date": time.strftime("%Y-%m-%d", time.gmtime())}, indent=1))
        rates = calibrate(seq=4096)
        (out / "rates.json").write_text(json.dumps(asdict(rates), indent=1))
        print("rates:", asdict(rates), flush=True)
        results = []
        for res in measure_cases(CASES, Path(args.runs) if args.runs else out / "runs",
                                 args.steps, args.timeout, args.first_timeout):
            print(json.dumps({k: v for k, v in res.items() if k != "case"}), flush=True)
            results.append(res)
            (out / "measured.json").write_text(json.dumps(results, indent=1))
    for r in results:
        try:
            r["predicted"] = predict(Case(**r["case"]), rates)
        except Exception as exc:  # a case the plan cannot read is a row that says so
            r["predicted"] = None
            r["error"] = f"prediction failed: {type(exc).__name__}: {exc}"
    print(f"rates: {asdict(rates)}")
    for line in provenance(Path(args.measured or args.out), results=results):
        print(line)
    print(table(results))
    if args.out:
        (Path(args.out) / "validation.json").write_text(json.dumps(results, indent=1,
                                                                   default=str))
        (Path(args.out) / "validation.md").write_text(table(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
