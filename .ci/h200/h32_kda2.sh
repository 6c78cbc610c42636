# H200 call (issue 32, helper-50): KDA's forward prepare step, the alternatives of template v23
# (bench.FWD_SWEEP, forward rows on request) against the default and fla 0.6's chunk_kda, at the
# Kimi-Linear layout (B1 H32 K=V=128 bf16) at T8192 and T32768. Not run yet.
#   bash .ci/h200/h32_kda2.sh        (carry .whl and .whl_fla; BUDGET=<s>, default 200)
# Steps (each under what is left of BUDGET, counted from the script's start, setup included):
# 1. bars (<= 60 s): the bf16 kernels against transformers' fp32 torch chunk function on the same
#    bf16-representable inputs (the bench check's inputs and bars: o <= 5e-3, every gradient
#    <= 1e-2 relative RMS) at B1 T1024 H16 D128, forward + backward, under the default config
#    and each new forward sweep config (the backward takes the forward's Tm, M, Aqk, so the
#    gradients are checked too). One JSON line per config; "ok": 1.0 passes.
# 2. bench: onboard bench --family kimi_delta --case B1T8192H32D128 --case B1T32768H32D128 with
#    the default (ours, ours_fwd), fla_fwd and the new rows, fla on PYTHONPATH.
# Outputs under $OUT, and all of them again as $OUT/kda2.tgz: env.txt, kda2_bars.txt,
# kda2_bench.txt, kda2.json.
# DRY=1: no setup, no GPU: the bars at a tiny shape on the CPU (TRITON_INTERPRET=1; bf16 dots are
# wrong in the interpreter, so its numbers are not bars) and the bench's row selection only.
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
BUDGET=${BUDGET:-200}
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
cap() { local l; l=$(left); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
ROWS="ours@kda_prep_warps=8_fwd,ours@prep_bk=16_fwd,ours@prep_bk=16+kda_prep_warps=8_fwd,ours@kda_prep=fused2_fwd"
ROWS="$ROWS,ours@kda_prep=fused2+prep_bk=16+kda_prep_warps=8_fwd"
if [ -n "$DRY" ]; then
  export TRITON_INTERPRET=1 KDA2_SHAPE=${KDA2_SHAPE:-1,80,1,1,32}
  PY=${PYTHON:-python3}
else
  OUT=$O source .ci/h200/setup.sh || exit 1
  PY=python3
fi
stamp bars
timeout "$(cap 60)" "$PY" - <<'PY' 2>&1 | tee "$O/kda2_bars.txt"
import json, os, time
import torch
from onboarding.bench import cases_linear_attention as la
from onboarding.families import family_module
from onboarding.testing.tolerance import rel_rms

fam = family_module("kimi_delta")
B, T, HK, HV, D = (int(x) for x in os.environ.get("KDA2_SHAPE", "1,1024,16,16,128").split(","))
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
mod, ours = la._ours("kimi_delta")
leaves = la.make_inputs(True, B, T, HK, HV, D, dev, seed=0)
do = torch.randn(B, T, HV, D, device=dev, generator=torch.Generator(device=dev).manual_seed(7)).to(torch.bfloat16)
t = time.time()
leaves32 = [x.detach().float().requires_grad_(True) for x in leaves]
o32, _ = la.transformers_fallback(True)(*leaves32)
ref = [o32.detach(), *torch.autograd.grad(o32, leaves32, do.float())]
print(json.dumps({"shape": [B, T, HK, HV, D], "device": str(dev), "reference_s": round(time.time() - t, 1)}), flush=True)
bucket, base = mod.shape_bucket(D), mod.config_for(D)
for cfg in [{}] + [c for c in fam.bench.FWD_SWEEP if c != {"kda_prep": "split"}]:
    t = time.time()
    mod.set_config({**base, **cfg}, bucket=bucket)
    try:
        o, _ = ours(*leaves)
        got = [o, *torch.autograd.grad(o, leaves, do)]
        res = {n: round(rel_rms(a, b), 6) for n, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref)}
        res["ok"] = float(res["o"] <= la.O_TOL and all(res[n] <= la.GRAD_TOL for n in ("dq", "dk", "dv", "dg", "dbeta")))
    except Exception as exc:  # noqa: BLE001 - report the config and go on
        res = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        mod.set_config(None, bucket=bucket)
    print(json.dumps({"cfg": la.sweep_label(cfg) if cfg else "ours", **res, "s": round(time.time() - t, 1)}), flush=True)
PY
stamp bench
if [ -n "$DRY" ]; then
  ROWS=$ROWS "$PY" - <<'PY' 2>&1 | tee "$O/kda2_bench.txt"
import os
from onboarding.bench.cases import select_cases
from onboarding.families import family_module
impls = ["ours", "ours_fwd", "fla_fwd", *os.environ["ROWS"].split(",")]
for c in select_cases(family_module("kimi_delta").bench.cases(), ["B1T8192H32D128", "B1T32768H32D128"], impls):
    unknown = [r for r in impls if r.startswith("ours@") and r not in family_module("kimi_delta").bench.SWEEP_ROWS]
    assert not unknown, unknown
    print(c.name, "rows left on request:", c.on_request)
PY
else
  PYTHONPATH=$FLA_SITE:$PYTHONPATH timeout "$(cap 400)" onboard bench --family kimi_delta \
    --case B1T8192H32D128 --case B1T32768H32D128 --impl "ours,ours_fwd,fla_fwd,$ROWS" \
    --out "$O/kda2.json" 2>&1 | tee "$O/kda2_bench.txt" | tail -60
fi
stamp end
( cd "$O" && tar czf kda2.tgz --exclude=kda2.tgz . )
