# H200 call (issue 33, helper moe20, twentieth session): MoE experts fwd+bwd against
# argsort + torch._grouped_mm, with the weight gradients by torch._grouped_mm (config
# `dw_grouped_mm`, moe_experts template v14) and the backward's other open choices as sweep rows.
#   source .ci/h200/setup.sh && bash .ci/h200/h33_moe.sh        (carry: .whl)
# Steps: (1) the GPU tests of the backward configs in bf16 (each of BF16_BWD_CONFIGS against the
# grid kernels' run and the fp32 reference, empty experts zero; the grouped_mm weight gradients of
# the mlp and bias renders; the interpreter's grouped_mm tests in fp32, where the Triton kernels
# must keep the gradients; timeout 75 s); (2) `onboard bench` of DeepSeek-V3 N8192, Qwen3-Next
# uniform and Zipf fwd+bwd, `--impl ours,grouped_mm`: each case also times its `ours@...` rows
# (bench.SWEEPS: MOE_BWD_SWEEP_BIG, MOE_DW_SWEEP, MOE_DW_SWEEP_SHORT; they come with `ours`),
# timeout 150 s; (3) DeepSeek-V3 N32768 fwd+bwd the same way (timeout $N32768_S, default 60 s).
# Expected ~4 min (setup ~0.5 min, tests <= 75 s, three cases ~120 s with the sweep rows'
# compiles, N32768 <= 60 s). Outputs under $OUT: env.txt (setup), moe_tests.txt, moe.json /
# moe_bench.txt, moe32k.json / moe32k_bench.txt. What to read: in moe_bench.txt, per case the
# `ours` row's ratio against grouped_mm, and each `ours@...` row's ms (its ratio to grouped_mm =
# grouped_mm ms / row ms); the goal is >= 1.2x at every case; the best row per bucket is its
# new default (family.py's _GPU_TILES / _GPU_TILES_BIG, with a template_version bump).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp moe-tests
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs \
  -k "backward_configs_bf16_cuda or grouped_mm" --durations=6 2>&1 | tee "$O/moe_tests.txt" | tail -15
stamp moe-bench
# the trailing $ keeps each name to its fwdbwd case (not fwdbwd_frozen); the JSON is rewritten
# after each case, so a run cut short keeps the cases done
timeout 150 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' \
  --case 'qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd$' --case 'qwen3_next/E512K10D2048F512N8192/zipf/fwdbwd$' \
  --impl ours,grouped_mm --out "$O/moe.json" 2>&1 | tee "$O/moe_bench.txt" | tail -40
stamp moe-bench-32k
if [ "${N32768_S:-60}" != 0 ]; then  # N32768_S=0 skips it
  timeout "${N32768_S:-60}" onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N32768/uniform/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe32k.json" 2>&1 | tee "$O/moe32k_bench.txt" | tail -15
fi
stamp end
