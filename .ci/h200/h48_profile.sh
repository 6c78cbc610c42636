#!/usr/bin/env bash
# Where the fwd+bwd time goes today (issues 32, 33, 35), on whatever card: one `--profile` bench
# per family at the goal shape (MoE DeepSeek-V3 N8192 fwd and fwd+bwd against `_grouped_mm`; GDN
# and ssd at B1 T8192, ours and ours_fwd). The latest per-kernel MoE profile in docs/LOG.md was of
# template v16 (twenty-eighth session). carry: .whl. Usage: bash .ci/h200/h48_profile.sh
set -u
OUT=${OUT:-/tmp/out}
source .ci/h200/setup.sh > /dev/null || exit 1
T0=$(date +%s)
D='deepseek_v3/E256K8D7168F2048N8192/uniform'
timeout 170 onboard bench --family moe_experts --case "$D/fwdbwd\$" --case "$D/fwd\$" --impl ours,grouped_mm \
  --profile > $OUT/moe_prof.log 2>&1
echo "moe rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
timeout 140 onboard bench --family gated_delta --case B1T8192 --impl ours,ours_fwd --profile > $OUT/gdn_prof.log 2>&1
echo "gdn rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
timeout 140 onboard bench --family ssd --case B1T8192H128 --impl ours,ours_fwd --profile > $OUT/ssd_prof.log 2>&1
echo "ssd rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
