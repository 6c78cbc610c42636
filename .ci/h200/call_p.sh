# Device call P (twenty-second session): issue 34's K <= 64 fix as the tree has it. The bf16 GPU
# bars of gated_delta and kimi_delta (both cases, and KDA's backward sweep at the mixed K=128 case),
# each family in its own pytest process (a fault poisons the process), then the proxy's worst
# slice alone (gdn_stages.py: o against the fp32 torch path; the hybrids with w or u from the
# tm_dot=tf32 run), then the proxy's call shape forward + backward (gdn_k64.py B8 T2048, render),
# then, with what is left of ${BUDGET:-560} s, issue 34's proxy training step (h34_gdn.sh: are all
# the GDN patches accepted now?).
#   bash .ci/h200/call_p.sh      (carry .whl, .dev)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/p; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-560} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
for f in gated_delta kimi_delta; do
  stamp "bars $f"
  timeout 150 python3 -m pytest -v -p no:cacheprovider "tests/kernel_tests/test_$f.py" -k "bf16_vs_fp32_on_gpu" -rxXs \
    2>&1 | tee "$O/bars_$f.txt" | grep -E "PASS|FAIL|over the bar|passed|failed|_kernel\[" | cut -c1-700
done
stamp gdn-stages
OUT=$O timeout 60 python3 .ci/h200/gdn_stages.py 1 2>&1 | tee "$O/gdn_stages.txt" | tail -8
stamp gdn-k64
timeout 60 python3 .ci/h200/gdn_k64.py 8 2048 render 2>&1 | tee "$O/gdn_k64.txt" | grep -E "^(ok|FAIL)|Error" | head
l=$(left 260); if [ "$l" -gt 150 ]; then stamp h34-gdn; TRAIN_TIMEOUT=$l OUT=$O bash .ci/h200/h34_gdn.sh; fi
stamp end
rm -f "$O/gdn_stages.pt"
tar czf "$D/call_p.tgz" -C "$O" .
