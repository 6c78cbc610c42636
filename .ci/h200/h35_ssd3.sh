# H200: issue 35's ssd family at template v8 (config `scan` "blocks": the chunk output kernel over
# every chunk in parallel, beside v7's "carry" default). Needs the carried .anchors/ (mamba_ssm
# 2.3.2.post1's source tree and .anchors/wheels/einops-*.whl, git-ignored) and .whl.
#   source .ci/h200/setup.sh && bash .ci/h200/h35_ssd3.sh
# Steps: the bf16-vs-fp32 bars on the GPU (the default, `scan` "blocks" at state chunks of 4 and 8,
# tf32 with fp32 states; each row also checks the no_grad forward; -v: each row's line as it ends,
# should the 60 s timeout cut the last); the bench of the headline
# case with mamba-ssm's rows, the kernel profile of ours / ours_fwd and the ten sweep rows of
# kernel_templates/ssd/bench.py's SWEEP (they come with `ours`, after the other rows):
# ours@scan=blocks (fwd+bwd) and ours@scan=blocks_fwd, ours@scan=blocks,scan_maxnreg=0_fwd,
# ours@scan=blocks,STATE_N=128_fwd, ours@scan=blocks,CHUNK=128,STATE_CHUNKS=2,scan_maxnreg=0_fwd,
# ours@scan=blocks,STATE_CHUNKS=8_fwd, ours@DBC_SPLIT=2, ours@DBC_SPLIT=4,
# ours@scan=blocks,DBC_SPLIT=4, ours@bwd_maxnreg=128 (fwd+bwd; timeout 140); then the
# per-kernel profile of the `scan` "blocks" rows (the bench profiles only ours / ours_fwd;
# timeout 30).
# Expected ~4 min (setup ~0.5, bars <= 60 s, bench <= 140 s, profile <= 30 s). Outputs under
# $OUT: env.txt (setup), ssd_bars.txt, ssd.json, ssd_bench.txt, ssd_blocks_profile.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
export PYTHONPATH=$PYTHONPATH:/tmp/site_anchor
stamp ssd-bars
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/kernel_tests/test_ssd.py -k bf16_vs_fp32 -rxXs \
  2>&1 | tee "$O/ssd_bars.txt" | tail -20
stamp ssd-bench
ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors timeout 140 onboard bench --family ssd --case '^B1T8192H128' \
  --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --profile --out "$O/ssd.json" 2>&1 \
  | tee "$O/ssd_bench.txt" | tail -60
stamp ssd-blocks-profile
timeout 30 python3 - <<'PY' 2>&1 | tee "$O/ssd_blocks_profile.txt"
# per-kernel GPU ms of the `scan` "blocks" rows at the headline case (harness.kernel_breakdown);
# SSD3_DRY=1: a tiny shape on the CPU (interpreter), each step run once, no profile
import os
import torch
from onboarding.bench.cases import config_sweep, fwd_sweep
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module
bench = family_module("ssd").bench
dry = os.environ.get("SSD3_DRY") == "1"
dev = torch.device("cpu" if dry else "cuda")
shape = (1, 40, 4, 16, 2, 16) if dry else bench.SHAPES[0][:6]
sets = [bench.make_inputs(*shape, dev, seed=s) for s in range(2)]
grads = [torch.randn(*shape[:4], device=dev, dtype=torch.bfloat16)]
mod, ours = bench._ours()
cfgs = [{"scan": "blocks"}]
steps = {k + "_fwd": v for k, v in fwd_sweep(mod, ours, sets, shape[3], cfgs).items()}
steps.update(config_sweep(mod, ours, sets, grads, shape[3], cfgs))
for name, step in steps.items():
    print(name, "(forward only)" if name.endswith("_fwd") else "(forward + backward)", flush=True)
    rows = (step(0), [])[1] if dry else kernel_breakdown(step)
    for r in rows:
        print(f"  {r['kernel'][:70]:70s} {r['ms']:.3f} ms x{r['calls']}")
PY
stamp end
