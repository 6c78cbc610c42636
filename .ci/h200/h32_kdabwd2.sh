# H200 call (issue 32, KDA template v29: fwd+bwd <= 3x the forward): the fused chunk-local backward
# (`kda_qk` "fused", `kda_chunk_bwd_fused_kernel`: the tiled pair's work in one kernel per (chunk,
# value head), the l2norm's row dots in closed form) and the reverse state pass with three prefetch
# stages, against the tiled default, at the Kimi-Linear layout (B1 H32 K = V = 128 bf16), T8192
# and T32768: the four rows of kernel_templates/kimi_delta/bench.py's BWD_SWEEP. Self-contained
# (sources setup.sh); carry .whl (fla is not asked for):
#   bash .ci/h200/h32_kdabwd2.sh
# Within ${BUDGET:-200} s (30 s kept for setup and packing), per-step limits:
#  1. `onboard bench --family kimi_delta --case B1T8192H32D128 --case B1T32768H32D128 --impl
#     ours,ours_fwd,<the BWD_SWEEP rows> --profile` (<= 95 s): wall and CUDA-graph ms, the check of
#     `ours` at T8192, the default's kernels -> kdabwd2_bench.txt (printed as it goes), kdabwd2.json.
#     First, so that the bars after it find the rows' bf16 kernels compiled.
#  2. the bf16-vs-fp32 GPU bars of the rows (`test_bf16_vs_fp32_on_gpu_bwd_sweep`: o 5e-3, every
#     gradient 1e-2 relative RMS; the fused rows first) (<= 75 s) -> kdabwd2_bars.txt;
#  3. `.ci/h200/h32_kdabwd_profile.py 8192` (<= 30 s): per config (default, then each row) the
#     fwd+bwd wall median and the backward's kernels alone (torch.profiler, GPU ms per step) ->
#     kdabwd2_profile.txt, kdabwd2_profile.json.
# Read: row / `ours_fwd` (wall and graph) at both lengths against 3.0 and against `ours` / `ours_fwd`
# (the tiled default: 3.67x at template v21); a row is a default candidate only with its bars passed.
# Outputs under $OUT: env.txt, kdabwd2_bench.txt, kdabwd2.json, kdabwd2_bars.txt,
# kdabwd2_profile.txt, kdabwd2_profile.json, kdabwd2.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-200} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kdabwd2.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kdabwd2.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=$(python3 -c "from onboarding.families import family_module as f; print(','.join(r for r in f('kimi_delta').bench.SWEEP_ROWS if not r.endswith('_fwd')))")
echo "rows: $ROWS"
stamp kdabwd2-bench
PYTHONUNBUFFERED=1 timeout "$(left 95)" onboard bench --family kimi_delta --case B1T8192H32D128 \
  --case B1T32768H32D128 --impl "ours,ours_fwd,$ROWS" --profile --out "$O/kdabwd2.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kdabwd2_bench.txt"
stamp kdabwd2-bars
timeout "$(left 75)" python3 -m pytest -v -p no:cacheprovider -rxXs \
  "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_bwd_sweep" 2>&1 | tee "$O/kdabwd2_bars.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
stamp kdabwd2-profile
timeout "$(left 30)" python3 .ci/h200/h32_kdabwd_profile.py 8192 "$O/kdabwd2_profile.json" 2>&1 \
  | tee "$O/kdabwd2_profile.txt" | grep -v '^{'
stamp end
