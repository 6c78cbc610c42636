# H200 call (issue 32, GDN template v24): does the chunk-local backward split in a V-side launch and
# one program per K tile (`bwd_split` "vk": gdn_chunk_bwd_part_kernel PART 1 per (chunk, value head),
# PART 2 per (K tile, chunk, value head), then gdn_chunk_bwd_rowsum_kernel) take GDN's fwd+bwd toward
# issue 32's 2.6x its own forward? The default's one kernel (gdn_chunk_bwd_wy_kernel) is the backward
# kernel furthest above its bound (the last per-kernel profile, an H200 in the nineteenth session:
# 0.689 ms at B1 T8192 HK16 HV32 D128 against ~0.19 ms by bytes; sm_90 AOT: 255 registers with 112 B
# spilled at 4 warps, two programs = 8 warps per SM). The split's K-tile launch builds at 180 registers
# (4 warps) or 126 (8 warps, `bwd_split_warps` 8: 16 warps per SM), no spills; the V side at 248.
# Expected by arithmetic only: if the K tiles' share (~70% of the kernel's dots and loads) is latency
# bound, twice the resident warps halve it: ~0.69 -> ~0.2 (V side) + ~0.24 (K tiles) + ~0.04 (P, Pq
# scratch and row sums) = ~0.48 ms at T8192, i.e. ~0.2 ms off the backward (the 2.6x goal needs
# ~0.4 ms off at that shape: this lever alone would not reach it); nothing, or worse, if the split's
# extra loads (Tm, P, Pq and each K tile's do / v_new / du) cost what the occupancy gains.
# Decides: whether `bwd_split` "vk" (and its warps) becomes the k_le_128 bucket's default.
# Self-contained: sources setup.sh. Carry .whl:
#   bash .ci/h200/h32_gdn7.sh
# Within ${BUDGET:-240} s (untimed; set-up ~30 s). Steps, each cut by `timeout` to what is left:
#  1. the GPU bars at K = V = 128, mixed decays, for the default and both rows
#     (`test_bf16_vs_fp32_on_gpu[k128-mixed]`, `test_bf16_vs_fp32_on_gpu_bwd_split[*-k128-mixed]`: o and
#     the final state within 5e-3 of the fp32 path, every gradient within 1e-2) -> gdn7_bars.txt
#     (cap 110 s);
#  2. `onboard bench --family gated_delta --case B2T4096 --case B1T8192 --impl ours,ours_fwd,
#     ours@bwd_split=vk,ours@bwd_split=vk+bwd_split_warps=8 --profile` -> gdn7_bench.txt (printed as
#     it goes), gdn7.json. The profile gives the per-kernel split (part / rowsum against wy).
# Outputs under $OUT: env.txt, gdn7_bars.txt, gdn7_bench.txt, gdn7.json, gdn7.tgz.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-240} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/gdn7.tgz" -C "$O" $(cd "$O" && ls | grep -v '^gdn7.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=ours@bwd_split=vk,ours@bwd_split=vk+bwd_split_warps=8
stamp gdn7-bars
timeout "$(left 110)" python3 -m pytest -v -p no:cacheprovider -rxXs \
  tests/kernel_tests/test_gated_delta.py::test_bf16_vs_fp32_on_gpu \
  tests/kernel_tests/test_gated_delta.py::test_bf16_vs_fp32_on_gpu_bwd_split -k "k128-mixed" 2>&1 \
  | tee "$O/gdn7_bars.txt" | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
stamp gdn7-bench
PYTHONUNBUFFERED=1 timeout "$(left 200)" onboard bench --family gated_delta \
  --case B2T4096 --case B1T8192 --impl "ours,ours_fwd,$ROWS" --profile --out "$O/gdn7.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/gdn7_bench.txt"
stamp end
