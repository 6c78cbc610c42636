# Device call J (twentieth session), from a clean snapshot of HEAD (.clean/head.tgz), one budget
# (${BUDGET:-470} s) shared in issue order: issue 32's KDA tiled backward (bars + bench against fla,
# h32_kdabwd.sh's steps without its profile), issue 33's MoE dw_grouped_mm (h33_moe.sh's tests and
# three cases, no N32768), then issue 34's gated-delta kernel under tm_dot=tf32 at the proxy's
# call shape (gdn_k64.py, blocking launches). At most 8 files come back.
#   bash .ci/h200/call_j.sh      (carry .whl, .whl_fla, .clean)
set -o pipefail
O=${OUT:-/tmp/out}; mkdir -p "$O"
source .ci/h200/clean.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-470} - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
T=tests/kernel_tests/test_kimi_delta.py
stamp kda-bars
timeout 40 python3 -m pytest -v -p no:cacheprovider -rxXs "$T::test_bf16_vs_fp32_on_gpu_bwd_sweep" \
  > "$O/kda_bars.txt" 2>&1; tail -12 "$O/kda_bars.txt"
stamp kda-bench
ROWS=$(python3 -c "from onboarding.families import family_module as f; print(','.join(r for r in f('kimi_delta').bench.SWEEP_ROWS if not r.endswith('_fwd')))")
PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout 190 onboard bench --family kimi_delta --case B1T8192H32D128 \
  --case B1T32768H32D128 --impl "ours,ours_fwd,fla_fwd,$ROWS" --profile --out "$O/kda.json" 2>&1 \
  | grep -v "^\s*$" > "$O/kda_bench.txt"; grep -A14 "^case " "$O/kda_bench.txt"
stamp moe-tests
timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider tests/kernel_tests/test_moe_experts.py -rxXs \
  -k "backward_configs_bf16_cuda or grouped_mm" --durations=6 > "$O/moe_tests.txt" 2>&1; tail -8 "$O/moe_tests.txt"
stamp moe-bench
timeout "$(left 150)" onboard bench --family moe_experts --case 'deepseek_v3/E256K8D7168F2048N8192/uniform/fwdbwd$' \
  --case 'qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd$' --case 'qwen3_next/E512K10D2048F512N8192/zipf/fwdbwd$' \
  --impl ours,grouped_mm --out "$O/moe.json" 2>&1 | grep -v "^\s*$" > "$O/moe_bench.txt"; grep -A30 "^case " "$O/moe_bench.txt"
stamp gdn-k64
l=$(left 60); [ "$l" -gt 25 ] && timeout "$l" python3 .ci/h200/gdn_k64.py > "$O/gdn_k64.txt" 2>&1; tail -20 "$O/gdn_k64.txt"
stamp end
