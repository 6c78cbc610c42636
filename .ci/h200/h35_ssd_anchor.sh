# H200: issue 35's ssd against mamba-ssm's Triton SSD (helper h35). Needs the carried
# .anchors/ (mamba_ssm 2.3.2.post1's source tree and .anchors/wheels/einops-*.whl, both
# git-ignored): the anchor is loaded from the tree without its package __init__; its rows are
# timed after its own check against ours (y and every gradient, twice our bars). Expected
# ~120 s (mamba-ssm's autotune compiles at the first call).
#   source .ci/h200/setup.sh && bash .ci/h200/h35_ssd_anchor.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || exit 1
export PYTHONPATH=$PYTHONPATH:/tmp/site_anchor ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors
stamp ssd-anchor
timeout 170 onboard bench --family ssd --case H128 \
  --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --out "$O/h35_ssd_anchor.json" 2>&1 | tail -30
stamp end
