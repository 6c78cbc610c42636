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
  python3 - "$O/$1" <<'PY'
import glob, json, statistics, sys
run = sys.argv[1]
for f in sorted(glob.glob(run + "/train/*.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    print(f.rsplit("/", 1)[1], "compile per step", [r.get("compile") for r in rows],
          "step s", [round(r["step_time_s"], 3) for r in rows])
    for r in rows:
        if "kernels" in r:
            print("kernels", json.dumps(r["kernels"]), "rejected", json.dumps(r.get("kernels_rejected")))
    if rows and rows[-1].get("compile_stats"):
        print("compile stats (last step)", json.dumps(rows[-1]["compile_stats"]))
    for lo in (2, 3):
        late = [r for r in rows if r.get("step", 0) >= lo]
        if late:
            print(f"median steps {lo}-6: tok/s %.0f, MFU %.1f%%, peak %.2f GiB" % (
                statistics.median(r["tokens_per_s"] for r in late),
                100 * statistics.median(r["mfu"] for r in late if r.get("mfu") is not None),
                max(r["peak_mem_bytes"] for r in late) / 2**30))
for f in sorted(glob.glob(run + "/train/profile_*.json")):
    p = json.load(open(f))
    print(f.rsplit("/", 1)[1], "wall %.1f ms, kernels %.1f ms" % (p["wall_ms"], p["kernel_ms"]),
          "by phase", json.dumps(p["by_phase"]))
    print("  by category", json.dumps(p["by_category"]))
    nodes = sorted(p["by_autograd_node"].items(), key=lambda kv: -kv[1])[:12]
    print("  by autograd node", "; ".join(f"{k} {v:.1f}" for k, v in nodes))
    for k in p["top_kernels"][:12]:
        print(f"  {k['calls']:4d} calls {k['ms']:7.3f} ms  {k['name'][:150]}")
PY
}
run compiled "--compile blocks" "$(left 330)"
run eager "" "$(left 230)"
stamp end
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/compile_z.tgz" -C "$O" .
