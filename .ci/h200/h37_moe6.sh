# NOT RUNNABLE since moe_experts v24 (config `ws` removed: bench.MOE_V22_SWEEP_BIG, test_v22_configs_bf16_cuda); kept as the record of its run in docs/LOG.md.
# Device call (thirty-seventh session, helper moe37): moe_experts template v20's half-height tails
# beside TMA rows (issue 33: fwd+bwd >= 1.2x torch._grouped_mm at DeepSeek-V3, E256 K8 D7168 F2048
# N8192, uniform routing; v19 stood at 46.314 ms against 53.691, 1.14x, H100, h36_moe5.sh).
#   source .ci/h200/setup.sh && BUDGET=200 bash .ci/h200/h37_moe6.sh      (carry: .whl; BUDGET default 200 s)
# Since template v22 (helper moe38) it also times config `ws`: dx's K loop (d(gate|up) rows and weights
# both by TMA at d_big) under triton's automatic warp specialization (a TMA producer warp group + two
# consumer groups, descriptors made in the kernel, per-slot rows for the combine pass instead of atomics,
# full-height tiles; bench.py's v22 notes). The bench case's rows are now bench.SWEEPS' (v20's
# half_tail_bwd and + half_tail_down, v22's ws and ws + half_tail_bwd; v20's h_tma row dropped to keep
# BUDGET 200), the profile's ours + half_tail_bwd, ws, ws + half_tail_bwd.
# Why (bench.py's v20 note): h36's profile put the partial row tiles (uniform against balanced
# routing, where every expert holds 256 rows) at dx 0.88 ms, down backward 0.47, gate/up 0.23, down
# forward 0.20; the v9 forward `half_tail` gained in the down forward (4.694 against 4.939) and lost
# in gate/up (10.164 against 8.832). The v20 rows keep gate/up at full height: `half_tail_bwd` (the
# down backward and dx run an expert's last tile at 64 rows when it holds that few, their dy /
# d(gate|up) rows by their own [64, 64] descriptors), + `half_tail_down` (the forward down GEMM
# alone), + `h_tma` (its h rows by TMA, now beside the half-height tiles too).
# Steps: (1) `test_v20_configs_bf16_cuda` and `test_v22_configs_bf16_cuda` (the d_big default against
# ws and ws + half_tail_bwd, same bars) (D 7168: the v20 default and bench.MOE_V20_SWEEP_BIG's three
# rows; D 2048: MOE_V20_SWEEP's two; the output and every gradient within 1e-2 of the fp32 reference
# and 2e-3 of the bucket default's run; its routing leaves half-height last tiles at both D), timeout
# 60 s. (2) `onboard bench --impl ours,grouped_mm`, DeepSeek-V3 N8192 uniform fwd+bwd: ours, grouped_mm
# and the three rows, timeout 75 s. (3) per-kernel GPU ms (torch.profiler via the bench's
# kernel_breakdown) of ours and the three rows at uniform routing, timeout 60 s. (4) Qwen3-Next uniform
# fwd+bwd (ours, grouped_mm, MOE_V20_SWEEP's two rows) with what is left of BUDGET (skipped under
# 30 s left or with QWEN=0; a case cut by its timeout writes no JSON).
# Expected ~3 min with setup: (1)-(3) at most 60 + 75 + 60 s (h36's like steps took 13, ~35, ~40 s).
# Outputs: $OUT/moe6_summary.txt (the tests' verdict, every bench row, the profile lines) and
# $OUT/h37_moe6.tgz (moe6_tests.txt, moe6.json, moe6_bench.txt, moe6_profile.json, moe6_profile.txt,
# moe6_qwen.json, moe6_qwen_bench.txt, and a copy of setup's env.txt, which stays too).
# What to read, in order:
# 1. tests: `3 passed`. A failure names the config (its dict) and the output index (0 y, 1 dx,
#    2 d topk_weights, 3 d gate_up, 4 d down).
# 2. bench: `ours` against grouped_mm (goal: wall <= grouped_mm / 1.2, ~44.7 ms at h36's 53.691)
#    and each `ours@half_tail_bwd=True...` / `ours@ws=True...` row against `ours`.
# 3. profile, one line per row: the four row-tiled kernels' ms. Against `ours`: dx and down
#    backward for half_tail_bwd (h36's tail cost: 0.88 and 0.47 ms at most to win), gate/up
#    unchanged in every row (it stays full height). ws: moe_dx_kernel against ours' (h36: 9.15), and
#    the backward combine (moe_combine_kernel, ~0.6 ms expected) that ws's per-slot rows add.
# 4. Decide: a row faster in (2) with its bars passed in (1) becomes d_big's default (the next
#    template version; the reviewed module re-rendered); dx or the down backward not faster in (3) says a half-height
#    tile costs its weight stream, not its rows (fold the tail rows into the expert's previous tile).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${BUDGET:-200} - ($(date +%s) - t0) )); }
stamp moe6-tests
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs \
  -k "v20_configs_bf16_cuda or v22_configs_bf16_cuda" --durations=4 2>&1 | tee "$O/moe6_tests.txt" | tail -12
