# H200 call (issue 33, helper h62): the sparse MLA forward with its score block split over the warp
# groups (FWD_SPLIT_SCORES, template v4) against the bucket's fused forward (`ours`: BLOCK_H 64,
# BLOCK_K 64, 2 stages, 8 warps), 128 heads, K 2048, d_qk 576 / d_v 512.
#   source .ci/h200/setup.sh && bash .ci/h200/h33_mla.sh        (carry: .whl)
# Why (sm_90 AOT, triton 3.6 and 3.9, docs/LOG.md "h62"): Triton lays a dot whose result feeds
# another dot out with all 8 warps along M, which over the 64 head rows makes both warp groups
# compute the whole 64 x 64 score block (72 m64n32 wgmma per warp group per key block, q read
# from shared memory twice). FWD_SPLIT_SCORES runs the softmax inside an always-taken branch so
# the score dots get a [4, 2] layout: 36 wgmma per warp group, each its own 32 key columns, 230 KB
# of shared memory with 3 stages (the index loads pipelined a block ahead).
# The rows (kernel_templates/sparse_attention/bench.py MLA_FWD_SWEEP, every option off by default):
#   FWD_SPLIT_SCORES=1,FWD_STAGES=3,FWD_ROW_END=1 / FWD_SPLIT_SCORES=1 / ...,FWD_STAGES=3 /
#   ...,FWD_ROW_END=1 / FWD_ROW_END=1 (the fused forward with row ends, for the split's own share).
# Steps, a BUDGET_S (default 230 s) from the first step:
# (1) GPU tests, timeout 70 s: test_gpu_bf16_accuracy for the split rows (bf16 output and every
#     gradient within 5e-3 / 1e-2 of the fp32 reference at T 1024, K 256, 128 heads x 576/512) and
#     test_split_scores_forward (compiled, fp32 dots: equal to the fused forward's o and lse).
# (2) `onboard bench --case 'mla-T8192-fwd$' --impl ours --profile`, timeout 80 s (6 rows; the
#     first compiles of the rows the tests did not build).
# (3) per-kernel profile of every row at T 8192 (h33_mla_profile.py), timeout 35 s.
# (4) T 32768 (6 rows, compiled by then) with what is left of the budget (skipped under 25 s).
# Outputs under $OUT, and again as $OUT/h33_mla.tgz: env.txt, mla_tests.txt, mla8k.json /
# mla8k_bench.txt, mla_profile.json / mla_profile.txt, mla32k.json / mla32k_bench.txt.
# What to read, in order:
# 1. mla_tests.txt: all passed (a failing split row's timings do not count).
# 2. mla8k_bench.txt: each row's ms and TFLOP/s (the case's useful FLOPs) against `ours`
#    (17.69 ms / 231 TFLOP/s on the H200 in call C). Goal: >= 350 TFLOP/s at T 8192 and 32768.
# 3. mla_profile.txt: per row `fwd_kernel_ms` and `fwd_kernel_tflops` (the forward kernel alone),
#    the row-end pass's kernels beside it.
# 4. The winning row's keys go into the d_le_1024 bucket (family.py, template_version bump, kernel PR).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${BUDGET_S:-230} - ($(date +%s) - t0) )); }
stamp mla-tests
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_sparse_attention.py -rxXs \
  -k "(gpu_bf16 and split_scores) or split_scores_forward" --durations=6 2>&1 | tee "$O/mla_tests.txt" | tail -14
stamp mla-bench-8k
# the trailing $ keeps the fwdbwd case out; the JSON is rewritten after each case
timeout 80 onboard bench --family sparse_attention --case 'mla-T8192-fwd$' --impl ours --profile \
  --out "$O/mla8k.json" 2>&1 | tee "$O/mla8k_bench.txt" | tail -24
stamp mla-profile
timeout 35 python3 .ci/h200/h33_mla_profile.py 8192 "$O/mla_profile.json" 2>&1 | tee "$O/mla_profile.txt" \
  | cut -c1-600
stamp mla-bench-32k
if [ "$(left)" -ge 25 ]; then
  timeout "$(left)" onboard bench --family sparse_attention --case 'mla-T32768-fwd$' --impl ours \
    --out "$O/mla32k.json" 2>&1 | tee "$O/mla32k_bench.txt" | tail -16
fi
stamp end
( cd "$O" && tar czf /tmp/h33_mla.tgz . && mv /tmp/h33_mla.tgz . )
