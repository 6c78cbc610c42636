# H200: re-run of the two LLM-gate tests that failed on the GPU in call C (issue 27), after the
# block check's flipped-row exclusion (df805e5) and the device-agnostic cheat cassettes; plus the
# CPU-designed flip tests and the mLSTM correct answer's gate (its reference builds its initial
# states on the inputs' device now).
#   source .ci/h200/setup.sh && bash .ci/h200/h27_gate.sh     (about 3 minutes warm)
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp gates
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_llm_router.py tests/test_llm_gate.py \
  tests/test_blockcheck_flips.py -m "slow or not slow" \
  -k "accepted_by_the_gate or hidden_reference or kernel_matches or flip or device" --tb=short \
  --junitxml="$O/h27_gate.xml" 2>&1 | grep -E "^E |Error|passed|failed|assert" | tail -30
stamp verdict
f=$(ls -t /tmp/pytest-of-*/pytest-*/test_router_family_accepted_by*/generated/llm/*/attempt-1/blockcheck.json 2>/dev/null | head -1)
[ -n "$f" ] && cp "$f" "$O/h27_router_blockcheck.json" && python3 -c "
import json,sys; v=json.load(open(sys.argv[1]))
print(v['passed'], v['reason']); [print(s['batch'], s['seq'], s['dtype'], 'excluded', s.get('excluded_rows')) for s in v['sizes']]
print(*v['notes'], sep='\n')" "$f"
stamp end
