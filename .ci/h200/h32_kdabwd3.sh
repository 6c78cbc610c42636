# H200 call (issue 32, KDA template v35: fwd+bwd <= 3x the forward): the K-tiled chunk-local
# backward (`kda_qk` "ktiles": `kda_chunk_bwd_vside_kernel` per (chunk, value head), then
# `kda_chunk_bwd_ktile_kernel` per (K tile, chunk, value head); no fp32 dq/dk/dg partials between
# two kernels) against the tiled default, at the Kimi-Linear layout (B1 T8192 H32 K = V = 128 bf16):
# the four rows of kernel_templates/kimi_delta/bench.py's KTILES_SWEEP. Self-contained (sources
# setup.sh); carry .whl (fla is not asked for):
#   bash .ci/h200/h32_kdabwd3.sh
# Within ${BUDGET:-300} s (30 s kept for setup and packing), per-step limits:
#  1. the bf16-vs-fp32 GPU bars of the rows (`test_bf16_vs_fp32_on_gpu_ktiles_sweep`: o 5e-3, every
#     gradient 1e-2 relative RMS) (<= 90 s) -> kdabwd3_bars.txt. A fault (illegal memory access)
#     fails every later row of the same process: read the first failing row.
#  2. `onboard bench --family kimi_delta --case B1T8192H32D128 --impl ours,ours_fwd,<the KTILES_SWEEP
#     rows> --profile` (<= 110 s): wall and CUDA-graph ms, the check of `ours`, the default's
#     kernels -> kdabwd3_bench.txt, kdabwd3.json.
#  3. `KDA_ROWS=ktiles .ci/h200/h32_kdabwd_profile.py 8192` (<= 60 s): per config (the default, then
#     each ktiles row) the fwd+bwd wall median and the backward's kernels alone (torch.profiler, GPU
#     ms per step) -> kdabwd3_profile.txt, kdabwd3_profile.json.
# Read: row / `ours_fwd` (graph) against 3.0 and against `ours` / `ours_fwd` (the tiled default: 4.27x
# in the thirty-first session); in 3, `kda_chunk_bwd_vside_kernel` + `kda_chunk_bwd_ktile_kernel`
# against `kda_chunk_bwd_wyt_kernel` + `kda_chunk_bwd_qkt_kernel` (1.132 + 0.927 ms). A row is a
# default candidate only with its bars passed.
# Outputs under $OUT: env.txt, kdabwd3_bars.txt, kdabwd3_bench.txt, kdabwd3.json,
# kdabwd3_profile.txt, kdabwd3_profile.json, kdabwd3.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-300} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kdabwd3.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kdabwd3.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=$(python3 -c "from onboarding.families import family_module as f; from onboarding.bench.cases_linear_attention import sweep_label; print(','.join(sweep_label(c) for c in f('kimi_delta').bench.KTILES_SWEEP))")
echo "rows: $ROWS"
stamp kdabwd3-bars
timeout "$(left 90)" python3 -m pytest -v -p no:cacheprovider -rxXs \
  "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_ktiles_sweep" 2>&1 | tee "$O/kdabwd3_bars.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
stamp kdabwd3-bench
PYTHONUNBUFFERED=1 timeout "$(left 110)" onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl "ours,ours_fwd,$ROWS" --profile --out "$O/kdabwd3.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kdabwd3_bench.txt"
stamp kdabwd3-profile
KDA_ROWS=ktiles timeout "$(left 60)" python3 .ci/h200/h32_kdabwd_profile.py 8192 "$O/kdabwd3_profile.json" 2>&1 \
  | tee "$O/kdabwd3_profile.txt" | grep -v '^{'
stamp end
