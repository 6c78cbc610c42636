# Device call I (twentieth session), issue 34 and 32, run from a clean snapshot of a commit
# (.clean/head.tgz = `git archive HEAD | gzip`, carried with .whl and .whl_fla: other engineers'
# uncommitted edits in the working tree stay out):
#  1. the issue's Qwen3-Next-style 4B table command, ours and transformers + PEFT (--baseline), no
#     fla, with the gated-delta module's 16-bit Tm dots replaced by fp32 (tf32) ones through a
#     tuned.json beside the reviewed module (tm_dot=tf32 in both K buckets): is the rejected patch
#     gone, and at what speed;
#  2. `onboard bench --family gated_delta --case B1T8192` with fla 0.6's forward and the tm_dot rows.
#   bash .ci/h200/call_i.sh
set -o pipefail
O=${OUT:-/tmp/out}; mkdir -p "$O"
source .ci/h200/clean.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
cat > kernels/gated_delta/chunk_fe7bb168.tuned.json <<'J'
{"buckets": {"k_le_64": {"config": {"tm_dot": "tf32"}}, "k_le_128": {"config": {"tm_dot": "tf32"}}}}
J
stamp train
timeout ${TRAIN_TIMEOUT:-330} onboard train hf:qwen3_next --proxy none --set vocab_size=32000 --set hidden_size=2048 \
  --set num_hidden_layers=12 --set num_attention_heads=16 --set num_key_value_heads=2 \
  --set head_dim=128 --set linear_num_key_heads=16 --set linear_num_value_heads=32 \
  --set linear_key_head_dim=64 --set linear_value_head_dim=64 \
  --set shared_expert_intermediate_size=768 --set num_experts=64 --set num_experts_per_tok=8 \
  --set moe_intermediate_size=768 --set intermediate_size=6144 --set decoder_sparse_step=1 \
  --nproc 1 --steps 8 --seq 2048 --micro-batch 8 --dtype bf16 --baseline --out /tmp/h34t 2>&1 \
  | grep -v "^\[transformers\]" | tail -25 | tee "$O/train.txt"
python3 - <<'PY' | tee "$O/train_rows.txt"
import json, glob
for f in sorted(glob.glob("/tmp/h34t/train/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        keep = {k: r.get(k) for k in ("step", "loss", "step_time_s", "tokens_per_s", "mfu", "peak_mem_bytes")}
        print(f.split("/")[-1], json.dumps(keep))
        if "kernels" in r:
            print("  kernels", json.dumps(r.get("kernels")), "\n  rejected", json.dumps(r.get("kernels_rejected")))
PY
cp /tmp/h34t/report.md "$O/train_report.md" 2>/dev/null
rm -f kernels/gated_delta/chunk_fe7bb168.tuned.json
stamp gdn-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout ${BENCH_TIMEOUT:-170} onboard bench --family gated_delta --case B1T8192 \
  --impl ours,ours_fwd,fla_fwd,ours@tm_dot=tf32_fwd,ours@tm_dot=tf32 --profile --out "$O/gdn.json" 2>&1 \
  | tee "$O/gdn_bench.txt" | tail -45
stamp end
