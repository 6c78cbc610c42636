# Device call V (twenty-fourth session): what call T's budget cut. The Qwen3-MoE-style proxy's row
# of issue 34's table (call_s.sh ONLY=moe: ours and transformers + PEFT, steps 6, step 6
# profiled), the conv1d backward's tile sweep at the Qwen3-Next proxy's conv shape (B8 T2048 C4096
# W4: `ours@` rows from the bench's BWD_SWEEP), then resume after a kill on the H200
# (call_u.sh PARTS=resume).
#   bash .ci/h200/call_v.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/v; mkdir -p "$D" "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
OUT=$O/s ONLY=moe BUDGET=270 bash .ci/h200/call_s.sh 2>&1 | grep -v "^\(torch\|transformers\|peft\|optuna\|langgraph\|openai\|fla\) "
stamp conv-sweep
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 100 onboard bench --family conv1d --case 'B8T2048C4096W4$' --impl ours,eager,compile \
  --out "$O/conv.json" > "$O/conv.log" 2>&1; echo "bench exit $?"; grep -v "^\s*$" "$O/conv.log" | tail -16 | cut -c1-200
stamp resume
OUT=$O/u PARTS=resume timeout $(( 555 - $(date +%s) + t0 )) bash .ci/h200/call_u.sh 2>&1 | grep -v "^\(torch\|transformers\|peft\|optuna\|langgraph\|openai\|fla\) "
stamp end
tar czf "$D/call_v.tgz" -C "$O" .
