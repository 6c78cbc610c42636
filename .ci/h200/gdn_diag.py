"""Device diagnostic (issue 34): how far each gated-delta call of the 4B Qwen3-Next-style proxy's
forward lands from transformers' fp32 torch path, for our kernel (bf16 and variants), fla's chunk
kernel (when $FLA_SITE is on the path) and the fp32 path itself under (1 +- bf16 eps) relative
perturbations of its inputs (the op's own conditioning). Prints one row per layer and writes
$OUT/gdn_diag.json.   python3 .ci/h200/gdn_diag.py [B] [T]
"""
import json, os, sys, time
from pathlib import Path

import torch
import transformers.models.qwen3_next.modeling_qwen3_next as M

from gdn_proxy import fla_chunk, our_module, proxy
from onboarding.patching.callswap import outputs_agree

B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
T = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run (TRITON_INTERPRET=1)
mod = our_module()
ours = mod.gated_delta
fla = fla_chunk()
model = proxy(dev, small=dev.type == "cpu")
cfg = model.config
orig = M.torch_chunk_gated_delta_rule
calls = []


def capture(q, k, v, g=None, beta=None, **kw):
    calls.append([x.detach().clone() for x in (q, k, v, g, beta)])
    return orig(q, k, v, g=g, beta=beta, **kw)


M.torch_chunk_gated_delta_rule = capture
for m in model.modules():
    if hasattr(m, "chunk_gated_delta_rule"):
        m.chunk_gated_delta_rule = capture
ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=torch.Generator(dev).manual_seed(1))
with torch.no_grad():
    model(input_ids=ids)
M.torch_chunk_gated_delta_rule = orig
print(f"captured {len(calls)} gated-delta calls at B{B} T{T}", flush=True)


def stats(a, ref):
    a, ref = a.double(), ref.double()
    d = (a - ref).abs()
    rms = ref.pow(2).mean().sqrt()
    out = (d > 0.25 * rms + 0.05 * ref.abs()).double().mean().item()
    return {"rel_rms": ((a - ref).norm() / ref.norm()).item(), "outlier_frac": out,
            "max_abs": d.max().item(), "ref_rms": rms.item()}


rows = []
eps = 2.0 ** -8
for i, (q, k, v, g, beta) in enumerate(calls):
    t0 = time.time()
    with torch.no_grad():
        f32 = [x.float() for x in (q, k, v, g, beta)]
        ref32 = orig(*f32[:3], g=f32[3], beta=f32[4], use_qk_l2norm_in_kernel=True)[0]
        refbf = orig(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
        row = {"layer_call": i, "g_mean": g.float().mean().item(),
               "heads_slow_decay": (g.float().mean(dim=(0, 1)) > -0.01).float().mean().item()}
        mod.set_config(None)
        o = ours(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        row["ours"] = stats(o, ref32)
        row["ours_gate"] = outputs_agree(o, refbf)[1][:160] or "pass"
        mod.set_config({"tm_dot": "tf32"})
        row["ours_tm_tf32"] = stats(ours(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0], ref32)
        mod.set_config(None)
        row["ours_fp32_in"] = stats(ours(*f32, use_qk_l2norm_in_kernel=True)[0], ref32)
        row["torch_bf16_out"] = stats(refbf, ref32)
        gen = torch.Generator(dev).manual_seed(100 + i)
        for d in range(2):
            pert = [x * (1 + eps * torch.sign(torch.randn(x.shape, device=dev, generator=gen))) for x in f32]
            row[f"perturbed{d}"] = stats(orig(*pert[:3], g=pert[3], beta=pert[4],
                                              use_qk_l2norm_in_kernel=True)[0], ref32)
        if fla is not None:
            of = fla(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
            row["fla"] = stats(of, ref32)
            row["fla_gate"] = outputs_agree(of, refbf)[1][:160] or "pass"
    row["s"] = round(time.time() - t0, 2)
    rows.append(row)
    short = {k: (f"{v['rel_rms']:.2e}/{v['outlier_frac']:.1e}" if isinstance(v, dict) else v)
             for k, v in row.items()}
    print(json.dumps(short), flush=True)
Path(os.environ.get("OUT", "/tmp")).joinpath("gdn_diag.json").write_text(json.dumps(rows, indent=1))
