# Device call T (prepared in the twenty-third session, for the next one): issue 34's step changes on
# the H200. First the new kernels' CUDA tests (each prints its fwd+bwd ms beside the torch path's):
# the weighted SwiGLU and the experts' pair gather, the LoRA linear kernel; then the issue's table
# (call_s.sh: both proxies, ours and transformers + PEFT, steps 6, step 6 profiled), to compare
# with call S (67,768 / 53,557 tok/s; 19.9% / 17.4% MFU) and see `_LoRADeltaBackward`,
# `_SwiGLUWeightedBackward`, `IndexBackward0` and the loss's `SliceBackward0` leave the profile.
# About 600 s in all on a cold machine (the Qwen3-Next run ~290 s, the MoE run ~190 s): with less
# budget the MoE run is cut first; run the table alone (call_s.sh) then.
#   bash .ci/h200/call_t.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/t; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_moe_swiglu_kernel.py \
  tests/kernel_tests/test_lora_training.py tests/kernel_tests/test_lora.py -k "cuda or bf16" -rxXs \
  2>&1 | tee "$O/tests.txt" | grep -E "ms|passed|failed|FAIL|Error" | cut -c1-300
stamp table
OUT=$O/s BUDGET=${BUDGET:-440} bash .ci/h200/call_s.sh 2>&1 | grep -v "^\(torch\|transformers\|peft\|optuna\|langgraph\|openai\|fla\) "
stamp end
tar czf "$D/call_t.tgz" -C "$O" .
