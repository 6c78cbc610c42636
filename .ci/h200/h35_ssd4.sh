# Device call for issue 35 (H200; run in the twenty-sixth session, call A: since then "split" is
# the P <= 64 forward and its bars row is [default], so step 1 below selects nothing), ssd template v9's `fwd` "split" (the forward as five launches
# with many small programs over chunks of 256 tokens; off by default). Self-contained: sources
# setup.sh. Carry .whl and .anchors (mamba_ssm 2.3.2.post1's source tree and
# .anchors/wheels/einops-*.whl, git-ignored):
#   bash .ci/h200/h35_ssd4.sh
# Within ${BUDGET:-250} s (setup ~30 s, bars <= 60, bench <= 130, profile <= 30):
#  1. the bf16-vs-fp32 bars of the new path, test_bf16_vs_fp32_on_gpu[fwd-split] (its forward with
#     and without a backward to come, every gradient; xfail-marked as a tuning value: XPASS is the
#     pass) -> ssd_bars.txt;
#  2. the headline bench, B1 T8192 H128 P64 G8 N128 bf16, against mamba-ssm in the same run:
#     ours, ours_fwd (the default), mamba_ssm, mamba_ssm_fwd and kernel_templates/ssd/bench.py's
#     SWEEP rows (they come with `ours`, after the others): ours@fwd=split (fwd+bwd),
#     ours@fwd=split_fwd, ours@fwd=split,split_states=fill (fwd+bwd), and forward-only at FWD_K=16, fwd_warps=8, FWD_M=32, fwd_maxnreg=0,
#     STATE_N=128, and v8's best forward ours@scan=blocks,STATE_N=128_fwd -> ssd_bench.txt, ssd.json;
#  3. per-kernel GPU ms (torch.profiler) of ours@fwd=split_fwd, ours@fwd=split (fwd+bwd) and
#     mamba-ssm's forward -> ssd_split_profile.txt (SSD4_DRY=1 runs this step's script on the CPU
#     at a tiny shape in the interpreter, no profile).
# Outputs under $OUT: env.txt, ssd_bars.txt, ssd_bench.txt, ssd.json, ssd_split_profile.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-250} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
export PYTHONPATH=$PYTHONPATH:/tmp/site_anchor
export ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors
stamp ssd-bars
timeout "$(left 60)" python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py \
  -k "bf16_vs_fp32_on_gpu and split" -rxXs 2>&1 | tee "$O/ssd_bars.txt" | tail -8
stamp ssd-bench
timeout "$(left 130)" onboard bench --family ssd --case '^B1T8192H128' \
  --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --out "$O/ssd.json" 2>&1 | grep -v "^\s*$" > "$O/ssd_bench.txt"
grep -A30 "^case " "$O/ssd_bench.txt" || tail -30 "$O/ssd_bench.txt"
stamp ssd-split-profile
timeout "$(left 30)" python3 - <<'PY' 2>&1 | tee "$O/ssd_split_profile.txt"
# per-kernel GPU ms (harness.kernel_breakdown) of the `fwd` "split" rows and of mamba-ssm's forward
import os
import torch
from onboarding.bench.cases import config_sweep, fwd_sweep
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("ssd").bench
dry = os.environ.get("SSD4_DRY") == "1"
dev = torch.device("cpu" if dry else "cuda")
shape = (1, 40, 4, 16, 2, 16) if dry else bench.SHAPES[0][:6]
sets = [bench.make_inputs(*shape, dev, seed=s) for s in range(2)]
grads = [torch.randn(*shape[:4], device=dev, dtype=torch.bfloat16)]
mod, ours = bench._ours()
cfgs = [{"fwd": "split"}]
steps = {k + "_fwd": v for k, v in fwd_sweep(mod, ours, sets, shape[3], cfgs).items()}
steps.update(config_sweep(mod, ours, sets, grads, shape[3], cfgs))
if not dry:
    steps["mamba_ssm_fwd"] = bench._anchor_steps(sets, grads)["mamba_ssm_fwd"]
for name, step in steps.items():
    print(name, "(forward only)" if name.endswith("_fwd") else "(forward + backward)", flush=True)
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
