"""Issue 33: per-kernel GPU times of the MoE experts forward + backward under each row of
bench.MOE_V17_SWEEP_BIG (the bench's --profile breaks down the `ours` row only), at DeepSeek-V3
(E256 K8 D7168 F2048, uniform routing, bf16), N from argv (default 8192).

    python3 .ci/h200/h33_moe3_profile.py 8192 $OUT/moe3_profile.json

For `ours` and each `ours@...` row: the bench's `kernel_breakdown` (torch.profiler: three warm-up
steps, then PROFILE_STEPS steps; GPU ms per kernel and step, the slowest 12 and the rest folded)
and the sum over kernels; a JSON line per row, also written to argv[2] when given. On a CPU
(TRITON_INTERPRET=1) it builds the same steps at a toy shape (E 8, K 2, D 64, F 32, N 37) and runs
each once: a smoke test of the script, not a timing.
"""

from __future__ import annotations

import json
import sys

import torch

from onboarding.families import family_module


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    bench = family_module("moe_experts").bench
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    e, k, d, f, n = (256, 8, 7168, 2048, n) if gpu else (8, 2, 64, 32, 37)
    steps = bench._moe_steps("deepseek_v3", e, k, d, f, n, "uniform", True, bench.MOE_V17_SWEEP_BIG, device)
    rows = []
    for label in ["ours"] + [s for s in steps if s.startswith("ours@")]:
        if not gpu:
            steps[label](0)
            rows.append({"row": label, "smoke": "ran"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        from onboarding.bench.harness import kernel_breakdown

        kernels = kernel_breakdown(steps[label])
        rows.append({"row": label, "N": n, "kernel_ms": round(sum(r["ms"] for r in kernels), 3),
                     "kernels": [{"kernel": r["kernel"][:90], "ms": round(r["ms"], 3), "calls": r["calls"]}
                                 for r in kernels]})
        print(json.dumps(rows[-1]), flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
