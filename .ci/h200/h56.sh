#!/usr/bin/env bash
# What the fifty-fifth and fifty-sixth sessions left owed on a GPU, each step cut to what is left of LIMIT,
# in the order STEPS names them (any card; say which card each number came from):
#   pf     the export probe's illegal memory access (`onboard train hf:qwen3_next ... --seq 16384` exited 1 in
#          `peft_export.probe_logits` after its steps): `probe_fault.py` names the kernel, first at --seq 256
#          --steps 1 (cheap), then at the failing --seq 16384 --steps 4 only if the short run was clean;
#   gdn    gated_delta v35's `bwd_wy` "keyhead" (the chunk-local backward per (chunk, key head), off): its tests on
#          the GPU (fp32 against the naive recurrence, the bf16 bars rows), then the bench rows beside the default at
#          both GDN goal shapes with the per-kernel profile (issue 32: fwd+bwd <= 2.6x its forward; 3.60x on an H100);
#   ssd    ssd v32's `bwd_head_unroll` 2 and the 128-register two-programs-per-SM build: bars rows, then the bench
#          (issue 35: fwd+bwd <= 3x its forward; 3.25-3.42x on H100s);
#   kprof  the per-kernel profile of kimi_delta v62's default fwd+bwd (`kda_wykq` 1), B1 T8192 H32 D128;
#   kda32  KDA at T32768 with v62 against fla's forward (issue 32: fwd >= 1.2x fla, fwd+bwd <= 3x its forward);
#   goals  on an H200 only (unless ANY_GPU=1): `h47_goals.sh` with what is left (every goal on the card it names).
# carry: .whl .whl_fla .anchors. Two calls: LIMIT=570 STEPS="pf gdn ssd" bash .ci/h200/h56.sh, then
# LIMIT=570 STEPS="kprof kda32 goals" bash .ci/h200/h56.sh
set -u
STEP_GREP="^[a-z_]+/|ratio|passed|failed|^\||error|Error|culprit|rc "
source .ci/h200/step.sh
begin || exit 1
QN="hf:qwen3_next --proxy small --micro-batch 1 --nproc 1 --dtype bf16 --device cuda --recompute none"
for s in ${STEPS:-pf gdn ssd}; do
  case $s in
    pf) step pf_short 150 python3 .ci/h200/probe_fault.py $QN --seq 256 --steps 1 --out $OUT/pf_short.json
        if python3 -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('ok') else 1)" $OUT/pf_short.json 2>/dev/null; then
          step pf_long 200 python3 .ci/h200/probe_fault.py $QN --seq 16384 --steps 4 --out $OUT/pf_long.json
        fi
        for f in $OUT/pf_*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], d.get('ok'), d.get('phase'), d.get('culprit'))" "$f"; done ;;
    gdn) step gdn_tests 200 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kernel_tests/test_gated_delta_keyhead.py
         step gdn 200 onboard bench --family gated_delta --case B1T8192 --case B2T4096 --impl \
           'ours,ours_fwd,ours@bwd_wy=keyhead+bwd_wy_bk=32,ours@bwd_wy=keyhead+bwd_wy_bk=32+bwd_wy_warps=8,ours@bwd_wy=keyhead+bwd_wy_bk=64+bwd_wy_warps=8,ours@bwd_wy=keyhead+bwd_wy_warps=8' \
           --profile --out $OUT/gdn.json ;;
    ssd) step ssd_bars 150 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py -k "bf16_vs_fp32_on_gpu and v32"
         step ssd 150 onboard bench --family ssd --case '^B1T8192H128P64G8N128$' \
           --impl 'ours,ours_fwd,ours@bwd_head_unroll=2,ours@bwd_split_maxnreg=128,bwd_stages=2' --out $OUT/ssd.json ;;
    kprof) step kprof 120 onboard bench --family kimi_delta --case B1T8192H32D128 --impl ours --profile --out $OUT/kprof.json ;;
    kda32) PYTHONPATH=$FLA_SITE:$PYTHONPATH step kda32 200 onboard bench --family kimi_delta --case B1T32768H32D128 \
             --impl ours,ours_fwd,fla_fwd --out $OUT/kda32.json ;;
    goals) L=$(( ${LIMIT:-570} - $(date +%s) + T0 - 15 ))
           if [ $L -gt 200 ]; then mkdir -p $OUT/goals && OUT=$OUT/goals LIMIT=$L bash .ci/h200/h47_goals.sh > $OUT/goals.log 2>&1
             echo "goals rc $? +$(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt; tail -30 $OUT/goals.log
           else echo "goals: skipped, $L s left" | tee -a $OUT/summary.txt; fi ;;
    *) echo "unknown step $s" ;;
  esac
done
