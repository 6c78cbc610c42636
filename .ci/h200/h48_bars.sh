#!/usr/bin/env bash
# The GPU-only bars the issues' "must show" names on the H200 (issue 32: the linear-attention
# families' bf16 tests; 33 and 35 the same for theirs): the forty-seventh session's seven groups,
# run at once (`par_pytest.sh`; they passed on an H100 in 231 s), then the sparse MLA forward at
# T8192 and T32768 (issue 33: 350 TFLOP/s; 318 on an H100, fortieth session). On another card it
# stops, unless ANY_GPU=1. carry: .whl. Usage: bash .ci/h200/h48_bars.sh
set -u
OUT=${OUT:-/tmp/out}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $GPU" | tee "$OUT/gpu_bars.txt"
case "$GPU" in *H200*) ;; *) [ "${ANY_GPU:-0}" = 1 ] || { echo "not an H200: nothing run"; exit 3; } ;; esac
source .ci/h200/setup.sh > /dev/null || exit 1
T0=$(date +%s)
K=tests/kernel_tests
bash .ci/h200/par_pytest.sh 270 \
  "$K/test_ssd.py -k 'on_gpu and (default or no_final)'" \
  "$K/test_ssd.py -k 'on_gpu and not default and not no_final'" \
  "$K/test_kimi_delta.py -k 'bf16_vs_fp32_on_gpu and not sweep'" \
  "$K/test_gated_delta.py -k on_gpu" \
  "$K/test_moe_experts.py -k 'bf16_tensor_core_accuracy_cuda or grouped_mm_weight_gradients_bf16_cuda or v28_grouped_mm_backward_bf16_cuda'" \
  "$K/test_sparse_attention.py -k 'gpu_bf16_accuracy or crossover_policy'" \
  "$K/test_selective_scan.py -k bf16_against_fp32" | tee $OUT/bars.txt
echo "bars +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
timeout 150 onboard bench --family sparse_attention --case 'mla-T8192-fwd$' --case 'mla-T32768-fwd$' --impl ours \
  --out $OUT/mla.json > $OUT/mla.log 2>&1
echo "mla rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; grep -E "^sparse_attention" $OUT/mla.log
