# Device call for issue 32 (H200, or an H100: the last calls got one), GDN template v25 (no template
# change: existing keys): does the prepare at its 4 warps capped at 168 registers (`prep_maxnreg`
# 168: three independent programs per SM instead of two) take the forward to 1.3x fla's
# chunk_gated_delta_rule? The thirty-sixth session's profile (H100, h32_gdn7.sh at 047b72b): the
# default forward at B1 T8192 HK16 HV32 D128 is gdn_prepare_fwd_kernel 0.286 ms (63.5%) +
# gdn_state_fwd_kernel 0.164 (graph 0.456 ms; fla 0.573, so 1.3x needs <= 0.441). By arithmetic the
# prepare moves ~436 MB there (0.13 ms at 3.35 TB/s) and ~27 GFLOP of dots: neither bounds it; it is
# latency bound, 4096 programs at 2 per SM (255 registers x 4 warps): 15.5 waves of one long serial
# chain (Gram loop, six exact-fp32 [4, 16, 16] dots and four tf32 64^3 merges of the inverse, the w
# and u loops). At 168 registers (sm_90 build with the forward's bf16 u: 320 B of spills on triton
# 3.6, 384 on 3.9, most in the inverse once per program, a few reloads per w tile) 3 programs fit an
# SM (10.3 waves). Expected,
# by arithmetic only: the prepare 0.286 -> 0.20-0.25 ms at T8192 if the third program overlaps the
# others' serial phases; nothing, or slower, if the spills or the shared bandwidth eat it. (The
# 8-warp cap of 128, `PREP_OCC`, was slower on the H200: it keeps two programs per SM, each split
# over more warps.) Rows (bench.PREP_C168): ours@prep_maxnreg=168_fwd (the bucket's fused output)
# and ours@fwd_o=fused+fused_kq=rows+prep_maxnreg=168_fwd (kd and qg not written; 176 B spills).
# Decides: whether `prep_maxnreg` 168 becomes the k_le_128 bucket's (family.py shape_buckets; a
# render change: bump template_version and re-review kernels/gated_delta).
# Self-contained: sources setup.sh. Carry .whl (and .whl_fla with GDN8_FLA=1: fla's anchor row,
# ~95 s more for its autotuning, so BUDGET ~300):
#   BUDGET=200 bash .ci/h200/h36_gdn8.sh
# Within ${BUDGET:-200} s after setup (~30 s), 20 s of them kept in reserve. Steps, each cut by
# `timeout` to what is left:
#  1. (<= 70 s) the bf16-vs-fp32 GPU bars at K = V = 128, mixed decays, of the default and both rows
#     (`test_bf16_vs_fp32_on_gpu[k128-mixed]`, `test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-...168]`:
#     o and the final state within 5e-3 of the fp32 path without training, then a training step,
#     every gradient within 1e-2) -> gdn8_bars.txt;
#  2. the bench, `--impl ours_fwd,<rows> --profile` (the profile: the bench's per-kernel breakdown,
#     onboarding.bench.harness.kernel_breakdown of each row's step), one case a call so that a cut
#     keeps the earlier: B1T8192 (<= 80 s), B2T4096 (<= 60 s), then B1T32768 (what is left)
#     -> gdn8_bench_<case>.txt, gdn8_<case>.json.
# How to decide (graph ms, the `graph` column): a row faster than ours_fwd at all three shapes by
# more than the ~3% row-to-row spread, whose bars PASSED, becomes the bucket's; its prepare's line in
# the profile against the default's gdn_prepare_fwd_kernel says whether the cap did it. Against fla
# (thirty-fifth session, H100, graph): 0.326 ms at B2 T4096 H16, 0.573 at T8192; 1.3x needs <= 0.251
# and <= 0.441.
# Outputs under $OUT: env.txt, gdn8_bars.txt, gdn8_bench_*.txt, gdn8_*.json, gdn8.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-200} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/gdn8.tgz" -C "$O" $(cd "$O" && ls | grep -v '^gdn8.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=ours@prep_maxnreg=168_fwd,ours@fwd_o=fused+fused_kq=rows+prep_maxnreg=168_fwd
IMPL=ours_fwd,$ROWS
EXTRA=
if [ "${GDN8_FLA:-0}" = 1 ]; then IMPL=$IMPL,fla_fwd; EXTRA=$FLA_SITE; fi
T=tests/kernel_tests/test_gated_delta.py
stamp gdn8-bars
timeout "$(left 70)" python3 -m pytest -v -p no:cacheprovider -rxXs "$T::test_bf16_vs_fp32_on_gpu[k128-mixed]" \
  "$T::test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-prep_maxnreg=168]" \
  "$T::test_bf16_vs_fp32_on_gpu_fwd_o[k128-mixed-fwd_o=fused,fused_kq=rows,prep_maxnreg=168]" 2>&1 \
  | tee "$O/gdn8_bars.txt" | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
for c in B1T8192:80 B2T4096:60 B1T32768:1000; do
  case_=${c%%:*}; cap=${c##*:}
  stamp "gdn8-bench $case_"
  if [ "$(left 1000)" -lt 20 ]; then echo "$case_ skipped: $(left 1000) s left"; continue; fi
  PYTHONPATH=$EXTRA${EXTRA:+:}$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left "$cap")" onboard bench \
    --family gated_delta --case "^$case_" --impl "$IMPL" --profile --out "$O/gdn8_$case_.json" 2>&1 \
    | grep --line-buffered -v "^\s*$" | tee "$O/gdn8_bench_$case_.txt"
done
stamp end
