#!/usr/bin/env bash
# What the fifty-seventh session left owed on a GPU, each step cut to what is left of LIMIT, in the
# order STEPS names them (any card; say which card each number came from):
#   fault  gdn_state_fwd_kernel's illegal memory access at a 16-token forward without training (the
#          export probe of `onboard train hf:qwen3_next --proxy small`, H100): `gdn_fault.py` runs each
#          config/T variant in its own process, dumps the T16 binary's PTX (its md5 by ptx_norm.py), then
#          the GPU test that pins it. If the standalone T16 run does not fault, the cause is around the
#          launch (its real arguments, other work on the device), not the kernel;
#   pf     the export probe again, `probe_fault.py` at --seq 256 --steps 1, with every kernel's PTX dumped
#          (tar $OUT/pf_dump before the call ends: a call returns a handful of files);
#   kprof  the per-kernel profile of kimi_delta v62's default fwd+bwd, B1 T8192 H32 D128;
#   kda32  KDA at T32768 against fla's forward (issue 32: fwd >= 1.2x fla, fwd+bwd <= 3x its forward);
#   goals  on an H200 only (unless ANY_GPU=1): `h47_goals.sh` with what is left (every goal on the card it names).
# carry: .whl .whl_fla .anchors. Usage: LIMIT=570 STEPS="fault pf" bash .ci/h200/h57.sh, then
# LIMIT=570 STEPS="goals" bash .ci/h200/h57.sh
set -u
STEP_GREP="^[a-z_]+/|ratio|passed|failed|^\||error|Error|culprit|rc=|^T="
source .ci/h200/step.sh
begin || exit 1
QN="hf:qwen3_next --proxy small --micro-batch 1 --nproc 1 --dtype bf16 --device cuda --recompute none"
for s in ${STEPS:-fault pf}; do
  case $s in
    fault) step fault 330 python3 .ci/h200/gdn_fault.py
           # the binary that ran, against this host's sm_90 build of the same launch (b428616f... with triton
           # 3.6.0 by .ci/h200/ptx_norm.py; helper-200 found that build in bounds over the whole grid)
           TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=$OUT/dump TRITON_ALWAYS_COMPILE=1 step fault_dump 90 \
             python3 .ci/h200/gdn_fault.py --one 16 '{}'
           python3 .ci/h200/ptx_norm.py $(find $OUT/dump -name 'gdn_state_fwd_kernel*.ptx') | tee -a $OUT/summary.txt
           step fault_test 120 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_gated_delta.py -k short_forward ;;
    pf) TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=$OUT/pf_dump TRITON_ALWAYS_COMPILE=1 step pf_short 150 python3 .ci/h200/probe_fault.py $QN --seq 256 --steps 1 --out $OUT/pf_short.json
        [ -f $OUT/pf_short.json ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('pf', d.get('ok'), d.get('phase'), d.get('culprit'))" $OUT/pf_short.json ;;
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
for d in dump pf_dump; do [ -d $OUT/$d ] && tar czf $OUT/$d.tgz -C $OUT $d && rm -rf $OUT/$d; done
