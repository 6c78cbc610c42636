# H100/H200 call (issue 32, KDA template v43): `kda_wyk_pre`, "ksplit"'s K tiles by
# `kda_chunk_bwd_wykp_kernel` (PART 2 of the wyp kernel with the epilogue's q, k, g, Tm loads issued before
# the V loop), at the Kimi-Linear layout (B1 T8192 H32 K = V = 128 bf16).
#   Why: Nsight Compute on an H100 (thirty-eighth session, `.ci/h200/h37_ncu.sh`): PART 2 871 us at 242
#   registers (two 4-warp programs per SM), 45% of warp samples long-scoreboard stalls; its SASS's top rows
#   a BAR.SYNC and STS.128 waiting on LDG.E.128: the V loop's loads are cp.async, the epilogue's plain loads
#   (global -> registers -> shared) each waited on after the loop.
#   sm_90 AOT (triton 3.6, bf16, every integer marked; registers / spill bytes / shared memory): the rows
#   of bench.KSPLIT_PRE_SWEEP: BV 64: 226 / 0 / 64 KB; BV 32 capped at 168: 168 / 0 / 36 KB (three programs
#   per SM); the same at 3 stages 168 / 0 / 52 KB.
# Self-contained (sources setup.sh); carry .whl (fla is not asked for):
#   BUDGET=200 bash .ci/h200/h38_kda6.sh
# Last H100 numbers (thirty-seventh session, h36_kda5.sh, v41): fwd+bwd by CUDA graph ksplit 3.643 ms,
# ours_fwd 0.801 (goal 3x: 2.4); backward kernels wyp x2 1.206, qkt 1.029, state bwd 0.525.
# Within ${BUDGET:-200} s (10 s kept for packing), per-step limits:
#  1. The GPU bars (<= 75 s; each row builds bf16 and fp32), `pytest -v` of
#     `test_bf16_vs_fp32_on_gpu_ksplit_pre_sweep` (the three rows): o 5e-3, every gradient 1e-2 relative
#     RMS -> kda6_bars.txt. A row that did not pass is left out of steps 2-3.
#  2. `onboard bench --family kimi_delta --case B1T8192H32D128 --impl ours,ours_fwd,<rows> --profile`
#     (<= 90 s; no fla; `ours` is the bucket's "ksplit"): wall and CUDA-graph ms per row, the `ours`
#     rows' per-kernel profile -> kda6_bench.txt, kda6.json.
#  3. In what is left (>= 25 s), `KDA_ROWS=kda_wyk_pre .ci/h200/h32_kdabwd_profile.py 8192`: the default
#     and the rows' backward kernels alone (wyp PART 1 + wykp against wyp x2) -> kda6_profile.txt/.json.
# Read: 1's PASSED / FAILED per row; 2's rows against `ours` and 3.0 x `ours_fwd`; 3's wykp against the
# default's second wyp launch. Say which card gave the numbers.
# Outputs under $OUT: env.txt, kda6_bars.txt, kda6_bench.txt, kda6.json, kda6_profile.txt,
# kda6_profile.json; kda6.tgz (all of them).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-200} - 10 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kda6.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kda6.tgz$') 2>/dev/null; }
trap pack EXIT
T=tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_ksplit_pre_sweep
stamp kda6-bars
lim=$(left 75); [ "$lim" -lt 10 ] && { stamp "end: no time left for the bars"; exit 1; }
timeout "$lim" python3 -m pytest -v -p no:cacheprovider -rxXs "$T" 2>&1 | tee "$O/kda6_bars.txt" \
  | grep --line-buffered -E "PASS|FAIL|ERROR|SKIP|relative RMS|passed|failed"
# the rows that passed, as bench labels (the test id's "," -> "+")
ROWS=$(grep -oE "ksplit_pre_sweep\[[^]]*\] PASSED" "$O/kda6_bars.txt" | sed -E 's/.*\[(.*)\] PASSED/ours@\1/' \
  | tr ',' '+' | paste -sd, -)
echo "rows that passed the bars: ${ROWS:-none}"
stamp kda6-bench
lim=$(left 90); [ "$lim" -lt 10 ] && { stamp "end: no time left for the bench"; exit 1; }
PYTHONUNBUFFERED=1 timeout "$lim" onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl "ours,ours_fwd${ROWS:+,$ROWS}" --profile --out "$O/kda6.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kda6_bench.txt"
stamp kda6-profile
lim=$(left 60)
# (the profile runs every row of the filter in one process: only when all three passed)
if [ "$lim" -ge 25 ] && [ "$(echo "$ROWS" | tr ',' '\n' | grep -c .)" = 3 ]; then
  KDA_ROWS=kda_wyk_pre timeout "$lim" python3 .ci/h200/h32_kdabwd_profile.py 8192 "$O/kda6_profile.json" 2>&1 \
    | tee "$O/kda6_profile.txt" | grep -v '^{'
else
  echo "profile skipped (${lim} s left, rows passed: ${ROWS:-none})"
fi
stamp end