stamp moe6-bench
# the trailing $ keeps the case to itself (fwdbwd, not fwdbwd_frozen); the JSON is rewritten after each case
timeout 75 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' \
  --impl ours,grouped_mm --out "$O/moe6.json" 2>&1 | tee "$O/moe6_bench.txt" | tail -12
stamp moe6-profile
timeout 60 python3 - "$O/moe6_profile.json" <<'PY' 2>&1 | tee "$O/moe6_profile.txt" | cut -c1-400
import json, sys
import torch
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("moe_experts").bench
rows = [bench.MOE_V20_SWEEP_BIG[0], *bench.MOE_V22_SWEEP_BIG]  # half_tail_bwd; ws; ws + half_tail_bwd
steps = bench._moe_steps("deepseek_v3", 256, 8, 7168, 2048, 8192, "uniform", True, rows, torch.device("cuda"))
rows = []
for label in [k for k in steps if k.startswith("ours")]:
    kernels = kernel_breakdown(steps[label])
    pick = {k: round(sum(r["ms"] for r in kernels if k in r["kernel"]), 3)
            for k in ("moe_dx_kernel", "moe_gate_up_fwd_kernel", "moe_down_fwd_kernel", "moe_down_bwd_kernel",
                      "cutlass")}
    rows.append({"routing": "uniform", "row": label, "kernel_ms": round(sum(r["ms"] for r in kernels), 3), **pick,
                 "kernels": [{"kernel": r["kernel"][:90], "ms": round(r["ms"], 3), "calls": r["calls"]}
                             for r in kernels]})
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
with open(sys.argv[1], "w") as fh:
    json.dump(rows, fh, indent=1)
PY
stamp moe6-bench-qwen
if [ "${QWEN:-1}" = 1 ] && [ "$(left)" -ge 30 ]; then
  timeout "$(left)" onboard bench --family moe_experts --case 'qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe6_qwen.json" 2>&1 | tee "$O/moe6_qwen_bench.txt" | tail -8
fi
stamp end
# one summary beside one archive: the tests' verdict, every bench row, the profile lines; this
# script's files go into the archive (env.txt, setup's, is copied in and left)
{ grep -E "passed|failed|error|skipped" "$O/moe6_tests.txt" | tail -3
  grep -hE "^moe_experts/.* (ok|fail|error)" "$O/moe6_bench.txt" "$O/moe6_qwen_bench.txt" 2>/dev/null | cut -c1-160
  grep -h '^{"routing"' "$O/moe6_profile.txt"; } > "$O/moe6_summary.txt"
( cd "$O" || exit 1
  files=$(ls moe6_tests.txt moe6.json moe6_bench.txt moe6_profile.json moe6_profile.txt moe6_qwen.json \
    moe6_qwen_bench.txt 2>/dev/null)
  tar czf h37_moe6.tgz $files $(ls env.txt 2>/dev/null) && rm -f $files )
