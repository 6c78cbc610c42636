#!/usr/bin/env bash
# The fifty-second session's second call (~520 s): what the first (h47_goals.sh on an H100) left
# unmeasured. 1. ssd against mamba-ssm's Triton SSD at the Mamba-2 layout (issue 35; h47_goals.sh's
# anchor step was cut while ptxas built mamba-ssm's backward); 2. the sparse MLA forward at T8192
# and T32768 (issue 33: 350 TFLOP/s); 3. KDA's bf16 bars alone, to completion (issue 32; the
# fifty-first session cut them at 260 s beside six other groups). carry: .whl .anchors.
# Usage: bash .ci/h200/h52.sh
set -u
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
source .ci/h200/setup.sh > /dev/null || exit 1
ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors timeout 230 onboard bench --family ssd --case '^B1T8192H128' \
  --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --out $OUT/ssd.json > $OUT/ssd.log 2>&1
echo "ssd rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^ssd|ratio" $OUT/ssd.log
timeout 100 onboard bench --family sparse_attention --case 'mla-T8192-fwd$' --case 'mla-T32768-fwd$' --impl ours \
  --out $OUT/mla.json > $OUT/mla.log 2>&1
echo "mla rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^sparse_attention" $OUT/mla.log
L=$(( ${LIMIT:-520} - $(date +%s) + T0 - 10 ))
timeout $L python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_kimi_delta.py \
  -k 'bf16_vs_fp32_on_gpu and not sweep' --durations=8 > $OUT/kda_bars.log 2>&1
echo "kda bars rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; tail -14 $OUT/kda_bars.log
