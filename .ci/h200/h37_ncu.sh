# Device call (issues 32, 35): WHY our three slowest kernels are slow, by Nsight Compute (H100 on
# Firecracker: ncu reads the counters there, gVisor's runtime refused it; --clock-control none). One
# launch each of the family's default module at its bench case, built by the bench's own case (the
# `ours` / `ours_fwd` row of `onboard bench --family F --case ^CASE`), through .ci/h200/ncu_step.py:
#  1. ssd_bwd_split_fused_kernel, ssd B1T8192H128P64G8N128 fwd+bwd: 0.953 ms of the 1.686 ms of
#     kernels (thirty-sixth session's H100 profile) against 0.31 ms for its bytes at HBM speed; by
#     its SASS (31-33 barriers per head loop, one 8-warp program per SM) suspected barrier-bound;
#  2. kimi_delta B1T8192H32D128 fwd+bwd, the wy kernel of the default backward: since v42 the
#     k_le_128 bucket's `kda_qk` "ksplit" launched kda_chunk_bwd_wyp_kernel twice a step (PART 1,
#     the V side per (chunk, head); PART 2, the K tiles): 1.206 ms together ("tiles"' single
#     kda_chunk_bwd_wyt_kernel took 1.322); both launches are profiled (the regex takes wyt too;
#     since kimi_delta v47 the two launches are kda_chunk_bwd_wyvp_kernel and _wykp_kernel, which
#     the regex takes as well);
#  3. gdn_prepare_fwd_kernel, gated_delta B1T8192H16/32D128 forward without grad: 0.288 of 0.452 ms.
# What it decides: which of barrier / long-scoreboard (global memory) / short-scoreboard (shared
# memory) / MIO / math-pipe stalls each kernel waits on, where in its SASS (top lines by warp-stall
# samples), its achieved occupancy and DRAM / L2 throughput against the peaks: the next change of each
# kernel goes after the top stall (e.g. ssd: fewer barriers per head, or a second program per SM, if
# "barrier" leads; its tiles' loads if "long_scoreboard" does).
# Self-contained: sources setup.sh. Carry .whl:
#   BUDGET=150 bash .ci/h200/h37_ncu.sh        (~180 s with setup)
#   NCU37_DRY=1 TRITON_INTERPRET=1 PY=/tmp/venv/bin/python bash .ci/h200/h37_ncu.sh
#   NCU_SET=bwd39 BUDGET=200 bash .ci/h200/h37_ncu.sh   (another set of rows: see ROWS below)
#        (CPU: each row's driver at a tiny case of its bucket, ncu's command lines echoed, not run)
# Within ${BUDGET:-150} s after setup, 10 s of them kept in reserve:
#  0. (<= 60 s) the three rows' drivers at once without ncu (3 steps each): Triton compiles every
#     kernel into its cache, so that the profiled runs only load them; each lists the kernels a step
#     launches and checks that the profiled one is among them -> ncu_summary.txt (head);
#  1-3. per kernel (<= 45 s each, in the order above; a row with < 15 s left is skipped): ncu over the
#     driver's 3 steps, profiling only step 3 (--profile-from-start off; the driver brackets it with
#     cudaProfilerStart / Stop), --launch-count 1 (2 for KDA's two wy launches), sections LaunchStats,
#     Occupancy, SpeedOfLight, WarpStateStats, SchedulerStats, MemoryWorkloadAnalysis,
#     ComputeWorkloadAnalysis, SourceCounters; then from the report: the details page (text, every
#     section's body) -> <row>_details.txt; the raw page's key metrics and per-reason stalls, the
#     source page's stall samples by reason / opcode and the top 25 SASS lines, and the top 15 lines of
#     the rendered Python (where ncu resolves them) -> ncu_summary.txt.
# Outputs under $OUT: env.txt, ncu_summary.txt, ssd_bwd_details.txt, kda_wy_details.txt,
# gdn_prep_details.txt, ncu37.tgz (all of it: the .ncu-rep reports for ncu-ui, the csv pages, the logs;
# the reports are left out of it when it would pass 15 MB).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
DRY=${NCU37_DRY:-0}
if [ "$DRY" != 1 ]; then
  OUT=$O source .ci/h200/setup.sh || exit 1
