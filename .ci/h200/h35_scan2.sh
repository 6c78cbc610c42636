# H200: issue 35's selective_scan template v4 (nineteenth session, helper): the "nt" backward
# (states as a loop, scans over time, relaxed atomics) against its alternatives. The GPU tests
# (bf16 bars in every order, the nt tiles first), then the bench of the Mamba-2.8B layout
# (B1 T4096 D5120 N16, bf16), profiled: ours (fwd+bwd, the nt default), ours_fwd and the three
# BWD_SWEEP rows (`--impl ours` keeps every ours@ row): ours@bwd_order=tdn (v3's backward with
# relaxed atomics), ours@bwd_maxnreg=128, ours@BWD_BLOCK_D=4,BWD_BLOCK_T=64. Goal: ours (fwd+bwd)
# <= 3x ours_fwd. Expected ~4 min (setup ~30 s, tests <= 2 min, bench ~90 s).
#   source .ci/h200/setup.sh && bash .ci/h200/h35_scan2.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
T=tests/kernel_tests/test_selective_scan.py
stamp scan-tests-new
timeout 45 python3 -m pytest -q -p no:cacheprovider "$T::test_bf16_against_fp32" \
  "$T::test_nt_chunks_and_channel_blocks" "$T::test_backward_refuses_states_of_another_spacing" \
  -rxXs --durations=5 2>&1 | tee "$O/scan_tests_new.txt" | tail -15
stamp scan-tests
timeout 75 python3 -m pytest -q -p no:cacheprovider "$T" -rxXs --durations=5 2>&1 \
  | tee "$O/scan_tests.txt" | tail -15
stamp scan-bench
timeout 120 onboard bench --family selective_scan --case '^B1T4096D5120N16$' --impl ours,ours_fwd \
  --profile --out "$O/scan.json" 2>&1 | tee "$O/scan_bench.txt" | tail -70
stamp end
