# Device call Z (issue 34, the non-kernel part of the step; prepared on the CPU, not run): the
# Qwen3-Next-style proxy of issue 34's table (.ci/h200/proxies.sh), ours only, first with
# `--compile blocks` (torch.compile of each decoder layer from step 2 on; step 1 eager), then
# without, --steps 6 with step 6 profiled. For each: tok/s, MFU and peak GiB (medians over
# steps 2-6 as the report takes them, and over steps 3-6: step 2 of the compiled run includes
# the compile), the compile counters of the last row (graphs, frames, graph breaks, seconds),
# dynamo's graph-break and recompile lines from the run's log (TORCH_LOGS), and the profile's
# by-category line (call W's eager step: copy / cast 40.0 of 191.5 kernel ms, wall 236 ms).
# Each run about 3 min on a warm machine; the compiled one adds its inductor builds.
#   bash .ci/h200/compile_z.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/z; mkdir -p "$D" "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-545} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
OUT=$O source .ci/h200/setup.sh || exit 1
source .ci/h200/proxies.sh
COMMON="$WIDTHS $NEXT --nproc 1 --steps 6 --seq 2048 --micro-batch 8 --dtype bf16 --profile-every 6"
run() {  # name extra timeout
  stamp "$1"
  TORCH_LOGS=graph_breaks,recompiles timeout "$3" onboard train hf:qwen3_next --proxy none \
    $COMMON $2 --out "$O/$1" > "$O/$1.log" 2>&1
  echo "exit $?"
  W=$(ls "$O/$1"/train/*.log 2>/dev/null | head -1); W=${W:-$O/$1.log}  # the worker's own log
  grep -E "^compile:|^error:|run failed" "$O/$1.log" "$W" | cut -c1-400
  echo "dynamo: $(grep -c 'Graph break' "$W") graph-break lines, $(grep -c 'Recompiling' "$W") recompiles"
  grep -E "Graph break in user code|Graph Break Reason|Recompiling function|guard failure|^ +- " "$W" \
    | sed -e 's/^[VWIE][0-9 :.]*[0-9]* [^]]*\] //' -e 's/^\[[0-9/]*\] \[__[a-z_]*\] //' | sort | uniq -c | sort -rn | head -12 | cut -c1-300
  python3 .ci/h200/run_summary.py "$O/$1"
}
run compiled "--compile blocks" "$(left 330)"
run eager "" "$(left 230)"
stamp end
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/compile_z.tgz" -C "$O" .
