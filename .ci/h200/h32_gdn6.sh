# Run in the thirty-fourth session (on an H100): every prep_share row slower than the default;
# gated_delta v23 removed prep_share, so its rows no longer run. Kept for the record.
# H200 call (issue 32, GDN template v20): does the prepare per (chunk, key head) (`prep_share`: the
# raw Gram products k k^T, q k^T and the l2norm row scales once per key head, then each of its
# HV / HK value heads' decay, beta, Aqk, M, Tm, w, u, kd/qg in turn; "on" keeps the raw k k^T in
# registers and inlines the inverse, "scratch" passes the raw k k^T through an fp32 [B, HK, Tp, 2 BT]
# scratch and takes Tm = (I + A)^-1 by a noinline call on its second slot) take the GDN forward
# past the default (`fwd_o` "fused") toward the issue's 1.3x of fla 0.6's chunk_gated_delta_rule?
# Decides: whether a SHARE_SWEEP row (bench.py) becomes the k_le_128 bucket's default, and which.
# sm_90 AOT (family.py): "scratch" at 8 warps builds without spills on triton 3.6 (the only such
# build; its call serialises the kernel's wgmma pipeline at the call, a ptxas note), "on" spills at
# 4 and 8 warps; this call says whether the saved Gram pass outweighs the spills, the scratch round
# trips and the call. At HV = 2 HK the share removes half of the Gram dots (a sixth of the prepare's
# dot FLOPs) and half of the Gram pass's q, k loads; at B2 T4096 H16 (HV = HK) it removes nothing
# (a control: the same work plus the loop, the call and the scratch). Rows, forward only, with the
# fused output: ours@prep_share=on+fwd_o=fused_fwd, ours@prep_share=scratch+prep_warps=8+fwd_o=fused_fwd,
# ours@prep_share=on+prep_warps=8+fwd_o=fused_fwd,
# ours@prep_share=scratch+prep_warps=8+fwd_o=fused+fused_kq=rows_fwd; against ours_fwd (the default)
# and fla_fwd, CUDA-graph ms, bf16. Self-contained: sources setup.sh. Carry .whl and .whl_fla:
#   bash .ci/h200/h32_gdn6.sh
# Within ${BUDGET:-300} s (untimed; arithmetic from h32_gdn5.sh: set-up ~30 s, fla's first call ~95 s
# with its autotuning, a prepare build ~10-20 s). Steps, each cut by `timeout` to what is left:
#  1. the bf16-vs-fp32 GPU bars of the four rows at K = V = 128, mixed decays
#     (`test_bf16_vs_fp32_on_gpu_fwd_o[prep_share...-k128-mixed]`: o and the final state within 5e-3
#     of the fp32 path without training, then a training step, every gradient within 1e-2; the
#     training forward runs the share kernel with the kept Tm) -> gdn6_bars.txt (cap 90 s);
#  2. `onboard bench --family gated_delta --case B2T4096 --case B1T8192 --case B1T32768 --impl
#     ours_fwd,<the four rows>,fla_fwd` -> gdn6_bench.txt (printed as it goes), gdn6.json.
# Outputs under $OUT: env.txt, gdn6_bars.txt, gdn6_bench.txt, gdn6.json, gdn6.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-300} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/gdn6.tgz" -C "$O" $(cd "$O" && ls | grep -v '^gdn6.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=ours@prep_share=on+fwd_o=fused_fwd,ours@prep_share=scratch+prep_warps=8+fwd_o=fused_fwd
ROWS=$ROWS,ours@prep_share=on+prep_warps=8+fwd_o=fused_fwd,ours@prep_share=scratch+prep_warps=8+fwd_o=fused+fused_kq=rows_fwd
stamp gdn6-bars
timeout "$(left 90)" python3 -m pytest -v -p no:cacheprovider -rxXs tests/kernel_tests/test_gated_delta.py \
  -k "bf16_vs_fp32_on_gpu_fwd_o and prep_share and k128-mixed" 2>&1 | tee "$O/gdn6_bars.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
stamp gdn6-bench
PYTHONPATH=$FLA_SITE:$PYTHONPATH PYTHONUNBUFFERED=1 timeout "$(left 240)" onboard bench --family gated_delta \
  --case B2T4096 --case B1T8192 --case B1T32768 --impl "ours_fwd,$ROWS,fla_fwd" --out "$O/gdn6.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/gdn6_bench.txt"
stamp end
