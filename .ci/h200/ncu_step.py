"""One family's default module on one bench case, step by step, for Nsight Compute (h37_ncu.sh); and
the summaries of ncu's exported pages.

Run mode: the case and its inputs come from the family's own bench (`cases_for` / `select_cases`, the
same `setup` that `onboard bench --family F --case ^CASE --impl ours` times), row ``ours`` (forward +
backward of the output, `--mode fwdbwd`) or ``ours_fwd`` (forward under no_grad, `--mode fwd`). It runs
`--steps` steps with a synchronize after each and prints each step's wall ms and the Triton kernels it
launched (name x count: the count per step sets ncu's --launch-count / --launch-skip). With
`--profile-from K` the steps from K on run inside cudaProfilerStart / Stop (ncu's
--profile-from-start off then sees only those: the compile and warm-up launches stay out).

    python3 .ci/h200/ncu_step.py --family ssd --case '^B1T8192H128' --mode fwdbwd --steps 3 --profile-from 2
    TRITON_INTERPRET=1 python3 .ci/h200/ncu_step.py --cpu --family kimi_delta --mode fwdbwd --steps 2 \
        --expect 'kda_chunk_bwd_wy[tvk]p?_kernel'    (a tiny case of the same bucket on the CPU)
    python3 .ci/h200/ncu_step.py --family ssd --case '^B1T8192H128' --dry-run   (the case picked; nothing built)

`--expect REGEX`: exit 3 when the last step launched no Triton kernel whose name REGEX finds (re.search,
as ncu's --kernel-name regex:REGEX: a check that it has something to find).

Summary mode (no torch needed):

    python3 .ci/h200/ncu_step.py --summarize-source SASS.csv [--top 25]   (ncu --page source --csv)
    python3 .ci/h200/ncu_step.py --summarize-raw RAW.csv                   (ncu --page raw --csv)

the first prints the warp-stall samples by reason, by opcode and the top instructions (or source lines);
the second the duration, throughputs, occupancy and the per-reason stall metrics of each profiled kernel.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
import time

# --cpu: a tiny case of the same shape bucket as the bench case (ssd: P <= 64; the delta rule: K = 128),
# built by the family's own case builder
TINY = {
    "ssd": (1, 128, 2, 16, 1, 16),          # B, T, H, P, G, N
    "gated_delta": (1, 64, 1, 2, 128),      # B, T, HK, HV, D
    "kimi_delta": (1, 64, 1, 1, 128),
}
IMPL = {"fwdbwd": "ours", "fwd": "ours_fwd"}


# ---------------------------------------------------------------- run mode

def tiny_case(family: str):
    if family == "ssd":
        from onboarding.families import family_module

        return family_module("ssd").bench.ssd_case(*TINY["ssd"])
    if family in ("gated_delta", "kimi_delta"):
        from onboarding.bench.cases_linear_attention import delta_rule_case

        return delta_rule_case(family, *TINY[family], per_channel=family == "kimi_delta")
    raise SystemExit(f"--cpu knows {sorted(TINY)}, not {family}")


def pick_case(family: str, pattern: str | None, impls: list[str], cpu: bool):
    """The first bench case of `family` that `pattern` picks and that times `impls` (host_step.py too)."""
    from onboarding.bench.cases import cases_for, select_cases

    cases = [tiny_case(family)] if cpu else cases_for([family])
    picked = select_cases(cases, [pattern] if pattern and not cpu else None, impls)
    if len(picked) > 1:
        print(f"{len(picked)} cases match {pattern!r}: {[c.name for c in picked]}; the first runs")
    return picked[0]


def run(args) -> int:
    impl = args.row or IMPL[args.mode]
    if args.dry_run:
        from onboarding.bench.cases import cases_for, name_matches

        names = [c.name for c in cases_for([args.family])]
        hits = [n for n in names if not args.case or name_matches(args.case, n)]
        print(f"{args.family}: cases {names}; {args.case!r} picks {hits[:1]} (row {impl}, {args.steps} steps)")
        return 0 if hits else 2
    import torch

    from onboarding.testing.launches import Launches  # kernel name -> launches (warm-ups not counted)

    device = torch.device("cpu" if args.cpu else "cuda")
    case = pick_case(args.family, args.case, [impl], args.cpu)
    steps = case.setup(device)
    if impl not in steps:
        print(f"{case.name}: no row {impl}; rows {sorted(steps)}")
        return 2
    step = steps[impl]
    print(f"{args.family}/{case.name} row {impl} on {device}", flush=True)
    cuda = device.type == "cuda"
    profiling = False
    last: collections.Counter = collections.Counter()
    with Launches() as launches:
        for i in range(args.steps):
            if args.profile_from is not None and i == args.profile_from:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                profiling = True  # on the CPU a label only
            t = time.perf_counter()
            step(i)
            if cuda:
                torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t)
            last = launches.take()
            ks = ", ".join(f"{k} x{v}" for k, v in sorted(last.items()))
            print(f"step {i}{' (profiled)' if profiling else ''}: {ms:.3f} ms wall; kernels: {ks}", flush=True)
    if profiling and cuda:
        torch.cuda.profiler.stop()
    if args.expect:
        hits = {k: v for k, v in last.items() if re.search(args.expect, k)}
        if not hits:
            print(f"EXPECT FAILED: the last step launched no kernel matching {args.expect!r}")
            return 3
        print("EXPECT OK: " + ", ".join(f"{k} x{v}" for k, v in sorted(hits.items())) + " in the last step")
    return 0


# ---------------------------------------------------------------- summary mode

def _num(text: str) -> float:
    try:
        return float(text.replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def _reason(col: str) -> str:
    for p in ("smsp__pcsamp_warps_issue_stalled_", "stall_"):
        if col.startswith(p):
            return col[len(p):]
    return col


def summarize_source(path: str, top: int = 25) -> str:
    """Warp-stall samples of ncu's source page (one row per SASS instruction or source line)."""
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    hi = next((i for i, r in enumerate(rows) if "Source" in r and any("Sampl" in c for c in r)), None)
    if hi is None:
        return f"{path}: no source-page header (Source + a sampling column) in {len(rows)} rows\n"
    hdr = rows[hi]
    isrc = hdr.index("Source")
    iall = next((i for i, c in enumerate(hdr) if "Sampling (All" in c), None)
    if iall is None:
        iall = next(i for i, c in enumerate(hdr) if "Sampl" in c)
    iaddr = next((i for i, c in enumerate(hdr) if "Address" in c or c in ("Line", "#")), None)
    stalls = [i for i, c in enumerate(hdr) if (c.startswith("smsp__pcsamp_warps_issue_stalled_")
                                               or c.startswith("stall_")) and not c.endswith("_not_issued")]
    data = [r for r in rows[hi + 1:] if len(r) == len(hdr) and r[isrc].strip()]
    total = sum(_num(r[iall]) for r in data)
    out = [f"{path}: {len(data)} rows, {total:.0f} samples ({hdr[iall]})"]
    if not total:
        return "\n".join(out) + "\n"
    if stalls:
        by = collections.Counter({_reason(hdr[i]): sum(_num(r[i]) for r in data) for i in stalls})
        st = sum(by.values()) or 1
        out.append("by reason: " + ", ".join(f"{k} {100 * v / st:.1f}%" for k, v in by.most_common(12) if v))
    ops: collections.Counter = collections.Counter()
    for r in data:
        toks = r[isrc].split()
        if toks and toks[0].startswith("@"):
            toks = toks[1:]
        if toks:
            ops[toks[0].split(".")[0]] += _num(r[iall])
    out.append("by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in ops.most_common(10)))
    out.append(f"top {top} rows by samples (%, top reasons, address, source):")
    for r in sorted(data, key=lambda r: -_num(r[iall]))[:top]:
        s = _num(r[iall])
        rs = sorted(((_num(r[i]), _reason(hdr[i])) for i in stalls), reverse=True)[:2]
        why = " ".join(f"{n}:{100 * v / s:.0f}%" for v, n in rs if v) if s else ""
        addr = r[iaddr].strip() if iaddr is not None else ""
        out.append(f"  {100 * s / total:5.1f}% {why:34s} {addr:>8s}  {' '.join(r[isrc].split())[:100]}")
    return "\n".join(out) + "\n"


# raw-page metrics printed first (substring match on the metric name), then every stall metric
RAW_KEYS = ("Kernel Name", "gpu__time_duration.sum", "launch__grid_size", "launch__block_size",
            "launch__registers_per_thread", "launch__shared_mem_per_block", "launch__occupancy_limit",
            "sm__warps_active.avg.pct_of_peak_sustained_active", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum", "dram__bytes_write.sum",
            "lts__t_sector_hit_rate.pct", "smsp__issue_active.avg.pct_of_peak_sustained_active",
            "smsp__average_warp_latency_per_inst_issued", "sm__pipe_tensor_op_hmma_cycles_active")
STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)(_per_issue_active)?\.(ratio|pct)$")
PCSAMP = re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$")


