# Device call N (twenty-second session): issue 34's WY-product check (gdn_wfix.py: our prepare
# kernel's w against float64 under slow decays, per config and variant, K 64 and 128), then the
# bf16 GPU bars of gated_delta and kimi_delta with the new slow-decay K=64 case, and, when
# `prep_bk` 64 gave a right w at both K=64 layouts, the K=64 bars again with it as the k_le_64
# bucket's value (edited in this call's copy of the tree only).
#   bash .ci/h200/call_n.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/n; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
bars() {
  timeout "$1" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_gated_delta.py \
    tests/kernel_tests/test_kimi_delta.py -k "bf16_vs_fp32_on_gpu and not sweep $2" -rxXs 2>&1 \
    | tee "$O/bars$3.txt" | grep -E "PASS|FAIL|over the bar|passed|failed" | cut -c1-700
}
stamp gdn-wfix
OUT=$D timeout 150 python3 .ci/h200/gdn_wfix.py 2>&1 | tee "$O/gdn_wfix.txt"
stamp bars
bars 150 "" ""
if [ "$(grep -c "K64 src {'prep_bk': 64}: w rel [0-9.]*e-0[3-9]" "$O/gdn_wfix.txt")" = 2 ]; then
  stamp bars-prep-bk-64
  sed -i 's/"num_stages": 1, "state_bwd_stages": 2}),/"num_stages": 1, "state_bwd_stages": 2, "prep_bk": 64}),/' \
    kernel_templates/gated_delta/family.py
  grep -n '"prep_bk": 64}' kernel_templates/gated_delta/family.py
  bars 120 "and k64" "_prep_bk64"
fi
stamp end
tar czf "$D/call_n.tgz" -C "$O" .
