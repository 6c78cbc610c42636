# Device call (thirty-sixth session, helper moe36): moe_experts template v19's default (d_big's down
# backward on its own 128 x 256 x 3-stage tile, bwd_epi_split 8) against argsort + torch._grouped_mm
# at DeepSeek-V3 (E256 K8 D7168 F2048 N8192), and what the row-tiled GEMMs' partial tiles cost.
#   source .ci/h200/setup.sh && BUDGET=230 bash .ci/h200/h36_moe5.sh      (carry: .whl; BUDGET default 230 s)
# Why the tail question (docs/LOG.md, moe36's note): at uniform routing the bench's experts hold 206-300
# rows (its multinomial draw, seed 0), so the 128-row tile map has 635 row tiles where 512 would
# hold the rows; 123 of them (19.4%) are third tiles of experts past 256 rows, ~13 rows each. The
# 128 x 256 GEMMs (dx 9.226 ms, gate/up 8.832, down forward 5.041, down backward 5.045 in the call
# that picked v19, H100) run one program per SM; if a mostly empty tile costs a full one, those
# tiles are ~19% of each: dx ~1.8 ms, all four ~5.4 ms of the ~44.8 kernel ms (expected by
# arithmetic, not measured). The ninth session's half-height tails (`half_tail`) gained nothing in
# the DeepSeek-V3 forward on the H200 (15.87 ms against 15.72): so either such tiles cost little,
# or they cost their weight stream, not their MMA rows. Step (3) tells which.
# Steps: (1) `test_v18_configs_bf16_cuda` (D 7168: the v19 default and bench.MOE_V19_SWEEP_BIG's
# rows, D 2048: v18's rows; the output and every gradient within 1e-2 of the fp32 reference and 2e-3
# of the bucket default's run), timeout 80 s. (2) `onboard bench --impl ours,grouped_mm`, DeepSeek-V3
# N8192 uniform fwd+bwd: ours (v19), grouped_mm, and MOE_V19_SWEEP_BIG's rows (the v18 default's down
# backward `DOWN_BWD_BLOCK_M=0,...,bwd_epi_split=2`, `down_bwd_stages=4`, `DOWN_BWD_BLOCK_M=64`),
# timeout 75 s. (3) per-kernel GPU ms (torch.profiler via the bench's kernel_breakdown) of ours, of
# ours with the forward's half-height tails (`half_tail=True`) and of grouped_mm, at uniform routing
# and at balanced routing (every expert exactly 256 rows: token t takes experts perm[(8t + j) % 256],
# j < 8, so no partial tile; the same weights' shapes, each routing built and freed in turn: one set
# of 22.5 GB of weights at a time), timeout 100 s. (4) Qwen3-Next uniform, then Zipf, fwd+bwd (v18's
# rows there; d_le_4k is unchanged by v19) with what is left of BUDGET (each skipped under 20 s left,
# or with QWEN=0; a case cut by its timeout writes no JSON: rerun with BUDGET=300).
# Expected ~4.5 min with setup: (1)-(3) at most 80 + 75 + 100 = 255 s (typically less), (4) the rest.
# Outputs under $OUT, and again as $OUT/h36_moe5.tgz: env.txt (setup), moe5_tests.txt, moe5.json /
# moe5_bench.txt, moe5_profile.json / moe5_profile.txt, moe5_qwen.json / moe5_qwen_bench.txt,
# moe5_qwen_zipf.json / moe5_qwen_zipf_bench.txt.
# What to read, in order:
# 1. moe5_tests.txt: `2 passed`. A failure names the config (its dict) and the output index (0 y,
#    1 dx, 2 d topk_weights, 3 d gate_up, 4 d down).
# 2. moe5_bench.txt: `ours` against grouped_mm (goal: wall <= grouped_mm / 1.2) and against the
#    v18-default row (`ours@DOWN_BWD_BLOCK_M=0,...`: v19 should be ~1.2 ms faster, as 48.579 against
#    49.779 in the call that picked it).
# 3. moe5_profile.txt, one line per (routing, row): the four row-tiled kernels' ms. uniform against
#    balanced for `ours`: the partial tiles' cost per kernel (~19% of each if a near-empty tile
#    costs a full one; ~0 if not). half_tail against ours, uniform: whether tile height (MMA rows)
#    is what they cost (gate_up / down forward only: half_tail is a forward key). grouped_mm's total
#    at both routings: what the same tails cost CUTLASS.
# 4. Decide: a tail cost near 19% with no half_tail gain says fold an expert's tail rows into its
#    previous tile (they must not stream the weight slice again); with a half_tail gain, a
#    half-height dx tail first (the forward key's pattern). A cost near 0: the tails are not it;
#    dx's ~6 us per tile outside its K loop (this call's dx 9.226 against the down forward's 5.041
#    ms, same tile and program count, 64 against 32 K steps) is what is left to hide.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${BUDGET:-230} - ($(date +%s) - t0) )); }
stamp moe5-tests
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs \
  -k "v18_configs_bf16_cuda" --durations=4 2>&1 | tee "$O/moe5_tests.txt" | tail -12
