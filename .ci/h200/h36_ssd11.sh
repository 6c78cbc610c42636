# Device call for issue 35 (H200, or an H100: the last calls got one), ssd template v21 toward
# fwd+bwd <= 3x the forward at B1 T8192 H128 P64 G8 N128 bf16. The thirty-sixth session's call 1
# (H100, triton 3.6, h35_ssd10.sh at 047b72b, CUDA graph) made "paired" at 8 warps uncapped with
# `bwd_sums` "kernel" the P <= 64 default: fwd+bwd 1.732 ms, forward 0.470 (3.69x; 3x is about
# 1.41). Its profile (P8, host sums): ssd_bwd_split_fused_kernel 0.963 ms, the fused pull 0.234.
# v21 adds `split_dbc` "triple" (the dC / dB program split in two: dC with the block pairs' terms,
# dB forming M again; three programs per chunk and group): no spills at 8 warps on triton 3.6 (36
# bytes under "paired"), 133 KB of shared memory (173), fewer barriers in the dC / dB loops (24
# and 13 against 31), 1.5x the programs; and PULL_N, the backward's pull over state tiles of 32
# or 16 columns (512 or 1024 programs; the forward keeps STATE_N 64). Expected by arithmetic only;
# nothing of v21 is timed.
# Self-contained: sources setup.sh. Carry .whl:
#   BUDGET=260 bash .ci/h200/h36_ssd11.sh        (~290 s with setup; steps 1-2, then 3 if time is left)
#   SSD11_DRY=1 TRITON_INTERPRET=1 bash .ci/h200/h36_ssd11.sh   (step 3 on the CPU at a tiny shape)
# Within ${BUDGET:-260} s after setup (~30 s), 20 s of them kept in reserve:
#  1. (<= 100 s) the bf16-vs-fp32 bars with --runxfail: test_bf16_vs_fp32_on_gpu [default] (now
#     "paired" with `bwd_sums` "kernel"), [v21-triple-w8], [v21-triple-w16], [v21-pull32],
#     [v21-pull16], [v20-two] (PASSED is within the bars; a FAILED row prints its errors)
#     -> ssd_bars.txt;
#  2. (<= 95 s) the bench, `--impl ours,ours_fwd --profile`: ours, ours_fwd (each with its
#     per-kernel breakdown: the default's, with no reduce_kernel left by `bwd_sums` "kernel"), then
#     bench.py's SWEEP in its order: "triple" at 8 warps, at 16 warps, PULL_N 32, 16, v20's
#     default ("two" capped at 128, host sums) -> ssd_bench.txt (rows printed as they finish: a cut keeps the
#     first), ssd.json;
#  3. (only when >= 30 s are left; its builds are step 2's) per-kernel GPU ms (torch.profiler, 5
#     steps) of fwd+bwd at "triple", 8 warps, then at PULL_N 32 -> ssd_profile.txt.
# How to decide (graph ms: the `graph` column, ssd.json "graph_ms"):
#  - the goal: fwd+bwd <= 3 x ours_fwd by graph. A "triple" row faster than `ours` in this run (by
#    more than the ~6% row-to-row spread) whose bars row PASSED can become the P <= 64 bucket's
#    `split_dbc` (family.py shape_buckets; with bwd_split_warps 16 where that row wins); likewise
#    a PULL_N row (the bucket's PULL_N).
#  - ssd_profile.txt against step 2's breakdown of `ours`: ssd_bwd_split_fused_kernel (x1: the
#    three programs' launch) against the default's 0.963 ms ("paired"); ssd_split_fused_pull_kernel
#    at PULL_N 32 against the default's 0.234; the other kernels the same.
# Outputs under $OUT: env.txt, ssd_bars.txt, ssd_bench.txt, ssd.json, ssd_profile.txt, ssd11.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
if [ "${SSD11_DRY:-0}" != 1 ]; then
  OUT=$O source .ci/h200/setup.sh || exit 1
fi
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-260} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/ssd11.tgz" -C "$O" $(cd "$O" && ls | grep -v '^ssd11.tgz$') 2>/dev/null; }
trap pack EXIT
if [ "${SSD11_DRY:-0}" != 1 ]; then
  stamp ssd-bars
  timeout "$(left 100)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py --runxfail \
    -k "bf16_vs_fp32_on_gpu and (default or v21 or v20-two)" -rfs 2>&1 | tee "$O/ssd_bars.txt" \
    | grep -E "PASSED|FAILED|ERROR|relative RMS|passed|failed"
  stamp ssd-bench
  # rows print as they come (Python unbuffered, grep line-buffered), blank lines dropped
  PYTHONUNBUFFERED=1 timeout "$(left 95)" onboard bench --family ssd --case '^B1T8192H128' \
    --impl ours,ours_fwd --profile --out "$O/ssd.json" 2>&1 | grep --line-buffered -v "^\s*$" \
    | tee "$O/ssd_bench.txt"
fi
stamp ssd-profile
if [ "${SSD11_DRY:-0}" = 1 ] || [ "$(left 1000)" -ge 30 ]; then
  timeout "$(left 1000)" python3 - <<'PY' 2>&1 | tee "$O/ssd_profile.txt"
# per-kernel GPU ms (torch.profiler CUDA activity, 5 steps after 3 warm-up ones, every kernel)
import os
import torch
from onboarding.bench.cases import config_sweep
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("ssd").bench
dry = os.environ.get("SSD11_DRY") == "1"
dev = torch.device("cpu" if dry else "cuda")
shape = (1, 300, 4, 16, 2, 16) if dry else bench.SHAPES[0][:6]
sets = [bench.make_inputs(*shape, dev, seed=s) for s in range(2)]
grads = [torch.randn(*shape[:4], device=dev, dtype=torch.bfloat16)]
mod, ours = bench._ours()
steps = config_sweep(mod, ours, sets, grads, shape[3], [bench.TRIPLE, {"PULL_N": 32}])



for name, step in steps.items():
    print(f"{name} (forward + backward)", flush=True)
    try:
        rows = (step(0), [])[1] if dry else kernel_breakdown(step, top=40)
    except Exception as exc:  # noqa: BLE001 - the other rows stand
        print(f"  failed: {type(exc).__name__}: {str(exc)[:300]}")
        continue
    for r in rows:
        print(f"  {r['kernel'][:70]:70s} {r['ms']:.3f} ms x{r['calls']:g}")
    print(f"  total {sum(r['ms'] for r in rows):.3f} ms", flush=True)
PY
else
  echo "step 3 skipped: $(left 1000) s left" | tee "$O/ssd_profile.txt"
fi
stamp end
