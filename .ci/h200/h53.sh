#!/usr/bin/env bash
# The fifty-third session's first call: on an H200, every goal in one tree (`h47_goals.sh`, the
# card issues 32, 33 and 35 name); on any other card, what the fifty-second session left owed there:
# 1. `onboard run hf:minimax --llm` in bf16 (the slow lightning test), to confirm that the patch's
# calibration now runs a block whose own code cannot run in bf16 in float32; 2. the sink_attention
# D 256 bucket's tile rows against torch.compile. carry: .whl .whl_fla .anchors.
# Usage: LIMIT=540 bash .ci/h200/h53.sh
set -u
OUT=${OUT:-/tmp/out}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in
  *H200*) exec bash .ci/h200/h47_goals.sh ;;
esac
T0=$(date +%s)
echo "gpu: $GPU (not an H200: the owed checks)" | tee "$OUT/gpu.txt"
source .ci/h200/setup.sh > /dev/null || exit 1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_llm_lightning.py -m slow \
  -k run_serves --durations=3 > $OUT/lightning.log 2>&1
echo "lightning rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; tail -30 $OUT/lightning.log
L=$(( ${LIMIT:-540} - $(date +%s) + T0 - 10 ))
timeout $L onboard bench --family sink_attention --case 'D256W4096C50$' --impl ours,compile \
  --out $OUT/sink.json > $OUT/sink.log 2>&1
echo "sink rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^sink|ratio" $OUT/sink.log
