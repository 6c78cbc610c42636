# H200 call D (nineteenth session): issue 27's gate re-run (h27_gate.sh, ~3 min), the AOT build's
# specialisation on triton 3.6 (aot_specialize.sh, < 100 s), and the ssd / selective_scan kernel
# tests with their bf16 bars on the GPU (not run there since templates v6 / v3).
#   source .ci/h200/setup.sh && bash .ci/h200/call_d.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp h27; bash .ci/h200/h27_gate.sh 2>&1 | tee "$O/h27.txt" | tail -30
stamp aot; bash .ci/h200/aot_specialize.sh 2>&1 | tee "$O/aot.txt" | tail -20
stamp ssd-tests
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py -m "not slow" -rxXs \
  --durations=5 2>&1 | tee "$O/ssd_tests.txt" | tail -12
stamp scan-tests
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_selective_scan.py -rxXs \
  --durations=5 2>&1 | tee "$O/scan_tests.txt" | tail -12
stamp end
