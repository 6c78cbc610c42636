# H200 call (issues 32, 33, 35; twenty-eighth session): where the time goes today, per kernel
# (`onboard bench --profile`: torch.profiler GPU ms per kernel of the ours / ours_fwd rows), to pick
# the next kernel work. Carry .whl and .anchors:
#   bash .ci/h200/h3235_profile.sh
# Within ${BUDGET:-420} s (set-up ~30 s):
#  1. MoE experts, DeepSeek-V3 E256 K8 D7168 F2048 N8192, fwd+bwd and fwd: ours and torch._grouped_mm
#     -> moe.json / moe_bench.txt (<= 120 s);
#  2. KDA forward at the Kimi-Linear layout, T8192 and T32768 (ours_fwd) -> kda.json / kda_bench.txt
#     (<= 70 s);
#  3. GDN forward at the Qwen3-Next layout, T8192 and T32768 (ours_fwd) -> gdn.json / gdn_bench.txt
#     (<= 70 s);
#  4. ssd forward, B1 T8192 H128 P64 G8 N128: ours_fwd and mamba-ssm's, wall and CUDA-graph times
#     -> ssd.json / ssd_bench.txt (what is left of the budget).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-420} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/h3235.tgz" -C "$O" $(cd "$O" && ls | grep -v '^h3235.tgz$') 2>/dev/null; }
trap pack EXIT
stamp moe
timeout "$(left 120)" onboard bench --family moe_experts \
  --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwd$' \
  --impl ours,grouped_mm --profile --out "$O/moe.json" 2>&1 | tee "$O/moe_bench.txt" | tail -40
stamp kda
timeout "$(left 70)" onboard bench --family kimi_delta --case B1T8192H32D128 --case B1T32768H32D128 \
  --impl ours_fwd --profile --out "$O/kda.json" 2>&1 | tee "$O/kda_bench.txt" | tail -30
stamp gdn
timeout "$(left 70)" onboard bench --family gated_delta --case B1T8192H16 --case B1T32768H16 \
  --impl ours_fwd --profile --out "$O/gdn.json" 2>&1 | tee "$O/gdn_bench.txt" | tail -30
stamp ssd
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_anchor \
  .anchors/wheels/*.whl || echo "einops wheel not carried: the mamba_ssm rows will be skipped"
PYTHONPATH=$PYTHONPATH:/tmp/site_anchor ONBOARD_ANCHOR_MAMBA_SSM=$PWD/.anchors timeout "$(left 200)" \
  onboard bench --family ssd --case '^B1T8192H128' --impl ours_fwd,mamba_ssm_fwd --profile \
  --out "$O/ssd.json" 2>&1 | tee "$O/ssd_bench.txt" | tail -30
stamp end
