#!/usr/bin/env bash
# The fifty-first session's short call (~450 s): KDA at the Kimi-Linear layout T8192 against fla's
# forward (h50_short.sh's first step), the sink_attention kernel tests on the GPU (v4's logit
# soft-cap and v5's D > 128 bucket were built on the CPU only), then the MoE forward at
# DeepSeek-V3 N8192. carry: .whl .whl_fla .anchors. Usage: bash .ci/h200/h51.sh
set -u
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
source .ci/h200/setup.sh > /dev/null || exit 1
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 170 onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl ours,ours_fwd,fla_fwd --out $OUT/kda.json > $OUT/kda.log 2>&1
echo "kda rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^kimi_delta|ratio|fla" $OUT/kda.log | head -20
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_sink_attention.py -m "not slow" \
  --durations=5 > $OUT/sink.log 2>&1
echo "sink tests rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; tail -5 $OUT/sink.log
timeout 90 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwd$' \
  --impl ours,grouped_mm --out $OUT/moe_fwd.json > $OUT/moe_fwd.log 2>&1
echo "moe fwd rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^moe_experts|ratio" $OUT/moe_fwd.log
