"""Issue 32: per-kernel GPU times of KDA's forward + backward under each bench.BWD_SWEEP config
(the bench's --profile breaks down the `ours` rows only). Kimi-Linear layout (H32, K = V = 128,
bf16, in-kernel l2norm), T from argv (default 8192). For each config: two warm-up steps, then
the wall median of REPS synchronised steps and the bench's `kernel_breakdown` (torch.profiler:
GPU ms per kernel and step); prints a JSON line per config, and writes them to argv[2] when
given.

    python3 .ci/h200/h32_kdabwd_profile.py 8192 $OUT/kda_profile.json
On a CPU (TRITON_INTERPRET=1, tiny T such as 70) it runs the same steps as a smoke test.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from onboarding.bench.cases import kernel
from onboarding.bench.cases_linear_attention import CHUNK, make_inputs
from onboarding.bench.harness import kernel_breakdown
from onboarding.families import family_module

REPS = 5


def main() -> None:
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    out = sys.argv[2] if len(sys.argv) > 2 else None
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    H, D = (32, 128) if cuda else (1, 16)
    mod, entry = kernel("kimi_delta", "chunk", {"chunk_size": CHUNK, "qk_l2norm": True})
    bench = family_module("kimi_delta").bench
    configs = [{}, *bench.BWD_SWEEP]
    q, k, v, g, beta = make_inputs(True, 1, T, H, H, D, dev, seed=0)
    do = torch.randn(1, T, H, D, device=dev).to(q.dtype)
    bucket, base = mod.shape_bucket(D), mod.config_for(D)
    rows = []

    def step():
        o = entry(q, k, v, g, beta, None, None, True, True)[0]
        return torch.autograd.grad(o, (q, k, v, g, beta), do)

    for cfg in configs:
        name = bench._label(cfg) if cfg else "ours (default)"
        mod.set_config({**base, **cfg}, bucket=bucket)
        try:
            for _ in range(2):
                step()
            if cuda:
                torch.cuda.synchronize()
            walls = []
            for _ in range(REPS):
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            row = {"config": name, "wall_ms_median": round(statistics.median(walls), 3)}
            if cuda:  # the bench's own breakdown: GPU time per kernel and step, after a warm-up
                row["kernels"] = kernel_breakdown(lambda i: step())
        except Exception as exc:  # noqa: BLE001 - report and go on to the next config
            row = {"config": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            mod.set_config(None, bucket=bucket)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"T": T, "H": H, "D": D, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
