# Device call L (twenty-first session), the working tree, in issue order within one budget
# (${BUDGET:-480} s): issue 34's stage dump of our gated-delta forward on the proxy's worst slices
# (gdn_stages.py, .dev/gdn_slices.pt from call K), issue 32's benches against fla in the same run
# (KDA with the tiled backward now the default; GDN after the backward's Tm^T load), then issue
# 35's ssd v8 step list (h35_ssd3.sh, with what time is left).
#   bash .ci/h200/call_l.sh      (carry .whl, .whl_fla, .anchors, .dev)
# At most 8 files come back: the logs and JSON go to /tmp/l and then as one $OUT/call_l.tgz.
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/l; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-480} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
stamp gdn-stages
OUT=$D timeout 60 python3 .ci/h200/gdn_stages.py 2 > "$O/gdn_stages.txt" 2>&1; tail -8 "$O/gdn_stages.txt"
stamp kda-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 150 onboard bench --family kimi_delta --case B1T8192H32D128 \
  --case B1T32768H32D128 --impl ours,ours_fwd,fla_fwd --profile --out "$O/kda.json" 2>&1 \
  | grep -v "^\s*$" > "$O/kda_bench.txt"; grep -A12 "^case " "$O/kda_bench.txt"
stamp gdn-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout "$(left 90)" onboard bench --family gated_delta --case B1T8192 \
  --case B1T32768 --impl ours,ours_fwd,fla_fwd --out "$O/gdn.json" 2>&1 | grep -v "^\s*$" > "$O/gdn_bench.txt"
grep -A10 "^case " "$O/gdn_bench.txt"
stamp ssd
l=$(left 240); [ "$l" -gt 90 ] && OUT=$O timeout "$l" bash .ci/h200/h35_ssd3.sh > "$O/ssd.txt" 2>&1; tail -40 "$O/ssd.txt"
stamp end
tar czf "$D/call_l.tgz" -C "$O" .
