# NOT RUNNABLE since 0b4e2d4: it names kernel_templates/ssd/bench.py's PAIRED and FUSED (its config_sweep line),
# which that commit removed; the script is kept as the record of the run docs/LOG.md reports.
# Device call for issue 35 (H200), ssd template v19: `split_dbc` "paired" and "fused", the split
# backward's dx, dC and dB in one launch per (split chunk of 64, group), toward fwd+bwd <= 3x the
# forward (v18's default on an H100: 2.224 / 0.474 ms by CUDA graph, 4.7x, at B1 T8192 H128 P64 G8
# N128 bf16). Each head's x, dy, incoming state and end-state gradient come from HBM once (the
# split dx and dC / dB kernels read x and dy three times, the states twice: about 2.0 GB of HBM
# reads fall to about 0.84 GB, by count; helper-93's note in docs/LOG.md). "fused": one program
# per (chunk, group) does every term; "paired": two, next to each other in the grid (a dx program,
# a dC / dB program: fewer live registers, the second reading the inputs from L2). sm_90 builds,
# registers / spill bytes on triton 3.6 (this image's): "paired" 16 warps 128 / 132, 8 warps 255 /
# 16; "fused" 16 warps 128 / 556.
# Self-contained: sources setup.sh. Carry .whl:
#   BUDGET=280 bash .ci/h200/h35_ssd9.sh        (~310 s with setup; steps 1-2, then 3 if time is left)
#   SSD9_DRY=1 TRITON_INTERPRET=1 bash .ci/h200/h35_ssd9.sh   (step 3 on the CPU at a tiny shape)
# Within ${BUDGET:-280} s after setup (~30 s), 20 s of them kept in reserve:
#  1. (<= 110 s) the bf16-vs-fp32 bars with --runxfail: test_bf16_vs_fp32_on_gpu [default],
#     [v19-fused-w16], [v19-paired-w16], [v19-paired-w8] (PASSED is within the bars; a FAILED row
#     prints its errors; its compiles are the bench's too) -> ssd_bars.txt;
#  2. (<= 100 s) the bench, `--impl ours,ours_fwd --profile`: ours, ours_fwd (each with its
#     per-kernel breakdown), then kernel_templates/ssd/bench.py's SWEEP in its order, the three
#     v19 rows first ("paired" at 16 warps, "fused" at 16 warps, "paired" at 8 warps; forward +
#     backward only: the option leaves the forward as it is) -> ssd_bench.txt (rows printed as
#     they finish: a cut keeps the first), ssd.json (only if the case finishes);
#  3. (only when >= 40 s are left) per-kernel GPU ms (torch.profiler, 5 steps) of fwd+bwd: the
#     default, "paired" and "fused" at 16 warps -> ssd_profile.txt.
# How to decide (graph ms: the `graph` column, ssd.json "graph_ms"):
#  - the goal: fwd+bwd <= 3 x ours_fwd by graph (about 1.42 ms at v18's forward). A v19 row
#    faster than `ours` in this run whose bars row PASSED can become the P <= 64 bucket's value
#    (family.py shape_buckets: its row's keys: split_dbc, bwd_split_warps, bwd_split_maxnreg).
#  - ssd_profile.txt: under "paired" / "fused" expect ssd_bwd_split_fused_kernel x1 in place of
#    the default's ssd_bwd_split_dx_kernel x1 and ssd_bwd_split_dbc_kernel x2; by arithmetic it
#    should take less than their sum (one launch, about 0.84 GB of HBM reads against about 2.0
#    GB). "fused" slower than "paired": its spills; both slower than the default: the loop over
#    the group's 16 heads is latency-bound (1024 or 2048 programs, one per SM at 16 warps).
# Outputs under $OUT: env.txt, ssd_bars.txt, ssd_bench.txt, ssd.json, ssd_profile.txt, ssd9.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
if [ "${SSD9_DRY:-0}" != 1 ]; then
  OUT=$O source .ci/h200/setup.sh || exit 1
fi
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-280} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/ssd9.tgz" -C "$O" $(cd "$O" && ls | grep -v '^ssd9.tgz$') 2>/dev/null; }
trap pack EXIT
if [ "${SSD9_DRY:-0}" != 1 ]; then
  stamp ssd-bars
  timeout "$(left 110)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py --runxfail \
    -k "bf16_vs_fp32_on_gpu and (default or v19)" -rfs 2>&1 | tee "$O/ssd_bars.txt" \
    | grep -E "PASSED|FAILED|ERROR|relative RMS|passed|failed"
  stamp ssd-bench
  # rows print as they come (Python unbuffered, grep line-buffered), blank lines dropped
  PYTHONUNBUFFERED=1 timeout "$(left 100)" onboard bench --family ssd --case '^B1T8192H128' \
    --impl ours,ours_fwd --profile --out "$O/ssd.json" 2>&1 | grep --line-buffered -v "^\s*$" \
    | tee "$O/ssd_bench.txt"
fi
stamp ssd-profile
if [ "${SSD9_DRY:-0}" = 1 ] || [ "$(left 1000)" -ge 40 ]; then
  timeout "$(left 1000)" python3 - <<'PY' 2>&1 | tee "$O/ssd_profile.txt"
# per-kernel GPU ms (torch.profiler CUDA activity, 5 steps after 3 warm-up ones, every kernel)
import os
import torch
from onboarding.bench.cases import config_sweep, fwd_bwd
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("ssd").bench
dry = os.environ.get("SSD9_DRY") == "1"
dev = torch.device("cpu" if dry else "cuda")
shape = (1, 300, 4, 16, 2, 16) if dry else bench.SHAPES[0][:6]
sets = [bench.make_inputs(*shape, dev, seed=s) for s in range(2)]
grads = [torch.randn(*shape[:4], device=dev, dtype=torch.bfloat16)]
mod, ours = bench._ours()
steps = {"ours (default)": fwd_bwd(ours, sets, grads)}
steps.update(config_sweep(mod, ours, sets, grads, shape[3], [bench.PAIRED, bench.FUSED]))



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
