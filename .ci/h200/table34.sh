# Device call (issue 34's must-show): the issue's table in ONE call on a fresh machine, both proxies,
# ours and transformers + PEFT side by side (--baseline), the issue's own commands (--steps 8, no
# profiler), first without fla, then with fla-core 0.6 on the path of both roles (the tool must
# choose the linear-attention path itself and say so). Runs on a warm Triton cache after the first
# pair; the numbers are medians over steps 2-8 as the report takes them.
#   bash .ci/h200/table34.sh        (carry .whl and .whl_fla; ONLY=next or ONLY=moe: one proxy)
# On a fresh machine the 600 s of one call do not hold the four runs: the first Qwen3-Next run's
# Triton compiles alone took over 170 s there (twenty-sixth session, call B).
# Outputs under $OUT: table34.tgz (each run's log and jsonl, no weights) and table34.txt (the rows).
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/t34; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-570} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
source .ci/h200/proxies.sh
COMMON="$WIDTHS --nproc 1 --steps 8 --seq 2048 --micro-batch 8 --dtype bf16 --baseline"
run() {  # name model extra
  local t; t=$(left 170); [ "$t" -lt 60 ] && { echo "skip $1: $t s left"; return; }
  stamp "$1"
  timeout "$t" onboard train "$2" --proxy none $COMMON $3 --out "$O/$1" > "$O/$1.log" 2>&1
  echo "exit $?"; grep -E "kernel packages|^(run|reference|baseline) " "$O/$1.log" | tee -a "$O/table34.txt"
  python3 .ci/h200/run_summary.py "$O/$1" | grep -E "^kernels|step s" | cut -c1-400
}
echo "--- fla absent" >> "$O/table34.txt"
has() { case ",${ONLY:-next,moe}," in *,$1,*) return 0;; esac; return 1; }
has next && run next hf:qwen3_next "$NEXT"
has moe && run moe hf:qwen3_moe "$MOE"
if [ -n "$FLA_SITE" ]; then
  export PYTHONPATH=$FLA_SITE:$PYTHONPATH
  python3 -c "import fla; print('fla', fla.__version__, 'on the path')" | tee -a "$O/table34.txt"
  has next && run next_fla hf:qwen3_next "$NEXT"
  has moe && run moe_fla hf:qwen3_moe "$MOE"
else
  echo "fla not carried (.whl_fla): the rows with fla are missing" | tee -a "$O/table34.txt"
fi
stamp end
cat "$O/table34.txt" > "$D/table34.txt"
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/table34.tgz" -C "$O" .
