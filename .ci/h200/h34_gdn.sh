# H200 (issue 34): why one gated-delta patch of the 4B Qwen3-Next-style proxy is rejected on its
# first call ("rejected:linear_attention.gated_delta": 1 in the issue's table run). One step of
# ours only, no fla on the path; prints the first step row's `kernels` and `kernels_rejected`
# (the calibration's comparison). ~3-4 min cold (set-up ~150 s at this size).
#   source .ci/h200/setup.sh && bash .ci/h200/h34_gdn.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp train
timeout ${TRAIN_TIMEOUT:-260} onboard train hf:qwen3_next --proxy none --set vocab_size=32000 --set hidden_size=2048 \
  --set num_hidden_layers=12 --set num_attention_heads=16 --set num_key_value_heads=2 \
  --set head_dim=128 --set linear_num_key_heads=16 --set linear_num_value_heads=32 \
  --set linear_key_head_dim=64 --set linear_value_head_dim=64 \
  --set shared_expert_intermediate_size=768 --set num_experts=64 --set num_experts_per_tok=8 \
  --set moe_intermediate_size=768 --set intermediate_size=6144 --set decoder_sparse_step=1 \
  --nproc 1 --steps 2 --seq 2048 --micro-batch 8 --dtype bf16 --out /tmp/h34g 2>&1 | tail -15
stamp rows
python3 - <<'PY' | tee "$O/h34_gdn.txt"
import json, glob
for f in sorted(glob.glob("/tmp/h34g/train/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if "kernels" in r or "kernels_rejected" in r:
            print(f, "step", r.get("step"))
            print("kernels", json.dumps(r.get("kernels")))
            print("rejected", json.dumps(r.get("kernels_rejected"), indent=1))
PY
stamp end
