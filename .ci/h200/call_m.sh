# Device call M (twenty-second session), the working tree, within one budget (${BUDGET:-420} s):
# issue 34's stage dump of our gated-delta forward on the proxy's worst slice, with the hybrids
# that take w or u from the tm_dot=tf32 run (gdn_stages.py, .dev/gdn_slices.pt), then issue 35's
# ssd with the backward's 128-register cap now the P <= 64 default: the GPU bars ([default] and
# [tf32-fp32-state]) and the headline bench against mamba-ssm (the sweep's ours@bwd_maxnreg=0 row
# is the former default).
#   bash .ci/h200/call_m.sh      (carry .whl, .anchors, .dev)
# At most 8 files come back: the logs and JSON go to /tmp/m and then as one $OUT/call_m.tgz.
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/m; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-420} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
stamp gdn-stages
OUT=$D timeout 90 python3 .ci/h200/gdn_stages.py 1 > "$O/gdn_stages.txt" 2>&1; tail -8 "$O/gdn_stages.txt"
stamp ssd-bars
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
export PYTHONPATH=$PYTHONPATH:/tmp/site_anchor
timeout "$(left 120)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py \
  -k "bf16_vs_fp32_on_gpu and (default or tf32)" -rxXs 2>&1 | tee "$O/ssd_bars.txt" | tail -8
stamp ssd-bench
ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors timeout "$(left 150)" onboard bench --family ssd --case '^B1T8192H128' \
  --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --out "$O/ssd.json" 2>&1 | grep -v "^\s*$" > "$O/ssd_bench.txt"
grep -A24 "^case " "$O/ssd_bench.txt"
stamp end
tar czf "$D/call_m.tgz" -C "$O" .
