# H200 call (issue 32, KDA template v28): the forward's "pipelined" prepare step (the default from
# v26: `kda_prepare_fwd_kernel` with its Gram pass a straight loop that Triton pipelines, chunks
# with strong decays redone by the tiers; one kernel with "fused" from v28, PIPE_GRAM) against the
# former default "fused" (the tiered Gram pass, bench row ours@kda_prep=fused_fwd) and fla 0.6's
# chunk_kda at the Kimi-Linear layout (B1 H32 K = V = 128 bf16), T8192 and T32768. Self-contained:
# sources setup.sh. Carry .whl and .whl_fla:
#   bash .ci/h200/h32_kda3.sh
# Within ${BUDGET:-420} s, not the ~220 s first asked: its steps as timed on the H200 (twenty-eighth
# session): setup ~30 s; the bench ~160 s (our first row's compiles 34 s, fla's first call 95 s
# with its autotuning, the pipelined row 5 s, T32768 16 s); the bars 185 s (they build the forward
# and backward in bf16 and fp32). A 220 s form (bars first, 60 s) was cut in both steps.
#  1. `onboard bench --family kimi_delta --case B1T8192H32D128 --case B1T32768H32D128 --impl
#     ours_fwd,fla_fwd,ours@kda_prep=fused_fwd --profile` (wall and CUDA-graph ms, the default's
#     kernels) -> kda3_bench.txt (printed as it goes), kda3.json;
#  2. the bf16-vs-fp32 GPU bars of the default (`test_bf16_vs_fp32_on_gpu`: forward and every
#     gradient, mixed decays: chunks of both paths of "pipelined") -> kda3_bars.txt.
# Outputs under $OUT: env.txt, kda3_bench.txt, kda3.json, kda3_bars.txt, kda3.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-420} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kda3.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kda3.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=ours@kda_prep=fused_fwd
stamp kda3-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left 200)" onboard bench --family kimi_delta \
  --case B1T8192H32D128 --case B1T32768H32D128 --impl "ours_fwd,fla_fwd,$ROWS" --profile --out "$O/kda3.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kda3_bench.txt"
stamp kda3-bars
timeout "$(left 220)" python3 -m pytest -v -p no:cacheprovider -rxXs tests/kernel_tests/test_kimi_delta.py \
  -k "bf16_vs_fp32_on_gpu and not sweep" 2>&1 | tee "$O/kda3_bars.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
stamp end
