# H200 call (issue 33, helper-95): moe_experts template v18's option against the default and
# argsort + torch._grouped_mm, at DeepSeek-V3 (E256 K8 D7168 F2048 N8192) and Qwen3-Next.
#   source .ci/h200/setup.sh && bash .ci/h200/h33_moe4.sh        (carry: .whl; BUDGET default 250 s)
# The option: the down backward (`moe_down_bwd_kernel`: dh = dy[tok] down_proj[e], the SwiGLU
# backward, r * h and the routing-weight gradient in its epilogue; 5.36 ms = 359 TFLOP/s on its
# 64 x 128 tile of 8 warps in the thirtieth session's profile) on dx's 128 x 256 tile (dx: 463
# TFLOP/s), its epilogue on eight 32-column slices (`bwd_epi_split` 8; 4 slices spill) with each
# slice's gate/up loaded before the previous slice's stores. Rows (kernel_templates/moe_experts/
# bench.py, MOE_V18_*; off by default):
#   BWD_BLOCK_M=128,BWD_BLOCK_N=256,bwd_stages=3,bwd_epi_split=8   (sm_90 AOT 231 regs, 0 spills, 144 KB)
#   the same with bwd_stages=4                                      (229 / 0 / 192 KB)
#   BWD_BLOCK_N=256,bwd_epi_split=8,bwd_stages=3 (64 x 256)         (168 / 0 / 120 KB)
#   bwd_epi_split=8 (the default 64 x 128 x 4 stages, eight slices)  (70 / 0 / 96 KB: 2 per SM)
#   bwd_epi_split=8,bwd_stages=3 (64 x 128)                         (70 / 0 / 72 KB: 3 per SM)
#   (the default: 64 x 128 x 4 stages, two slices, 126 / 0 / 96 KB; AOT by triton 3.6, the GPU's)
#   Qwen3-Next (D 2048, 160 rows per expert): 64 x 256 with dx kept on 64 x 128, the 128 x 256
#   row with dx kept likewise, the three-per-SM row, and that row with dx at 3 stages too (dx 71 /
#   0 / 72 KB: three per SM).
# Expected by arithmetic (not measured): at dx's rate the DeepSeek-V3 down backward takes ~3.9-4.3 ms,
# -1.1 to -1.4 ms of fwd+bwd's ~47.3 (the 1.2x goal needs ~4 ms; this is a part of it, not all).
# Steps: (1) `test_v18_configs_bf16_cuda` (every row at D 7168 and D 2048: the output and every
# gradient within 1e-2 of the fp32 reference and 2e-3 of the bucket default's run; empty experts'
# weight gradients zero; D 7168 first), timeout 80 s. (2) `onboard bench --impl ours,grouped_mm`,
# DeepSeek-V3 N8192 uniform fwd+bwd (ours, the 5 rows, grouped_mm), timeout 75 s. (3) per-kernel
# GPU ms of `ours` and each row at N8192 (torch.profiler via the bench's kernel_breakdown; the
# bench's --profile breaks down `ours` only), timeout 50 s. (4) Qwen3-Next uniform fwd+bwd
# (MOE_V18_SWEEP, 4 rows) with what is left of BUDGET (skipped under 20 s left, or with QWEN=0; a
# case cut by its timeout writes no JSON: if (1)-(3) ran long, rerun with BUDGET=300).
# Expected ~4.5 min with setup: (1)-(3) at most 80 + 75 + 50 = 205 s, (4) the rest of 250 s; setup
# ~30 s on top. Outputs under $OUT, and again as $OUT/h33_moe4.tgz: env.txt (setup),
# moe4_tests.txt, moe4.json / moe4_bench.txt, moe4_profile.json / moe4_profile.txt, moe4_qwen.json /
# moe4_qwen_bench.txt.
# What to read, in order:
# 1. moe4_tests.txt: `2 passed`. A failure names the row (its config dict) and the output index
#    (0 y, 1 dx, 2 d topk_weights, 3 d gate_up, 4 d down): that row's timing does not count.
# 2. moe4_bench.txt: `ours` against grouped_mm and each `ours@...` row. A row beats `ours` when it
#    is faster by more than ~1% (single medians). Goal: fwd+bwd <= grouped_mm / 1.2.
# 3. moe4_profile.txt, per row: `moe_down_bwd_kernel` ms against `ours`'s (5.36 in the thirtieth
#    session), and that `moe_dx_kernel` did not change (the rows keep dx's own 128 x 256 tile; with
#    BWD_BLOCK_M 128 dx shares the down backward's tile map, no second one). Expected by
#    arithmetic for the 128 x 256 rows ~3.9-4.3 ms; the 64 x 128 rows keep the tile's 43 FLOP/B,
#    so less (they hide the epilogue only).
# 4. Decide: a row that wins at DeepSeek-V3 goes into _GPU_TILES_BIG (family.py, template_version
#    bump, re-review); Qwen3-Next's row into _GPU_TILES only if it wins there too.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${BUDGET:-250} - ($(date +%s) - t0) )); }
stamp moe4-tests
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs \
  -k "v18_configs_bf16_cuda" --durations=4 2>&1 | tee "$O/moe4_tests.txt" | tail -12
stamp moe4-bench
# the trailing $ keeps the case to itself (fwdbwd, not fwdbwd_frozen); the JSON is rewritten after each case
timeout 75 onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' \
  --impl ours,grouped_mm --out "$O/moe4.json" 2>&1 | tee "$O/moe4_bench.txt" | tail -20
stamp moe4-profile
timeout 50 python3 - "$O/moe4_profile.json" <<'PY' 2>&1 | tee "$O/moe4_profile.txt" | cut -c1-600
import json, sys
import torch
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("moe_experts").bench
steps = bench._moe_steps("deepseek_v3", 256, 8, 7168, 2048, 8192, "uniform", True, bench.MOE_V18_SWEEP_BIG,
                         torch.device("cuda"))
rows = []
for label in ["ours"] + [s for s in steps if s.startswith("ours@")]:
    kernels = kernel_breakdown(steps[label])
    pick = {k: round(sum(r["ms"] for r in kernels if k in r["kernel"]), 3)
            for k in ("moe_down_bwd_kernel", "moe_dx_kernel", "cutlass", "moe_gate_up_fwd_kernel", "moe_down_fwd_kernel")}
    rows.append({"row": label, "kernel_ms": round(sum(r["ms"] for r in kernels), 3), **pick,
                 "kernels": [{"kernel": r["kernel"][:90], "ms": round(r["ms"], 3), "calls": r["calls"]} for r in kernels]})
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
with open(sys.argv[1], "w") as fh:
    json.dump(rows, fh, indent=1)
PY
stamp moe4-bench-qwen
if [ "${QWEN:-1}" = 1 ] && [ "$(left)" -ge 20 ]; then
  timeout "$(left)" onboard bench --family moe_experts --case 'qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd$' \
    --impl ours,grouped_mm --out "$O/moe4_qwen.json" 2>&1 | tee "$O/moe4_qwen_bench.txt" | tail -12
fi
stamp end
( cd "$O" && tar czf /tmp/h33_moe4.tgz . && mv /tmp/h33_moe4.tgz . )
