# Device call (issue 32): whether kimi_delta's `kda_qkt_cold` "split" (v53) runs clean on the GPU and is worth
# adopting. v51-v52's hot launch (SPLIT 1) faulted on an H100 ("Out-of-range shared or local address" at the
# `_dot` of its chunk tier, kda_chunk_bwd_qkt_kernel+0x64b0): ptxas 12.8 (triton 3.6's) built the K steps of
# that tier's fourth wgmma with B descriptors from the shared base register (stride 16896 B for 512; sm_90
# SASS read back by tests/kernel_tests/sass_hgmma.py). v53 runs the hot launch's chunk tier by its own
# `_kda_qkt_chunk_dots` (the same values, the dots reordered), whose triton 3.6 builds check clean on the CPU.
# What it decides, in order (each step runs whatever the one before gave):
#  1. memcheck: compute-sanitizer over one fwd+bwd step of the split row at B1 T8192 H32 D128 (HV = HK):
#     "ERROR SUMMARY: 0 errors" or where it faults still (the kernel, the launch, the line);
#  2. the GPU bars of the split rows: test_bf16_vs_fp32_on_gpu_qkt_cold_sweep (both bench rows) and
#     test_qkt_split_cold_tiles_on_gpu (HV = HK and grouped, the cold launch at work: within 5e-3 of
#     "ksplit"'s one launch, bf16 and fp32), and test_qkt_cold_split_equals_inline's cases on the GPU;
#  3. the bench: `ours` (the default, "ksplit" inline), `ours_fwd`, and the split row, fwd+bwd ms in one run;
#  4. the descriptors of every kda_chunk_bwd_qkt_kernel cubin steps 1-3 built (this run's own Triton cache:
#     the device's triton and ptxas): 0 flagged, or the build the device's ptxas still gets wrong.
# "split" becomes the k_le_128 bucket's default only when 1, 2 and 4 pass and 3 is faster (the lead re-runs it).
# Self-contained: sources setup.sh. Carry .whl:
#   BUDGET=200 bash .ci/h200/kda_split_check.sh       (~150-200 s with setup, an H100 will do)
# Outputs under $OUT: env.txt, kda_split.txt (every step's tail), memcheck.txt, bars.txt, bench.txt.
# Budget: memcheck <= 75 s, bars <= 70 s, bench <= 60 s, descriptors <= 30 s, each cut to what is left.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
S=$O/kda_split.txt; : > "$S"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s" | tee -a "$S"; }
left() { local l=$(( ${BUDGET:-200} - 5 - $(date +%s) + t0 )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
ROW='ours@kda_qk=ksplit+kda_qkt_cold=split'
export TRITON_CACHE_DIR=$(mktemp -d /tmp/kda_split_cache.XXXXXX)   # this run's builds only (step 4)

stamp "1. memcheck of $ROW"
CUDA_LAUNCH_BLOCKING=1 timeout "$(left 75)" compute-sanitizer --tool memcheck --print-limit 20 \
  python3 .ci/h200/ncu_step.py --family kimi_delta --case '^B1T8192' --row "$ROW" --steps 1 > "$O/memcheck.txt" 2>&1
echo "rc=$?" >> "$O/memcheck.txt"
grep -E "ERROR SUMMARY|Out-of-range|Invalid|at .*kda_chunk|in chunk.py|by thread|rc=" "$O/memcheck.txt" | head -20 | tee -a "$S"

stamp "2. GPU bars of the split rows"
timeout "$(left 70)" python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_kimi_delta.py \
  -m "not slow" -k "qkt_cold or qkt_split" > "$O/bars.txt" 2>&1
echo "rc=$?" >> "$O/bars.txt"
grep -E "passed|failed|FAILED|Error" "$O/bars.txt" | tail -12 | tee -a "$S"

stamp "3. bench"
timeout "$(left 60)" onboard bench --family kimi_delta --case B1T8192H32D128 --impl "ours,ours_fwd,$ROW" \
  > "$O/bench.txt" 2>&1
echo "rc=$?" >> "$O/bench.txt"
tail -25 "$O/bench.txt" | tee -a "$S"
stamp "4. wgmma descriptors of this run's qkt builds (steps 1-3)"
timeout "$(left 30)" python3 tests/kernel_tests/sass_hgmma.py "$TRITON_CACHE_DIR" kda_chunk_bwd_qkt_kernel 2>&1 \
  | tee -a "$S" | tail -20

stamp "done"
rm -rf "$TRITON_CACHE_DIR"
