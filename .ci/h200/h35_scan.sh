# H200: issue 35's selective_scan (template v3, helper h35): the GPU tests (bf16 bars in both
# tile orders) and the bench of the Mamba-2.8B layout, the default beside template v2's default
# and the other configs (rows ours@...), profiled. Expected ~150 s (tests ~60, bench ~90).
#   source .ci/h200/setup.sh && bash .ci/h200/h35_scan.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp scan-tests
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_selective_scan.py -rxX \
  --durations=8 2>&1 | tail -20
stamp scan-bench
# ours, ours_fwd, ours@... (v2's default: ours@fwd_order=dnt,bwd_order=dnt,BLOCK_T=32,...), the
# torch token loop's forward; not its fwd+bwd (seconds a call) nor the compile case
timeout 115 onboard bench --family selective_scan --case '^B1T4096D5120N16$' \
  --impl ours,ours_fwd,eager_fwd --profile --out "$O/h35_scan.json" 2>&1 | tail -70
stamp end
