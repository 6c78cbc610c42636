# H200 call (issue 33, helper-57): MoE experts template v17's options against the default (v16's:
# `dw_grouped_mm`, v15's backward rows) and argsort + torch._grouped_mm at DeepSeek-V3 and Qwen3-Next.
#   source .ci/h200/setup.sh && bash .ci/h200/h33_moe3.sh        (carry: .whl)
# The rows (kernel_templates/moe_experts/bench.py, MOE_V17_*; every option off by default). Each
# puts two or three programs on an SM so that one's epilogue runs under another's MMAs (sm_90 AOT
# registers / shared memory in bench.py's v17 notes):
#   dw_grouped_mm=False,dw_persistent=2,dw_sorted,dw_tma,dw_warps=4,dw_pad: both weight gradients
#     by our persistent kernel on slot-ordered rows loaded by TMA, the gathered operand padded per
#     expert with zero rows (both operands to the MMA from shared memory), 128 x 128 on one
#     warpgroup, instead of torch's CUTLASS (at these M, N its K-grouped schedule is cooperative
#     128 x 256 x 64: nothing overlaps the epilogue of a tile's four K steps); also on 8 warps x 2
#     stages (dw_warps=8,dw_stages=2), and without the padding (a's rows masked in registers).
#   bwd_warps=4,dx_warps=8,bwd_epi_split=4: the down backward on one warpgroup (m64n128 MMAs).
#   DOWN_BLOCK_N=128,down_stages=3,down_warps=4: the forward down GEMM on 128 x 128, one warpgroup.
#   h_tma (fwd case only): the forward down GEMM's h rows by TMA.
# Steps: (1) `test_v17_configs_bf16_cuda` (every row at D 2048 and D 7168: the output and every
# gradient within 1e-2 of the fp32 reference and 2e-3 of the bucket default's run; empty experts'
# weight gradients zero; D 7168 first), timeout 70 s. (2) `onboard bench --impl ours,grouped_mm --profile`,
# DeepSeek-V3 N8192 fwd+bwd (MOE_V17_SWEEP_BIG, 6 rows), timeout 75 s; then its fwd
# (MOE_V17_FWD_SWEEP_BIG, 3 rows), timeout 40 s. (3) the per-kernel profile of every fwd+bwd row
# at N8192 (h33_moe3_profile.py; the bench profiles `ours` only), timeout 35 s. (4) Qwen3-Next
# uniform (MOE_V17_SWEEP) and Zipf (MOE_V17_SWEEP_SHORT) fwd+bwd with what is left of a 220 s
# budget from the first step (BUDGET_S; skipped under 20 s left, or with QWEN=0). (5) only with
# N32768=1: DeepSeek-V3 N32768 fwd+bwd (MOE_V17_SWEEP_SHORT) with what is left after that.
# Expected ~3.5-4 min with setup: steps (1)-(3) take at most 70 + 75 + 40 + 35 = 220 s, step (4)
# only what the budget leaves; setup ~30 s on top. Outputs under $OUT, and again as $OUT/h33_moe3.tgz:
# env.txt (setup), moe3_tests.txt, moe3.json / moe3_bench.txt (DeepSeek-V3 N8192 fwd+bwd),
# moe3_fwd.json / moe3_fwd_bench.txt, moe3_profile.json / moe3_profile.txt, moe3_qwen.json /
# moe3_qwen_bench.txt, moe3_32k.json / moe3_32k_bench.txt.
# What to read, in order:
# 1. moe3_tests.txt: `2 passed`. A failure names the row (its config dict) and the output index
#    (0 y, 1 dx, 2 d topk_weights, 3 d gate_up, 4 d down): that row's timing does not count. Cut
#    by the timeout (mostly Triton compiles of the new variants): the rows stay unchecked; rerun
#    the step alone (`-k v17_configs_bf16_cuda`, ~2 min) before a default changes.
# 2. moe3_bench.txt: `ours` against grouped_mm and each `ours@...` row's ms. Goal at DeepSeek-V3
#    N8192 fwd+bwd: <= grouped_mm ms / 1.2 (~43.6 ms at today's 52.3). A row beats `ours` when it
#    is faster by more than ~1% (single medians). moe3_fwd_bench.txt likewise (goal: >= 1.3x).
# 3. moe3_profile.txt, per row the kernel ms: for the dw_tma rows `moe_dw_persistent_kernel` (2
#    launches) against `ours`'s CUTLASS grouped GEMM (16.8 ms today; its name starts
#    `void cutlass::device_kernel<`) plus what the rows add: the dw_pad rows one more dy gather
#    and two index builds (`vectorized_gather_kernel` ~0.5 ms more than `ours`'s 0.93, the `cat`
#    copies), the dw_tma rows none. Below 16.8 together is a win. For bwd_warps=4, `moe_down_bwd_kernel`
#    (5.36 ms today; `moe_dx_kernel` unchanged); for down_warps=4, `moe_down_fwd_kernel` (4.99).
# 4. Decide per bucket (_GPU_TILES_BIG for D > 4096, _GPU_TILES for D <= 4096): the keys of the
#    fastest passing row, or of the winning pieces combined, go into the bucket (family.py,
#    template_version bump, kernel PR); where Qwen3-Next disagrees, only _GPU_TILES_BIG changes.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp moe3-tests
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs \
  -k "v17_configs_bf16_cuda" --durations=4 2>&1 | tee "$O/moe3_tests.txt" | tail -12
stamp moe3-bench
# the trailing $ keeps each name to its own case (fwdbwd, not fwdbwd_frozen); the JSON is rewritten
# after each case, so a run cut short keeps the cases done. A bench runs its cases in the family's
# order (fwd before fwdbwd): the fwd+bwd case, which decides the most, gets its own call first.
timeout 75 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' \
  --impl ours,grouped_mm --profile --out "$O/moe3.json" 2>&1 | tee "$O/moe3_bench.txt" | tail -30
stamp moe3-bench-fwd
timeout 40 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwd$' \
  --impl ours,grouped_mm --profile --out "$O/moe3_fwd.json" 2>&1 | tee "$O/moe3_fwd_bench.txt" | tail -20
stamp moe3-profile
timeout 35 python3 .ci/h200/h33_moe3_profile.py 8192 "$O/moe3_profile.json" 2>&1 | tee "$O/moe3_profile.txt" \
  | cut -c1-400
stamp moe3-bench-qwen
# what is left of the budget (BUDGET_S, default 220 s from the first step)
left() { echo $(( ${BUDGET_S:-220} - ($(date +%s) - t0) )); }
if [ "${QWEN:-1}" = 1 ] && [ "$(left)" -ge 20 ]; then
  timeout "$(left)" onboard bench --family moe_experts --case 'qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd$' \
    --case 'qwen3_next/E512K10D2048F512N8192/zipf/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe3_qwen.json" 2>&1 | tee "$O/moe3_qwen_bench.txt" | tail -20
fi
stamp moe3-bench-32k
if [ "${N32768:-0}" = 1 ] && [ "$(left)" -ge 20 ]; then
  timeout "$(left)" onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N32768/uniform/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe3_32k.json" 2>&1 | tee "$O/moe3_32k_bench.txt" | tail -12
fi
stamp end
( cd "$O" && tar czf /tmp/h33_moe3.tgz . && mv /tmp/h33_moe3.tgz . )
