# H200 call (issue 34, helper pair_sum, twenty-sixth session): expert parallelism's pair sums (the
# combine and the token gather's backward) as one Triton kernel (kernel_templates/pair_sum, variant
# `gather`; attached by attach_pair_sum_kernels), and the torch path it replaces, with
# embedding_bag (the path before that) as an anchor. Not run yet.
#   bash .ci/h200/pair_sum.sh        (carry: .whl)
# Steps: one pytest run with -s, timeout 40 s: tests/kernel_tests/test_pair_sum.py on CUDA (the
# kernel against exact sums at odd widths and k 1-17, bf16 within one rounding to nearest, the
# contract in fp32/fp16/bf16, determinism, the attach/check tests, and
# `test_cuda_proxy_shape_bf16_and_timing`: 16384 x top-8 x D 2048 bf16 against the fp32 sums,
# bit-equal run to run, then the kernel's time beside gather + sum and embedding_bag), and
# tests/test_moe_swiglu_kernel.py's `test_cuda_pair_sums_by_embedding_bag_proxy_shape_and_timing`
# (gather + sum against embedding_bag, as LOG call Y: 0.501 against 0.717 ms).
# Expected < 60 s with setup (~20 s). Outputs under $OUT and all of them again as
# $OUT/pair_sum.tgz: env.txt, pair_sum_tests.txt.
# What to read: pair_sum_tests.txt (all passed, or the bar that failed), then the two printed
# "pair sums 16384x8 rows of 2048 bf16" lines: the kernel's ms and TB/s (the memory-bound ideal
# is ~0.15 ms: 604 MB at ~4 TB/s) against gather + sum and embedding_bag.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp pair-sum-tests
timeout 40 python3 -m pytest -q -s -p no:cacheprovider -rxXs --durations=5 \
  tests/kernel_tests/test_pair_sum.py \
  "tests/test_moe_swiglu_kernel.py::test_cuda_pair_sums_by_embedding_bag_proxy_shape_and_timing" \
  2>&1 | tee "$O/pair_sum_tests.txt" | tail -25
stamp end
( cd "$O" && tar czf pair_sum.tgz --exclude=pair_sum.tgz . )
