# Device call for issue 35 (H200), ssd template v16: the split backward toward fwd+bwd <= 3x the
# forward (v15's default: 2.759 / 0.505 ms by CUDA graph, 5.5x, at B1 T8192 H128 P64 G8 N128 bf16).
# Untimed tuning values beside the P <= 64 default (`bwd` "split", `pass` "fused", split chunks of
# 256 = CHUNK 64 x STATE_CHUNKS 4, BWD_M 64, dx and dB/dC at 8 warps capped at 128 registers):
#  - STATE_CHUNKS 2 and 1 (split chunks of 128 and 64: the intra-chunk block pairs per 64-row block
#    fall from 2.5 to 1.5 and 1, more stored states; forward and backward);
#  - bwd_split_warps 16 with bwd_split_maxnreg 0 (the split backward's dx and dB/dC at 16 warps:
#    the sm_90 build has no spills at <= 128 registers, against 112-216 spill bytes at 8 warps capped);
#  - split_dbc "one" (dC and dB in one launch, each block pair's M = sum_h (dy x^T) w formed once,
#    dB's terms as fp32 partials summed by ssd_bwd_split_dbsum_kernel), at 16 warps and at 8
#    (capped: 320 spill bytes), and with split chunks of 128 and 64;
#  - 16 warps with BLOCK_N 128 (dx's N loop in one step; 164 KB of shared memory, no spills);
#  - the fused pass / pull (forward and backward) at STATE_N 32 and at PASS_K 128 (existing keys, untimed).
# Self-contained: sources setup.sh. Carry .whl and .anchors (mamba_ssm's source tree and
# .anchors/wheels/einops-*.whl):
#   BUDGET=450 bash .ci/h200/h35_ssd8.sh        (~480 s with setup; steps 1-2, then 3 and 4 if time is left)
#   SSD8_DRY=1 TRITON_INTERPRET=1 bash .ci/h200/h35_ssd8.sh   (step 4 on the CPU at a tiny shape)
# Within ${BUDGET:-450} s after setup (~30 s), 20 s of them kept in reserve:
#  1. (<= 150 s) the bf16-vs-fp32 bars with --runxfail, test_bf16_vs_fp32_on_gpu [v16-one-w16-sc2],
#     [v16-sc2], [v16-w16], [v16-one-w16], [v16-sc1] (in that order; PASSED is within the bars, a
#     FAILED row prints its errors; its compiles are the bench's too) -> ssd_bars.txt;
#  2. (<= 200 s) the bench, `--impl ours,ours_fwd`: ours, ours_fwd, then kernel_templates/ssd/bench.py's
#     SWEEP in its order (the likeliest winners first) -> ssd_bench.txt (rows printed as they finish: a cut
#     keeps the first), ssd.json (only if the case finishes);
#  3. (only when >= 120 s are left) `--impl ours_fwd,mamba_ssm,mamba_ssm_fwd` with the anchor (its
#     check compiles mamba-ssm's autotuned backward, ~100 s) -> ssd_anchor.txt, ssd_anchor.json;
#  4. (only when >= 40 s are left) per-kernel GPU ms (torch.profiler, 5 steps) of fwd+bwd: the
#     default, STATE_CHUNKS 2, split_dbc "one" at 16 warps, and that with STATE_CHUNKS 2 -> ssd_profile.txt.
# How to decide (graph ms: the `graph` column, ssd.json "graph_ms"):
#  - the goal: fwd+bwd <= 3 x ours_fwd by graph. A row faster than `ours` in this run whose bars row
#    PASSED can become the P <= 64 bucket's value (family.py shape_buckets: the row's keys). The
#    STATE_CHUNKS rows change the forward too: take their `_fwd` row into account (the bucket's
#    forward is the same run's ours@STATE_CHUNKS=k_fwd).
#  - w16 against the default says whether no spills at one 16-warp program per SM beats two 8-warp
#    programs with spills; one-w16 against w16 what the single dB/dC launch gains; one (8 warps,
#    capped) against one-w16 the same question for the fused kernel.
#  - ssd_profile.txt: under split_dbc "one" expect ssd_bwd_split_dbc1_kernel x1 instead of
#    ssd_bwd_split_dbc_kernel x2, plus ssd_bwd_split_dbsum_kernel (none at STATE_CHUNKS 1).
# Outputs under $OUT: env.txt, ssd_bars.txt, ssd_bench.txt, ssd.json, ssd_anchor.txt,
# ssd_anchor.json, ssd_profile.txt, ssd8.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
if [ "${SSD8_DRY:-0}" != 1 ]; then
  OUT=$O source .ci/h200/setup.sh || exit 1
