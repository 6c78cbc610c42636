"""Device dump (issue 34): the intermediates of our gated-delta forward on the proxy slices that
gdn_slice.py saved ($SLICES, default .dev/gdn_slices.pt), for a stage-by-stage check on the CPU.
Each slice runs alone (B1, one key head, one value head) under the default config, `tm_dot=tf32`
and `state_bv` 64 (the batch run's state tile); per run: o and every saved intermediate (w, kd,
qg, Aqk, gl, Tm, M, S_c, v_new) plus the prepare kernel's u, kept for the first slice's default
and tm_dot=tf32 runs (about 12 MB: a returned file is at most 16 MiB). Writes $OUT/gdn_stages.pt.
    python3 .ci/h200/gdn_stages.py [slices]
"""
import os, sys, tempfile
from pathlib import Path

import torch

from onboarding.families import family_module
from onboarding.generate import templating

NS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
dev = torch.device(os.environ.get("DEV", "cuda"))  # DEV=cpu with TRITON_INTERPRET=1: a smoke run
src = templating.render(family_module("gated_delta").FAMILY, "chunk", {"chunk_size": 64})
mod = templating.load_module(templating.write_module(src, Path(tempfile.mkdtemp()) / "gd" / "chunk.py"))
data = torch.load(os.environ.get("SLICES", ".dev/gdn_slices.pt"))
names = ("o", "ht", "w", "kd", "qg", "Aqk", "gl", "Tm", "M", "h", "vn")
out = []
for s in data["slices"][:NS]:
    q, k = (s[n][None, :, None].contiguous().to(dev) for n in ("q", "k"))
    v, g, beta = (s[n][None, :, None].contiguous().to(dev) for n in ("v", "g", "beta"))
    scale = q.shape[-1] ** -0.5
    runs = {}
    for label, cfg in (("default", None), ("tm_tf32", {"tm_dot": "tf32"}), ("state_bv64", {"state_bv": 64})):
        mod.set_config(cfg)
        with torch.no_grad():
            res = mod._forward(q, k, v, g, beta, None, scale, True, save=True)
            u = mod._prepare(q, k, v, g, beta, scale, True)[1]
        mod.set_config(None)
        runs[label] = {n: t.detach().float().cpu() for n, t in zip(names, res)}
        runs[label]["u"] = u.float().cpu()
        err = ((runs[label]["o"][0, :, 0].double() - s["ref"].double()).norm() / s["ref"].double().norm()).item()
        print(f"b{s['b']} hv{s['hv']} {label}: o vs the fp32 torch path {err:.3e}", flush=True)
    # hybrids: the default forward with one prepare output (w or u) taken from the tm_dot=tf32 run,
    # to tell which of the two Tm dots carries the error
    with torch.no_grad():
        mod.set_config(None)
        base = list(mod._prepare(q, k, v, g, beta, scale, True))
        mod.set_config({"tm_dot": "tf32"})
        wide = list(mod._prepare(q, k, v, g, beta, scale, True))
        mod.set_config(None)
        for label, idx in (("w from tf32", (0,)), ("u from tf32", (1,)), ("w and u from tf32", (0, 1))):
            p = list(base)
            for i in idx:
                p[i] = wide[i].to(base[i].dtype)
            h, vn, _ = mod._state_forward(p[0], p[1], p[2], p[5], None, v.shape[-1], q.dtype)
            o = mod._output(p[3], h, p[4], vn, q.shape[1], v.dtype)
            err = ((o[0, :, 0].double().cpu() - s["ref"].double()).norm() / s["ref"].double().norm()).item()
            print(f"b{s['b']} hv{s['hv']} default with {label}: {err:.3e}", flush=True)
    if not out:
        out.append({"b": s["b"], "hv": s["hv"], "runs": {n: runs[n] for n in ("default", "tm_tf32")}})
torch.save(out, Path(os.environ.get("OUT", "/tmp")) / "gdn_stages.pt")
