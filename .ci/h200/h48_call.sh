#!/usr/bin/env bash
# One call that uses whichever card comes: on an H200 the goals (`h47_goals.sh`), on any other
# card the per-kernel profiles (`h48_profile.sh`) unless PROFILE=0 (the forty-eighth session ran
# them on an H100 once; docs/LOG.md), or with TUNE=1 README's main command at the 90 s tune budget
# (`h44_tune.sh`: does the tune stage now end within it?). carry: .whl .whl_fla .anchors. Packs $OUT.
set -u
OUT=${OUT:-/tmp/out}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in
  *H200*) LIMIT=${LIMIT:-555} bash .ci/h200/h47_goals.sh ;;
  *) echo "gpu: $GPU" | tee $OUT/gpu.txt
     if [ "${TUNE:-0}" = 1 ]; then BUDGETS=90 timeout 400 bash .ci/h200/h44_tune.sh > $OUT/tune.log 2>&1; tail -20 $OUT/tune.log
     elif [ "${PROFILE:-1}" = 1 ]; then bash .ci/h200/h48_profile.sh; fi ;;
esac
rc=$?
cd $OUT && tar czf /tmp/all.tgz . && find . -type f -delete && mv /tmp/all.tgz $OUT/
exit $rc
