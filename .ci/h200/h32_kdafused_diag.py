"""One KDA forward + backward under one config, in its own process (a CUDA fault poisons the
process): prints OK and the bf16-vs-fp32 relative RMS per output, or the error. For
.ci/h200/h36_diag.sh, which runs it per variant with CUDA_LAUNCH_BLOCKING=1 and under
compute-sanitizer.
    python .ci/h200/h32_kdafused_diag.py '{"kda_qk": "fused"}' HK HV T K V B L2
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernel_tests"))
import torch  # noqa: E402
from test_gated_delta import Case, grads_of, load, make_inputs  # noqa: E402
from kernel_cases import DEVICE  # noqa: E402
from test_kimi_delta import pinned  # noqa: E402

from onboarding.families import family_module  # noqa: E402

cfg = json.loads(sys.argv[1])
HK, HV, T, K, V, B, L2 = (int(x) for x in sys.argv[2:9])
case = Case(HK=HK, HV=HV, T=T, l2=bool(L2), h0=True, K=K, V=V, B=B)
module = load(family_module("kimi_delta").FAMILY, {"chunk_size": 64})
gen = torch.Generator().manual_seed(6)
args = make_inputs(case, True, torch.bfloat16, DEVICE, gen)
douts = [torch.randn(B, T, HV, V, generator=gen).to(DEVICE), torch.randn(B, HV, K, V, generator=gen).to(DEVICE)]
try:
    with pinned(module, cfg):
        outs, grads = grads_of(module.entry, args, [douts[0].bfloat16(), douts[1]])
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    ref_outs, ref_grads = grads_of(module.entry, [a.float() if isinstance(a, torch.Tensor) else a for a in args], douts)
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errs = {n: round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)
            for n, a, b in zip(names, [*outs, *grads], [*ref_outs, *ref_grads])}
    print("OK", cfg, sys.argv[2:9], errs)
except Exception as e:  # noqa: BLE001
    print("FAIL", cfg, sys.argv[2:9], type(e).__name__, str(e)[:200])
    sys.exit(1)
