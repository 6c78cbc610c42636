# H200 call (issue 32, GDN template v18): the forward with o computed in the state pass (`fwd_o`
# "fused": no output kernel; a forward without training writes neither S_c nor v_new), alone and
# with 16-wide state tiles (`state_bv` 16: 256 state programs at B * HV = 32), the prepare kernel's
# reordered loops (`prep_pipe` "on", v18: g summed after the Gram loop, kd and qg from a pipelined
# loop of their own before the solve), alone and with "fused", that again with the prepare at 8 warps
# capped at 128 registers (`prep_warps` 8, `prep_maxnreg` 128), and "fused" with kd and qg not
# written (`fused_kq` "rows", v18: row factors instead, the fused pass feeds the raw k and q rows
# to its dots), alone and with prep_pipe and the 8-warp cap, against the default
# (split: state pass + output kernel) and fla 0.6's chunk_gated_delta_rule, CUDA-graph time in one
# run, at the issue's three shapes (B2 T4096 H16 D128; the Qwen3-Next layout HK16 HV32 D128 at
# T8192 and T32768), bf16. Self-contained: sources setup.sh. Carry .whl and .whl_fla:
#   bash .ci/h200/h32_gdn5.sh
# Within ${BUDGET:-420} s (not timed on a GPU yet; the step limits below are arithmetic from the
# KDA call h32_kda3.sh: set-up ~30 s, our first row's compiles ~35 s, fla's first call ~95 s with
# its autotuning; v18's five rows add four prepare builds and one state build, ~10-20 s each, hence step 1's
# 240 s and the 420 s default; step 3 runs only if 1 and 2 end early). Steps, each cut by
# `timeout` to what is left:
#  1. `onboard bench --family gated_delta --case B2T4096 --case B1T8192 --case B1T32768 --impl
#     ours_fwd,ours@fwd_o=fused_fwd,ours@fwd_o=fused+state_bv=16_fwd,ours@prep_pipe=on_fwd,
#     ours@prep_pipe=on+fwd_o=fused_fwd,ours@prep_pipe=on+prep_warps=8+prep_maxnreg=128+fwd_o=fused_fwd,
#     ours@fwd_o=fused+fused_kq=rows_fwd,ours@fwd_o=fused+fused_kq=rows+prep_pipe=on+prep_warps=8+
#     prep_maxnreg=128_fwd,fla_fwd --profile` (wall and CUDA-graph ms, the default's kernels; a
#     prep_* row differs from its pair only in the prepare kernel) -> gdn5_bench.txt (printed as it
#     goes), gdn5.json;
#  2. the bf16-vs-fp32 GPU bars (o and the final state within 5e-3, every gradient within 1e-2
#     relative RMS of the fp32 path) at K = V = 128, mixed decays: the default
#     (`test_bf16_vs_fp32_on_gpu[k128-mixed]`), both `fwd_o` rows and the five v18 rows
#     (`test_bf16_vs_fp32_on_gpu_fwd_o[...-k128-mixed]`: forward without training, then a
#     training step; a fused forward keeps S_c, v_new, kd and qg for it) -> gdn5_bars.txt (cap 150 s);
#  3. if >= 60 s are left: fwd+bwd of the default and of `fwd_o` "fused" at T8192 (the issue's
#     fwd+bwd <= 2.6x its own forward) -> gdn5_train.txt, gdn5_train.json.
# Outputs under $OUT: env.txt, gdn5_bench.txt, gdn5.json, gdn5_bars.txt, gdn5_train.*, gdn5.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-420} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/gdn5.tgz" -C "$O" $(cd "$O" && ls | grep -v '^gdn5.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=ours@fwd_o=fused_fwd,ours@fwd_o=fused+state_bv=16_fwd,ours@prep_pipe=on_fwd,ours@prep_pipe=on+fwd_o=fused_fwd
ROWS=$ROWS,ours@prep_pipe=on+prep_warps=8+prep_maxnreg=128+fwd_o=fused_fwd,ours@fwd_o=fused+fused_kq=rows_fwd
ROWS=$ROWS,ours@fwd_o=fused+fused_kq=rows+prep_pipe=on+prep_warps=8+prep_maxnreg=128_fwd
stamp gdn5-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left 240)" onboard bench --family gated_delta \
  --case B2T4096 --case B1T8192 --case B1T32768 --impl "ours_fwd,$ROWS,fla_fwd" --profile --out "$O/gdn5.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/gdn5_bench.txt"
stamp gdn5-bars
timeout "$(left 150)" python3 -m pytest -v -p no:cacheprovider -rxXs tests/kernel_tests/test_gated_delta.py \
  -k "bf16_vs_fp32_on_gpu and k128-mixed" 2>&1 | tee "$O/gdn5_bars.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
if [ "$(left 60)" -ge 60 ]; then
  stamp gdn5-train
  PYTHONUNBUFFERED=1 timeout "$(left 120)" onboard bench --family gated_delta --case B1T8192 \
    --impl "ours,ours@fwd_o=fused,ours_fwd,ours@fwd_o=fused_fwd" --out "$O/gdn5_train.json" 2>&1 | grep --line-buffered -v "^\s*$" \
    | tee "$O/gdn5_train.txt"
fi
stamp end
