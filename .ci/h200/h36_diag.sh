# Device call (issues 32, 35), thirty-first session: why two untimed backward options failed on
# the H200 in this session's call 2, ssd's candidate default beside mamba-ssm, and the
# linear-attention GPU tests.
#   bash .ci/h200/h36_diag.sh          (carry: .whl .anchors; BUDGET=470 s)
# 1. KDA `kda_qk` "fused" (kda_chunk_bwd_fused_kernel) faulted with an illegal address at the bars'
#    shape. Each variant in its own process, CUDA_LAUNCH_BLOCKING=1 (h32_kdafused_diag.py), so the
#    first faulting kernel is named and one fault does not poison the rest: the bars' case, one
#    value head per key head, no l2norm, the default K tile, K 64, one chunk.
# 2. compute-sanitizer memcheck on the bars' variant at T 100 (the faulting access, if the runtime
#    allows the tool).
# 3. ssd: the candidate default (v12's `pass` "fused" + `split_states` "fill": in call 1 the
#    fastest forward, 0.516 ms against 0.591, and fwd+bwd 3.008 against 3.477; its parts' bars
#    passed) beside mamba-ssm's Triton SSD in one bench run (`--impl ours,ours_fwd,mamba_ssm,
#    mamba_ssm_fwd`: the sweep rows run with "ours").
# 4. With what is left (BUDGET, default 470 s): the GPU bf16 tests of gated_delta and kimi_delta
#    (the KDA fused rows deselected while they fault), GDN's `fused_kq` "rows" bars among them.
# Carry .whl and .anchors.
set -o pipefail
cd "$(dirname "$0")/../.."
source .ci/h200/setup.sh >/dev/null 2>&1 || source .ci/h200/setup.sh
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
D=.ci/h200/h32_kdafused_diag.py
F='"kda_qk": "fused"'
stamp kda-variants
{
for row in "{$F, \"kda_qk_bk\": 16, \"kda_qk_warps\": 8}|2 4 1000 128 128 2 1" \
           "{$F, \"kda_qk_bk\": 16, \"kda_qk_warps\": 8}|2 2 1000 128 128 2 1" \
           "{$F, \"kda_qk_bk\": 16, \"kda_qk_warps\": 8}|2 4 1000 128 128 2 0" \
           "{$F}|2 4 1000 128 128 2 1" \
           "{$F, \"kda_qk_bk\": 16, \"kda_qk_warps\": 8}|2 4 1000 64 64 2 1" \
           "{$F, \"kda_qk_bk\": 16, \"kda_qk_warps\": 8}|1 1 64 128 128 1 1"; do
  cfg=${row%%|*}; shape=${row#*|}
  CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 $D "$cfg" $shape 2>&1 | grep -E "^(OK|FAIL)|Error|error" | head -4
done
} 2>&1 | tee "$O/kda_variants.txt"
stamp kda-sanitizer
timeout 150 compute-sanitizer --tool memcheck --print-limit 6 python3 $D "{$F, \"kda_qk_bk\": 16, \"kda_qk_warps\": 8}" 2 4 100 128 128 1 1 \
  > "$O/kda_memcheck.txt" 2>&1; echo "rc $?" >> "$O/kda_memcheck.txt"
grep -E "Invalid|at 0x|by thread|Address|ERROR SUMMARY|kernel|^OK|^FAIL|rc " "$O/kda_memcheck.txt" | head -40
stamp ssd-anchor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
PYTHONUNBUFFERED=1 PYTHONPATH=$PYTHONPATH:/tmp/site_anchor ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors \
  timeout 170 onboard bench --family ssd --case '^B1T8192H128' --impl ours,ours_fwd,mamba_ssm,mamba_ssm_fwd \
  --out "$O/ssd_anchor.json" 2>&1 | grep --line-buffered -v "^\s*$" | tee "$O/ssd_anchor.txt" | grep -v "^[0-9:]* "
stamp la-tests
left=$(( ${BUDGET:-470} - $(date +%s) + t0 ))
[ "$left" -ge 40 ] && timeout "$left" python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kernel_tests/test_gated_delta.py \
  tests/kernel_tests/test_kimi_delta.py -k "gpu and not (bwd_sweep and kda_qk)" -rfEs 2>&1 | tee "$O/la_tests.txt" | tail -25 | cut -c1-400
stamp end
