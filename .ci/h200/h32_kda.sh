# H200 call (issue 32): KDA's forward at the Kimi-Linear layout (H32 D128 bf16), the default
# prepare step (template v19: the fused one-kernel prepare, faster than v18's split one in the
# nineteenth session's call F) against fla 0.6's chunk_kda in the same run, and the same-input
# forward row of the alternative (bench.FWD_SWEEP): ours@kda_prep=split_fwd (the Gram products
# + Tm in kda_gram_fwd_kernel, w/u/kd/qg in kda_wu_fwd_kernel), at T8192 and T32768, with the
# per-kernel profile. First the family's GPU kernel tests (the bf16 bars against the fp32
# kernels, and the prepare configs on the GPU); their compiles fill the Triton cache the bench
# then reuses.
#   source .ci/h200/setup.sh && bash .ci/h200/h32_kda.sh     (carry .whl and .whl_fla)
# Expected: ~6 min (setup ~0.5; tests <= 90 s; bench <= 240 s, ~90 s of it fla's first-call
# autotuning). Outputs under $OUT: env.txt, kda_tests.txt, kda.json, kda_bench.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp kda-tests
T=tests/kernel_tests/test_kimi_delta.py
timeout 90 python3 -m pytest -q -p no:cacheprovider -rxXs --durations=8 "$T::test_bf16_vs_fp32_on_gpu" \
  "$T::test_prepare_runs_its_kernels" "$T::test_prepare_configs_equal_split" \
  "$T::test_gram_paths_mixed_in_one_call" 2>&1 | tee "$O/kda_tests.txt" | tail -25
stamp kda-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 240 onboard bench --family kimi_delta --case B1T8192H32D128 \
  --case B1T32768H32D128 --impl ours,ours_fwd,fla_fwd,ours@kda_prep=split_fwd \
  --profile --out "$O/kda.json" 2>&1 \
  | tee "$O/kda_bench.txt" | tail -80
stamp end
