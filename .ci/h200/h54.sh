#!/usr/bin/env bash
# The fifty-fourth session's device calls: the anchors still owed on the H200 (issues 32, 33, 35),
# each step cut to what is left of LIMIT, in the order STEPS names them (default: all, in this order):
#   kda  `onboard bench --family kimi_delta` at the Kimi-Linear layout T8192 and T32768 against fla's
#        forward (issue 32: forward >= 1.2x fla, fwd+bwd <= 3x its own forward);
#   gdn  `onboard bench --family gated_delta` at the three GDN shapes against fla, forward and
#        fwd+bwd (issue 32: forward >= 1.3x fla, fwd+bwd <= 2.6x its own forward);
#   ssd  `onboard bench --family ssd` at the Mamba-2 layout against mamba-ssm's Triton SSD
#        (issue 35: forward >= 1.0x mamba-ssm, fwd+bwd <= 3x its own forward);
#   mla  `onboard bench --family sparse_attention` DeepSeek-V3.2 MLA forward at T8192 and T32768
#        (issue 33: >= 350 TFLOP/s).
# carry: .whl .whl_fla .anchors. Usage: LIMIT=560 STEPS="kda gdn" bash .ci/h200/h54.sh
set -u
source .ci/h200/step.sh
begin || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl > /dev/null 2>&1 || echo "einops wheel not carried: no mamba_ssm rows"
for s in ${STEPS:-kda gdn ssd mla}; do
  case $s in
    kda) PYTHONPATH=$FLA_SITE:$PYTHONPATH step kda 240 onboard bench --family kimi_delta --case B1T8192H32D128 \
           --case B1T32768H32D128 --impl ours,ours_fwd,fla_fwd --out $OUT/kda.json ;;
    gdn) PYTHONPATH=$FLA_SITE:$PYTHONPATH step gdn 300 onboard bench --family gated_delta --case B2T4096 \
           --case B1T8192 --case B1T32768 --impl ours,ours_fwd,fla,fla_fwd --out $OUT/gdn.json ;;
    ssd) PYTHONPATH=$PYTHONPATH:/tmp/site_anchor ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors step ssd 200 \
           onboard bench --family ssd --case '^B1T8192H128' --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd \
           --out $OUT/ssd.json ;;
    mla) step mla 100 onboard bench --family sparse_attention --case 'mla-T8192-fwd$' --case 'mla-T32768-fwd$' \
           --impl ours --out $OUT/mla.json ;;
    *) echo "unknown step $s" ;;
  esac
done
