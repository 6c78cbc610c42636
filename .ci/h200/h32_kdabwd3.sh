# H200/H100 call (issue 32, KDA template v35+: fwd+bwd <= 3x the forward): the K-tiled chunk-local
# backward (`kda_qk` "ktiles": `kda_chunk_bwd_vside_kernel` per (chunk, value head), then
# `kda_chunk_bwd_ktile_kernel` per (K tile, chunk, value head); no fp32 dq/dk/dg partials between
# two kernels) against the tiled default, at the Kimi-Linear layout (B1 T8192 H32 K = V = 128 bf16):
# the four rows of kernel_templates/kimi_delta/bench.py's KTILES_SWEEP. Self-contained (sources
# setup.sh); carry .whl (fla is not asked for):
#   BUDGET=560 bash .ci/h200/h32_kdabwd3.sh
# The thirty-fourth session's run (H100, triton 3.6) faulted ("an illegal memory access") at the
# first row and so poisoned every later row of the process: which kernel faults, and whether the
# other rows do, is unknown. On the CPU the interpreter's bounds check (loads, stores and atomics,
# tests/kernel_tests/test_kimi_delta_bounds.py) finds every address in bounds on the GPU's 16-bit
# path at these tiles, so the fault is the build's; steps 1-2 localise it.
# Within ${BUDGET:-560} s (30 s kept for setup and packing), per-step limits:
#  1. Localise (<= 90 s for the first variant, which compiles, 40 s for each other; ~250 s in all): each variant in its own process, CUDA_LAUNCH_BLOCKING=1, a synchronise
#     after every kernel launch of the module (`.ci/h200/kda_launch_diag.py`: prints each kernel, its
#     grid and tiles, then OK once the bf16 fwd+bwd ran, or FAIL naming the kernel that faulted; until
#     the thirty-sixth session this script's own copy also ran an fp32 pass for errors, which step 3's
#     bars measure, and which timed out in h32_kdabwd4.sh's copy) -> kdabwd3_diag.txt.
#     Variants at the bars' shape (HK2 HV4 T1000 K = V = 128 B2, l2norm): the four rows; HV = HK (the
#     bench's layout: dq, dk final, no group sum); "ktiles" at the bucket's tiles (BK 32, BV 64, 4
#     warps); the first row with the V-side kernel at 8 warps, with one pipeline stage everywhere, with
#     `tm_dot` tf32 (the Tm dots on fp32 operands), without the l2norm.
#  2. compute-sanitizer memcheck on the first row at T100 HK2 HV4 K = V = 128 B1 (<= 100 s) ->
#     kdabwd3_memcheck.txt (the faulting instruction, its kernel and source line); the device's
#     builds of the two kernels (cubin, ptx, ttgir, json from the Triton cache) -> kdabwd3_builds/,
#     for a CPU session to map the PC onto SASS.
#  3-5. Only when every variant of 1 passed, each within what is left of BUDGET: the bf16-vs-fp32 GPU bars of the rows
#     (`test_bf16_vs_fp32_on_gpu_ktiles_sweep`: o 5e-3, every gradient 1e-2 relative RMS) (<= 90 s)
#     -> kdabwd3_bars.txt; `onboard bench --family kimi_delta --case B1T8192H32D128 --impl
#     ours,ours_fwd,<the KTILES_SWEEP rows> --profile` (<= 110 s) -> kdabwd3_bench.txt, kdabwd3.json;
#     `KDA_ROWS=ktiles .ci/h200/h32_kdabwd_profile.py 8192` (<= 60 s): per config the fwd+bwd wall
#     median and the backward's kernels alone -> kdabwd3_profile.txt, kdabwd3_profile.json.
# Read: 1's FAIL lines (the kernel named; which variants pass), 2's "Invalid ... at ... in" lines;
# then row / `ours_fwd` (graph) against 3.0 and against `ours` / `ours_fwd` (the tiled default: 4.3x
# on the H100 in the thirty-fourth session); in 5, `kda_chunk_bwd_vside_kernel` +
# `kda_chunk_bwd_ktile_kernel` against `kda_chunk_bwd_wyt_kernel` + `kda_chunk_bwd_qkt_kernel`
# (1.329 + 1.033 ms on that H100). A row is a default candidate only with its bars passed.
# Outputs under $OUT: env.txt, kdabwd3_diag.txt, kdabwd3_memcheck.txt, kdabwd3_builds/, and when 1
# passed kdabwd3_bars.txt, kdabwd3_bench.txt, kdabwd3.json, kdabwd3_profile.txt,
# kdabwd3_profile.json; kdabwd3.tgz (all of them).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-560} - 30 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kdabwd3.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kdabwd3.tgz$') 2>/dev/null; }
trap pack EXIT
ROWS=$(python3 -c "from onboarding.families import family_module as f; from onboarding.bench.cases_linear_attention import sweep_label; print(','.join(sweep_label(c) for c in f('kimi_delta').bench.KTILES_SWEEP))")
echo "rows: $ROWS"
# one forward + backward in its own process, every kernel launch of the module synchronised
# (.ci/h200/kda_launch_diag.py; the bars of step 3 measure the accuracy)
D=.ci/h200/kda_launch_diag.py
R1='"kda_qk": "ktiles", "bwd_bv": 32, "kda_qk_bk": 16, "kda_qk_warps": 8'
stamp kdabwd3-diag
{
n=0
for row in "{$R1}|2 4 1000 128 128 2 1" \
           "{$R1}|2 2 1000 128 128 2 1" \
           "{\"kda_qk\": \"ktiles\", \"bwd_bv\": 32, \"kda_qk_warps\": 8}|2 4 1000 128 128 2 1" \
           "{\"kda_qk\": \"ktiles\", \"bwd_bv\": 32, \"kda_qk_bk\": 16}|2 4 1000 128 128 2 1" \
           "{\"kda_qk\": \"ktiles\"}|2 4 1000 128 128 2 1" \
           "{$R1, \"kda_wy_warps\": 8}|2 4 1000 128 128 2 1" \
           "{$R1, \"num_stages\": 1}|2 4 1000 128 128 2 1" \
           "{$R1, \"tm_dot\": \"tf32\"}|2 4 1000 128 128 2 1" \
           "{$R1}|2 4 1000 128 128 2 0"; do
  cfg=${row%%|*}; shape=${row#*|}
  # the first child compiles the family's kernels (the cache serves the rest)
  lim=$(left $([ $n = 0 ] && echo 90 || echo 40)); n=$((n + 1))
  [ "$lim" -lt 15 ] && { echo "SKIP (budget) $cfg $shape"; continue; }
  CUDA_LAUNCH_BLOCKING=1 timeout "$lim" python3 $D "$cfg" $shape 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -14
  echo "rc $? for $cfg $shape"
done
} 2>&1 | tee "$O/kdabwd3_diag.txt"
stamp kdabwd3-memcheck
timeout "$(left 100)" compute-sanitizer --tool memcheck --print-limit 8 python3 $D "{$R1}" 2 4 100 128 128 1 1 \
  > "$O/kdabwd3_memcheck.txt" 2>&1; echo "rc $?" >> "$O/kdabwd3_memcheck.txt"
grep -E "Invalid|at 0x|by thread|Address|ERROR SUMMARY|^OK|^FAIL|rc " "$O/kdabwd3_memcheck.txt" | head -40
mkdir -p "$O/kdabwd3_builds"
for k in kda_chunk_bwd_vside_kernel kda_chunk_bwd_ktile_kernel; do
  find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name "$k.*" \( -name "*.cubin" -o -name "*.json" -o -name "*.ttgir" -o -name "*.ptx" \) 2>/dev/null \
    | while read -r f; do cp "$f" "$O/kdabwd3_builds/$(basename "$(dirname "$f")")_$(basename "$f")"; done
done
ls "$O/kdabwd3_builds" | head -20
if [ "$(grep -c '^OK' "$O/kdabwd3_diag.txt")" -lt 9 ]; then
  stamp "end: $(grep -c '^OK' "$O/kdabwd3_diag.txt") of 9 variants OK; bars, bench and profile skipped"
  exit 1
fi
stamp kdabwd3-bars
timeout "$(left 90)" python3 -m pytest -v -p no:cacheprovider -rxXs \
  "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_ktiles_sweep" 2>&1 | tee "$O/kdabwd3_bars.txt" \
  | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
stamp kdabwd3-bench
PYTHONUNBUFFERED=1 timeout "$(left 110)" onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl "ours,ours_fwd,$ROWS" --profile --out "$O/kdabwd3.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kdabwd3_bench.txt"
stamp kdabwd3-profile
KDA_ROWS=ktiles timeout "$(left 60)" python3 .ci/h200/h32_kdabwd_profile.py 8192 "$O/kdabwd3_profile.json" 2>&1 \
  | tee "$O/kdabwd3_profile.txt" | grep -v '^{'
stamp end
