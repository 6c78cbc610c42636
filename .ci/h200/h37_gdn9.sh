#!/usr/bin/env bash
# Issue 32 (thirty-seventh session): gated_delta's forward without training, `fused_kq` "rows"
# alone against the default and against rows + `prep_maxnreg` 168, with fla's anchor in the same
# run. h36_gdn8.sh (H100) had `prep_maxnreg` 168 alone lose (0.465 against 0.456 ms by graph at
# T8192) while rows + 168 won at all three shapes (0.439, 0.229, 1.733 against 0.456, 0.240,
# 1.757): this says whether "rows" alone did it.
# Self-contained: sources setup.sh. Carry .whl .whl_fla:
#   BUDGET=240 bash .ci/h200/h37_gdn9.sh      (the third shape needs ~300)
# Within ${BUDGET:-300} s after setup (~30 s), 20 s of them kept in reserve. Steps, each cut by
# `timeout` to what is left:
#  1. (<= 45 s) the bf16-vs-fp32 GPU bars of the rows row at K = V = 128, mixed decays
#     (`test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-fwd_o=fused,fused_kq=rows]`) -> gdn9_bars.txt;
#  2. the bench, `--impl ours_fwd,<rows>,fla_fwd --profile`, one case a call: B1T8192 (<= 130 s,
#     fla's autotuning included), B2T4096 (<= 60 s), then B1T32768 (what is left)
#     -> gdn9_bench_<case>.txt, gdn9_<case>.json.
# How to decide (graph ms): a row faster than ours_fwd at all three shapes by more than the ~3%
# row-to-row spread, whose bars PASSED, becomes the bucket's. Goal: fla / ours >= 1.3 at each shape.
# Outputs under $OUT: env.txt, gdn9_bars.txt, gdn9_bench_*.txt, gdn9_*.json, gdn9.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-300} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/gdn9.tgz" -C "$O" $(cd "$O" && ls | grep -v '^gdn9.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=ours@fwd_o=fused+fused_kq=rows_fwd,ours@fwd_o=fused+fused_kq=rows+prep_maxnreg=168_fwd
IMPL=ours_fwd,$ROWS
IMPL=$IMPL,fla_fwd; EXTRA=$FLA_SITE
T=tests/kernel_tests/test_gated_delta.py
stamp gdn9-bars
timeout "$(left 45)" python3 -m pytest -v -p no:cacheprovider -rxXs \
  "$T::test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-fwd_o=fused,fused_kq=rows]" 2>&1 \
  | tee "$O/gdn9_bars.txt" | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
for c in B1T8192:130 B2T4096:60 B1T32768:1000; do
  case_=${c%%:*}; cap=${c##*:}
  stamp "gdn9-bench $case_"
  if [ "$(left 1000)" -lt 20 ]; then echo "$case_ skipped: $(left 1000) s left"; continue; fi
  PYTHONPATH=$EXTRA${EXTRA:+:}$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left "$cap")" onboard bench \
    --family gated_delta --case "^$case_" --impl "$IMPL" --profile --out "$O/gdn9_$case_.json" 2>&1 \
    | grep --line-buffered -v "^\s*$" | tee "$O/gdn9_bench_$case_.txt"
done
stamp end
