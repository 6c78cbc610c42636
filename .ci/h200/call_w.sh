# Device call W (prepared in the twenty-fourth session by the helper on copies, issue 34; not run):
# the step's copy traffic after the experts' combine and gather backward became one gather-sum
# each (`moe_ep._sum_pairs`: embedding_bag on CUDA, no [pairs, D] temporary; docs/LOG.md, "helper
# copies"). First the CUDA test of that sum at the proxy's shape (bf16 agreement with the gather +
# sum it replaces, each one's ms printed), then the Qwen3-Next-style proxy row of issue 34's table,
# ours only (no --baseline: transformers + PEFT is unchanged since call S), --steps 6 with step 6
# profiled, and the profile's copy / cast lines printed beside call S's numbers (copy / cast 57.5
# of 213.1 kernel ms; vectorized_gather_kernel 85 calls 13.5 ms, bf16 sum reduce_kernel 78 calls
# 6.3 ms; _GatherPairsBackward 6.8 ms, _PlaceRowsBackward 3.5 ms). ONLY=next,moe adds the MoE row
# (~190 s more). About 330 s for the Next row on a cold machine.
#   bash .ci/h200/call_w.sh      (carry .whl)
set -o pipefail
D=${OUT:-/tmp/out}; O=/tmp/w; mkdir -p "$D" "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-560} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
stamp tests
timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/test_moe_swiglu_kernel.py \
  -k "cuda_pair_sums or cuda_gather_pairs or combine" -rxXs 2>&1 | tee "$O/tests.txt" \
  | grep -E "ms|passed|failed|FAIL|Error" | cut -c1-300
source .ci/h200/proxies.sh
COMMON="$WIDTHS --nproc 1 --steps 6 --seq 2048 --micro-batch 8 --dtype bf16 --profile-every 6"
run() {  # name model extra timeout
  stamp "$1"
  timeout "$4" onboard train "$2" --proxy none $COMMON $3 --out "$O/$1" > "$O/$1.log" 2>&1
  echo "exit $?"; grep -B2 -A6 "tok/s" "$O/$1.log" | tail -9
  python3 - "$O/$1" <<'PY'
import glob, json, statistics, sys
run = sys.argv[1]
for f in sorted(glob.glob(run + "/train/*.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    late = [r for r in rows if r.get("step", 0) >= 2]
    for r in rows:
        if "kernels" in r:
            print("kernels", json.dumps(r["kernels"]), "rejected", json.dumps(r.get("kernels_rejected")))
    if late:
        print(f.rsplit("/", 1)[1], "median steps 2-6: tok/s %.0f, MFU %.1f%%, peak %.2f GiB" % (
            statistics.median(r["tokens_per_s"] for r in late),
            100 * statistics.median(r["mfu"] for r in late if r.get("mfu") is not None),
            max(r["peak_mem_bytes"] for r in late) / 2**30))
for f in sorted(glob.glob(run + "/train/profile_*.json")):
    p = json.load(open(f))
    print(f.rsplit("/", 1)[1], "wall %.1f ms, kernels %.1f ms" % (p["wall_ms"], p["kernel_ms"]),
          "by phase", json.dumps(p["by_phase"]))
    print("  by category", json.dumps(p["by_category"]))
    nodes = sorted(p["by_autograd_node"].items(), key=lambda kv: -kv[1])[:16]
    print("  by autograd node", "; ".join(f"{k} {v:.1f}" for k, v in nodes))
    for k in p["top_kernels"]:
        n = k["name"]
        if any(s in n for s in ("copy", "Cat", "gather", "reduce_kernel", "add", "embedding", "Embedding")):
            print(f"  {k['calls']:4d} calls {k['ms']:7.3f} ms  {n[:150]}")
PY
}
case ",${ONLY:-next}," in *,next,*) run next hf:qwen3_next "$NEXT" "$(left 330)";; esac
case ",${ONLY:-next}," in *,moe,*) run moe hf:qwen3_moe "$MOE" "$(left 230)";; esac
stamp end
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/call_w.tgz" -C "$O" .
