#!/usr/bin/env bash
# The fifty-second session's third call (~450 s): 1. sink_attention's new Gemma 2 case (D 256 tiles,
# soft-cap 50, window 4096; v4/v5 never timed) against Gemma 2's eager attention and its
# torch.compile; 2. the recorded lightning-attention LLM family (hf:minimax) end to end on the GPU
# (`onboard run hf:minimax --llm` through the local replay server: the slow test), never run on a
# GPU before. carry: .whl. Usage: bash .ci/h200/h52b.sh
set -u
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
source .ci/h200/setup.sh > /dev/null || exit 1
timeout 200 onboard bench --family sink_attention --case 'D256W4096C50$' --impl ours,eager,compile \
  --out $OUT/sink.json > $OUT/sink.log 2>&1
echo "sink rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^sink|ratio" $OUT/sink.log
L=$(( ${LIMIT:-450} - $(date +%s) + T0 - 10 ))
timeout $L python3 -m pytest -q -p no:cacheprovider tests/test_llm_lightning.py -m slow \
  -k run_serves --durations=3 > $OUT/lightning.log 2>&1
echo "lightning rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; tail -30 $OUT/lightning.log
