"""One KDA forward + backward (bf16) in this process with every kernel launch of the module synchronised:
prints each kernel, its grid and tiles, then OK once the fwd + bwd ran, or FAIL naming the kernel whose
launch raised (with CUDA_LAUNCH_BLOCKING=1 the fault is the last launch's). A fault check, not an accuracy
one (the GPU bars measure that). Used by h36_kda5.sh and h32_kdabwd3.sh.

    CUDA_LAUNCH_BLOCKING=1 python3 .ci/h200/kda_launch_diag.py '{"kda_qk": "ksplit"}' HK HV T K V B L2
On a CPU (TRITON_INTERPRET=1, small sizes) it runs the same steps, as a smoke test of this script.
"""

import json
import sys
import traceback

sys.path.insert(0, "tests/kernel_tests")
import torch  # noqa: E402
from test_gated_delta import Case, grads_of, load, make_inputs  # noqa: E402
from test_kimi_delta import pinned  # noqa: E402

from onboarding.families import family_module  # noqa: E402

cfg = json.loads(sys.argv[1])
HK, HV, T, K, V, B, L2 = (int(x) for x in sys.argv[2:9])
module = load(family_module("kimi_delta").FAMILY, {"chunk_size": 64})
dev = "cuda" if torch.cuda.is_available() else "cpu"
last = [None]


class Synced:
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        def launch(*a, **kw):
            last[0] = self.name
            out = self.kernel[grid](*a, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            tiles = {k: kw[k] for k in ("BK", "BV", "G", "PART", "SLOTS", "USE_L2", "num_warps", "num_stages",
                                        "maxnreg") if k in kw}
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
douts = [torch.randn(B, T, HV, V, generator=gen).to(dev).bfloat16(), torch.randn(B, HV, K, V, generator=gen).to(dev)]
try:
    with pinned(module, cfg):
        grads_of(module.entry, args, douts)
    if dev == "cuda":
        torch.cuda.synchronize()
    print("OK", cfg, sys.argv[2:9], "bf16 fwd+bwd ran, every launch synchronised", flush=True)
except Exception as e:  # noqa: BLE001 - the fault is the report
    print("FAIL", cfg, sys.argv[2:9], f"in {last[0]}:", type(e).__name__, str(e)[:160])
    print("".join(traceback.format_exc().splitlines(True)[-6:]))
    sys.exit(1)