fi
PY=${PY:-python3}
W=$(mktemp -d /tmp/ncu37.XXXXXX)   # the work folder: packed into ncu37.tgz at the end
S=$O/ncu_summary.txt; : > "$S"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s" | tee -a "$S"; }
left() { local l=$(( ${BUDGET:-150} - 10 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() {
  tar -czf "$O/ncu37.tgz" -C "$W" . 2>/dev/null
  if [ "$(stat -c %s "$O/ncu37.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
    tar -czf "$O/ncu37.tgz" -C "$W" --exclude='*.ncu-rep' . 2>/dev/null
    echo "ncu37.tgz: the .ncu-rep reports left out (over 15 MB)" >> "$S"
  fi
  rm -rf "$W"
}
trap pack EXIT
D=.ci/h200/ncu_step.py
if [ "$DRY" = 1 ]; then
  # a stand-in: prints ncu's command line, then runs what follows `-o REPORT` (the driver, on the CPU)
  NCU=(bash -c 'echo "ncu $*"; while [ $# -gt 0 ] && [ "$1" != -o ]; do shift; done; shift 2; exec "$@"' ncu)
  CPU=--cpu
else
  NCU=("$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)"); CPU=
  [ -n "${NCU[0]}" ] || { echo "no ncu on this machine" | tee -a "$S"; exit 1; }
  "${NCU[@]}" --version 2>&1 | tail -n 1 | tee -a "$S"
fi
# row | family | case | mode | ncu kernel regex (the driver's --expect too) | launches profiled
ROWS=("ssd_bwd|ssd|^B1T8192H128P64|fwdbwd|ssd_bwd_split_fused_kernel|1"
      "kda_wy|kimi_delta|^B1T8192H32D128|fwdbwd|kda_chunk_bwd_wy[tvk]p?_kernel|2"
      "gdn_prep|gated_delta|^B1T8192H16/32D128|fwd|gdn_prepare_fwd_kernel|1")
# NCU_SET=bwd39 (thirty-ninth session): the backward kernels the fwd+bwd goals wait on now instead:
# KDA's qkt kernel (never profiled), v47's wyvp / wykp (the loads issued early), ssd's fused backward
# at v23's `bwd_exp` "exp2"
case "${NCU_SET:-h37}" in
  h37) ;;
  bwd39) ROWS=("kda_qkt|kimi_delta|^B1T8192H32D128|fwdbwd|kda_chunk_bwd_qkt_kernel|1"
               "kda_wy|kimi_delta|^B1T8192H32D128|fwdbwd|kda_chunk_bwd_wy[tvk]p?_kernel|2"
               "ssd_bwd|ssd|^B1T8192H128P64|fwdbwd|ssd_bwd_split_fused_kernel|1") ;;
  *) echo "NCU_SET: h37 or bwd39, not '$NCU_SET'" >&2; exit 2 ;;
esac
SECTIONS="--section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
--section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SourceCounters"

stamp warm
cap=$(left 60)
for row in "${ROWS[@]}"; do
  IFS='|' read -r name fam case mode kre cnt <<< "$row"
  timeout "$cap" $PY $D --family "$fam" --case "$case" --mode "$mode" --steps 3 --expect "$kre" $CPU \
    > "$W/${name}_warm.txt" 2>&1 &
done
wait
for row in "${ROWS[@]}"; do
  name=${row%%|*}
  { echo "-- $name (no ncu)"; grep -E "^(step|EXPECT|[A-Za-z_]+/B|[0-9]+ cases)|Error|error" "$W/${name}_warm.txt" \
      | cut -c1-400 | tail -n 8; } | tee -a "$S"
done

for row in "${ROWS[@]}"; do
  IFS='|' read -r name fam case mode kre cnt <<< "$row"
  stamp "ncu $name"
  cap=$(left 45)
  if [ "$cap" -lt 15 ]; then echo "skipped: $cap s left" | tee -a "$S"; continue; fi
  R=$W/$name
  # shellcheck disable=SC2086
  timeout "$cap" "${NCU[@]}" --clock-control none --target-processes all --profile-from-start off \
    --kernel-name "regex:$kre" --launch-skip 0 --launch-count "$cnt" $SECTIONS --import-source yes \
    -f -o "$R" $PY $D --family "$fam" --case "$case" --mode "$mode" --steps 3 --profile-from 2 $CPU \
    > "${R}_ncu.txt" 2>&1
  echo "rc $?" >> "${R}_ncu.txt"
  grep -E "^(step [0-9]+ \(profiled\)|rc |ncu )|==PROF==|==ERROR==|==WARNING==|Error" "${R}_ncu.txt" \
    | cut -c1-300 | tail -n 12 | tee -a "$S"
  if [ "$DRY" = 1 ]; then continue; fi
  if [ ! -f "$R.ncu-rep" ]; then echo "no report $R.ncu-rep" | tee -a "$S"; continue; fi
  timeout 20 "${NCU[@]}" --import "$R.ncu-rep" --page details --print-details all > "$O/${name}_details.txt" 2>&1
  cp "$O/${name}_details.txt" "$W/"
  timeout 20 "${NCU[@]}" --import "$R.ncu-rep" --page raw --csv > "${R}_raw.csv" 2> /dev/null
  timeout 20 "${NCU[@]}" --import "$R.ncu-rep" --page source --csv --print-source sass > "${R}_sass.csv" 2> /dev/null
  timeout 20 "${NCU[@]}" --import "$R.ncu-rep" --page source --csv --print-source cuda > "${R}_py.csv" 2> /dev/null
  { echo "-- $name: metrics"; $PY $D --summarize-raw "${R}_raw.csv"
    echo "-- $name: SASS"; $PY $D --summarize-source "${R}_sass.csv" --top 25
    echo "-- $name: rendered Python lines"; $PY $D --summarize-source "${R}_py.csv" --top 15; } 2>&1 \
    | cut -c1-220 | tee -a "$S"
done
stamp end
