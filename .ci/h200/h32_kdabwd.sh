# H200 call (issue 32): KDA's backward at the Kimi-Linear layout (H32 K=V=128 bf16), template v20.
# Goal: forward + backward <= 3x the forward at T8192 and T32768. The default backward (serial
# kda_chunk_bwd_qk_kernel) against the rows of kernel_templates/kimi_delta/bench.py's BWD_SWEEP
# (forward + backward, same inputs): `kda_qk` "tiles" (the wy kernel also writes the l2norm row
# dots; kda_chunk_bwd_qkt_kernel per K tile), its K tile 16, then with 8 warps for the wy kernel and
# the reverse state pass, and those 8 warps alone on the default (serial) backward.
#   source .ci/h200/setup.sh && bash .ci/h200/h32_kdabwd.sh     (carry .whl and .whl_fla)
# Steps: the bf16-vs-fp32 bars of every sweep config on the GPU (timeout 40 s, -v: a line per
# config as it passes), the bench with fla 0.6's forward on PYTHONPATH through $FLA_SITE (timeout
# 190 s; ~80 s of it fla's first-call autotuning; each row logs its wall median as it finishes, so
# a cut run still shows T8192), then the per-kernel profile of each sweep config at T8192 (timeout 25 s; the bench's --profile
# breaks down the `ours` rows only).
# Expected ~4.5 min (setup ~0.5). Outputs under $OUT: kda_bars.txt, kda.json, kda_bench.txt,
# kda_profile.json, kda_profile.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp kda-bars
T=tests/kernel_tests/test_kimi_delta.py
timeout 40 python3 -m pytest -v -p no:cacheprovider -rxXs "$T::test_bf16_vs_fp32_on_gpu_bwd_sweep" \
  2>&1 | tee "$O/kda_bars.txt" | tail -20
stamp kda-bench
ROWS=$(python3 -c "from onboarding.families import family_module as f; print(','.join(r for r in f('kimi_delta').bench.SWEEP_ROWS if not r.endswith('_fwd')))")
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 190 onboard bench --family kimi_delta --case B1T8192H32D128 \
  --case B1T32768H32D128 --impl "ours,ours_fwd,fla_fwd,$ROWS" --profile --out "$O/kda.json" 2>&1 \
  | tee "$O/kda_bench.txt" | tail -90
stamp kda-profile
timeout 25 python3 .ci/h200/h32_kdabwd_profile.py 8192 "$O/kda_profile.json" 2>&1 | tee "$O/kda_profile.txt" | tail -12
stamp end
