# Device call O (twenty-second session): issue 34's K=64 faults. The bf16 bars' slow-decay K=64
# case under candidate K <= 64 bucket configs, one process each, launches blocking
# (gdn_k64bars.py), gated_delta's six then kimi_delta's default and 8 warps.
#   bash .ci/h200/call_o.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; mkdir -p "$D"
OUT=$D source .ci/h200/setup.sh || exit 1
BUDGET=${BUDGET:-330} python3 .ci/h200/gdn_k64bars.py 2>&1 | tee "$D/k64bars.txt"
