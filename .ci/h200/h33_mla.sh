# H200 call (issue 33, helper h33): the sparse MLA forward's open choices timed side by side
# (the default fused forward `ours` and the `ours@...` rows of bench.MLA_FWD_SWEEP: FWD_TWO_PASS,
# FWD_DV_SPLIT 2 with 128 heads per program, FWD_ROW_END, BLOCK_K 64), then the family's GPU
# tests of the gathered kernel (bf16 accuracy of each new forward at 128 heads x 576 / 512,
# the interpreter tests' shapes on the GPU). Total < 240 s.
#   source .ci/h200/setup.sh && bash .ci/h200/h33_mla.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp mla-bench
# forward cases only (the trailing $ leaves the -fwdbwd cases out); ours@... rows are the sweep;
# the JSON is rewritten after each case, so a run cut short keeps the T 8192 rows
timeout 150 onboard bench --family sparse_attention --case 'mla-T8192-fwd$' --case 'mla-T32768-fwd$' \
  --impl ours --out "$O/h33_mla_fwd.json" 2>&1 | tail -30
stamp tests
timeout 85 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_sparse_attention.py -rxX \
  -k "gpu_bf16 or value_split or gathered_forward_backward or indexer_feeds" --durations=8 2>&1 | tail -25
stamp end
