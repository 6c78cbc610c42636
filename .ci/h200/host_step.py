"""Is a bench row's wall time its kernels' time or its host's? One family's bench case, row by row.

`onboard bench` reports two clocks per row: wall (each step timed with a synchronize, median over
interleaved rounds) and graph (the step captured in a CUDA graph and replayed: kernels only). When a
row's wall is well above its graph time, either the launches leave gaps (the host cannot enqueue the
step's kernels as fast as the GPU runs them) or the synchronize costs; then a kernel change shows in
graph time and not in wall. This script separates the two for the rows named, on the same inputs the
bench times:

- host ms: the Python + launch time to enqueue one step, `--steps` steps issued back to back with no
  synchronize (the CUDA launch queue holds them), divided by the steps;
- gpu ms: CUDA events around those same steps (the GPU's time to drain them, gaps included);
- wall ms: the median of `--steps` single steps, each followed by a synchronize (what `onboard bench`'s
  wall column measures).

A row with host ms >= gpu ms is host-bound: its wall follows the host, and a faster kernel does not
show there. Rows run interleaved, round by round, so drift hits every row alike.

    python3 .ci/h200/host_step.py --family ssd --case '^B1T8192H128' \\
        --impl 'ours,ours@PULL_P=32,pull_scale=dy' --steps 20 --rounds 5
    TRITON_INTERPRET=1 python3 .ci/h200/host_step.py --cpu --family ssd --impl ours --steps 2 --rounds 1
        (a tiny case of the same bucket on the CPU: the script's own check, no meaning as a timing)

`--cprofile N`: then N more steps of the first row under cProfile, enqueued with no synchronize, and
the functions with the most own time and the most cumulative time (where the host's ms go: our
wrappers, torch's dispatch and autograd, Triton's launcher), `--top` rows each.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

from ncu_step import pick_case  # the same case picking (and tiny CPU cases) as the Nsight Compute driver


def measure(step, steps: int, cuda: bool, torch) -> tuple[float, float, float]:
    """(host ms, gpu ms, wall ms) per step: `steps` steps enqueued back to back, then `steps` synced."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    for i in range(steps):
        step(i)
    host = 1e3 * (time.perf_counter() - t) / steps
    if cuda:
        end.record()
    sync()
    gpu = start.elapsed_time(end) / steps if cuda else float("nan")
    walls = []
    for i in range(steps):
        t = time.perf_counter()
        step(i)
        sync()
        walls.append(1e3 * (time.perf_counter() - t))
    return host, gpu, statistics.median(walls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True)
    ap.add_argument("--case", default=None, help="a bench case name or anchored pattern (the first match runs)")
    ap.add_argument("--impl", default="ours", help="rows, as `onboard bench --impl` takes them")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="a tiny case on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="N steps of the first row under cProfile")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    import torch

    from onboarding.bench.cases import split_impls

    impls = split_impls(args.impl)
    device = torch.device("cpu" if args.cpu else "cuda")
    case = pick_case(args.family, args.case, impls, args.cpu)
    steps = case.setup(device)
    missing = [r for r in impls if r not in steps]
    if missing:
        print(f"{case.name}: no row {missing}; rows {sorted(steps)}", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    for r in impls:  # compile and warm every row first
        for i in range(2):
            steps[r](i)
    if cuda:
        torch.cuda.synchronize()
    got: dict[str, list[tuple[float, float, float]]] = {r: [] for r in impls}
    for _ in range(args.rounds):
        for r in impls:
            got[r].append(measure(steps[r], args.steps, cuda, torch))
    print(f"{args.family}/{case.name} on {torch.cuda.get_device_name(0) if cuda else 'cpu'}: per step, "
          f"median over {args.rounds} rounds of {args.steps} steps")
    print(f"{'row':48s} {'host ms':>9s} {'gpu ms':>9s} {'wall ms':>9s}  bound")
    for r in impls:
        host, gpu, wall = (statistics.median(x[k] for x in got[r]) for k in range(3))
        bound = "-" if not cuda else ("host" if host >= 0.9 * gpu else "gpu")
        print(f"{r:48s} {host:9.3f} {gpu:9.3f} {wall:9.3f}  {bound}")
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.cprofile):
            steps[impls[0]](i)
        prof.disable()
        if cuda:
            torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
            print(f"--- {impls[0]}: {args.cprofile} steps under cProfile, by {key}")
            print(out.getvalue().split("\n", 4)[-1] if "function calls" in out.getvalue() else out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
