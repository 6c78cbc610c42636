"""Device check (issue 34): the gated-delta kernel at the 4B Qwen3-Next proxy's call shape
(B8 T2048 H32 K=V=64 bf16, l2norm in the kernel), forward + backward, under each `tm_dot`, with
CUDA_LAUNCH_BLOCKING=1 so that a faulting kernel names itself; the reviewed module (the one
training patches) and the template's current render (names after B and T: only those; a fault
poisons the CUDA context, so a faulting module ends the run).   python3 .ci/h200/gdn_k64.py [B T [reviewed|render ...]]
"""
import os, sys, tempfile, traceback
from pathlib import Path

os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
import torch

from onboarding.families import family_module
from onboarding.generate import templating

dev = torch.device("cuda")
mods = {"reviewed": templating.load_module(sorted(Path("kernels/gated_delta").glob("chunk_*.py"))[0])}
src = templating.render(family_module("gated_delta").FAMILY, "chunk", {"chunk_size": 64, "qk_l2norm": True})
mods["render"] = templating.load_module(templating.write_module(src, Path(tempfile.mkdtemp()) / "gd" / "chunk.py"))
gen = torch.Generator(dev).manual_seed(0)
B, T = (int(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (8, 2048)
mods = {n: m for n, m in mods.items() if n in sys.argv[3:]} if len(sys.argv) > 3 else mods
for hk, hv, d in ((32, 32, 64), (16, 32, 64), (16, 32, 128)):
    for name, mod in mods.items():
        for tm in ("input", "tf32"):
            q = torch.randn(B, T, hk, d, device=dev, generator=gen).bfloat16().requires_grad_()
            k = torch.randn(B, T, hk, d, device=dev, generator=gen).bfloat16().requires_grad_()
            v = torch.randn(B, T, hv, d, device=dev, generator=gen).bfloat16().requires_grad_()
            g = (-torch.rand(B, T, hv, device=dev, generator=gen) * 3).requires_grad_()
            beta = torch.rand(B, T, hv, device=dev, generator=gen).bfloat16().requires_grad_()
            mod.set_config({"tm_dot": tm})
            try:
                o, _ = mod.gated_delta(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
                o.float().square().mean().backward()
                torch.cuda.synchronize()
                print(f"ok   {name} tm_dot={tm} HK{hk} HV{hv} D{d}: |o| {o.float().norm():.3e} "
                      f"|dq| {q.grad.float().norm():.3e} |dg| {g.grad.float().norm():.3e}", flush=True)
            except Exception:  # noqa: BLE001
                print(f"FAIL {name} tm_dot={tm} HK{hk} HV{hv} D{d}:", flush=True)
                traceback.print_exc()
                sys.exit(1)
            finally:
                mod.set_config(None)
