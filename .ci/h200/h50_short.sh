#!/usr/bin/env bash
# A short call for a session with little device time left (the fiftieth session: ~650 s after
# failed starts): KDA at the Kimi-Linear layout T8192 against fla's forward (not timed with the
# current kernels on any card since the thirtieth session), then the MoE forward at DeepSeek-V3
# N8192 (the one forward goal shape below 1.3x on the H200, 1.28x in the forty-seventh session).
# carry: .whl .whl_fla .anchors. Usage: bash .ci/h200/h50_short.sh
set -u
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
source .ci/h200/setup.sh > /dev/null || exit 1
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 170 onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl ours,ours_fwd,fla_fwd --out $OUT/kda.json > $OUT/kda.log 2>&1
echo "kda rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^kimi_delta|ratio|fla" $OUT/kda.log | head -20
timeout 90 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwd$' \
  --impl ours,grouped_mm --out $OUT/moe_fwd.json > $OUT/moe_fwd.log 2>&1
echo "moe fwd rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^moe_experts|ratio" $OUT/moe_fwd.log
