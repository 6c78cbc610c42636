# Device call for issue 34's host overhead (helper-52; prepared on the CPU, not run): the
# Qwen3-Next-style 4B proxy of issue 34's table (.ci/h200/proxies.sh), ours only, --steps 6 with
# step 6 profiled, after the host pass (no gradient-norm host read inside the step, the norm and
# the clip as foreach ops, one pair order per MoE layer). Compare with call Y / call S: wall
# 236.3 / 303.1 ms, kernels 191.5 / 191.2 ms, host gaps 36.1 / 54.7 ms at step 6; 80,754 / 75,583
# tok/s. Then the same step at seq 4096 x micro-batch 1 with --recompute full (call X: 283 ms,
# host-bound), if the budget allows.
#   bash .ci/h200/host34.sh      (carry .whl; BUDGET seconds, default 200)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/h34; mkdir -p "$D" "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-200} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
OUT=$O source .ci/h200/setup.sh || exit 1
source .ci/h200/proxies.sh
run() {  # name extra timeout
  stamp "$1"
  [ "$3" -gt 20 ] || { echo "skipped (budget)"; return; }
  timeout "$3" onboard train hf:qwen3_next --proxy none $WIDTHS $NEXT --nproc 1 --steps 6 \
    --dtype bf16 --profile-every 6 $2 --out "$O/$1" > "$O/$1.log" 2>&1
  echo "exit $?"; grep -E "^error:|run failed" "$O/$1.log" | cut -c1-300
  python3 .ci/h200/run_summary.py "$O/$1"  # its profile line: wall, device busy, host gaps
}
run next16k "--seq 2048 --micro-batch 8" "$(left 170)"
run next4k "--seq 4096 --micro-batch 1 --recompute full" "$(left 120)"
stamp end
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/host34.tgz" -C "$O" .
