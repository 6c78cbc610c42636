# H200/H100 call (issue 32, KDA template v40): "ksplit" after its dedupe, and the default's per-kernel profile,
# at the Kimi-Linear layout (B1 T8192 H32 K = V = 128 bf16).
#   v40: "ksplit"'s two wy kernels (wyv, wyk, v38) are one, `kda_chunk_bwd_wyp_kernel`: the default wyt
#   kernel's body `_kda_wy_head` by its PART, launched per (chunk, value head) for the V side (PART 1), then
#   per (K tile, chunk, value head) for the K tiles (PART 2). The default's sm_90 builds are unchanged
#   (triton 3.6 AOT: the same PTX but for debug lines, the same registers, spills, shared memory); ksplit's
#   are new: PART 1 244 registers / 0 spills (wyv 247 / 0), PART 2 at 4 warps 242 / 0 (wyk 229 / 0), at 8
#   warps capped at 128 128 / 16 B (wyk 128 / 0). `kda_qk_tiers` "split" is gone (it faulted in
#   kda_chunk_bwd_qkc_kernel on the H100 at HV = HK), and with it KSPLIT_SWEEP's rows 3 and 4.
# The two rows of kernel_templates/kimi_delta/bench.py's KSPLIT_SWEEP: ksplit; ksplit with the K tiles at 8
# warps capped at 128 registers. Self-contained (sources setup.sh); carry .whl (fla is not asked for):
#   BUDGET=240 bash .ci/h200/h36_kda5.sh
# Last H100 numbers (thirty-sixth session, v39, h32_kdabwd4.sh, in git at 047b72b): fwd+bwd wall ms ours
# 4.266, ours_fwd 1.070, ours@kda_qk=ksplit 4.163.
# Within ${BUDGET:-240} s (20 s kept for packing), per-step limits:
#  1. Fault check (<= 60 s for the first row, which compiles, 30 s for the second; none started after the
#     step's first 90 s): each row in its own process, CUDA_LAUNCH_BLOCKING=1, every kernel launch of the
#     module synchronised (`.ci/h200/kda_launch_diag.py`: each kernel, grid and tiles, then OK or FAIL
#     naming the kernel), at HK = HV = 2 (the bench's one value head per key head; the bars run HV = 2 HK),
#     T 1000, K = V = 128, B 2, l2norm -> kda5_diag.txt. A row that failed or did not run is left out of
#     steps 2-4.
#  2. The GPU bars (<= 100 s; each build twice, bf16 and fp32), `pytest -v` (each test's result printed as
#     it ends): `test_bf16_vs_fp32_on_gpu[k128-mixed]` (the default) and
#     `test_bf16_vs_fp32_on_gpu_ksplit_sweep` (the clean rows): o 5e-3, every gradient 1e-2 relative RMS
#     -> kda5_bars.txt.
#  3. `onboard bench --family kimi_delta --case B1T8192H32D128 --impl ours,ours_fwd,<rows> --profile`
#     (<= 60 s; no fla): the rows' wall ms, and the `ours` rows' per-kernel profile (the default's fwd+bwd
#     and forward kernels) -> kda5_bench.txt, kda5.json.
#  4. In what is left (<= 40 s), `KDA_ROWS=ksplit .ci/h200/h32_kdabwd_profile.py 8192`: per config (the
#     default, then the ksplit rows) the fwd+bwd wall median and the backward's kernels alone
#     -> kda5_profile.txt, kda5_profile.json (only when both rows ran clean in 1: they share one process).
# Read: 1's OK / FAIL lines; 2's PASSED / FAILED per test; 3's rows against `ours` and 3.0 x `ours_fwd`,
# and the default's kernel table; 4's wyp (x2) + rowsum against wyt. Say which card gave the numbers.
# Outputs under $OUT: env.txt, kda5_diag.txt, kda5_bars.txt, kda5_bench.txt, kda5.json, kda5_profile.txt,
# kda5_profile.json; kda5.tgz (all of them).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-240} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kda5.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kda5.tgz$') 2>/dev/null; }
trap pack EXIT
# the rows as JSON (one a line)
python3 -c "import json; from onboarding.families import family_module as f
for c in f('kimi_delta').bench.KSPLIT_SWEEP: print(json.dumps(c))" > /tmp/kda5_rows.txt || exit 1
cat /tmp/kda5_rows.txt
stamp kda5-diag
{
n=0; d0=$(date +%s)
while read -r cfg; do
  # the first child compiles the family's kernels (the cache serves the rest)
  lim=$(left $([ $n = 0 ] && echo 60 || echo 30)); n=$((n + 1))
  if [ "$lim" -lt 10 ] || [ $(( $(date +%s) - d0 )) -gt 90 ]; then echo "SKIP (budget) $cfg"; continue; fi
  CUDA_LAUNCH_BLOCKING=1 timeout "$lim" python3 .ci/h200/kda_launch_diag.py "$cfg" 2 2 1000 128 128 2 1 \
    < /dev/null 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -14
  echo "rc $? for $cfg"
done < /tmp/kda5_rows.txt
} 2>&1 | tee "$O/kda5_diag.txt"
# the rows that printed OK (rc 0), as bench labels
ROWS=$(python3 - "$O/kda5_diag.txt" <<'PY'
import json, sys
from onboarding.bench.cases_linear_attention import sweep_label
ok = [l.split(" for ", 1)[1] for l in open(sys.argv[1]).read().splitlines() if l.startswith("rc 0 for ")]
print(",".join(sweep_label(json.loads(r)) for r in ok))
PY
)
echo "rows that ran clean: ${ROWS:-none}"
# (`timeout 0` would not limit: a step with under 10 s left is skipped)
stamp kda5-bars
lim=$(left 100); [ "$lim" -lt 10 ] && { stamp "end: no time left for the bars"; exit 1; }
timeout "$lim" python3 -m pytest -v -p no:cacheprovider -rxXs \
  "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu[k128-mixed]" \
  $(for r in ${ROWS//,/ }; do
      echo "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_ksplit_sweep[${r#ours@}]" | tr '+' ','
    done) \
  2>&1 | tee "$O/kda5_bars.txt" | grep --line-buffered -E "PASS|FAIL|ERROR|SKIP|relative RMS|passed|failed"
stamp kda5-bench
lim=$(left 60); [ "$lim" -lt 10 ] && { stamp "end: no time left for the bench"; exit 1; }
PYTHONUNBUFFERED=1 timeout "$lim" onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl "ours,ours_fwd${ROWS:+,$ROWS}" --profile --out "$O/kda5.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kda5_bench.txt"
stamp kda5-profile
lim=$(left 40)
# both ksplit rows run in one process: only when both ran clean in step 1
if [ "$lim" -ge 15 ] && [ "$(echo "$ROWS" | tr ',' '\n' | grep -c .)" = "$(grep -c . /tmp/kda5_rows.txt)" ]; then
  KDA_ROWS=ksplit timeout "$lim" python3 .ci/h200/h32_kdabwd_profile.py 8192 "$O/kda5_profile.json" 2>&1 \
    | tee "$O/kda5_profile.txt" | grep -v '^{'
else
  echo "profile skipped (${lim} s left, rows clean: ${ROWS:-none})"
fi
stamp end