fi
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-450} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/ssd8.tgz" -C "$O" $(cd "$O" && ls | grep -v '^ssd8.tgz$') 2>/dev/null; }
trap pack EXIT
if [ "${SSD8_DRY:-0}" != 1 ]; then
  stamp ssd-bars
  timeout "$(left 150)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py --runxfail \
    -k "bf16_vs_fp32_on_gpu and v16" -rfs 2>&1 | tee "$O/ssd_bars.txt" \
    | grep -E "PASSED|FAILED|ERROR|relative RMS|passed|failed"
  stamp ssd-bench
  # rows print as they come (Python unbuffered, grep line-buffered), blank lines dropped
  PYTHONUNBUFFERED=1 timeout "$(left 200)" onboard bench --family ssd --case '^B1T8192H128' \
    --impl ours,ours_fwd --out "$O/ssd.json" 2>&1 | grep --line-buffered -v "^\s*$" | tee "$O/ssd_bench.txt"
  stamp ssd-anchor
  if [ "$(left 1000)" -ge 120 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
      .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
    PYTHONUNBUFFERED=1 PYTHONPATH=$PYTHONPATH:/tmp/site_anchor ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors \
      timeout "$(left 1000)" onboard bench --family ssd --case '^B1T8192H128' \
      --impl ours_fwd,mamba_ssm,mamba_ssm_fwd --out "$O/ssd_anchor.json" 2>&1 \
      | grep --line-buffered -v "^\s*$" | tee "$O/ssd_anchor.txt"
  else
    echo "step 3 skipped: $(left 1000) s of BUDGET=${BUDGET:-450} left" | tee "$O/ssd_anchor.txt"
  fi
fi
stamp ssd-profile
if [ "${SSD8_DRY:-0}" = 1 ] || [ "$(left 1000)" -ge 40 ]; then
  timeout "$(left 1000)" python3 - <<'PY' 2>&1 | tee "$O/ssd_profile.txt"
# per-kernel GPU ms (torch.profiler CUDA activity, 5 steps after 3 warm-up ones, every kernel)
import os
import torch
from onboarding.bench.cases import config_sweep, fwd_bwd
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("ssd").bench
dry = os.environ.get("SSD8_DRY") == "1"
dev = torch.device("cpu" if dry else "cuda")
shape = (1, 300, 4, 16, 2, 16) if dry else bench.SHAPES[0][:6]
sets = [bench.make_inputs(*shape, dev, seed=s) for s in range(2)]
grads = [torch.randn(*shape[:4], device=dev, dtype=torch.bfloat16)]
mod, ours = bench._ours()
w16 = {"bwd_split_warps": 16, "bwd_split_maxnreg": 0}
steps = {"ours (default)": fwd_bwd(ours, sets, grads)}
steps.update(config_sweep(mod, ours, sets, grads, shape[3], [{"STATE_CHUNKS": 2}, {"split_dbc": "one", **w16},
                                                             {"split_dbc": "one", **w16, "STATE_CHUNKS": 2}]))



for name, step in steps.items():
    print(f"{name} (forward + backward)", flush=True)
    try:
        rows = (step(0), [])[1] if dry else kernel_breakdown(step, top=40)
    except Exception as exc:  # noqa: BLE001 - the other rows stand
        print(f"  failed: {type(exc).__name__}: {str(exc)[:300]}")
        continue
    for r in rows:
        print(f"  {r['kernel'][:70]:70s} {r['ms']:.3f} ms x{r['calls']:g}")
    print(f"  total {sum(r['ms'] for r in rows):.3f} ms", flush=True)
PY
else
  echo "step 4 skipped: $(left 1000) s left" | tee "$O/ssd_profile.txt"
fi
stamp end
