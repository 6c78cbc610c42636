#!/usr/bin/env bash
# The tune stage's builds ahead of the check, A/B on one machine (forty-sixth session). The first
# GPU run of compile ahead (forty-sixth session, call 1, README's main command at 90 s) gave the
# small studies 20 trials (4-8 without it, forty-fourth session) but moe_experts 3 at 35 s of
# compile a trial, and the tune stage ended 27 s past its budget; that host was slower at every
# stage, so only one machine can compare. Here, on the built-in example generated once, each on a
# copy of that run and a fresh Triton cache, `onboard tune --tune-budget 90`:
#   C: the default (compile ahead, build slots: one pass per 4 cores);
#   B: --no-compile-ahead (each check JIT-compiles under the GPU gate: the forty-fourth session's);
#   A: --compile-slots 0 (compile ahead without slots: the forty-fifth session's default).
# Ran at 208d23f (forty-sixth session, in git there); A won, and the slots and their flag were
# removed after it: from then on C is A (the default). Later commits add to the default that a
# study thread with no study left to start joins the searches still running (`OpenSearches`), and
# an opt-in timing by CUDA graph (`--timing graph`); this script ran C (the default), J
# (--no-join-studies: A as it ran) and G (--timing graph) at 9dda448 (forty-seventh session,
# docs/LOG.md), and graph timing became the default after it: it now runs C (the default: graph),
# J (--no-join-studies) and E (--timing events). B is in the table already.
# Read per study: trials, default_ms (the same config in every run: how much the run's own load
# moves a timing), best/default, phase_s, and the tune stage's seconds against its 90 s budget.
# Before them: the GPU test that the pass builds every kernel the check launches. carry: .whl
# (and .snap/head.tgz when run on a snapshot). ~470 s: LIMIT (default 540) cuts the last run
# (E last). Per study it prints the finalists' re-timed medians too.
set -u
source .ci/h200/setup.sh > /dev/null || exit 1
OUT=${OUT:-/tmp/out}; T0=$(date +%s)
left() { echo $(( ${LIMIT:-540} - $(date +%s) + T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
TRITON_CACHE_DIR=$(mktemp -d) timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_tune.py \
  -k "builds_every_kernel" > "$OUT/pytest.txt" 2>&1
echo "gpu test rc $? +$(( $(date +%s) - T0 )) s: $(tail -1 "$OUT/pytest.txt")" | tee -a "$OUT/summary.txt"
TRITON_CACHE_DIR=$(mktemp -d) timeout 150 onboard generate --out /tmp/g46 > "$OUT/generate.log" 2>&1
echo "generate rc $? +$(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
for run in "C" "J --no-join-studies" "E --timing events"; do
  set -- $run; label=$1; shift
  [ "$(left)" -lt 130 ] && { echo "$label: skipped, $(left) s left" | tee -a "$OUT/summary.txt"; continue; }
  rm -rf /tmp/t46$label && cp -r /tmp/g46 /tmp/t46$label
  s=$(date +%s)
  TRITON_CACHE_DIR=$(mktemp -d) timeout $(( $(left) - 10 )) onboard tune --out /tmp/t46$label \
    --tune-budget 90 "$@" > "$OUT/tune_$label.log" 2>&1
  echo "== $label ($*): rc $?, $(( $(date +%s) - s )) s wall" | tee -a "$OUT/summary.txt"
  [ -f /tmp/t46$label/tune.json ] && cp /tmp/t46$label/tune.json "$OUT/tune_$label.json" && \
  python3 - /tmp/t46$label/tune.json <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
print(f"  tune {d.get('seconds')} s of budget {d.get('budget_s')} s, {d.get('parallel_studies')} at once")
for s in d.get("studies", []):
    r = s["result"]
    b, df = r.get("best_ms"), r.get("default_ms")
    print(f"  {s['family']}/{s['variant']} {s['bucket']}: trials {r['n_trials']} complete {r['n_complete']} "
          f"default {df and round(df, 4)} best {b and round(b, 4)} ({(df / b) if b and df else 0:.2f}x) "
          f"took {r.get('seconds')} s; helpers ran {r.get('helper_trials', 0)}; {r.get('phase_s')}; "
          f"{r.get('stopped') or ''}; timing {r.get('timing')}")
    if r.get("final"):
        print("    re-timed: " + ", ".join(f"{v:.4g}" if v else "-" for v in r["final"].values()))
PY
done
echo "done +$(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
