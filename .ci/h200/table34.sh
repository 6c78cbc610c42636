# Device call (issue 34's must-show): the issue's table in ONE call, both proxies, ours and
# transformers + PEFT side by side (--baseline), the issue's own commands (--steps 8, no profiler),
# without fla and with fla-core 0.6 on the path of both roles (the tool must choose the
# linear-attention path itself and say so). Numbers: medians over steps 2-8 as the report takes them.
#   bash .ci/h200/table34.sh        (carry .whl, .whl_fla; ONLY=next or ONLY=moe: one proxy)
# FLA: "both" (default: the runs without fla, then with, on one GPU), "0" or "1" (one of them).
# EXTRA: options added to every run (e.g. EXTRA="--init-device device": the weights made on the GPU,
# each role's set-up line shows what that saves).
# GPUS=2 (on nvidia-h200-x2): the runs without fla on GPU 0 and those with fla on GPU 1 at the same
# time (32 host cores for two processes; one shared Triton cache). On one GPU of a fresh machine the
# 600 s of a call do not hold the four runs: the first Qwen3-Next run's Triton compiles alone took
# over 170 s there (twenty-sixth session, call B); two GPUs halve the wall time.
# Outputs under $OUT: table34.tgz (each run's log and jsonl, no weights) and table34.txt (the rows).
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/t34; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-540} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
source .ci/h200/proxies.sh
COMMON="$WIDTHS --nproc 1 --steps 8 --seq 2048 --micro-batch 8 --dtype bf16 --baseline ${EXTRA:-}"
run() {  # name model extra (the run's cap: what is left, at most CAP s)
  local t; t=$(left "${CAP:-200}"); [ "$t" -lt 60 ] && { echo "skip $1: $t s left" | tee -a "$O/$1.txt"; return; }
  stamp "$1"
  timeout "$t" onboard train "$2" --proxy none $COMMON $3 --out "$O/$1" > "$O/$1.log" 2>&1
  echo "$1 exit $?" >> "$O/$1.txt"
  grep -E "kernel packages|^set-up|^(run|reference|baseline) " "$O/$1.log" "$O/$1"/train/*.log 2>/dev/null \
    | sed "s|^$O/||" >> "$O/$1.txt"
  python3 .ci/h200/run_summary.py "$O/$1" 2>/dev/null | grep -E "^kernels|step s" | cut -c1-400 >> "$O/$1.txt"
  cat "$O/$1.txt"
}
has() { case ",${ONLY:-next,moe}," in *,$1,*) return 0;; esac; return 1; }
without() { has next && run next hf:qwen3_next "$NEXT"; has moe && run moe hf:qwen3_moe "$MOE"; }
with() {
  [ -n "$FLA_SITE" ] || { echo "fla not carried (.whl_fla): the rows with fla are missing" | tee "$O/fla.txt"; return; }
  export PYTHONPATH=$FLA_SITE:$PYTHONPATH
  python3 -c "import fla; print('fla', fla.__version__, 'on the path')" | tee "$O/fla.txt"
  has next && run next_fla hf:qwen3_next "$NEXT"; has moe && run moe_fla hf:qwen3_moe "$MOE"
}
if [ "${GPUS:-1}" = 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0; without ) > "$O/gpu0.out" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=1; with ) > "$O/gpu1.out" 2>&1 &
  wait; cat "$O/gpu0.out" "$O/gpu1.out"
else
  case "${FLA:-both}" in 0) without;; 1) with;; *) without; with;; esac
fi
stamp end
cat "$O"/*.txt > "$D/table34.txt" 2>/dev/null
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/table34.tgz" -C "$O" .