def _stall_lines(title: str, found: dict[str, float]) -> list[str]:
    found = {k: v for k, v in found.items() if v and not k.endswith("_not_issued")}
    tot = sum(found.values()) or 1
    return [f"  {title}:"] + [f"    {k:28s} {v:12.2f}  {100 * v / tot:5.1f}%"
                              for k, v in sorted(found.items(), key=lambda kv: -kv[1])[:14]]


def summarize_raw(path: str) -> str:
    """Key metrics and the per-reason warp stalls of each kernel of ncu's raw page (csv)."""
    with open(path, newline="", errors="replace") as f:
        rows = [r for r in csv.reader(f) if r]
    hi = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if hi is None:
        return f"{path}: no raw-page header (Kernel Name) in {len(rows)} rows\n"
    hdr = rows[hi]
    units = rows[hi + 1] if hi + 1 < len(rows) and not rows[hi + 1][0].strip().isdigit() else [""] * len(hdr)
    out = []
    for r in rows[hi + 1:]:
        if len(r) != len(hdr) or not r[0].strip().isdigit():
            continue
        out.append(f"kernel {r[hdr.index('Kernel Name')][:80]}")
        for key in RAW_KEYS[1:]:
            for i, c in enumerate(hdr):
                if key in c:
                    out.append(f"  {c:70s} {r[i]:>16s} {units[i] if i < len(units) else ''}")
        # cycles per issued instruction by reason (WarpStateStats), the ratio per issue where the page
        # has both forms; warp-state samples by reason (SourceCounters)
        per_issue: dict[str, float] = {}
        for i, c in enumerate(hdr):
            m = STALL.match(c)
            if m and (m.group(1) not in per_issue or m.group(2)):
                per_issue[m.group(1)] = _num(r[i])
        samples = {m.group(1): _num(r[i]) for i, c in enumerate(hdr) if (m := PCSAMP.match(c))}
        if per_issue:
            out += _stall_lines("stalls, cycles per issued instruction (share)", per_issue)
        if samples:
            out += _stall_lines("stalls, warp samples (share)", samples)
    return "\n".join(out or [f"{path}: no kernel rows"]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family")
    ap.add_argument("--case", help="a bench case name pattern (^ and $ anchor it, as onboard bench --case)")
    ap.add_argument("--mode", choices=sorted(IMPL), default="fwdbwd")
    ap.add_argument("--row", default=None,
                    help="a bench row other than the mode's (e.g. a sweep row 'ours@kda_qk=ksplit+kda_qkt_cold=split')")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile-from", type=int, default=None,
                    help="steps from this one on run between cudaProfilerStart and Stop")
    ap.add_argument("--expect", help="a regex (re.search) some Triton kernel of the last step must match")
    ap.add_argument("--cpu", action="store_true", help="a tiny case of the same bucket on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--dry-run", action="store_true", help="print the case picked; build nothing")
    ap.add_argument("--summarize-source", metavar="CSV")
    ap.add_argument("--summarize-raw", metavar="CSV")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.summarize_source or args.summarize_raw:
        if args.summarize_raw:
            sys.stdout.write(summarize_raw(args.summarize_raw))
        if args.summarize_source:
            sys.stdout.write(summarize_source(args.summarize_source, args.top))
        return 0
    if not args.family:
        ap.error("--family is needed (or --summarize-source / --summarize-raw)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
