# H200/H100 call (issue 32, KDA template v38+: fwd+bwd <= 3x the forward): the two levers of v38 on the
# tiled default's backward, against the default at the Kimi-Linear layout (B1 T8192 H32 K = V = 128 bf16):
#   `kda_qk` "ksplit": the wy kernel (`kda_chunk_bwd_wyt_kernel`, 1.329 of the backward's 2.898 ms per step
#     on the H100 in the thirty-fourth session) split into `kda_chunk_bwd_wyv_kernel` per (chunk, value
#     head), `kda_chunk_bwd_wyk_kernel` per (K tile, chunk, value head) and `kda_chunk_bwd_rowsum_kernel`:
#     4x the programs for its K loop, and with `kda_wyk_warps` 8 / `kda_wyk_maxnreg` 128 two 8-warp
#     programs per SM (the wyt kernel: two 4-warp ones);
#   `kda_qk_tiers` "split": the qkt kernel (1.033 ms) as its chunk tier alone (`kda_chunk_bwd_qkc_kernel`,
#     no spills; qkt's triton 3.6 build spills 1780 B, and its SASS has 92 spill stores and 65 loads, ~760 B
#     a thread, on the lines after the tier branch, which every tile runs) and the redo of the tiles it
#     flags (`kda_chunk_bwd_qkx_kernel`: none expected at the bench's gates).
# The four rows of kernel_templates/kimi_delta/bench.py's KSPLIT_SWEEP: ksplit; ksplit with wyk at 8 warps
# capped at 128; that with the tier split; that at `kda_qk_bk` 16. Self-contained (sources setup.sh);
# carry .whl (fla is not asked for):
#   BUDGET=240 bash .ci/h200/h32_kdabwd4.sh        (BUDGET=400 runs every step in full)
# What it decides: whether either lever lowers the backward's kernels (the profile: wyv + wyk + rowsum
# against wyt, qkc + qkx against qkt) and fwd+bwd; a row is a default candidate only with its bars passed
# and a lower fwd+bwd than `ours` in the same run. Neither lever has what the faulting "fused" and
# "ktiles" kernels share and the default lacks (docs/LOG.md, helper-94): no Gram backward next to the
# V-tile dots, no atomics, no transposed Tm load, no CTA barrier, no qg S_c loop; the CPU bounds check
# passes (tests/kernel_tests/test_kimi_delta_bounds.py -k ksplit). Still, a fault is first localised.
# Within ${BUDGET:-240} s (20 s kept for packing), per-step limits:
#  1. Localise (<= 70 s for the first variant, which compiles, 30 s for each other; none started after the
#     step's first 110 s): each variant in its own process, CUDA_LAUNCH_BLOCKING=1, a synchronise after
#     every kernel launch of the module (prints each kernel, grid and tiles, then OK once the bf16
#     fwd + bwd ran, or FAIL naming the kernel; KDA_DIAG_FP32=1 adds the fp32 pass and its relative
#     errors: it recompiles every kernel, which the thirty-fifth session's H100 call did not fit in
#     these limits, every row timing out after its bf16 pass had run clean) -> kdabwd4_diag.txt. At the bars' shape (HK2 HV4 T1000
#     K = V = 128 B2, l2norm): row 3 (every new kernel) first, then rows 1 and 4, then row 3 at HV = HK
#     (the bench's layout); row 2's builds are rows 1 and 3's. A row that failed or did not run is left
#     out of steps 2-3.
#  2. The GPU bars (<= 120 s; each build twice, bf16 and fp32): `test_bf16_vs_fp32_on_gpu_ksplit_sweep` (the clean rows) and
#     `test_bf16_vs_fp32_on_gpu[k128-mixed]` (the default): o 5e-3, every gradient 1e-2 relative RMS
#     -> kdabwd4_bars.txt.
#  3. `onboard bench --family kimi_delta --case B1T8192H32D128 --impl ours,ours_fwd,<rows> --profile`
#     (<= 60 s; no fla) -> kdabwd4_bench.txt, kdabwd4.json; then, in what is left (<= 40 s),
#     `KDA_ROWS=ksplit .ci/h200/h32_kdabwd_profile.py 8192`: per row the fwd+bwd wall median and the
#     backward's kernels alone -> kdabwd4_profile.txt, kdabwd4_profile.json (only when every row ran
#     clean in 1: its rows share one process).
# Read: 1's OK / FAIL lines; 2's pass / fail per row; 3's row / `ours_fwd` (graph) against 3.0 and
# against `ours` / `ours_fwd`, and in the profile the kernels above against the default's. Say which
# card gave the numbers.
# Outputs under $OUT: env.txt, kdabwd4_diag.txt, kdabwd4_bars.txt, kdabwd4_bench.txt, kdabwd4.json,
# kdabwd4_profile.txt, kdabwd4_profile.json; kdabwd4.tgz (all of them).
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT=$O source .ci/h200/setup.sh || exit 1
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { local l=$(( ${BUDGET:-240} - 20 - $(date +%s) + t0 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { tar -czf "$O/kdabwd4.tgz" -C "$O" $(cd "$O" && ls | grep -v '^kdabwd4.tgz$') 2>/dev/null; }
trap pack EXIT
# the rows as JSON (one a line) and as bench labels
python3 -c "import json; from onboarding.families import family_module as f
for c in f('kimi_delta').bench.KSPLIT_SWEEP: print(json.dumps(c))" > /tmp/kdabwd4_rows.txt || exit 1
cat /tmp/kdabwd4_rows.txt
# one forward + backward in its own process, every kernel launch of the module synchronised
D=/tmp/kda_ksplit_diag.py
cat > $D <<'PY'
import json, sys, traceback
sys.path.insert(0, "tests/kernel_tests")
import torch
from test_gated_delta import Case, grads_of, load, make_inputs
from test_kimi_delta import pinned
from onboarding.families import family_module
cfg = json.loads(sys.argv[1]); HK, HV, T, K, V, B, L2 = (int(x) for x in sys.argv[2:9])
module = load(family_module("kimi_delta").FAMILY, {"chunk_size": 64})
dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: an interpreter smoke test of this script
state = {"last": None, "stage": "bf16"}
class Synced:
    def __init__(self, name, kernel): self.name, self.kernel = name, kernel
    def __getitem__(self, grid):
        def launch(*a, **kw):
            state["last"] = self.name
            out = self.kernel[grid](*a, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            if state["stage"] == "bf16":
                tiles = {k: kw[k] for k in ("BK", "BV", "NP", "G", "USE_L2", "num_warps", "num_stages", "maxnreg")
                         if k in kw}
                print("  ran", self.name, tuple(grid), tiles, flush=True)
            return out
        return launch
for name in dir(module):
    obj = getattr(module, name)
    if name.endswith("_kernel") and hasattr(obj, "run"):
        setattr(module, name, Synced(name, obj))
case = Case(HK=HK, HV=HV, T=T, l2=bool(L2), h0=True, K=K, V=V, B=B)
gen = torch.Generator().manual_seed(6)
args = make_inputs(case, True, torch.bfloat16, torch.device(dev), gen)
douts = [torch.randn(B, T, HV, V, generator=gen).to(dev), torch.randn(B, HV, K, V, generator=gen).to(dev)]
try:
    with pinned(module, cfg):
        outs, grads = grads_of(module.entry, args, [douts[0].bfloat16(), douts[1]])
        if not int(__import__("os").environ.get("KDA_DIAG_FP32", "0")):
            # the fault check only: every kernel of the bf16 fwd + bwd ran, each synchronised
            # (the fp32 comparison recompiles every kernel: the bars step measures accuracy)
            torch.cuda.synchronize() if dev == "cuda" else None
            print("OK", cfg, sys.argv[2:9], "bf16 fwd+bwd ran, every launch synchronised", flush=True)
            sys.exit(0)
        state["stage"] = "fp32"
        ref_outs, ref_grads = grads_of(module.entry, [a.float() if isinstance(a, torch.Tensor) else a for a in args], douts)
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errs = {n: round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)
            for n, a, b in zip(names, [*outs, *grads], [*ref_outs, *ref_grads])}
    print("OK", cfg, sys.argv[2:9], errs)
except Exception as e:  # noqa: BLE001
    print("FAIL", cfg, sys.argv[2:9], f"in {state['last']} ({state['stage']} pass):", type(e).__name__, str(e)[:160])
    print("".join(traceback.format_exc().splitlines(True)[-6:]))
    sys.exit(1)
PY
stamp kdabwd4-diag
{
n=0; d0=$(date +%s)
# (row number in KSPLIT_SWEEP, HK HV T K V B L2)
# (row 2's builds are rows 1 and 3's: wyv at 4 warps and qkt from row 1, wyk at 8 warps / 128 from row 3)
for run in "3|2 4 1000 128 128 2 1" "1|2 4 1000 128 128 2 1" "4|2 4 1000 128 128 2 1" "3|2 2 1000 128 128 2 1"; do
  cfg=$(sed -n "${run%%|*}p" /tmp/kdabwd4_rows.txt); shape=${run#*|}
  # the first child compiles the family's kernels (the cache serves the rest)
  lim=$(left $([ $n = 0 ] && echo 70 || echo 30)); n=$((n + 1))
  if [ "$lim" -lt 10 ] || [ $(( $(date +%s) - d0 )) -gt 110 ]; then echo "SKIP (budget) $cfg $shape"; continue; fi
  CUDA_LAUNCH_BLOCKING=1 timeout "$lim" python3 $D "$cfg" $shape 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -12
  echo "rc $? for $cfg $shape"
done
} 2>&1 | tee "$O/kdabwd4_diag.txt"
# the rows whose every variant printed OK (a FAIL or a timeout leaves a row out of the bars and the bench);
# row 2 is clean when rows 1 and 3 are (its builds are theirs)
ROWS=$(python3 - "$O/kdabwd4_diag.txt" <<'PY'
import json, sys
from onboarding.bench.cases_linear_attention import sweep_label
lines = open(sys.argv[1]).read().splitlines()
rcs = [l for l in lines if l.startswith("rc ")]
rows = [r for r in open("/tmp/kdabwd4_rows.txt").read().split("\n") if r.strip()]
clean = {}
for i, row in enumerate(rows, 1):
    mine = [l for l in rcs if l.split(" for ", 1)[1].startswith(row + " ")]
    clean[i] = bool(mine) and all(l.startswith("rc 0 ") for l in mine)
clean[2] = clean[1] and clean[3]
print(",".join(sweep_label(json.loads(row)) for i, row in enumerate(rows, 1) if clean[i]))
PY
)
echo "rows that ran clean: ${ROWS:-none}"
# (`timeout 0` would not limit: a step with under 10 s left is skipped)
stamp kdabwd4-bars
lim=$(left 120); [ "$lim" -lt 10 ] && { stamp "end: no time left for the bars"; exit 1; }
timeout "$lim" python3 -m pytest -v -p no:cacheprovider -rxXs \
  "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu[k128-mixed]" \
  $(for r in ${ROWS//,/ }; do echo "tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu_ksplit_sweep[${r#ours@}]" | tr '+' ','; done) \
  2>&1 | tee "$O/kdabwd4_bars.txt" | grep -E "PASS|FAIL|ERROR|relative RMS|passed|failed"
[ -z "$ROWS" ] && { stamp "end: no ksplit row ran clean; bench skipped"; exit 1; }
stamp kdabwd4-bench
lim=$(left 60); [ "$lim" -lt 10 ] && { stamp "end: no time left for the bench"; exit 1; }
PYTHONUNBUFFERED=1 timeout "$lim" onboard bench --family kimi_delta --case B1T8192H32D128 \
  --impl "ours,ours_fwd,$ROWS" --profile --out "$O/kdabwd4.json" 2>&1 \
  | grep --line-buffered -v "^\s*$" | tee "$O/kdabwd4_bench.txt"
stamp kdabwd4-profile
lim=$(left 40)
# every ksplit row of the profile runs in one process: only when all ran clean in step 1
if [ "$lim" -ge 15 ] && [ "$(echo "$ROWS" | tr ',' '\n' | wc -l)" = "$(grep -c . /tmp/kdabwd4_rows.txt)" ]; then
  KDA_ROWS=ksplit timeout "$lim" python3 .ci/h200/h32_kdabwd_profile.py 8192 "$O/kdabwd4_profile.json" 2>&1 \
    | tee "$O/kdabwd4_profile.txt" | grep -v '^{'
else
  echo "profile skipped (${lim} s left, rows clean: $ROWS)"
fi
stamp end
