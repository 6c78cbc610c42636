# H200 call (issue 34, helper ce24, twenty-fourth session): the training loss as one Triton kernel
# (kernel_templates/cross_entropy, variant `fused`; attached by attach_loss_kernel). Not run yet.
#   bash .ci/h200/ce24.sh        (carry: .whl)
# Steps: (1) the GPU tests of the new family: the bf16 bars at 16384 x 32000, 8192 x 151936 and
# 333 x 1000 (`test_bf16_bars_on_gpu`: fp32 F.cross_entropy within 5e-3 / 1e-2 rel RMS, and
# check_loss_kernel against _ChunkedCE on bf16 logits) plus the rest of the file on CUDA (the
# attach tests, the contract in fp32/fp16/bf16), timeout 40 s. (2) `onboard bench --family
# cross_entropy`: both cases, rows ours, eager (F.cross_entropy on fp32 logits, as transformers),
# compile, eager_bf16 and chunked (the worker's _ChunkedCE, what the kernel replaces), timeout 60 s.
# Expected < 120 s with setup (~20 s). Outputs under $OUT and all of them again as $OUT/ce24.tgz:
# env.txt, ce24_tests.txt, ce24.json / ce24_bench.txt.
# What to read: ce24_tests.txt (all passed, or the bar that failed); then per case ours against
# chunked (the issue's goal: ~1 ms against ~5 ms at 16384 x 32000, fwd+bwd) and against compile.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp ce24-tests
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_cross_entropy.py -rxXs \
  --durations=5 2>&1 | tee "$O/ce24_tests.txt" | tail -15
stamp ce24-bench
timeout 60 onboard bench --family cross_entropy --out "$O/ce24.json" 2>&1 \
  | tee "$O/ce24_bench.txt" | tail -30
stamp end
( cd "$O" && tar czf ce24.tgz --exclude=ce24.tgz . )
