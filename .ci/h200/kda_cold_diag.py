"""kimi_delta's `kda_qkt_cold` "split" against "inline" and the fp32 naive recurrence, per tile, at the case of
tests/kernel_tests/test_kimi_delta.py::test_qkt_split_cold_tiles_on_gpu (HK 2, HV 4 then 2, T 1000, K = V = 128,
B 2; two chunks' gates scaled so the hot launch flags their tiles): each row's relative RMS against the naive
fp32 path for o, the final state and every gradient; split against inline; the six worst (b, chunk, head,
K tile) tiles of dq, dk, dg; the flag buffer's flagged entries. Forty-second session (H100): it placed the
4-warp cold build's wrong bf16 gradients at G 2 (kimi_delta v55; v56 launches the cold build at 8 warps).

    source .ci/h200/setup.sh && python3 .ci/h200/kda_cold_diag.py                  # GPU, ~7 min of compiles
    DIAG_T=200 DIAG_K=32 TRITON_INTERPRET=1 python3 .ci/h200/kda_cold_diag.py        # a small CPU run of the script
"""
import os, sys, torch
T_ = int(os.environ.get("DIAG_T", 1000)); K_ = int(os.environ.get("DIAG_K", 128))
sys.path.insert(0, "tests/kernel_tests")
from kernel_cases import DEVICE, LaunchSpy
from test_gated_delta import Case, grads_of, load, make_inputs
from onboarding.families import family_module
from test_kimi_delta import pinned
kd = family_module("kimi_delta")
module = load(kd.FAMILY, {"chunk_size": 64})
names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]
def run(HV, cfg, dtype, seed=6, scale=True, fn=None):
    case = Case(HK=2, HV=HV, T=T_, l2=True, h0=True, K=K_, V=K_, B=2)
    gen = torch.Generator().manual_seed(seed)
    args = make_inputs(case, True, torch.bfloat16, DEVICE, gen)
    g = args[3].clone()
    if scale:
        g[:, 320 % T_ // 64 * 64:320 % T_ // 64 * 64 + 64, 0] *= 30.0
        g[1, 640 % T_ // 64 * 64 + 64:640 % T_ // 64 * 64 + 128, HV - 1] *= 4.0
    args[3] = g
    douts = [torch.randn(case.B, case.T, case.HV, case.V, generator=gen).to(DEVICE),
             torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)]
    xs = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ds = [douts[0].to(dtype), douts[1]]
    flags = []
    kname = "kda_chunk_bwd_qkt_kernel"
    orig = getattr(module, kname)
    setattr(module, kname, LaunchSpy(orig, lambda grid, kw: flags.append((grid, kw.get("SPLIT"), kw.get("p_flag")))))
    try:
        with pinned(module, cfg):
            outs, grads = grads_of(fn or module.entry, xs, ds)
        torch.cuda.synchronize() if DEVICE.type == "cuda" else None
    finally:
        setattr(module, kname, orig)
    return dict(zip(names, [*outs, *grads])), flags
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
def tiles(a, b, BK=32):
    # per (b, chunk, head, ktile) relative error of a vs b for [B, T, H, K]
    B, T, H, K = a.shape
    out = []
    for bb in range(B):
        for c in range(-(-T // 64)):
            for h in range(H):
                for kt in range(-(-K // BK)):
                    x = a[bb, 64*c:64*c+64, h, BK*kt:BK*kt+BK].float(); y = b[bb, 64*c:64*c+64, h, BK*kt:BK*kt+BK].float()
                    out.append((((x - y).norm() / (y.norm() + 1e-30)).item(), bb, c, h, kt))
    return sorted(out, reverse=True)
SPLIT = {"kda_qk": "ksplit", "kda_qkt_cold": "split"}
INL = {"kda_qk": "ksplit", "kda_qkt_cold": "inline"}
for HV in (4, 2):
    print(f"===== HV {HV} (HK 2)")
    ref, _ = run(HV, INL, torch.float32, fn=module.reference)
    res = {}
    for tag, cfg, dt in (("inline-bf16", INL, torch.bfloat16), ("split-bf16", SPLIT, torch.bfloat16),
                         ("inline-fp32", INL, torch.float32), ("split-fp32", SPLIT, torch.float32),
                         ("default-bf16", {}, torch.bfloat16)):
        r, fl = run(HV, cfg, dt)
        res[tag] = r
        nflag = [int(f[2].sum()) for f in fl if f[2] is not None]
        print(f"{tag:12s} launches {[(f[0], f[1]) for f in fl]} flagged {nflag[:1]}")
        print("   vs naive fp32:", {k: float(f"{rel(r[k], ref[k]):.2e}") for k in names})
        if tag.startswith("split"):
            other = res[tag.replace("split", "inline")]
            print("   vs inline   :", {k: float(f"{rel(r[k], other[k]):.2e}") for k in names})
            fl0 = [f[2] for f in fl if f[2] is not None][0].cpu()
            for k in ("dq", "dk", "dg"):
                t = tiles(r[k], other[k])[:6]
                print(f"   worst {k} tiles split vs inline (err, b, chunk, head, ktile):", [tuple(round(x, 4) if isinstance(x, float) else x for x in tt) for tt in t])
            print("   flag tensor nonzero idx:", fl0.nonzero().flatten().tolist()[:40], "numel", fl0.numel())
    for k in ("dq",):
        for tag in ("inline-bf16", "split-bf16"):
            t = tiles(res[tag][k], ref[k])[:6]
            print(f"   worst {k} tiles {tag} vs naive:", [tuple(round(x, 4) if isinstance(x, float) else x for x in tt) for tt in t])
