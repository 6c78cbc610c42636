#!/usr/bin/env bash
# The fifty-third session's timing call (~520 s): the new backward options beside their defaults in
# one run each, then their GPU bars, each step cut to what is left of LIMIT. 1. ssd v27's `bwd_ahead` rows (the sweep's first three) at the
# Mamba-2 layout, fwd+bwd over forward (issue 35: <= 3x); 2. gated_delta v35's `bwd_fold` row at the
# Qwen3-Next layout (issue 32: <= 2.6x); 3. moe_experts v32's DeepSeek-V3 N8192 rows (`gate_up_one_dot`,
# `x_sorted_out`) against `_grouped_mm` (issue 33: fwd >= 1.3x, fwd+bwd >= 1.2x); 4. with what is left,
# the bf16 bars of those options. Run once (docs/LOG.md, fifty-third session): gated_delta v35 and
# moe_experts v32 were reverted after it, ssd's `bwd_ahead` became v28's default; run again, it times
# the current sweep rows. carry: .whl. Usage: LIMIT=520 bash .ci/h200/h53b.sh
set -u
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
source .ci/h200/setup.sh > /dev/null || exit 1
source .ci/h200/step.sh
step ssd 150 onboard bench --family ssd --case '^B1T8192H128P64G8N128$' --impl ours,ours_fwd --out $OUT/ssd.json
D='deepseek_v3/E256K8D7168F2048N8192/uniform'
step moe 150 onboard bench --family moe_experts --case "$D/fwd\$" --case "$D/fwdbwd\$" --impl ours,grouped_mm --out $OUT/moe.json
step gdn 130 onboard bench --family gated_delta --case 'B1T8192H16' --impl ours,ours_fwd --out $OUT/gdn.json
step bars 600 python3 -m pytest -q -p no:cacheprovider -x tests/kernel_tests/test_ssd.py \
  tests/kernel_tests/test_gated_delta.py tests/kernel_tests/test_moe_experts.py -k 'gpu and (ahead or bwd_fold) or v32' --durations=5
