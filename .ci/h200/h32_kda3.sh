# H200 call (issue 32, KDA template v31): the forward's default (the "pipelined" prepare step,
# `kda_prepare_fwd_kernel` with its Gram pass a straight loop that Triton pipelines; the split
# output, `kda_output_fwd_kernel`) against o computed in the state pass (`fwd_o` "fused", bench row
# ours@fwd_o=fused_fwd: `kda_state_fwd_kernel` with FUSE_O, no output launch, neither S_c nor v_new
# written without training), the former default prepare "fused" (row ours@kda_prep=fused_fwd) and
# fla 0.6's chunk_kda at the Kimi-Linear layout (B1 H32 K = V = 128 bf16), T8192 and T32768 (goal:
# 1.2x fla by CUDA graph). Self-contained: sources setup.sh. Carry .whl and .whl_fla:
#   bash .ci/h200/h32_kda3.sh
# Within ${BUDGET:-480} s. Step caps from the twenty-eighth session's timings of this script's
# template-v28 form (setup ~30 s; the bench ~160 s: our first row's compiles 34 s, fla's first call
# 95 s with its autotuning, the pipelined row 5 s, T32768 16 s; the bars 185 s, which build the
# forward and backward in bf16 and fp32); the v31 additions (one bench row, the fwd_o bars) are
# arithmetic, not run: ~20 s more in the bench; the fwd_o bars run first (cap 200 s: they make the
# bf16 and fp32 builds of the whole forward and backward, which the default's bars then reuse from
# Triton's cache), the default's bars take what is left (cap 220 s), all within BUDGET - 30 s.
#  1. `onboard bench --family kimi_delta --case B1T8192H32D128 --case B1T32768H32D128 --impl
#     ours_fwd,fla_fwd,ours@fwd_o=fused_fwd,ours@kda_prep=fused_fwd --profile` (wall and CUDA-graph
#     ms, the default's kernels) -> kda3_bench.txt (printed as it goes), kda3.json;
#  2. the bf16-vs-fp32 GPU bars of the fwd_o row at K = 128 (`test_bf16_vs_fp32_on_gpu_fwd_o
#     [k128-mixed-fwd_o=fused]`: the forward without training, o and the final state within 5e-3 of
#     the fp32 path, then a training step, every gradient within 1e-2) -> kda3_bars_fwd_o.txt;
#  3. the default's bars (`test_bf16_vs_fp32_on_gpu`: forward and every gradient, mixed and slow
#     decays) and the fwd_o row's at K = 64 (slow decays) -> kda3_bars.txt;
#  4. if >= 60 s are left: fwd+bwd at T8192, `--impl ours,ours@fwd_o=fused` (the training forward
#     keeps S_c and v_new; it saves only the output launch there) -> kda3_train.txt, kda3_train.json.
# Outputs under $OUT: env.txt, kda3_bench.txt, kda3.json, kda3_bars_fwd_o.txt, kda3_bars.txt,
# kda3_train.*, kda3.tgz.
# Reading it: `--profile` lists the default's kernels only, so ours@fwd_o=fused_fwd's gain is its
# forward against ours_fwd's; if it is faster at both lengths and passes its bars, `fwd_o` "fused"
# becomes the k_le_128 bucket's value (kernel_templates/kimi_delta/family.py).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-480} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kda3.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kda3.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=ours@fwd_o=fused_fwd,ours@kda_prep=fused_fwd
stamp kda3-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left 210)" onboard bench --family kimi_delta \
  --case B1T8192H32D128 --case B1T32768H32D128 --impl "ours_fwd,fla_fwd,$ROWS" --profile --out "$O/kda3.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kda3_bench.txt"
stamp kda3-bars-fwd_o
timeout "$(left 200)" python3 -m pytest -v -p no:cacheprovider -rxXs tests/kernel_tests/test_kimi_delta.py \
  -k "bf16_vs_fp32_on_gpu_fwd_o and k128-mixed" 2>&1 | tee "$O/kda3_bars_fwd_o.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|over the bar|passed|failed"
stamp kda3-bars
timeout "$(left 220)" python3 -m pytest -v -p no:cacheprovider -rxXs tests/kernel_tests/test_kimi_delta.py \
  -k "bf16_vs_fp32_on_gpu and not sweep and not k128-mixed-fwd_o" 2>&1 | tee "$O/kda3_bars.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|over the bar|passed|failed"
if [ "$(left 60)" -ge 60 ]; then
  stamp kda3-train
  PYTHONUNBUFFERED=1 timeout "$(left 120)" onboard bench --family kimi_delta --case B1T8192H32D128 \
    --impl "ours,ours@fwd_o=fused" --out "$O/kda3_train.json" 2>&1 | grep --line-buffered -v "^\s*$" \
    | tee "$O/kda3_train.txt"
fi
stamp end
