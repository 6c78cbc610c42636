# Device call S (twenty-third session): issue 34's table on a fresh machine, both proxies, ours and
# transformers + PEFT side by side in one run each (--baseline), the issue's own commands with
# --steps 6 and a profiled step 6 (train/profile_<role>_step6.json: time per kernel and block kind).
# fla is not installed here unless WITH_FLA=1 (then fla-core 0.6 from .whl_fla goes on the path of
# both roles: the tool must choose the linear-attention path itself and say so).
#   bash .ci/h200/call_s.sh            (carry .whl; .whl_fla with WITH_FLA=1; ONLY=moe or ONLY=next: one proxy)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/s; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
[ "${WITH_FLA:-0}" = 1 ] && export PYTHONPATH=$FLA_SITE:$PYTHONPATH && python3 -c "import fla; print('fla', fla.__version__, 'on the path')"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-500} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
source .ci/h200/proxies.sh
COMMON="$WIDTHS --nproc 1 --steps 6 --seq 2048 --micro-batch 8 --dtype bf16 --baseline --profile-every 6"
run() {  # name model extra timeout
  stamp "$1"
  timeout "$4" onboard train "$2" --proxy none $COMMON $3 --out "$O/$1" > "$O/$1.log" 2>&1
  echo "exit $?"; grep -B2 -A6 "tok/s" "$O/$1.log" | tail -9
  python3 - "$O/$1" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/train/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if "kernels" in r:
            print(f.rsplit("/", 1)[1], "kernels", json.dumps(r["kernels"]), "rejected", json.dumps(r.get("kernels_rejected")))
PY
}
case ",${ONLY:-next,moe}," in *,next,*) run next hf:qwen3_next "$NEXT" "$(left 300)";; esac
case ",${ONLY:-next,moe}," in *,moe,*) run moe hf:qwen3_moe "$MOE" "$(left 260)";; esac
stamp end
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/call_s.tgz" -C "$O" .
