"""Device check (issue 34): the WY product w = Tm (k beta exp(gc)) of our gated-delta prepare
kernel against the module's PyTorch twin (`chunk_prepare_torch`) on the GPU, under slow decays
(g about -0.05 per token, as the proxy's value head 25, where call M found the default 16-bit w
118% off past row 16 of each chunk at K=64), per config and source variant, at K = 64 and 128,
alone and in Qwen3-Next's grouped layout. Keeps the TRITON_CACHE_DIR files of the prepare kernel
(ttgir, ptx) under $OUT/prep_k64.tgz for reading.   python3 .ci/h200/gdn_wfix.py"""
import os, tarfile, tempfile
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
import torch

from onboarding.families import family_module
from onboarding.generate import templating

dev = torch.device(os.environ.get("DEV", "cuda"))  # DEV=cpu TRITON_INTERPRET=1 T=128: a smoke run
SRC = templating.render(family_module("gated_delta").FAMILY, "chunk", {"chunk_size": 64})
# the bf16 cast of Tm hoisted out of the K-tile loop of w (a variant of the code, not a config)
HOIST = SRC.replace("    b_T = _unit_lower_inverse(b_Akk, BT, BC, INV_PREC)  # Tm = (I + A)^-1\n",
                    "    b_T = _unit_lower_inverse(b_Akk, BT, BC, INV_PREC)  # Tm = (I + A)^-1\n"
                    "    b_Tw = b_T.to(p_w.dtype.element_ty)\n").replace(
    "b_w = _dot(b_T, b_k * (b_beta * tl.exp(b_gc))[:, None], TM_PREC)",
    "b_w = _dot(b_Tw, (b_k * (b_beta * tl.exp(b_gc))[:, None]).to(p_w.dtype.element_ty), TM_PREC)")
assert HOIST != SRC
mods = {n: templating.load_module(templating.write_module(s, Path(tempfile.mkdtemp()) / n / "chunk.py"))
        for n, s in (("src", SRC), ("hoist", HOIST))}


gen = torch.Generator(dev).manual_seed(0)
for B, hk, hv, K in ((1, 1, 1, 64), (1, 16, 32, 64), (1, 1, 1, 128), (1, 16, 32, 128)):
    T = int(os.environ.get("T", 2048))
    q = (0.15 * torch.randn(B, T, hk, K, device=dev, generator=gen)).bfloat16()
    k = (0.15 * torch.randn(B, T, hk, K, device=dev, generator=gen)).bfloat16()
    v = (0.02 * torch.randn(B, T, hv, K, device=dev, generator=gen)).bfloat16()
    g = -0.05 * torch.exp(0.3 * torch.randn(B, T, hv, device=dev, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, hv, device=dev, generator=gen)).bfloat16()
    # the module's PyTorch twin of the prepare step (fp32; call N used a float64 copy of it, which
    # agrees with the twin to 9e-8 relative on these inputs: a CPU check, T 256)
    ref = mods["src"].chunk_prepare_torch(q, k, v, g, beta, K ** -0.5, True)[0].double().reshape(B, hv, T, K)
    for name, cfg in (("src", None), ("src", {"prep_bk": 64}), ("src", {"prep_bk": 16}), ("src", {"num_warps": 8}),
                      ("src", {"prep_stages": 2}), ("src", {"inv_dot": "ieee"}), ("src", {"tm_dot": "tf32"}),
                      ("hoist", None)):
        mod = mods[name]
        mod.set_config(cfg)
        try:
            w = mod._prepare(q, k, v, g, beta, K ** -0.5, True)[0].double()
        finally:
            mod.set_config(None)
        e = (w - ref).norm() / ref.norm()
        rows = ((w - ref).reshape(-1, 64, K).norm(dim=-1) / ref.reshape(-1, 64, K).norm(dim=-1)).mean(0)
        bad = (rows > 0.05).nonzero().flatten().tolist()
        print(f"B{B} HK{hk} HV{hv} K{K} {name} {cfg}: w rel {e:.3e}; chunk rows > 5%: "
              f"{(bad[0], bad[-1], len(bad)) if bad else 'none'}", flush=True)
with tarfile.open(Path(os.environ.get("OUT", "/tmp")) / "prep_k64.tgz", "w:gz") as tf:
    for f in Path(os.environ["TRITON_CACHE_DIR"]).rglob("gdn_prepare_fwd_kernel.*"):
        if f.suffix in (".ttgir", ".ptx", ".json", ".ttir"):
            tf.add(f, arcname=f"{f.parent.name}/{f.name}")
