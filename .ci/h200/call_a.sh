# H200 call A (eighteenth session): issue 27's last uncovered block timed (xLSTM's mLSTM backend,
# the safe rung, T 512: its graph unrolls per 64-token chunk, 862 ops at T 2048 against 162 at
# T 256), the recorded LLM kernels' gates on the GPU, and issue 35's ssd kernels (tests, bench).
#   source .ci/h200/setup.sh && bash .ci/h200/call_a.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp xlstm
timeout 210 onboard bench --blocks hf:xlstm --proxy small --seq 512 --dtype bf16 --start safe \
  --timeout 190 --out "$O/h27_xlstm.json" 2>&1 | tail -40
stamp gates
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_llm_router.py tests/test_llm_gate.py \
  -m "slow or not slow" -k "accepted_by_the_gate or kernel_matches or rejected" 2>&1 | tail -15
stamp ssd-tests
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py -m "not slow" -rxX 2>&1 | tail -15
stamp ssd-bench
timeout 160 onboard bench --family ssd --profile --out "$O/h35_ssd.json" 2>&1 | tail -60
stamp end
