# H200: issue 35's ssd family at template v7 (16-bit dots and bf16 chunk states the P <= 64
# default; config STATE_CHUNKS: state chunks of several kernel chunks; config gstate: bf16
# end-state gradients; SCAN_N). Needs the carried .anchors/ (mamba_ssm 2.3.2.post1's source tree
# and .anchors/wheels/einops-*.whl, git-ignored), as .ci/h200/h35_ssd_anchor.sh.
#   source .ci/h200/setup.sh && bash .ci/h200/h35_ssd2.sh
# Steps: the bf16-vs-fp32 bars on the GPU (the new default and the v7 alternatives; timeout 120),
# the other ssd kernel tests on the GPU (timeout 80), then the bench of the headline case with
# mamba-ssm's rows, the kernel profile of ours / ours_fwd and the four sweep rows of
# kernel_templates/ssd/bench.py's SWEEP (they come with `ours`): ours@STATE_CHUNKS=4_fwd,
# ours@STATE_CHUNKS=4,BLOCK_P=32_fwd, ours@BLOCK_N=64,DBC_N=64 and
# ours@STATE_CHUNKS=4,gstate=input,BLOCK_N=64,DBC_N=64 (timeout 170).
# Expected ~6 min (setup ~0.5, bars <= 120 s, tests <= 80 s, bench ~150 s: cold compiles of
# mamba-ssm's autotune and of our 4 sweep configs). Outputs under $OUT: env.txt (setup),
# ssd_bars.txt, ssd_tests.txt, ssd.json, ssd_bench.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
export PYTHONPATH=$PYTHONPATH:/tmp/site_anchor
stamp ssd-bars
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py -k bf16_vs_fp32 -rxXs \
  2>&1 | tee "$O/ssd_bars.txt" | tail -20
stamp ssd-tests
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_ssd.py -m "not slow" \
  -k "not bf16_vs_fp32" -rxXs --durations=5 2>&1 | tee "$O/ssd_tests.txt" | tail -20
stamp ssd-bench
ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors timeout 170 onboard bench --family ssd --case '^B1T8192H128' \
  --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --profile --out "$O/ssd.json" 2>&1 \
  | tee "$O/ssd_bench.txt" | tail -70
stamp end
