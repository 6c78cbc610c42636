# H200 call (the sink_attention family, new in the thirty-third session; untimed so far): gpt-oss's
# attention core (per-head sinks, sliding window 128 or full causal, 64 query / 8 KV heads, head
# dim 64). Self-contained (sources setup.sh); carry .whl:
#   bash .ci/h200/h37_sink.sh
# Within ${BUDGET:-300} s (30 s kept for setup and packing), per-step limits:
#  1. the family's kernel tests on the GPU (`tests/kernel_tests/test_sink_attention.py -m "not slow"`:
#     bf16 / fp16 / fp32 forward and every gradient against the reference, the binding on
#     transformers' own gpt-oss attention) (<= 100 s) -> sink_tests.txt;
#  2. `onboard bench --family sink_attention --profile` (<= 150 s): ours (the window as a band
#     by index), ours_mask (transformers' additive mask handed too, as the binding runs it),
#     eager (transformers' eager sink attention) and compile, wall and CUDA-graph ms, the bf16
#     check -> sink_bench.txt, sink.json.
# Read: ours / eager and ours / compile per case; ours_mask against ours (what the mask costs the
# binding); the check's o and gradients within 0.005 / 0.01.
# Outputs under $OUT: env.txt, sink_tests.txt, sink_bench.txt, sink.json, sink.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-300} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/sink.tgz" -C "$O" $(cd "$O" && ls | grep -v '^sink.tgz$') 2>/dev/null; }
trap pack EXIT
stamp sink-tests
timeout "$(left 100)" python3 -m pytest -q -m "not slow" -p no:cacheprovider -rxXs \
  tests/kernel_tests/test_sink_attention.py 2>&1 | tee "$O/sink_tests.txt" | tail -15
stamp sink-bench
PYTHONUNBUFFERED=1 timeout "$(left 150)" onboard bench --family sink_attention --profile \
  --out "$O/sink.json" 2>&1 | grep --line-buffered -v "^\s*$" | tee "$O/sink_bench.txt"
stamp end
