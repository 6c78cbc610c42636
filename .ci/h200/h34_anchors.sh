# H200 call (issues 32 and 35): the current defaults against their anchors, each in one run, on
# the H200 the goals name (the thirty-fourth session's calls ran on an H100). Nothing new is timed:
#  - gated_delta v23's default (prep_share removed) against fla 0.6's chunk_gated_delta_rule at the
#    three GDN shapes, forward and forward + backward (issue 32: forward >= 1.3x fla at all three,
#    fwd+bwd <= 2.6x its own forward; the H100 gave 1.34x / 1.27x by graph at the first two, the
#    third was cut by that call's budget);
#  - ssd v18's default (STATE_CHUNKS 1, adopted from the H100's rows) against mamba-ssm's Triton SSD,
#    forward and forward + backward (issue 35: forward >= 1.0x mamba-ssm, fwd+bwd <= 3x own forward;
#    the H100 timed the former default beside mamba-ssm, not this one).
# Self-contained: sources setup.sh. Carry .whl, .whl_fla and .anchors:
#   BUDGET=560 bash .ci/h200/h34_anchors.sh
# Within ${BUDGET:-560} s (30 s kept for setup and packing), each step cut by `timeout`:
#  1. (<= 300 s; fla's first call autotunes, ~95 s) `onboard bench --family gated_delta --case
#     B2T4096 --case B1T8192 --case B1T32768 --impl ours,ours_fwd,fla,fla_fwd` -> gdn_anchor.txt,
#     gdn_anchor.json (rows printed as they finish);
#  2. (<= 200 s; mamba-ssm's autotuned backward compiles ~100 s) `onboard bench --family ssd --case
#     '^B1T8192H128' --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd` -> ssd_anchor.txt,
#     ssd_anchor.json.
# Read: the ratios column (anchor / ours, interleaved wall, then CUDA graph) per case; fwd+bwd over
# fwd by the `graph` column.
# Outputs under $OUT: env.txt, gdn_anchor.*, ssd_anchor.*, anchors.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-560} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/anchors.tgz" -C "$O" $(cd "$O" && ls | grep -v '^anchors.tgz$') 2>/dev/null; }
trap pack EXIT
stamp gdn-anchor
PYTHONPATH=$FLA_SITE:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left 300)" onboard bench --family gated_delta \
  --case B2T4096 --case B1T8192 --case B1T32768 --impl ours,ours_fwd,fla,fla_fwd --out "$O/gdn_anchor.json" \
  2>&1 | grep --line-buffered -v "^\s*$" | tee "$O/gdn_anchor.txt"
stamp ssd-anchor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
PYTHONUNBUFFERED=1 PYTHONPATH=$PYTHONPATH:/tmp/site_anchor ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors \
  timeout "$(left 200)" onboard bench --family ssd --case '^B1T8192H128' \
  --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd --out "$O/ssd_anchor.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/ssd_anchor.txt"
stamp end
