"""PR.md, the pull request's body, built only from the rows the run recorded: the candidates'
checks, alignment.json, tune.json and benchmark rows. A number that was not measured is said
to be missing ("not measured on a GPU"), never filled in."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from onboarding.pr.collect import KernelModule, Proposal

NOT_ON_GPU = "not measured on a GPU"


def _cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _num(x: Any, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


def group_paths(paths: list[str], limit: int = 4) -> str:
    """Block paths with their layer numbers folded: `model.layers.{0-3,5}.mlp` (first `limit`
    groups, then a count)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for p in paths:
        m = re.search(r"\.(\d+)\.", p)
        key = p[:m.start(1)] + "{}" + p[m.end(1):] if m else p
        groups[key].append(int(m.group(1)) if m else -1)
    parts = []
    for key, nums in groups.items():
        nums = sorted(n for n in nums if n >= 0)
        parts.append(key.replace("{}", "{" + _ranges(nums) + "}") if nums else key)
    more = len(parts) - limit
    return ", ".join(f"`{x}`" for x in parts[:limit]) + (f" and {more} more" if more > 0 else "")


def _ranges(nums: list[int]) -> str:
    out, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(out)


def _params(p: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(p.items())) or "-"


def kernels_table(prop: Proposal) -> list[str]:
    lines = ["| family | module | variant | parameters | blocks served | in the model's "
             "alignment |", "|---|---|---|---|---|---|"]
    for m in prop.modules:
        lines.append(f"| {m.family} | `kernels/{m.family}/{m.name}` | {m.variant} | "
                     f"{_cell(_params(m.params))} | {len(m.blocks)}: "
                     f"{_cell(group_paths(m.blocks))} | {_cell(aligned(prop, m))} |")
    return lines


def aligned(prop: Proposal, m: KernelModule) -> str:
    """How many of the module's blocks ran its family's kernel in the run's alignment (a block
    that failed there keeps its module out of the PR, so those that ran passed)."""
    a = prop.alignment
    if not a:
        return "alignment not run"
    active = {p["path"] for p in a.get("patches", [])
              if p.get("status") == "active" and p["family"] == m.family}
    n = sum(b in active for b in m.blocks)
    if n:
        return f"{n} of {len(m.blocks)} blocks patched, passed"
    why = next((x.get("reason") for x in a.get("not_checked", []) if x["path"] in m.blocks),
               None)
    return "not patched" + (f": {why}" if why else " in this run's alignment")


def call_lines(prop: Proposal) -> list[str]:
    lines = ["Each module is self-contained (it imports only torch, triton and the standard "
             "library) and is loaded by path, never as a package named `kernels`:", "",
             "```python", "import importlib.util", ""]
    for i, m in enumerate(prop.modules):
        var = f"{m.family}_{m.source.stem}"
        if i:
            lines.append("")
        lines += [f'spec = importlib.util.spec_from_file_location("{var}", '
                  f'"kernels/{m.family}/{m.name}")',
                  f"{var} = importlib.util.module_from_spec(spec)",
                  f"spec.loader.exec_module({var})",
                  f"out = {var}.{m.entry}  # {var}.reference(...) takes the same arguments"]
    lines += ["```", "",
              "A `<module>.tuned.json` beside a module holds its tuned tile configs per shape "
              "bucket; `onboard` applies them when it loads the module."]
    return lines


def correctness_table(prop: Proposal) -> list[str]:
    lines = ["Each candidate against its own pure-PyTorch `reference`, forward output and every "
             "input gradient, on fresh random inputs at the served block's widths, in fp32 "
             "(the generate stage; `tests/reviewed_kernels/` re-runs exactly these inputs):", "",
             "| module | check | shape | dtype | rel RMS | max abs err | bound (rel RMS; atol + "
             "rtol·\\|ref\\|) | verdict |", "|---|---|---|---|---|---|---|---|"]
    for m in prop.modules:
        for c in m.checks:
            bound = (f"{_num(c.get('max_rel_rms'), '.0e')}; {_num(c.get('atol'), '.0e')} + "
                     f"{_num(c.get('rtol'), '.0e')}" if "max_rel_rms" in c
                     else _cell(c.get("message") or "-"))
            shape = "x".join(map(str, c.get("shape", []))) or "-"
            lines.append(f"| {m.label} | {c['name'].split('.', 1)[-1]} | {shape} | fp32 | "
                         f"{_num(c.get('rel_rms'))} | {_num(c.get('max_abs'))} | {bound} | "
                         f"{'pass' if c.get('passed') else 'FAIL'} |")
    a = prop.alignment
    if a:
        lines += ["", f"In the model (alignment, {a.get('candidate_dtype')} against "
                      f"{a.get('reference_dtype')}, block by block): the worst relative RMS error "
                      "of the blocks each family ran in:", "",
                  "| family | blocks patched | forward output | input gradients | "
                  "parameter gradients | verdicts |", "|---|---|---|---|---|---|"]
        for fam, row in alignment_by_family(a, {m.family for m in prop.modules}).items():
            lines.append(f"| {fam} | {row['n']} | {_num(row['fwd'])} | {_num(row['bwd'])} | "
                         f"{_num(row['params'])} | {_cell(row['verdicts'])} |")
    return lines