stamp moe5-bench
# the trailing $ keeps the case to itself (fwdbwd, not fwdbwd_frozen); the JSON is rewritten after each case
timeout 75 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' \
  --impl ours,grouped_mm --out "$O/moe5.json" 2>&1 | tee "$O/moe5_bench.txt" | tail -20
stamp moe5-profile
timeout 100 python3 - "$O/moe5_profile.json" <<'PY' 2>&1 | tee "$O/moe5_profile.txt" | cut -c1-600
import gc, json, sys
import torch
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("moe_experts").bench
real = bench.routing


def routing(kind, n, e, k, device, gen):
    # "balanced": every expert gets exactly n k / e rows (256 here), so the 128-row tile map has no
    # partial tile; the routing weights are drawn as uniform's
    if kind != "balanced":
        return real(kind, n, e, k, device, gen)
    _, w = real("uniform", n, e, k, device, gen)
    perm = torch.randperm(e, device=device, generator=gen)
    slots = (torch.arange(n, device=device)[:, None] * k + torch.arange(k, device=device)) % e
    return perm[slots], w


bench.routing = routing
rows = []
for kind in ("uniform", "balanced"):
    steps = bench._moe_steps("deepseek_v3", 256, 8, 7168, 2048, 8192, kind, True, [{"half_tail": True}],
                             torch.device("cuda"))
    for label in ("ours", "ours@half_tail=True", "grouped_mm"):
        kernels = kernel_breakdown(steps[label])
        pick = {k: round(sum(r["ms"] for r in kernels if k in r["kernel"]), 3)
                for k in ("moe_dx_kernel", "moe_gate_up_fwd_kernel", "moe_down_fwd_kernel", "moe_down_bwd_kernel",
                          "cutlass")}
        rows.append({"routing": kind, "row": label, "kernel_ms": round(sum(r["ms"] for r in kernels), 3), **pick,
                     "kernels": [{"kernel": r["kernel"][:90], "ms": round(r["ms"], 3), "calls": r["calls"]}
                                 for r in kernels]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
    del steps
    gc.collect()
    torch.cuda.empty_cache()
with open(sys.argv[1], "w") as fh:
    json.dump(rows, fh, indent=1)
PY
stamp moe5-bench-qwen
if [ "${QWEN:-1}" = 1 ] && [ "$(left)" -ge 20 ]; then
  timeout "$(left)" onboard bench --family moe_experts --case 'qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe5_qwen.json" 2>&1 | tee "$O/moe5_qwen_bench.txt" | tail -12
fi
stamp moe5-bench-qwen-zipf
if [ "${QWEN:-1}" = 1 ] && [ "$(left)" -ge 20 ]; then
  timeout "$(left)" onboard bench --family moe_experts --case 'qwen3_next/E512K10D2048F512N8192/zipf/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe5_qwen_zipf.json" 2>&1 | tee "$O/moe5_qwen_zipf_bench.txt" | tail -12
fi
stamp end
( cd "$O" && tar czf /tmp/h36_moe5.tgz . && mv /tmp/h36_moe5.tgz . )
