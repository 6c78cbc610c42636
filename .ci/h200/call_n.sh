# Device call N (twenty-second session): issue 34's WY-product check (gdn_wfix.py: our prepare
# kernel's w against float64 under slow decays, per config and variant, K 64 and 128), then the
# bf16 GPU bars of gated_delta and kimi_delta with the new slow-decay K=64 case.
#   bash .ci/h200/call_n.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/n; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp gdn-wfix
OUT=$D timeout 150 python3 .ci/h200/gdn_wfix.py 2>&1 | tee "$O/gdn_wfix.txt"
stamp bars
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_gated_delta.py \
  tests/kernel_tests/test_kimi_delta.py -k "bf16_vs_fp32_on_gpu and not sweep" -rxXs 2>&1 \
  | tee "$O/bars.txt" | grep -E "PASS|FAIL|Error|over the bar|passed|failed" | cut -c1-600
stamp end
tar czf "$D/call_n.tgz" -C "$O" .
