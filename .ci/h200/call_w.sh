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
  python3 .ci/h200/run_summary.py "$O/$1" --kernels-like copy,Cat,gather,reduce_kernel,add,embedding,Embedding
}
case ",${ONLY:-next}," in *,next,*) run next hf:qwen3_next "$NEXT" "$(left 330)";; esac
case ",${ONLY:-next}," in *,moe,*) run moe hf:qwen3_moe "$MOE" "$(left 230)";; esac
stamp end
find "$O" -name "*.safetensors" -delete; rm -rf "$O"/*/train/kernels "$O"/*/checkpoints
tar czf "$D/call_w.tgz" -C "$O" .
