# H200 call C (eighteenth session): ssd's new backward and the mamba-ssm anchor (issue 35),
# selective_scan's new tile order (issue 35), the sparse MLA forward variants (issue 33), and
# the LLM-gate tests that failed on the GPU in call B, with their reasons (issue 27).
#   source .ci/h200/setup.sh && bash .ci/h200/call_c.sh     (carry .whl and .anchors)
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp ssd
ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors timeout 175 onboard bench --family ssd --case B1T8192 \
  --impl ours,ours_fwd,eager_fwd,mamba_ssm,mamba_ssm_fwd --profile --out "$O/h35_ssd.json" 2>&1 \
  | grep -v "^[0-9:]*   " | tail -45
stamp scan
timeout 100 onboard bench --family selective_scan --case '^B1T4096D5120N16$' \
  --impl ours,ours_fwd,eager_fwd --out "$O/h35_scan.json" 2>&1 | grep -v "^[0-9:]*   " | tail -25
stamp mla
timeout 140 onboard bench --family sparse_attention --case 'mla-T8192-fwd$' --case 'mla-T32768-fwd$' \
  --impl ours --out "$O/h33_mla_fwd.json" 2>&1 | grep -v "^[0-9:]*   " | tail -25
stamp gates
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_llm_router.py tests/test_llm_gate.py \
  -m "slow or not slow" -k "accepted_by_the_gate or kernel_matches or hidden_reference" --tb=short \
  2>&1 | grep -E "^E |Error|passed|failed|assert" | tail -30
stamp end
