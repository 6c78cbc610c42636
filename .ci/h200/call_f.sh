# H200 call F (nineteenth session): issue 32's KDA v18 (h32_kda.sh: GPU tests, bench against fla
# at T8192 and T32768, the fused-prepare and chunk-tier rows), then, in what is left of
# ${BUDGET:-540} s, issue 34's rejected gated-delta patch (h34_gdn.sh).
#   source .ci/h200/setup.sh && BUDGET=540 bash .ci/h200/call_f.sh     (carry .whl, .whl_fla)
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp kda; bash .ci/h200/h32_kda.sh 2>&1 | tail -70
left=$(( ${BUDGET:-540} - $(date +%s) + t0 - 20 ))
stamp "gdn (${left} s left)"
[ "$left" -gt 150 ] && TRAIN_TIMEOUT=$left bash .ci/h200/h34_gdn.sh 2>&1 | tail -30
stamp end
