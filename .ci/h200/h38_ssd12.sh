# Ran once (thirty-ninth session's call 1, H100, at bccc7ae): the three bars rows passed; "exp2"
# won by both clocks and is the P <= 64 bucket's `bwd_exp` since ssd v23, which removed
# `bwd_prefetch` (kernel_templates/ssd/family.py has the numbers). Since v23 its rows are gone:
# the bars' -k "v22" selects [v22-exp] (the former default), and --impl names rows that no longer
# exist (bench.py's SWEEP is `ours@bwd_exp=exp`). Not to be run again as it is.
# Device call for issue 35 (H200, or an H100: the last calls got one), ssd template v22 toward
# fwd+bwd <= 3x the forward at B1 T8192 H128 P64 G8 N128 bf16. The thirty-seventh session's call 1
# (H100, triton 3.6, h36_ssd11.sh, CUDA graph): the default ("paired", `bwd_sums` "kernel") 1.753 ms,
# forward 0.462 (3.79x; 3x is about 1.39). The thirty-eighth session's ncu profile (h37_ncu.sh) of
# its ssd_bwd_split_fused_kernel (0.94 ms): one 8-warp program per SM, issue active 36%, stalls
# short scoreboard / wait / selected / barrier / long scoreboard; FMUL and FADD the most issued
# opcodes; the top sampled instruction (cs_last - cs, each head's first) waits on that head's cs load.
# v22 adds two options of that kernel, both off by default:
#  - `bwd_exp` "exp2": its exponentials as one MUFU.EX2 each (exp2 of cs in log2 units) instead of
#    tl.exp's multiply, range check, MUFU.EX2 and fix-up; sm_90 bf16 build (triton 3.9): head loops
#    823 (dC / dB) and 1151 (dx) instructions against 914 / 1253, 246 registers against 254;
#  - `bwd_prefetch`: each head's cs and dt loaded one head ahead (255 registers; with "exp2" 811 /
#    1125 instructions, 16 bytes of stack outside the loops).
# Expected from the instruction counts only; nothing of v22 is timed.
# Self-contained: sources setup.sh. Carry .whl:
#   BUDGET=170 bash .ci/h200/h38_ssd12.sh        (~200 s with setup)
#   SSD12_DRY=1 bash .ci/h200/h38_ssd12.sh       (CPU: the rows each step would run, nothing timed)
# Within ${BUDGET:-170} s after setup (~30 s), 20 s of them kept in reserve:
#  1. (<= 60 s) the bf16-vs-fp32 bars with --runxfail: test_bf16_vs_fp32_on_gpu [v22-exp2],
#     [v22-pre], [v22-exp2-pre] (PASSED is within the bars; a FAILED row prints its errors)
#     -> ssd_bars.txt;
#  2. (<= 90 s) the bench: ours, ours_fwd, then bench.py's SWEEP (the rows `ours` brings, named
#     here too): ours@bwd_exp=exp2, ours@bwd_prefetch=True, ours@bwd_exp=exp2,bwd_prefetch=True
#     -> ssd_bench.txt (rows printed as they finish: a cut keeps the first), ssd.json.
# How to decide (graph ms: the `graph` column, ssd.json "graph_ms"): a v22 row faster than `ours`
# in this run by more than the row-to-row spread (~2-6%), by graph and by wall, whose bars row
# PASSED, can become the P <= 64 bucket's value (family.py shape_buckets: `bwd_exp` "exp2" and / or
# `bwd_prefetch` True). The goal stays fwd+bwd <= 3 x ours_fwd by graph.
# Outputs under $OUT: env.txt, ssd_bars.txt, ssd_bench.txt, ssd.json, ssd12.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
DRY=${SSD12_DRY:-0}
if [ "$DRY" != 1 ]; then
  OUT=$O source .ci/h200/setup.sh || exit 1
fi
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-170} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/ssd12.tgz" -C "$O" $(cd "$O" && ls | grep -v '^ssd12.tgz$') 2>/dev/null; }
trap pack EXIT
IMPL=ours,ours_fwd,ours@bwd_exp=exp2,ours@bwd_prefetch=True,ours@bwd_exp=exp2,bwd_prefetch=True
stamp ssd-bars
if [ "$DRY" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py --co -k "bf16_vs_fp32_on_gpu and v22" \
    2>&1 | tee "$O/ssd_bars.txt"
else
  timeout "$(left 60)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py --runxfail \
    -k "bf16_vs_fp32_on_gpu and v22" -rfs 2>&1 | tee "$O/ssd_bars.txt" \
    | grep -E "PASSED|FAILED|ERROR|relative RMS|passed|failed"
fi
stamp ssd-bench
if [ "$DRY" = 1 ]; then
  onboard bench list --family ssd --case '^B1T8192H128' --json 2>&1 | tee "$O/ssd_bench.txt"
else
  # rows print as they come (Python unbuffered, grep line-buffered), blank lines dropped
  PYTHONUNBUFFERED=1 timeout "$(left 90)" onboard bench --family ssd --case '^B1T8192H128' \
    --impl "$IMPL" --out "$O/ssd.json" 2>&1 | grep --line-buffered -v "^\s*$" | tee "$O/ssd_bench.txt"
fi
stamp end
