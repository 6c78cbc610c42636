#!/usr/bin/env bash
# README's main command on the GPU with the tune stage's studies run at once (forty-fourth session):
# the default 40 s budget, then 120 s; each run's tune.json summarized per study (trials, complete,
# best against the default). carry: .whl (and a .snap/head.tgz when run on a snapshot). BUDGET ~500 s.
# Usage: [BUDGETS="40 120"] bash .ci/h200/h44_tune.sh [EXTRA onboard run flags for every run]
set -u
source .ci/h200/setup.sh > /dev/null || exit 1
OUT=${OUT:-/tmp/out}
summ() {  # $1 run dir, $2 label
  python3 - "$1" "$2" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1] + "/tune.json"))
print(f"== {sys.argv[2]}: tune {d.get('seconds')} s of budget {d.get('budget_s')} s, "
      f"{d.get('parallel_studies')} studies at once, gpu {d.get('gpu')}")
for s in d.get("studies", []):
    r = s["result"]
    print(f"  {s['family']}/{s['variant']} {s['bucket']}: trials {r['n_trials']} complete "
          f"{r['n_complete']} best {r['best_ms']} default {r['default_ms']} "
          f"budget {r.get('budget_s')} s took {r.get('seconds')} s; phases {r.get('phase_s')}; "
          f"{r.get('stopped') or ''}")
PY
}
for b in ${BUDGETS:-40 120}; do
  d=/tmp/r$b-$RANDOM
  start=$(date +%s)
  onboard run --out "$d" --tune-budget $b "$@" > "$OUT/run$b.log" 2>&1
  rc=$?
  echo "run --tune-budget $b: rc $rc, $(( $(date +%s) - start )) s wall" | tee -a "$OUT/summary.txt"
  tail -25 "$OUT/run$b.log"
  [ -f "$d/tune.json" ] && cp "$d/tune.json" "$OUT/tune$b.json" && summ "$d" "budget $b"
done
