# Device call U (prepared in the twenty-third session, for the next one): issue 34's sequence-length
# table for the 4B Qwen3-Next-style proxy, one H200, RECOMPUTE=full (default) or none, lengths
# ${LENGTHS:-4096,16384,65536} (micro-batch 1; `--seq-sweep`: one fresh process per length, the
# first length's kernel candidates reused), then one resume-after-kill run on the H200 (the small
# Qwen3-MoE proxy: 8 steps uninterrupted; the same run killed after step 5 with a checkpoint every
# 2 steps, then started again from its train.toml; the uninterrupted run a second time, to tell a
# resume fault from a backward that is not bit-reproducible on CUDA; the loss curves and gradient
# norms are printed side by side).
#   bash .ci/h200/call_u.sh      (carry .whl; PARTS=resume or PARTS=sweep: one part; EXTRA: options
#   added to the sweep, e.g. EXTRA="--init-device device")
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/u; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-540} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
PARTS=",${PARTS:-resume,sweep},"
if [[ $PARTS == *,resume,* ]]; then
stamp resume
R="onboard train hf:qwen3_moe --proxy small --nproc 1 --steps 8 --seq 1024 --dtype bf16 --checkpoint-interval 2"
timeout 150 $R --out "$O/whole" > "$O/resume_whole.log" 2>&1; echo "whole exit $?"
timeout 150 $R --out "$O/whole2" > "$O/resume_whole2.log" 2>&1; echo "whole2 exit $?"
ONBOARD_TEST_KILL=0:5 timeout 150 $R --out "$O/killed" > "$O/resume_killed.log" 2>&1; echo "killed exit $? (non-zero expected)"
timeout 150 onboard train --config "$O/killed/train.toml" > "$O/resume_again.log" 2>&1; echo "resumed exit $?"
grep -h "resumed from" "$O/resume_again.log" "$O"/killed/train/*.log 2>/dev/null | head -2
python3 - "$O" <<'PY' | tee "$O/resume.txt"
import json, sys
o = sys.argv[1]
rows = lambda d: [json.loads(l) for l in open(f"{o}/{d}/train/reference.jsonl")]
a, b, c = rows("whole"), rows("killed"), rows("whole2")
print("step  whole loss / grad norm  | resumed run  | whole again  | resumed equal, again equal, resumed equal to again")
for ra, rb, rc in zip(a, b[-len(a):] if len(b) > len(a) else b, c):
    print(ra["step"], repr(ra["loss"]), repr(ra["grad_norm"]), "|", repr(rb["loss"]), repr(rb["grad_norm"]),
          "|", repr(rc["loss"]), repr(rc["grad_norm"]), "|", ra["loss"] == rb["loss"], ra["loss"] == rc["loss"], rb["loss"] == rc["loss"])
PY
fi
if [[ $PARTS == *,sweep,* ]]; then
stamp seq-sweep
source .ci/h200/proxies.sh
timeout "$(left 480)" onboard train hf:qwen3_next --proxy none $WIDTHS $NEXT \
  --set max_position_embeddings=262144 --nproc 1 --steps 3 --micro-batch 1 --dtype bf16 \
  --recompute "${RECOMPUTE:-full}" ${EXTRA:-} --seq-sweep "${LENGTHS:-4096,16384,65536}" --out "$O/sweep" > "$O/sweep.log" 2>&1
echo "sweep exit $?"; grep -A12 "seq " "$O/sweep.log" | head -20
fi
stamp end
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/train/ckpt "$O"/sweep/*/train/kernels
tar czf "$D/call_u.tgz" -C "$O" .
