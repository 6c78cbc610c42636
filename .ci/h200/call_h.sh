# Device call H (twentieth session): issue 34's gated-delta accuracy diagnostic on the 4B
# Qwen3-Next-style proxy's forward (gdn_diag.py: ours, ours variants, fla, the fp32 path under
# bf16-sized input perturbations, per layer), then the KDA GPU kernel tests (SIGINT at the limit
# so pytest prints what ran).
#   source .ci/h200/setup.sh && bash .ci/h200/call_h.sh      (carry .whl, .whl_fla)
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp diag
PYTHONPATH=${FLA_SITE:+$FLA_SITE:}$PYTHONPATH timeout 200 python3 .ci/h200/gdn_diag.py 8 2048 2>&1 | grep -v "^\[transformers\]" | tee "$O/gdn_diag.txt"
stamp kda-tests
T=tests/kernel_tests/test_kimi_delta.py
timeout -s INT ${KDA_TIMEOUT:-150} python3 -m pytest -v -p no:cacheprovider -rxXs --durations=5 "$T::test_bf16_vs_fp32_on_gpu" \
  "$T::test_prepare_runs_its_kernels" "$T::test_prepare_configs_equal_split" \
  "$T::test_gram_paths_mixed_in_one_call" > "$O/kda_tests.txt" 2>&1; tail -15 "$O/kda_tests.txt"
stamp end
