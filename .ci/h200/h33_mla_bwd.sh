# H200 call (issue 33): the split MLA backward (BWD_SPLIT 1, sparse_attention template v6, off by
# default) against the bucket's fused backward (`ours`), forward + backward, 128 heads, K 2048,
# d_qk 576 / d_v 512, bf16.
#   source .ci/h200/setup.sh && bash .ci/h200/h33_mla_bwd.sh        (carry: .whl)
# Decides whether BWD_SPLIT (and which tiles) goes into the d_le_1024 bucket. Why: the fused
# backward (one program per query and 32 heads) adds its [16, 576] fp32 dkv partial per key block
# with atomics, once per head block: T K 576 4 B x 4 head blocks = 155 GB at T 8192, which bounds
# it (163.6 ms of the 182.6 ms fwd+bwd step, 79 TFLOP/s). BWD_SPLIT runs a dq kernel (no atomics,
# rows stopped at their last valid index) and a dkv kernel (per query and 64 selected keys, all
# 128 heads walked in its loop, one fp32 add per query and key: 4x fewer); both recompute the
# scores and dp (~40% more FLOPs). Goal: fwd+bwd >= 150 TFLOP/s at T 8192 (backward <= ~65 ms).
# The rows (kernel_templates/sparse_attention/bench.py MLA_FWDBWD_SWEEP): dq 64 heads x 32 keys
# with dkv 64 keys x 32 or 16 heads, 1 or 2 stages; dq 64 x 16; the bucket's tiles (dq 32 x 16).
# Run in the thirty-first session (docs/LOG.md, call 5); the winner (dq 64 x 32, dkv 64 x 32, 2
# stages) became the bucket's default in template v7, and MLA_FWDBWD_SWEEP now holds the rows
# beside it (the fused backward, 1 stage, 16-head dkv steps, 16-key dq steps); the test rows are
# [mla-bwd-fused], [mla-bwd-split-1stage] and the default [mla-h128-576-512] (the adopted
# 2-stage backward under its bars). Run again, this script times and checks those.
# Steps, a BUDGET_S (default 240 s) from the first step:
# (1) GPU tests, timeout 80 s: test_gpu_bf16_accuracy for the split rows (bf16 output and every
#     gradient within 5e-3 / 1e-2 of the fp32 reference at T 1024, K 256, 128 heads x 576/512) and
#     test_mla_split_backward (compiled, fp32 dots: equal to the fused backward and the reference).
# (2) `onboard bench --case 'mla-T8192-fwdbwd' --impl ours --profile`, timeout 150 s (7 rows; the
#     rows the tests did not build compile first).
# (3) T 32768 (7 rows, compiled by then) when 60 s or more of the budget are left.
# (4) per-kernel profile of every row at T 8192 (h33_mla_bwd_profile.py: dq / dkv / fused
#     backward kernel ms and TFLOP/s) with what is left (skipped under 30 s). BUDGET_S=420 runs
#     all four.
# Outputs under $OUT, and again as $OUT/h33_mla_bwd.tgz: env.txt, mla_bwd_tests.txt, mla8k_fb.json /
# mla8k_fb_bench.txt, mla32k_fb.json / mla32k_fb_bench.txt, mla_bwd_profile.json / .txt.
# What to read, in order:
# 1. mla_bwd_tests.txt: all passed (a failing split row's timings do not count).
# 2. mla8k_fb_bench.txt: each row's ms and TFLOP/s (the case's useful fwd+bwd FLOPs) against
#    `ours` (182.6 ms / 79 TFLOP/s on the H200). Goal: >= 150 TFLOP/s.
# 3. mla32k_fb_bench.txt: the same at T 32768 (linear in T: about 4x the 8k times).
# 4. mla_bwd_profile.txt: per row `bwd_kernel_ms` (dq + dkv kernels, or the fused one) and the
#    kernels beside it (the forward, delta, the row-end pass, the fp32 dkv cast).
# 5. The winning row's keys go into the d_le_1024 bucket (family.py, template_version bump).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${BUDGET_S:-240} - ($(date +%s) - t0) )); }
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
stamp mla-bwd-tests
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_sparse_attention.py -rxXs \
  -k "(gpu_bf16 and (mla-bwd or mla-h128)) or test_mla_split_backward" --durations=6 2>&1 | tee "$O/mla_bwd_tests.txt" | tail -14
stamp mla-fwdbwd-8k
if [ "$(left)" -ge 30 ]; then
  timeout "$(cap 150)" onboard bench --family sparse_attention --case 'mla-T8192-fwdbwd' --impl ours --profile \
    --out "$O/mla8k_fb.json" 2>&1 | tee "$O/mla8k_fb_bench.txt" | tail -30
fi
stamp mla-fwdbwd-32k
if [ "$(left)" -ge 60 ]; then
  timeout "$(left)" onboard bench --family sparse_attention --case 'mla-T32768-fwdbwd' --impl ours \
    --out "$O/mla32k_fb.json" 2>&1 | tee "$O/mla32k_fb_bench.txt" | tail -16
fi
stamp mla-bwd-profile
if [ "$(left)" -ge 30 ]; then
  timeout "$(left)" python3 .ci/h200/h33_mla_bwd_profile.py 8192 "$O/mla_bwd_profile.json" 2>&1 \
    | tee "$O/mla_bwd_profile.txt" | cut -c1-700
fi
stamp end
( cd "$O" && tar czf /tmp/h33_mla_bwd.tgz . && mv /tmp/h33_mla_bwd.tgz . )
