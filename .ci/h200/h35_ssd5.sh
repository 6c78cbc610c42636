# Device call for issue 35 (H200), ssd template v11: `split_states` "fill" (the forward with a
# backward to come passes states over split chunks of 256 tokens, then fills in each split chunk's
# chunks' incoming states; off by default) against the default ("pass"). Run at template v10
# (commit 40401a5) it also timed v10's "local", which v11 removed (family.py has its numbers).
# Self-contained: sources setup.sh. Carry .whl and .anchors (mamba_ssm's source tree and
# .anchors/wheels/einops-*.whl):
#   bash .ci/h200/h35_ssd5.sh
# Within ${BUDGET:-240} s (setup ~30 s, bars <= 70, bench <= 110, profile <= 30):
#  1. the bf16-vs-fp32 bars, test_bf16_vs_fp32_on_gpu [fill] (an xfail-marked tuning value: XPASS
#     is the pass) -> ssd_bars.txt;
#  2. the headline bench, B1 T8192 H128 P64 G8 N128 bf16: ours, ours_fwd (the default), mamba_ssm,
#     mamba_ssm_fwd, then kernel_templates/ssd/bench.py's SWEEP row (fwd+bwd):
#     ours@split_states=fill -> ssd_bench.txt (printed as it goes), ssd.json;
#  3. per-kernel GPU ms (torch.profiler) of fwd+bwd at the default and with "fill"
#     -> ssd_profile.txt (SSD5_DRY=1 runs this step on the CPU at a tiny shape, no profile).
# Outputs under $OUT: env.txt, ssd_bars.txt, ssd_bench.txt, ssd.json, ssd_profile.txt, ssd5.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
if [ "${SSD5_DRY:-0}" != 1 ]; then
  OUT=$O source .ci/h200/setup.sh || exit 1
fi
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-240} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/ssd5.tgz" -C "$O" $(cd "$O" && ls | grep -v '^ssd5.tgz$') 2>/dev/null; }
trap pack EXIT
if [ "${SSD5_DRY:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
    .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
  export PYTHONPATH=$PYTHONPATH:/tmp/site_anchor
  export ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors
  stamp ssd-bars
  timeout "$(left 70)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py \
    -k "bf16_vs_fp32_on_gpu and fill" -rxXs 2>&1 | tee "$O/ssd_bars.txt" | grep -E "PASS|FAIL|XFAIL|ERROR|relative RMS|passed|failed"
  stamp ssd-bench
  # rows print as they come (Python unbuffered, grep line-buffered), blank lines dropped
  PYTHONUNBUFFERED=1 timeout "$(left 110)" onboard bench --family ssd --case '^B1T8192H128' \
    --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --out "$O/ssd.json" 2>&1 | grep --line-buffered -v "^\s*$" \
    | tee "$O/ssd_bench.txt"
fi
stamp ssd-profile
timeout "$(left 30)" python3 - <<'PY' 2>&1 | tee "$O/ssd_profile.txt"
# per-kernel GPU ms (harness.kernel_breakdown) of fwd+bwd at the default and with `split_states` "fill"
import os
import torch
from onboarding.bench.cases import config_sweep
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("ssd").bench
dry = os.environ.get("SSD5_DRY") == "1"
dev = torch.device("cpu" if dry else "cuda")
shape = (1, 40, 4, 16, 2, 16) if dry else bench.SHAPES[0][:6]
sets = [bench.make_inputs(*shape, dev, seed=s) for s in range(2)]
grads = [torch.randn(*shape[:4], device=dev, dtype=torch.bfloat16)]
mod, ours = bench._ours()
steps = config_sweep(mod, ours, sets, grads, shape[3], [{"split_states": "pass"}, {"split_states": "fill"}])
for name, step in steps.items():
    print(name, "(forward + backward)", flush=True)
    try:
        rows = (step(0), [])[1] if dry else kernel_breakdown(step)
    except Exception as exc:  # noqa: BLE001 - the other rows stand
        print(f"  failed: {type(exc).__name__}: {str(exc)[:200]}")
        continue
    for r in rows:
        print(f"  {r['kernel'][:70]:70s} {r['ms']:.3f} ms x{r['calls']}")
    print(f"  total {sum(r['ms'] for r in rows):.3f} ms", flush=True)
PY
stamp end
