#!/usr/bin/env bash
# The fifty-fifth session's device calls, each step cut to what is left of LIMIT, in the order STEPS names them:
#   kda    `onboard bench --family kimi_delta` at the Kimi-Linear layout T8192: the default, fla's forward, the
#          `kda_wykq` row and the row with `state_bwd_stages=3` too (issue 32: fwd+bwd <= 3x its own forward);
#   wykq   the GPU rows of tests/kernel_tests/test_kimi_delta_wykq.py (the bf16 bars of bench.WYKQ_SWEEP's rows
#          and their cold-tile check against the inline qkt path), never run to the end on a GPU;
#   pv     the plan validation's re-measurement (`python -m onboarding.plan.validate --out`).
# carry: .whl .whl_fla. Usage: LIMIT=570 STEPS="kda wykq" bash .ci/h200/h55.sh
set -u
STEP_GREP="^[a-z_]+/|ratio|passed|failed|^\||STALE|rates|error|Error"
source .ci/h200/step.sh
begin || exit 1
W='ours@kda_qk=ksplit+kda_wykq=1'
for s in ${STEPS:-kda wykq}; do
  case $s in
    kda) PYTHONPATH=$FLA_SITE:$PYTHONPATH step kda 220 onboard bench --family kimi_delta --case B1T8192H32D128 \
           --impl "ours,ours_fwd,fla_fwd,$W,$W+state_bwd_stages=3+kda_state_bwd_warps=8" --out $OUT/kda.json ;;
    wykq) step wykq 330 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_kimi_delta_wykq.py \
           -k gpu --durations=10 ;;
    pv) step pv 430 python3 -m onboarding.plan.validate --out $OUT/pv --runs /tmp/vruns --steps 4 --timeout 70 ;;
    *) echo "unknown step $s" ;;
  esac
done
