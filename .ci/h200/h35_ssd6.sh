# Device call for issue 35 (H200), ssd template v12, all off by default: the split forward's `pass`
# "fused" (its chunk-state kernel and state pass, 0.119 + 0.097 ms in the twenty-eighth session's
# call 1, as one serial loop per (head, BLOCK_P x STATE_N tile); in the backward "fused" is dy's
# pull and the reverse pass as one serial loop too), `cb` "input" (its C B^T stored in bf16: half
# the output kernel's largest operand), and BLOCK_S 1024 (the state passes' grid in one wave: at
# 512 the sm_90 build's 40 registers let 1584 of the forward pass's 2048 programs run at once).
# Self-contained: sources setup.sh. Carry .whl and .anchors (mamba_ssm's source tree and
# .anchors/wheels/einops-*.whl):
#   bash .ci/h200/h35_ssd6.sh            (~220 s: no mamba-ssm row)
#   BUDGET=380 bash .ci/h200/h35_ssd6.sh (~380 s: also step 4, mamba-ssm's forward in the same call)
# Within ${BUDGET:-220} s: setup ~30 s, then
#  1. (<= 60 s) the bf16-vs-fp32 bars, test_bf16_vs_fp32_on_gpu [split-fused] and
#     [split-fused-fill-cb] (xfail-marked tuning values: XPASS is the pass, XFAIL is outside the
#     bars) -> ssd_bars.txt; BLOCK_S changes no rounding (the pass's elementwise order is the same);
#  2. (<= 100 s) the bench, B1 T8192 H128 P64 G8 N128 bf16, `--impl ours,ours_fwd --profile` (no
#     anchor: mamba-ssm's check compiles its autotuned backward, ~100 s): ours (fwd+bwd), ours_fwd
#     (both with per-kernel ms), then kernel_templates/ssd/bench.py's SWEEP in this order:
#     ours@pass=fused_fwd, ours@BLOCK_S=1024 (fwd+bwd), ours@BLOCK_S=1024_fwd, ours@cb=input_fwd,
#     ours@pass=fused,split_states=fill (fwd+bwd) -> ssd_bench.txt (rows printed as they finish: a
#     cut keeps the first), ssd.json (only if the case finishes);
#  3. (<= 30 s) per-kernel GPU ms (torch.profiler) of the forward with `pass` "fused" and with `cb`
#     "input", and of fwd+bwd with `pass` "fused" + `split_states` "fill" -> ssd_profile.txt
#     (SSD6_DRY=1 runs this step on the CPU at a tiny shape, no profile);
#  4. only when >= 150 s of the budget are left: `--impl ours_fwd,mamba_ssm_fwd` -> ssd_anchor.txt,
#     ssd_anchor.json (else the line "step 4 skipped").
# How to decide (graph ms: the `graph` column, ssd.json "graph_ms"; wall ms beside it):
#  - the forward goal is ours_fwd's graph time below mamba-ssm's forward (0.583 ms graph, ours_fwd
#    0.598, in the twenty-eighth session's call 1; step 4 re-times both) with a margin: a forward
#    row whose graph ms is below this run's ours_fwd (and, for pass=fused / cb=input, whose bar
#    XPASSes: [split-fused], [split-fused-fill-cb]) may become the P <= 64 bucket's value
#    (family.py shape_buckets); the three are independent (the pass, the C B^T dtype, the pass
#    kernel's block): take every one that wins and re-time them together (the kernel-sum target:
#    <= ~0.52 ms, against 0.574 for the default);
#  - fwd+bwd: ours@BLOCK_S=1024 and ours@pass=fused,split_states=fill against ours (3.782 wall in
#    call A of the twenty-sixth session); the backward's goal is fwd+bwd <= 3 x ours_fwd;
#  - ssd_profile.txt: under "fused" (forward) no ssd_split_state_kernel / ssd_state_pass_kernel and
#    one ssd_split_fused_state_kernel, its ms against their sum in ssd_bench.txt's ours_fwd
#    breakdown; under "input", ssd_split_scan_kernel and ssd_split_cb_kernel against the same; the
#    fwd+bwd breakdown of "fused,fill": ssd_bwd_fused_state_kernel once, no ssd_bwd_dstate_kernel
#    and no ssd_state_pass_kernel, against ours's breakdown.
# Outputs under $OUT: env.txt, ssd_bars.txt, ssd_bench.txt, ssd.json, ssd_profile.txt
# (ssd_anchor.txt, ssd_anchor.json), ssd6.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
if [ "${SSD6_DRY:-0}" != 1 ]; then
  OUT=$O source .ci/h200/setup.sh || exit 1
