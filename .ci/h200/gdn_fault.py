"""Which gated_delta forward config faults (illegal memory access) at a short no-grad forward.

probe_fault.py (fifty-seventh session, H100) named `gdn_state_fwd_kernel` of the reviewed module
(then chunk_04fde1a8; chunk_89711166 has the same forward) in the export probe of `onboard train
hf:qwen3_next --proxy small --seq 256`: a no-grad forward of 16 tokens, B1 HK16 HV16 K128 V128 bf16, the k_le_128 bucket (fwd_o fused, fused_kq rows, state_stages 3,
state_bv auto = 16 at B*HV 16 on 132 SMs). Each variant runs in its own process (a fault poisons the
context): `python3 .ci/h200/gdn_fault.py` prints one line per variant (`--pick I J ...`: those of VARIANTS); `--one T PIN_JSON` runs one.
"""
import glob
import json
import subprocess
import sys
import time

MODULE = sorted(glob.glob("kernels/gated_delta/chunk_*.py"))[0]  # the reviewed module


def one(T: int, pin: dict, B: int = 1, HK: int = 16, HV: int = 16, D: int = 128) -> None:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("gdn_mod", MODULE)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    if pin:
        m.set_config(pin)
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, T, HK, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, HK, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, HV, D, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(B, T, HV, device=dev).mul(0.5)
    beta = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        o, ht = m._forward(q, k, v, g, beta, None, D ** -0.5, True)
    torch.cuda.synchronize()
    ref = None
    with torch.no_grad():  # the stored-kd split path as a same-module reference
        m.set_config({**pin, "fwd_o": "split", "fused_kq": "stored", "state_stages": 1})
        ref, _ = m._forward(q, k, v, g, beta, None, D ** -0.5, True)
    torch.cuda.synchronize()
    err = ((o.float() - ref.float()).pow(2).mean() / ref.float().pow(2).mean().clamp_min(1e-30)).sqrt().item()
    print(json.dumps({"ok": True, "finite": bool(torch.isfinite(o).all()), "rel_rms_vs_split": err}))


VARIANTS = [
    (16, {}), (16, {"state_bv": 32}), (16, {"state_bv": 64}), (16, {"state_stages": 1}),
    (16, {"state_stages": 2}), (16, {"fused_kq": "stored"}), (16, {"fwd_o": "split"}),
    (64, {}), (65, {}), (128, {}), (256, {}), (256, {"state_stages": 1}), (1, {}), (100, {"state_bv": 32}),
]

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(int(sys.argv[2]), json.loads(sys.argv[3]))
        sys.exit(0)
    pick = [int(a) for a in sys.argv[2:]] if sys.argv[1:2] == ["--pick"] else range(len(VARIANTS))
    for T, pin in (VARIANTS[i] for i in pick):
        t0 = time.time()
        p = subprocess.run([sys.executable, __file__, "--one", str(T), json.dumps(pin)], capture_output=True,
                           text=True, timeout=120)
        tail = (p.stdout.strip().splitlines() or [""])[-1] if p.returncode == 0 else \
            " | ".join(l for l in p.stderr.splitlines() if "Error" in l)[-300:]
        print(f"T={T} pin={json.dumps(pin)} rc={p.returncode} {time.time() - t0:.0f}s {tail}", flush=True)
