"""Issue 33: per-kernel GPU times of the sparse MLA forward + backward (128 heads, K 2048, d_qk 576 /
d_v 512, bf16) under the bucket's config (`ours`: the fused backward) and each row of
bench.MLA_FWDBWD_SWEEP (the split backward, BWD_SPLIT 1; the bench's --profile breaks down the
`ours` row only), at T from argv (default 8192).

    python3 .ci/h200/h33_mla_bwd_profile.py 8192 $OUT/mla_bwd_profile.json

Per row the bench's `kernel_breakdown` (torch.profiler: warm-up steps, then GPU ms per kernel and
step), the backward kernels' sum (`_bwd` in the name: the fused kernel, or the dq and dkv kernels)
and its TFLOP/s on the backward's useful FLOPs (6 d_qk + 4 d_v per head and valid pick: the
case's fwd+bwd FLOPs less the forward's), and the sum over every kernel (forward, delta, the row-end
pass, casts); a JSON line per row, also written to argv[2] when given. On a CPU
(TRITON_INTERPRET=1) it builds the same steps at a toy shape (4 heads, d_qk 40 / d_v 32, K 8,
T 37) and runs each once: a smoke test of the script, not a timing.
"""

from __future__ import annotations

import json
import sys

import torch

from onboarding.families import family_module


def main() -> None:
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    bench = family_module("sparse_attention").bench
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        bench.LAYOUTS["mla"], bench.TOPK, t = (4, 1, 40, 32), 8, 37
    steps = bench._attn_steps("mla", t, True, device)
    h, _, d_qk, d_v = bench.LAYOUTS["mla"]
    pairs = h * bench.useful_pairs(t, bench.TOPK)
    bwd_flops = pairs * (6 * d_qk + 4 * d_v)
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
        bwd = sum(r["ms"] for r in kernels if "_bwd" in r["kernel"])
        rows.append({"row": label, "T": t, "kernel_ms": round(total, 3), "bwd_kernel_ms": round(bwd, 3),
                     "bwd_kernel_tflops": round(bwd_flops / bwd / 1e9, 1) if bwd else None,
                     "fwdbwd_tflops": round(pairs * (8 * d_qk + 6 * d_v) / total / 1e9, 1) if total else None,
                     "kernels": [{"kernel": r["kernel"][:90], "ms": round(r["ms"], 3), "calls": r["calls"]}
                                 for r in kernels]})
        print(json.dumps(rows[-1]), flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
