#!/usr/bin/env bash
# Issue 32 (thirty-eighth session): gated_delta v27's forward without training (k_le_128: `fused_kq`
# "rows" with the row-factor prepare capped at 168 registers, `rows_maxnreg`) in a run of its own:
# its bf16 GPU bars, then v27 against v26's forward (`fused_kq` "stored") and fla at B1T8192 and
# B2T4096 (h37_gdn9.sh, H100, by graph: rows + 168 0.438 / 0.231 ms, v26 0.453 / 0.241, fla 0.575 / 0.323).
# Self-contained: sources setup.sh. Carry .whl .whl_fla:
#   BUDGET=200 bash .ci/h200/h38_gdn10.sh
# Steps, each cut by `timeout` to what is left of ${BUDGET:-200} s (20 s kept in reserve):
#  1. (<= 70 s) `test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-fwd_o=fused]` (the bucket's no-grad
#     forward: v27's default) and `[k128-mixed-fused_kq=stored]` (v26's) -> gdn10_bars.txt;
#  2. the bench, `--impl ours_fwd,ours@fused_kq=stored_fwd,fla_fwd --profile`, B1T8192 (<= 110 s,
#     fla's autotuning included), then B2T4096 (what is left) -> gdn10_bench_<case>.txt, gdn10_<case>.json.
# How to read: ours_fwd's "fla_fwd=" ratios (interleaved rounds; graph) against 1.3; ours_fwd
# against ours@fused_kq=stored_fwd (v26) by graph.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-200} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
T=tests/kernel_tests/test_gated_delta.py
stamp gdn10-bars
timeout "$(left 70)" python3 -m pytest -v -p no:cacheprovider -rxXs \
  "$T::test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-fwd_o=fused]" \
  "$T::test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-fused_kq=stored]" 2>&1 \
  | tee "$O/gdn10_bars.txt" | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
for c in B1T8192:110 B2T4096:1000; do
  case_=${c%%:*}; cap=${c##*:}
  stamp "gdn10-bench $case_"
  if [ "$(left 1000)" -lt 20 ]; then echo "$case_ skipped: $(left 1000) s left"; continue; fi
  PYTHONPATH=$FLA_SITE${FLA_SITE:+:}$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left "$cap")" onboard bench \
    --family gated_delta --case "^$case_" --impl "ours_fwd,ours@fused_kq=stored_fwd,fla_fwd" --profile \
    --out "$O/gdn10_$case_.json" 2>&1 | grep --line-buffered -v "^\s*$" | tee "$O/gdn10_bench_$case_.txt" | tail -12
done
stamp end
