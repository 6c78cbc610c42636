"""kimi_delta's `kda_qkt_cold` "split" against "inline" and the fp32 naive recurrence, per tile, at the case of
tests/kernel_tests/test_kimi_delta.py::test_qkt_split_cold_tiles_on_gpu (HK 2, HV 4 then 2, T 1000, K = V = 128,
B 2; two chunks' gates scaled so the hot launch flags their tiles): each row's relative RMS against the naive
fp32 path for o, the final state and every gradient; split against inline; the six worst (b, chunk, head,
K tile) tiles of dq, dk, dg; the flag buffer's flagged entries. Forty-second session (H100): it placed the
4-warp cold build's wrong bf16 gradients at G 2 (kimi_delta v55; v56 launches the cold build at 8 warps).

    source .ci/h200/setup.sh && python3 .ci/h200/kda_cold_diag.py                  # GPU, ~7 min of compiles
    DIAG_T=200 DIAG_K=32 TRITON_INTERPRET=1 python3 .ci/h200/kda_cold_diag.py        # a small CPU run of the script
"""
import itertools, os, sys, torch
T_ = int(os.environ.get("DIAG_T", 1000)); K_ = int(os.environ.get("DIAG_K", 128))
sys.path.insert(0, "tests/kernel_tests")
from kernel_cases import DEVICE, LaunchSpy
from test_gated_delta import Case, grads_of, load, make_inputs
from onboarding.families import family_module
from test_kimi_delta import pinned
kd = family_module("kimi_delta")
module = load(kd.FAMILY, {"chunk_size": 64})
names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]
KNAME = "kda_chunk_bwd_qkt_kernel"
def inputs(HV):
    # the entry's args (bf16 values; two chunks' gates scaled) and the cotangents of o and the final state,
    # the same for every run at this HV (grads_of differentiates clones)
    case = Case(HK=2, HV=HV, T=T_, l2=True, h0=True, K=K_, V=K_, B=2)
    gen = torch.Generator().manual_seed(6)
    args = make_inputs(case, True, torch.bfloat16, DEVICE, gen)
    c0, c1 = 320 % T_ // 64 * 64, 640 % T_ // 64 * 64 + 64
    args[3][:, c0:c0 + 64, 0] *= 30.0
    args[3][1, c1:c1 + 64, HV - 1] *= 4.0
    douts = [torch.randn(case.B, case.T, case.HV, case.V, generator=gen).to(DEVICE),
             torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)]
    return args, douts
def run(args, douts, cfg, dtype, fn=None):
    # (outputs and gradients by name, the qkt kernel's launches: (grid, SPLIT, flag buffer))
    xs = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ds = [douts[0].to(dtype), douts[1]]
    flags = []
    orig = getattr(module, KNAME)
    setattr(module, KNAME, LaunchSpy(orig, lambda grid, kw: flags.append((grid, kw.get("SPLIT"), kw.get("p_flag")))))
    try:
        with pinned(module, cfg):
            outs, grads = grads_of(fn or module.entry, xs, ds)
        torch.cuda.synchronize() if DEVICE.type == "cuda" else None
    finally:
        setattr(module, KNAME, orig)
    return dict(zip(names, [*outs, *grads])), flags
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
def tiles(a, b, BK=32):
    # per (b, chunk, head, ktile) relative error of a vs b for [B, T, H, K]
    B, T, H, K = a.shape
    out = []
    for bb, c, h, kt in itertools.product(range(B), range(-(-T // 64)), range(H), range(-(-K // BK))):
        x, y = (t[bb, 64*c:64*c+64, h, BK*kt:BK*kt+BK].float() for t in (a, b))
        out.append((((x - y).norm() / (y.norm() + 1e-30)).item(), bb, c, h, kt))
    return sorted(out, reverse=True)
def worst(a, b):
    # the six worst tiles of a vs b: (error to 4 places, b, chunk, head, ktile)
    return [(round(err, 4), *where) for err, *where in tiles(a, b)[:6]]
SPLIT = {"kda_qk": "ksplit", "kda_qkt_cold": "split"}
INL = {"kda_qk": "ksplit", "kda_qkt_cold": "inline"}
for HV in (4, 2):
    print(f"===== HV {HV} (HK 2)")
    args, douts = inputs(HV)
    ref, _ = run(args, douts, INL, torch.float32, fn=module.reference)
    res = {}
    for tag, cfg, dt in (("inline-bf16", INL, torch.bfloat16), ("split-bf16", SPLIT, torch.bfloat16),
                         ("inline-fp32", INL, torch.float32), ("split-fp32", SPLIT, torch.float32),
                         ("default-bf16", {}, torch.bfloat16)):
        r, fl = run(args, douts, cfg, dt)
        res[tag] = r
        bufs = [f[2] for f in fl if f[2] is not None]
        print(f"{tag:12s} launches {[(f[0], f[1]) for f in fl]} flagged {[int(b.sum()) for b in bufs[:1]]}")
        print("   vs naive fp32:", {k: float(f"{rel(r[k], ref[k]):.2e}") for k in names})
        if tag.startswith("split"):
            other = res[tag.replace("split", "inline")]
            print("   vs inline   :", {k: float(f"{rel(r[k], other[k]):.2e}") for k in names})
            for k in ("dq", "dk", "dg"):
                print(f"   worst {k} tiles split vs inline (err, b, chunk, head, ktile):", worst(r[k], other[k]))
            print("   flag tensor nonzero idx:", bufs[0].cpu().nonzero().flatten().tolist()[:40], "numel", bufs[0].numel())
    for tag in ("inline-bf16", "split-bf16"):
        print(f"   worst dq tiles {tag} vs naive:", worst(res[tag]["dq"], ref["dq"]))
