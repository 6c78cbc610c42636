# Device call G (twentieth session): issue 34's rejected gated-delta patch on the 4B Qwen3-Next
# proxy (h34_gdn.sh: the first step row's kernels_rejected), then the GPU-only kernel tests not
# yet run at HEAD: KDA (template v19) and ssd's bf16 bars rows.
#   source .ci/h200/setup.sh && bash .ci/h200/call_g.sh      (carry .whl)
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp gdn; TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-250} bash .ci/h200/h34_gdn.sh 2>&1 | tail -40
stamp kda-tests
T=tests/kernel_tests/test_kimi_delta.py
timeout 100 python3 -m pytest -q -p no:cacheprovider -rxXs --durations=5 "$T::test_bf16_vs_fp32_on_gpu" \
  "$T::test_prepare_runs_its_kernels" "$T::test_prepare_configs_equal_split" \
  "$T::test_gram_paths_mixed_in_one_call" > "$O/kda_tests.txt" 2>&1; tail -8 "$O/kda_tests.txt"
stamp ssd-bars
timeout 90 python3 -m pytest -q -p no:cacheprovider -rxXs tests/kernel_tests/test_ssd.py::test_bf16_vs_fp32_on_gpu \
  > "$O/ssd_bars.txt" 2>&1; tail -8 "$O/ssd_bars.txt"
stamp end
