# Source from a device script, then call `begin` (OUT defaults to /tmp/out, T0 = now, the card's name to
# $OUT/gpu.txt, .ci/h200/setup.sh sourced; non-zero when set-up fails). `step NAME TIMEOUT COMMAND...` runs COMMAND
# with its timeout shrunk to what is left of ${LIMIT} (10 s kept), writes $OUT/NAME.log, appends
# "NAME rc N +S s" to $OUT/summary.txt and prints the log's lines matching $STEP_GREP (bench rows,
# ratios, pytest's summary); a step with under 30 s left is skipped and says so.
STEP_GREP=${STEP_GREP:-"^[a-z_]+/|ratio|passed|failed"}
begin() {
  OUT=${OUT:-/tmp/out}
  T0=$(date +%s)
  nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
  source .ci/h200/setup.sh > /dev/null
}
step() {
  local name=$1 t=$2; shift 2
  local left=$(( ${LIMIT:-540} - $(date +%s) + T0 - 10 ))
  [ $left -lt $t ] && t=$left
  [ $t -lt 30 ] && { echo "$name: skipped, ${left} s left" | tee -a $OUT/summary.txt; return; }
  timeout $t "$@" > $OUT/$name.log 2>&1
  echo "$name rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
  grep -vE "falling back|^\s*$" $OUT/$name.log | grep -E "$STEP_GREP" | tail -40
}
