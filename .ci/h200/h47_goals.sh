#!/usr/bin/env bash
# The issues' goal measurements on an H200, in one call (the forty-sixth and forty-seventh sessions
# prepared it; every call since got an H100): moe_experts at the four goal shapes of issue 33, forward
# then forward + backward (`--impl ours,grouped_mm`); kimi_delta at the Kimi-Linear layout T8192 and
# T32768 against fla's forward (issue 32: KDA forward >= 1.2x fla, fwd+bwd <= 3x its own forward);
# then, with what is left of LIMIT, `h34_anchors.sh` (GDN against fla, ssd against mamba-ssm).
# On another card it stops unless ANY_GPU=1: the goals name the H200 (an H100's same-run ratios
# are still a same-commit table of every goal).
# Its first H200 run (forty-seventh session, as .snap/s47_c4.sh) lost the MoE step to case names
# with a `moe_experts/` prefix (the bench's names have none; fixed) and its KDA step to the 110 s
# it was given: on the H200 `ours` finished 28 s in and fla's forward row had not after 110 s.
# carry: .whl .whl_fla .anchors. Usage: LIMIT=560 bash .ci/h200/h47_goals.sh
set -u
OUT=${OUT:-/tmp/out}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU" | tee "$OUT/gpu.txt"
case "$GPU" in *H200*) ;; *) [ "${ANY_GPU:-0}" = 1 ] || { echo "not an H200: the goals name it; nothing run (ANY_GPU=1 runs them)"; exit 3; } ;; esac
source .ci/h200/setup.sh > /dev/null || exit 1
T0=$(date +%s)
M='qwen3_next/E512K10D2048F512N8192'; D='deepseek_v3/E256K8D7168F2048'
timeout 100 onboard bench --family moe_experts --case "$M/uniform/fwd\$" --case "$M/zipf/fwd\$" --case "$D""N8192/uniform/fwd\$" \
  --case "$D""N32768/uniform/fwd\$" --impl ours,grouped_mm --out $OUT/moe_fwd.json > $OUT/moe_fwd.log 2>&1
echo "moe fwd rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^moe_experts|ratios" $OUT/moe_fwd.log
timeout 150 onboard bench --family moe_experts --case "$M/uniform/fwdbwd\$" --case "$M/zipf/fwdbwd\$" --case "$D""N8192/uniform/fwdbwd\$" \
  --case "$D""N32768/uniform/fwdbwd\$" --impl ours,grouped_mm --out $OUT/moe_fwdbwd.json > $OUT/moe_fwdbwd.log 2>&1
echo "moe fwdbwd rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^moe_experts|ratios" $OUT/moe_fwdbwd.log
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 240 onboard bench --family kimi_delta --case B1T8192H32D128 --case B1T32768H32D128 \
  --impl ours,ours_fwd,fla_fwd --out $OUT/kda.json > $OUT/kda.log 2>&1
echo "kda rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^kimi_delta|ratios" $OUT/kda.log
L=$(( ${LIMIT:-360} - $(date +%s) + T0 - 20 ))
echo "anchors budget $L" | tee -a $OUT/summary.txt
[ $L -gt 120 ] && mkdir -p $OUT/anchors && OUT=$OUT/anchors BUDGET=$L bash .ci/h200/h34_anchors.sh > $OUT/anchors.log 2>&1
echo "anchors rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; tail -40 $OUT/anchors.log
