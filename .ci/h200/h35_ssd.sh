# H200: issue 35's ssd family at template v6 (the dB/dC backward redesigned, N tiles DBC_N and
# STATE_N, state passes loading a step ahead, config pass "fused", C B^T once per group, dB/dC over P tiles): the
# kernel tests (bf16 vs fp32 bars on the GPU, every gradient) and the bench with its kernel
# profile and sweep. The tests compile many kernel variants: if they hit their 100 s, the tail
# shows how far they got and the bench still runs.
#   source .ci/h200/setup.sh && bash .ci/h200/h35_ssd.sh
# Expected: ~4-5 min (setup ~0.5, tests <= 100 s, bench <= 170 s). Outputs under $OUT:
# env.txt (setup), h35_ssd_tests.txt, h35_ssd.json, h35_ssd_bench.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp ssd-tests
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py -m "not slow" -rxXs \
  --durations=8 2>&1 | tee "$O/h35_ssd_tests.txt" | tail -25
stamp ssd-bench
timeout 170 onboard bench --family ssd --profile --out "$O/h35_ssd.json" 2>&1 | tee "$O/h35_ssd_bench.txt" | tail -70
stamp end
