#!/usr/bin/env bash
# The fifty-fourth session's second call (~560 s), each step cut to what is left of LIMIT:
#   pv   the plan validation's re-measurement (`python -m onboarding.plan.validate --out`): the
#        stored runs (reference_runs/plan_validation) predate 434 commits to the training step;
#   kda  kimi_delta v60's `kda_wykq` rows beside the default at the Kimi-Linear layout T8192
#        (issue 32: fwd+bwd <= 3x its own forward), with `state_bwd_stages=3`'s never-timed row;
#   ssd  ssd v29's `pull_ahead` sweep row beside the default (issue 35: <= 3x);
#   moe  moe_experts v32's `gate_up_one_dot` and v33's `dw_held` rows at DeepSeek-V3 N8192 (issue 33);
#   bars the GPU bf16 bars of those options.
# carry: .whl. Usage: LIMIT=560 STEPS="pv kda" bash .ci/h200/h54b.sh
set -u
STEP_GREP="^[a-z_]+/|ratio|passed|failed|^\||STALE|rates|error"
source .ci/h200/step.sh
begin || exit 1
D='deepseek_v3/E256K8D7168F2048N8192/uniform'
for s in ${STEPS:-pv kda ssd moe}; do
  case $s in
    pv) step pv 420 python3 -m onboarding.plan.validate --out $OUT/pv --runs /tmp/vruns --steps 4 --timeout 70 ;;
    kda) step kda 200 onboard bench --family kimi_delta --case B1T8192H32D128 --impl \
           'ours,ours_fwd,ours@kda_qk=ksplit+kda_wykq=1,ours@kda_qk=ksplit+kda_wykq=1+kda_wy_warps=8,ours@state_bwd_stages=3+kda_state_bwd_warps=8' \
           --out $OUT/kda.json ;;
    ssd) step ssd 150 onboard bench --family ssd --case '^B1T8192H128P64G8N128$' --impl ours,ours_fwd --out $OUT/ssd.json ;;
    moe) step moe 230 onboard bench --family moe_experts --case "$D/fwd\$" --case "$D/fwdbwd\$" --impl ours,grouped_mm \
           --out $OUT/moe.json ;;
    bars) step bars 200 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py \
           tests/kernel_tests/test_kimi_delta_wykq.py tests/kernel_tests/test_ssd.py \
           -k 'v32_configs or v33_configs or (wykq and gpu) or (on_gpu and pull-ahead)' --durations=5 ;;
    *) echo "unknown step $s" ;;
  esac
done
