# H200 call B (eighteenth session): the LLM-written kernels' gates on the GPU (issue 27), the
# ssd and selective_scan kernel tests with their bf16 bars and the selective_scan bench
# (issue 35), KDA against fla in one run (issue 32), and one short Qwen3-Next proxy training run
# whose step rows name the rejected gated-delta patch (issue 34).
#   source .ci/h200/setup.sh && bash .ci/h200/call_b.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp gates
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_llm_router.py tests/test_llm_gate.py \
  -m "slow or not slow" -k "accepted_by_the_gate or kernel_matches or rejected" 2>&1 | tail -8
stamp kernel-tests
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py \
  tests/kernel_tests/test_selective_scan.py -m "not slow" -rxXs 2>&1 | tail -15
stamp scan-bench
timeout 70 onboard bench --family selective_scan --case B1T4096D5120N16 --case B1T8192D4096N16 \
  --impl ours,ours_fwd,eager_fwd --profile --out "$O/h35_scan.json" 2>&1 | tail -30
stamp kda
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 130 onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl ours,ours_fwd,fla_fwd --out "$O/h32_kda.json" 2>&1 | tail -12
stamp train
timeout 170 onboard train hf:qwen3_next --proxy none --set vocab_size=32000 --set hidden_size=2048 \
  --set num_hidden_layers=12 --set num_attention_heads=16 --set num_key_value_heads=2 --set head_dim=128 \
  --set linear_num_key_heads=16 --set linear_num_value_heads=32 --set linear_key_head_dim=64 \
  --set linear_value_head_dim=64 --set shared_expert_intermediate_size=768 --set num_experts=64 \
  --set num_experts_per_tok=8 --set moe_intermediate_size=768 --set intermediate_size=6144 \
  --set decoder_sparse_step=1 --nproc 1 --steps 4 --seq 2048 --micro-batch 8 --dtype bf16 \
  --out /tmp/t34 2>&1 | tail -25
grep -rh "rejected" /tmp/t34 2>/dev/null | head -20 | cut -c1-1500
tar czf "$O/t34.tgz" -C /tmp t34 2>/dev/null
stamp end
