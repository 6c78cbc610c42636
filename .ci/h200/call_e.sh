# H200 call E (nineteenth session): issue 27's gate after the block check's probe (h27_gate.sh),
# issue 35's ssd v7 (h35_ssd2.sh: bars, tests, bench with mamba-ssm) and selective_scan v4's
# nt backward (its whole test file and the bench). ~9 min.
#   source .ci/h200/setup.sh && bash .ci/h200/call_e.sh     (carry .whl, .anchors)
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp h27; bash .ci/h200/h27_gate.sh 2>&1 | tee "$O/h27.txt" | tail -14
stamp ssd; bash .ci/h200/h35_ssd2.sh 2>&1 | tail -60
T=tests/kernel_tests/test_selective_scan.py
stamp scan-tests
timeout 70 python3 -m pytest -q -p no:cacheprovider "$T" -rxXs --durations=5 2>&1 \
  | tee "$O/scan_tests.txt" | tail -12
stamp scan-bench
timeout 110 onboard bench --family selective_scan --case '^B1T4096D5120N16$' --impl ours,ours_fwd \
  --profile --out "$O/scan.json" 2>&1 | tee "$O/scan_bench.txt" | tail -45
stamp end
