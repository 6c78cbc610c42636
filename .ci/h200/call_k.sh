# Device call K (twenty-first session), the working tree: issue 34's tm_dot=tf32 fault at K = 64
# with the backward's Tm^T loaded transposed (gdn_k64.py on the template's render only), the dump
# of the proxy's worst gated-delta slices for the CPU (gdn_slice.py, fla on the path), then
# issue 32's KDA tiled backward's GPU bars (the `kda_qk: tiles` row, long enough to compile).
#   bash .ci/h200/call_k.sh      (carry .whl, .whl_fla)
set -o pipefail
O=${OUT:-/tmp/out}; mkdir -p "$O"
source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp gdn-k64
timeout 90 python3 .ci/h200/gdn_k64.py 8 2048 render > "$O/gdn_k64.txt" 2>&1; tail -12 "$O/gdn_k64.txt"
stamp gdn-slice
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 150 python3 .ci/h200/gdn_slice.py 7 8 2048 4 > "$O/gdn_slice.txt" 2>&1
tail -12 "$O/gdn_slice.txt"
stamp kda-bars
timeout 230 python3 -m pytest -v -p no:cacheprovider -rxXs \
  "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_bwd_sweep[kda_qk=tiles]" \
  > "$O/kda_bars.txt" 2>&1; tail -12 "$O/kda_bars.txt"
stamp end