def alignment_by_family(a: dict[str, Any], families: set[str]) -> dict[str, dict[str, Any]]:
    """Per family: blocks it ran in (patch active), worst fwd/bwd/param-grad rel RMS, verdicts."""
    blocks = {b["path"]: b for b in a.get("blocks", [])}
    out: dict[str, dict[str, Any]] = {}
    for p in a.get("patches", []):
        if p.get("status") != "active" or p["family"] not in families:
            continue
        b = blocks.get(p["path"])
        row = out.setdefault(p["family"], {"n": 0, "fwd": None, "bwd": None, "params": None,
                                           "v": defaultdict(int)})
        row["n"] += 1
        if b is None:
            continue
        for key, d, part in (("fwd", "fwd", "output"), ("bwd", "bwd", "output"),
                             ("params", "bwd", "params")):
            stats = (b.get(d) or {}).get(part) or {}
            v = stats.get("rel_rms")
            if v is not None and (row[key] is None or v > row[key]):
                row[key] = v
        for d in ("fwd", "bwd"):
            row["v"][f"{d} {(b.get(d) or {}).get('verdict')}"] += 1
    for row in out.values():
        row["verdicts"] = ", ".join(f"{k} x{n}" for k, n in sorted(row.pop("v").items()))
    return out


def _gpu_tune_studies(prop: Proposal) -> list[dict[str, Any]]:
    t = prop.tune or {}
    gpu = str(t.get("gpu") or "")
    if t.get("skipped") or not gpu or "cpu" in gpu.lower():
        return []
    fams = {(m.family, m.variant) for m in prop.modules}
    return [s for s in t.get("studies", []) if (s.get("family"), s.get("variant")) in fams]


def speed_lines(prop: Proposal) -> list[str]:
    fams = {m.family for m in prop.modules}
    rows = [r for r in prop.bench if r.get("family") in fams and r.get("status", "ok") == "ok"
            and r.get("ratios")]
    studies = _gpu_tune_studies(prop)
    lines: list[str] = []
    if rows:
        lines += ["Benchmark rows of this run (anchor time / our time from interleaved rounds; "
                  "> 1: ours is faster):", "",
                  "| family | case | shape | ours (ms) | against the anchors | rows from |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            ms = (r.get("timing") or {}).get("median_ms")
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(r["ratios"].items()))
            shape = ", ".join(f"{k}={v}" for k, v in (r.get("shape") or {}).items())
            lines.append(f"| {r['family']} | {r.get('case')} ({r.get('impl')}) | {shape} | "
                         f"{_num(ms, '.4g')} | {ratios} | {r.get('_file')} |")
    if studies:
        gpu = (prop.tune or {}).get("gpu")
        lines += ([""] if lines else []) + [
            f"Tuning in this run on {gpu} ({(prop.tune or {}).get('dtype')}): the tuned config "
            "against the bucket's default, forward + backward at the block's shapes:", "",
            "| kernel | bucket | default (ms) | tuned (ms) | speed-up | trials |",
            "|---|---|---|---|---|---|"]
        for s in studies:
            r = s.get("result", {})
            gain = (f"{r['default_ms'] / r['best_ms']:.2f}x"
                    if r.get("best_ms") and r.get("default_ms") else "-")
            lines.append(f"| {s['family']}/{s['variant']} | {s.get('bucket')} | "
                         f"{_num(r.get('default_ms'), '.4g')} | {_num(r.get('best_ms'), '.4g')} "
                         f"| {gain} | {r.get('n_trials')} |")
    if not lines:
        why = (prop.tune or {}).get("skipped")
        lines.append(f"{NOT_ON_GPU}: this run recorded no benchmark rows and no GPU tuning"
                     + (f" (tune: {why})" if why else "") + ". `onboard bench --family NAME "
                     "--out <run_dir>/bench-NAME.json` on a GPU adds the rows; `onboard pr create` "
                     "reads them.")
    return lines


