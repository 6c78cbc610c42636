# Device call X (prepared in the twenty-fourth session, for the next one): what that session's
# fixes need on the H200 (issue 34), then the GDN K <= 64 backward's tiles.
# 1. Resume after a kill (call_u.sh PARTS=resume): call V's resumed run failed in fused AdamW (a
#    CPU step tensor; fixed in ee4ac37).
# 2. The sequence table with --recompute full (call_u.sh PARTS=sweep, 65536 first): call U failed
#    at every length (the delta-rule patch's first call saved its torch path's tensors inside the
#    checkpoint; fixed in 5ce5ccd); the re-run finished 65536 (143.6 s) and was cut in 16384, and
#    the interrupted sweep removed its directory (each row is printed as it ends now).
# 3. `onboard bench --family gated_delta --case B8T2048H32D64` with the K64_SWEEP rows (the 4B
#    proxy's GDN call; its backward WY kernel took 7.9 of 11.2 ms a step).
#   bash .ci/h200/call_x.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/x; mkdir -p "$D" "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
quiet() { grep -v "^\(torch\|transformers\|peft\|optuna\|langgraph\|openai\|fla\) "; }
OUT=$O/r PARTS=resume timeout 220 bash .ci/h200/call_u.sh 2>&1 | quiet
stamp sweep
OUT=$O/s PARTS=sweep LENGTHS=${LENGTHS:-65536,16384,4096} BUDGET=300 timeout 320 bash .ci/h200/call_u.sh 2>&1 | quiet
stamp gdn-k64
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROWS=$(python3 -c "from onboarding.families import family_module as f; print(','.join(f('gated_delta').bench.K64_ROWS))")
timeout $(( 570 - $(date +%s) + t0 )) onboard bench --family gated_delta --case 'B8T2048H32D64' \
  --impl "ours,ours_fwd,$ROWS" --out "$O/gdn.json" > "$O/gdn.log" 2>&1; echo "bench exit $?"
grep -v "^\s*$" "$O/gdn.log" | tail -14 | cut -c1-200
stamp end
tar czf "$D/call_x.tgz" -C "$O" .
