"""Issue 33: per-kernel GPU times of the sparse MLA forward, or forward + backward with --bwd (128
heads, K 2048, d_qk 576 / d_v 512, bf16), under the bucket's config (`ours`) and, with --bwd, each
row of the bench's MLA_FWDBWD_SWEEP (the bench's --profile breaks down the `ours` row only), at T
from argv (default 8192).

    python3 .ci/h200/h33_mla_profile.py 8192 $OUT/mla_profile.json
    python3 .ci/h200/h33_mla_profile.py --bwd 8192 $OUT/mla_bwd_profile.json

Per row the bench's `kernel_breakdown` (torch.profiler: warm-up steps, then GPU ms per kernel and
step) and the sum over every kernel. The forward: the forward kernel's time (`_fwd` in its name)
and its TFLOP/s on the case's useful FLOPs (causal, so early rows with fewer than K picks count
fewer). With --bwd: the backward kernels' sum (`_bwd` in the name: the fused kernel, or the dq and
dkv kernels), its TFLOP/s on the backward's useful FLOPs (the case's fwd+bwd FLOPs less the
forward's), and fwd+bwd TFLOP/s on the sum. A JSON line per row, also written to the path after T
when given. On a CPU (TRITON_INTERPRET=1) it builds the same steps at a toy shape (4 heads, d_qk 40
/ d_v 32, K 8, T 37) and runs each once: a smoke test of the script, not a timing.
"""

from __future__ import annotations

import json
import sys

import torch

from onboarding.families import family_module


def main(backward: bool = False) -> None:
    args = sys.argv[1:]
    if args[:1] == ["--bwd"]:
        backward, args = True, args[1:]
    t = int(args[0]) if args else 8192
    bench = family_module("sparse_attention").bench
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        bench.LAYOUTS["mla"], bench.TOPK, t = (4, 1, 40, 32), 8, 37
    steps = bench._attn_steps("mla", t, backward, device)
    fwd_flops = bench.attention_flops("mla", t, False)
    all_flops = bench.attention_flops("mla", t, True) if backward else fwd_flops
    part, part_flops = ("_bwd", all_flops - fwd_flops) if backward else ("_fwd", fwd_flops)
    rows = []
    for label in ["ours"] + [s for s in steps if s.startswith("ours@")]:
        if not gpu:
            steps[label](0)
            rows.append({"row": label, "smoke": "ran"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        from onboarding.bench.harness import kernel_breakdown

        kernels = kernel_breakdown(steps[label])
        total = sum(r["ms"] for r in kernels)
        ms = sum(r["ms"] for r in kernels if part in r["kernel"])
        row = {"row": label, "T": t, "kernel_ms": round(total, 3), f"{part[1:]}_kernel_ms": round(ms, 3),
               f"{part[1:]}_kernel_tflops": round(part_flops / ms / 1e9, 1) if ms else None}
        if backward:
            row["fwdbwd_tflops"] = round(all_flops / total / 1e9, 1) if total else None
        rows.append({**row, "kernels": [{"kernel": r["kernel"][:90], "ms": round(r["ms"], 3), "calls": r["calls"]}
                                        for r in kernels]})
        print(json.dumps(rows[-1]), flush=True)
    if len(args) > 1:
        with open(args[1], "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