def roofline_lines(prop: Proposal) -> list[str]:
    fams = {m.family for m in prop.modules}
    rows = [r for r in prop.bench if r.get("family") in fams and r.get("impl") == "ours"
            and (r.get("roofline_frac") is not None or r.get("tflops") is not None)]
    if not rows:
        return [f"{NOT_ON_GPU}: the run recorded no benchmark rows with the copy and matmul "
                "ceilings."]
    lines = ["Our full step (forward + backward) against the ceilings measured in the same "
             "benchmark run:", "",
             "| family | case | GB/s | % of copy ceiling | TFLOP/s | % of bf16 matmul ceiling |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ceil = r.get("_ceilings") or {}
        mm = ceil.get("matmul_bf16_tflops")
        pct_mm = (f"{100 * r['tflops'] / mm:.0f}%" if r.get("tflops") and mm else "-")
        pct_copy = (f"{100 * r['roofline_frac']:.0f}%" if r.get("roofline_frac") is not None
                    else "-")
        lines.append(f"| {r['family']} | {r.get('case')} | {_num(r.get('gbps'), '.0f')} | "
                     f"{pct_copy} | {_num(r.get('tflops'), '.1f')} | {pct_mm} |")
    return lines


def alignment_lines(prop: Proposal) -> list[str]:
    a = prop.alignment
    if not a:
        return ["alignment not run: the run directory has no alignment.json."]
    verdict = "passed" if a.get("verdict_passed", a.get("passed")) else "FAILED"
    culprit = a.get("culprit") or {}
    lines = [f"**{verdict}**: {a.get('candidate_dtype')} against {a.get('reference_dtype')}, "
             f"{len(a.get('blocks', []))} blocks"
             + (f"; logits relative RMS {_num((a.get('logits') or {}).get('stats', {}).get('rel_rms'))}"
                if a.get("logits") else "")
             + (f"; culprits: forward {culprit.get('fwd') or '-'}, backward "
                f"{culprit.get('bwd') or '-'}" if verdict == "FAILED" else "") + "."]
    patched: dict[str, list[str]] = defaultdict(list)
    other: dict[str, list[str]] = defaultdict(list)
    for p in a.get("patches", []):
        (patched if p.get("status") == "active" else other)[p["family"]].append(p["path"])
    lines += ["", "Patched blocks (running our kernels):", ""]
    lines += [f"- {fam} ({len(ps)}): {group_paths(ps, 6)}" for fam, ps in sorted(patched.items())]
    if not patched:
        lines.append("- none")
    nc = a.get("not_checked") or []
    lines += ["", "Unpatched coverable blocks (the model's own code ran there):", ""]
    lines += [f"- `{x['path']}` ({x.get('kind')}, {x.get('family')}): {x.get('reason')}"
              for x in nc] or ["- none"]
    for fam, ps in sorted(other.items()):
        lines.append(f"- {fam}: patch not active at {group_paths(ps, 6)}")
    bnc = a.get("backward_not_checked") or []
    if bnc:
        lines += ["", "Backward not checked:", ""]
        lines += [f"- `{x['path']}` ({x.get('family')}): {x.get('reason')}" for x in bnc]
    return lines


def build_body(prop: Proposal, *, branch: str, base: str, base_commit: str,
               run_command: str | None = None, repo_hint: str = ".") -> str:
    env = prop.environment
    ref = prop.model_ref or prop.model
    lines = [f"# Kernels for {prop.model}", "",
             f"Branch `{branch}` onto `{base}` (at {base_commit[:12]}), from the run directory "
             f"`{prop.run_dir}` of `{ref}`: {len(prop.modules)} kernel module(s) in "
             f"{len(prop.families)} famil{'y' if len(prop.families) == 1 else 'ies'}, one commit "
             "each with the module, its test and its inputs"
             + (", its tuned configs" if any(m.tuned for m in prop.modules) else "")
             + (", the generated family folder" if any(f.folder for f in prop.families) else "")
             + ".", "",
             "Review: `onboard pr show|diff " + branch + "`; answer: `onboard pr approve "
             + branch + "` (merge into " + base + ") or `onboard pr reject " + branch
             + " --why \"...\"`.", "",
             "## Kernels and the blocks they serve", "", *kernels_table(prop), ""]
    gen = [f for f in prop.families if f.folder]
    if gen:
        lines += ["Generated families (their folder is in the family's commit, under "
                  "`kernel_templates/<family>/`): " + ", ".join(f.family for f in gen), ""]
    lines += ["## How to call them", "", *call_lines(prop), "",
              "## Correctness", "", *correctness_table(prop), "",
              "## Speed against the anchors", "", *speed_lines(prop), "",
              "## Roofline", "", *roofline_lines(prop), "",
              "## Alignment", "", *alignment_lines(prop), ""]
    if prop.left_out:
        lines += ["## Not proposed", "",
                  "Nothing that failed a correctness check is committed:", ""]
        lines += [f"- {label}: {why}" for label, why in prop.left_out]
        lines.append("")
    tuned = [m for m in prop.modules if m.tuned]
    lines += ["## Environment", "",
              "| onboard | commit | torch | triton | transformers | python | GPU | date |",
              "|---|---|---|---|---|---|---|---|",
              "| " + " | ".join(_cell(env.get(k) or "-") for k in
                               ("onboard", "commit", "torch", "triton", "transformers", "python",
                                "gpu", "date")) + " |", ""]
    if tuned:
        lines += ["Tuned on: " + "; ".join(f"{m.label}: {m.tuned_gpu}" for m in tuned), ""]
    lines += ["## Reproduce", "", "```",
              run_command or f"onboard run {ref}".strip(),
              f"onboard pr create <run_dir> --repo {repo_hint}",
              "pytest " + str(Path("tests") / "reviewed_kernels"), "```", ""]
    return "\n".join(lines)

