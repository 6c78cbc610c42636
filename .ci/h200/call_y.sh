# Device call Y (prepared in the twenty-fourth session, for the next one): the session's untimed
# training-step changes in one call, so one cold start serves both: first `ce24.sh` (the fused
# cross-entropy family's GPU tests and bench, < 120 s), then `call_w.sh` (the experts' pair-sum
# CUDA test and the Qwen3-Next proxy's row, ours only, step 6 profiled; ~330 s). The Next row has
# every change of the session in it (conv1d v3's backward tiles and time-major binding, the pair
# sums, the loss kernel): compare with call T (70,687 tok/s, 22.9% MFU).
#   bash .ci/h200/call_y.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/y; mkdir -p "$D" "$O/ce" "$O/w"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
OUT=$O/ce timeout 150 bash .ci/h200/ce24.sh 2>&1 | grep -v "^\(torch\|transformers\|peft\|optuna\|langgraph\|openai\|fla\) "
stamp call-w
OUT=$O/w BUDGET=$(( 560 - $(date +%s) + t0 )) bash .ci/h200/call_w.sh 2>&1 | grep -v "^\(torch\|transformers\|peft\|optuna\|langgraph\|openai\|fla\) "
stamp end
rm -f "$O/ce/ce24.tgz"
tar czf "$D/call_y.tgz" -C "$O" .
