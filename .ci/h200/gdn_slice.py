"""Device dump (issue 34): the gated-delta call of the 4B Qwen3-Next-style proxy where our bf16
forward lands far from the fp32 path (call 7 of gdn_diag.py: same proxy, seed, B8 T2048), cut to
its worst (batch, value head) slices so that the CPU can study them: per slice the bf16 inputs
(q, k of the key head, v, g, beta of the value head), transformers' torch path on fp32 copies,
our kernel (default and `tm_dot=tf32`) and fla's (when $FLA_SITE is on the path); each slice
also re-run alone (B1, one key and one value head) to show the error is the slice's own.
Writes $OUT/gdn_slices.pt.   python3 .ci/h200/gdn_slice.py [call] [B] [T] [slices]
"""
import os, sys
from pathlib import Path

import torch
import transformers.models.qwen3_next.modeling_qwen3_next as M

from gdn_proxy import fla_chunk, our_module, proxy

CALL = int(sys.argv[1]) if len(sys.argv) > 1 else 7
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
T = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
NS = int(sys.argv[4]) if len(sys.argv) > 4 else 4
dev = torch.device("cuda")
mod = our_module()
fla = fla_chunk()
model = proxy(dev)
cfg = model.config
orig = M.torch_chunk_gated_delta_rule
calls = []


def capture(q, k, v, g=None, beta=None, **kw):
    if len(calls) == CALL:
        calls.append([x.detach().clone() for x in (q, k, v, g, beta)])
    else:
        calls.append(None)
    return orig(q, k, v, g=g, beta=beta, **kw)


M.torch_chunk_gated_delta_rule = capture
for m in model.modules():
    if hasattr(m, "chunk_gated_delta_rule"):
        m.chunk_gated_delta_rule = capture
ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=torch.Generator(dev).manual_seed(1))
with torch.no_grad():
    model(input_ids=ids)
M.torch_chunk_gated_delta_rule = orig
q, k, v, g, beta = calls[CALL]
del model, calls
print(f"call {CALL}: q {tuple(q.shape)} {q.dtype}, v {tuple(v.shape)}, g {g.dtype} mean {g.float().mean():.3f}, "
      f"beta {beta.dtype}", flush=True)
G = v.shape[2] // q.shape[2]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


with torch.no_grad():
    f32 = [x.float() for x in (q, k, v, g, beta)]
    ref = orig(*f32[:3], g=f32[3], beta=f32[4], use_qk_l2norm_in_kernel=True)[0].float()
    outs = {"ours": mod.gated_delta(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].float()}
    mod.set_config({"tm_dot": "tf32"})
    outs["ours_tm_tf32"] = mod.gated_delta(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].float()
    mod.set_config(None)
    if fla is not None:
        outs["fla"] = fla(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0].float()
    print({n: f"{rel(o, ref):.3e}" for n, o in outs.items()}, flush=True)
    # per (b, hv): relative RMS of ours against the fp32 path
    d = (outs["ours"] - ref).double().pow(2).sum(dim=(1, 3))
    n = ref.double().pow(2).sum(dim=(1, 3))
    per = (d / n).sqrt()  # [B, HV]
    order = per.flatten().argsort(descending=True).tolist()
    picks = order[:NS - 1] + [order[len(order) // 2]]  # the worst, and one median slice
    slices = []
    for idx in picks:
        b, h = divmod(idx, per.shape[1])
        hk = h // G
        s = {"b": b, "hv": h, "hk": hk, "q": q[b, :, hk].cpu(), "k": k[b, :, hk].cpu(), "v": v[b, :, h].cpu(),
             "g": g[b, :, h].cpu(), "beta": beta[b, :, h].cpu(), "ref": ref[b, :, h].cpu()}
        for name, o in outs.items():
            s[name] = o[b, :, h].cpu()
        err_t = (outs["ours"][b, :, h] - ref[b, :, h]).abs().amax(dim=-1)
        s["worst_t"] = err_t.argsort(descending=True)[:8].tolist()
        # the slice alone: B1, one key head, one value head
        one = [x[b:b + 1, :, hk:hk + 1].contiguous() for x in (q, k)] + \
              [x[b:b + 1, :, h:h + 1].contiguous() for x in (v, g, beta)]
        s["alone"] = mod.gated_delta(*one, use_qk_l2norm_in_kernel=True)[0].float()[0, :, 0].cpu()
        slices.append(s)
        print(f"b{b} hv{h}: ours {rel(s['ours'], s['ref']):.3e} alone {rel(s['alone'], s['ref']):.3e} "
              + " ".join(f"{n} {rel(s[n], s['ref']):.3e}" for n in outs if n != "ours")
              + f" worst t {s['worst_t'][:4]} g there {[round(s['g'][t].item(), 2) for t in s['worst_t'][:4]]}"
              f" beta {[round(s['beta'][t].float().item(), 2) for t in s['worst_t'][:4]]}", flush=True)
torch.save({"call": CALL, "B": B, "T": T, "per_slice_rel": per.cpu(), "slices": slices},
           Path(os.environ.get("OUT", "/tmp")) / "gdn_slices.pt")
