# H200 call (issue 33, helper moe24, twenty-fourth session): MoE experts template v15's backward
# options against the default (template v14's, `dw_grouped_mm`) and argsort + torch._grouped_mm,
# plus DeepSeek-V3's forward tile rows.
#   source .ci/h200/setup.sh && bash .ci/h200/h33_moe2.sh        (carry: .whl)
# Steps: (1) the GPU bf16 tests of the v15 rows (`test_backward_v15_configs_bf16_cuda`: every row
# of bench.MOE_V15_SWEEP at D 2048 and MOE_V15_SWEEP_BIG at D 7168 against the fp32 reference
# (1e-2) and the bucket default's run (2e-3), empty experts zero; timeout 60 s), then the new fp32
# tests of the interpreter on the GPU (timeout 30 s). (2) `onboard bench --impl ours,grouped_mm` (each case's `ours@...` rows come
# with `ours`): DeepSeek-V3 N8192 fwd+bwd (MOE_V15_SWEEP_BIG) and fwd (MOE_FWD_SWEEP_BIG), timeout
# 100 s; then Qwen3-Next uniform (MOE_V15_SWEEP) and Zipf (MOE_V15_SWEEP_SHORT) fwd+bwd, timeout 60 s.
# (3) DeepSeek-V3 N32768 fwd+bwd (MOE_V15_SWEEP_SHORT), timeout $N32768_S (default 45 s; 0 skips).
# Expected ~4.5 min with setup (worst case the timeouts, 60 + 30 + 100 + 60 + 45 s, + setup ~30 s).
# Outputs under $OUT, and all of them again as $OUT/h33_moe2.tgz:
# env.txt (setup), moe2_tests.txt, moe2.json / moe2_bench.txt (DeepSeek-V3 N8192), moe2_qwen.json /
# moe2_qwen_bench.txt, moe2_32k.json / moe2_32k_bench.txt.
# What to read: moe2_tests.txt first (all passed, or the row that failed is out). Then per case
# the `ours` row's ratio against grouped_mm (interleaved medians) and each `ours@...` row's ms (its
# ratio = grouped_mm ms / row ms). Decide per bucket (_GPU_TILES for D <= 4k, _GPU_TILES_BIG for
# DeepSeek-V3): the fastest row whose keys pass step (1) becomes the default (family.py, with a
# template_version bump and a kernel PR). Goals: fwd+bwd >= 1.2x grouped_mm at DeepSeek-V3
# N8192 / N32768 and Qwen3-Next uniform / Zipf; the forward >= 1.3x at every shape.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp moe2-tests
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs \
  -k "v15_configs_bf16_cuda" --durations=4 2>&1 | tee "$O/moe2_tests.txt" | tail -12
# the CPU tests of the new paths on the GPU (fp32, CI's half): optional, cut at 30 s
timeout 30 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs -m "not slow" \
  -k "sorted_rows_and_split or gathered_once" --durations=4 2>&1 | tee -a "$O/moe2_tests.txt" | tail -8
stamp moe2-bench
# the trailing $ keeps each name to its own case (fwdbwd, not fwdbwd_frozen); the JSON is rewritten
# after each case, so a run cut short keeps the cases done. DeepSeek-V3 N8192 first (a bench runs
# its cases in the family's order, so it gets its own call): it decides the most.
timeout 100 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' \
  --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwd$' \
  --impl ours,grouped_mm --out "$O/moe2.json" 2>&1 | tee "$O/moe2_bench.txt" | tail -30
stamp moe2-bench-qwen
timeout 60 onboard bench --family moe_experts --case 'qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd$' \
  --case 'qwen3_next/E512K10D2048F512N8192/zipf/fwdbwd$' \
  --impl ours,grouped_mm --out "$O/moe2_qwen.json" 2>&1 | tee "$O/moe2_qwen_bench.txt" | tail -25
stamp moe2-bench-32k
if [ "${N32768_S:-45}" != 0 ]; then
  timeout "${N32768_S:-45}" onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N32768/uniform/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe2_32k.json" 2>&1 | tee "$O/moe2_32k_bench.txt" | tail -15
fi
stamp end
( cd "$O" && tar czf h33_moe2.tgz --exclude=h33_moe2.tgz . )