fi
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-220} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/ssd6.tgz" -C "$O" $(cd "$O" && ls | grep -v '^ssd6.tgz$') 2>/dev/null; }
trap pack EXIT
if [ "${SSD6_DRY:-0}" != 1 ]; then
  stamp ssd-bars
  timeout "$(left 60)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py \
    -k "bf16_vs_fp32_on_gpu and split-fused" -rxXs 2>&1 | tee "$O/ssd_bars.txt" \
    | grep -E "PASS|FAIL|XFAIL|ERROR|relative RMS|passed|failed"
  stamp ssd-bench
  # rows print as they come (Python unbuffered, grep line-buffered), blank lines dropped
  PYTHONUNBUFFERED=1 timeout "$(left 100)" onboard bench --family ssd --case '^B1T8192H128' \
    --impl ours,ours_fwd --profile --out "$O/ssd.json" 2>&1 | grep --line-buffered -v "^\s*$" \
    | tee "$O/ssd_bench.txt"
fi
stamp ssd-profile
timeout "$(left 30)" python3 - <<'PY' 2>&1 | tee "$O/ssd_profile.txt"
# per-kernel GPU ms (harness.kernel_breakdown): the forward with `pass` "fused" and with `cb` "input",
# fwd+bwd with `pass` "fused" and `split_states` "fill"
import os
import torch
from onboarding.bench.cases import config_sweep, fwd_sweep
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("ssd").bench
dry = os.environ.get("SSD6_DRY") == "1"
dev = torch.device("cpu" if dry else "cuda")
shape = (1, 40, 4, 16, 2, 16) if dry else bench.SHAPES[0][:6]
sets = [bench.make_inputs(*shape, dev, seed=s) for s in range(2)]
grads = [torch.randn(*shape[:4], device=dev, dtype=torch.bfloat16)]
mod, ours = bench._ours()
steps = {f"{k}_fwd": v for k, v in fwd_sweep(mod, ours, sets, shape[3], [{"pass": "fused"}, {"cb": "input"}]).items()}
steps.update(config_sweep(mod, ours, sets, grads, shape[3], [{"pass": "fused", "split_states": "fill"}]))
for name, step in steps.items():
    print(name, "(forward)" if name.endswith("_fwd") else "(forward + backward)", flush=True)
    try:
        rows = (step(0), [])[1] if dry else kernel_breakdown(step)
    except Exception as exc:  # noqa: BLE001 - the other rows stand
        print(f"  failed: {type(exc).__name__}: {str(exc)[:200]}")
        continue
    for r in rows:
        print(f"  {r['kernel'][:70]:70s} {r['ms']:.3f} ms x{r['calls']}")
    print(f"  total {sum(r['ms'] for r in rows):.3f} ms", flush=True)
PY
if [ "${SSD6_DRY:-0}" != 1 ]; then
  stamp ssd-anchor
  if [ "$(left 1000)" -ge 150 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
      .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
    PYTHONUNBUFFERED=1 PYTHONPATH=$PYTHONPATH:/tmp/site_anchor ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors \
      timeout "$(left 1000)" onboard bench --family ssd --case '^B1T8192H128' --impl ours_fwd,mamba_ssm_fwd \
      --out "$O/ssd_anchor.json" 2>&1 | grep --line-buffered -v "^\s*$" | tee "$O/ssd_anchor.txt"
  else
    echo "step 4 skipped: $(left 1000) s of BUDGET=${BUDGET:-220} left (BUDGET=380 runs it)"
  fi
fi
stamp end
