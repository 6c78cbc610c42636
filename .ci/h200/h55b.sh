#!/usr/bin/env bash
# The fifty-fifth session's last device call, each step cut to what is left of LIMIT, in the order STEPS names them:
#   kdat   ssd v31's `bwd_dbc_ln` GPU bf16 bars row, beside kimi_delta v62's GPU checks (the k_le_128 bucket now runs `kda_wykq` 1 with the reverse state pass at 3
#          stages / 8 warps): the default's bf16 bars and its cold-tile check at both head layouts, as three pytest
#          processes at once, four with ssd's row (each compiles its own kernels; the GPU work is small);
#   ssd    ssd v31's `bwd_dbc_ln` row beside the default at the Mamba-2 layout (issue 35: fwd+bwd <= 3x its forward);
#   qn     `onboard train hf:qwen3_next --proxy small --seq 16384` (bf16, kernels) as the plan validation runs it:
#          it exited 1 after its 4 steps in call 2, the output lost;
#   kprof  the per-kernel profile of KDA's new default fwd+bwd (`onboard bench --profile`).
# carry: .whl. Usage: LIMIT=560 STEPS="kdat ssd qn kprof" bash .ci/h200/h55b.sh
set -u
STEP_GREP="^[a-z_]+/|ratio|passed|failed|^\||error|Error|kernel|rc "
source .ci/h200/step.sh
begin || exit 1
K=tests/kernel_tests
par_kda() {  # three pytest processes at once, then their summaries
  local py="python3 -m pytest -q -p no:cacheprovider -p no:randomly"
  $py "$K/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu" "$K/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_no_final_state_grad" \
    "$K/test_kimi_delta.py::test_state_tile_fills_the_gpu" > $OUT/kdat1.log 2>&1 &
  $py "$K/test_kimi_delta_wykq.py::test_wykq_cold_tiles_on_gpu[kda_wykq=1-hv=hk]" > $OUT/kdat2.log 2>&1 &
  $py "$K/test_kimi_delta_wykq.py::test_wykq_cold_tiles_on_gpu[kda_wykq=1-grouped]" > $OUT/kdat3.log 2>&1 &
  $py "$K/test_ssd.py::test_bf16_vs_fp32_on_gpu[v31-dbc-ln]" > $OUT/kdat4.log 2>&1 &
  wait
  for f in 1 2 3 4; do echo "kdat$f: $(tail -1 $OUT/kdat$f.log)"; grep -E "^E |FAILED" $OUT/kdat$f.log | head -5; done
}
for s in ${STEPS:-kdat ssd qn kprof}; do
  case $s in
    kdat) export -f par_kda; export K OUT; step kdat 260 bash -c par_kda ;;
    ssd) step ssd 150 onboard bench --family ssd --case '^B1T8192H128P64G8N128$' \
           --impl 'ours,ours_fwd,ours@bwd_dbc_ln=True' --out $OUT/ssd.json
         ;;
    qn) step qn 120 onboard train hf:qwen3_next --proxy small --seq 16384 --micro-batch 1 --nproc 1 --dtype bf16 \
          --device cuda --recompute none --steps 4 --out /tmp/qn ; echo "qn tail:"; tail -25 $OUT/qn.log ;;
    kprof) step kprof 120 onboard bench --family kimi_delta --case B1T8192H32D128 --impl ours --profile \
             --out $OUT/kprof.json ;;
    *) echo "unknown step $s" ;;
  esac
done
