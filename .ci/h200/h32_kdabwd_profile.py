"""Issue 32: per-kernel GPU times of KDA's backward under the default config and each
bench.BWD_SWEEP config (the bench's --profile breaks down the `ours` rows only). Kimi-Linear
layout (H32, K = V = 128, bf16, in-kernel l2norm), T from argv (default 8192), the bench's inputs.
For each config: the wall median of REPS synchronised forward + backward steps, then one saving
forward and torch.profiler over backward-only steps (`autograd.grad` on its kept graph: the
backward's kernels alone, GPU ms per kernel and step, the bench's `aggregate_kernels`). Prints a
table and a JSON line per config, and writes the rows to argv[2] when given.

    python3 .ci/h200/h32_kdabwd_profile.py 8192 $OUT/kdabwd2_profile.json
KDA_ROWS=<substring> keeps the default and the rows whose name holds it (`h32_kdabwd3.sh`: ktiles).
On a CPU (TRITON_INTERPRET=1, a tiny T such as 70) it runs the same steps without the profiler,
as a smoke test.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from onboarding.bench.cases import kernel
from onboarding.bench.cases_linear_attention import CHUNK, make_inputs, sweep_label
from onboarding.bench.harness import PROFILE_STEPS, aggregate_kernels
from onboarding.families import family_module

REPS = 5


def backward_breakdown(o, inputs, do) -> list[dict]:
    """GPU ms per kernel and step of `autograd.grad(o, inputs, do)` alone (the graph kept)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        torch.autograd.grad(o, inputs, do, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            torch.autograd.grad(o, inputs, do, retain_graph=True)
        torch.cuda.synchronize()
    return aggregate_kernels([(e.key, e.self_device_time_total, e.count)
                              for e in prof.key_averages() if e.self_device_time_total > 0], PROFILE_STEPS)


def main() -> None:
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    out = sys.argv[2] if len(sys.argv) > 2 else None
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    H, D = (32, 128) if cuda else (1, 16)
    mod, entry = kernel("kimi_delta", "chunk", {"chunk_size": CHUNK, "qk_l2norm": True})
    bench = family_module("kimi_delta").bench
    keep = os.environ.get("KDA_ROWS", "")
    configs = [{}, *(c for c in bench.BWD_SWEEP if keep in sweep_label(c))]
    q, k, v, g, beta = make_inputs(True, 1, T, H, H, D, dev, seed=0)
    inputs = (q, k, v, g, beta)
    do = torch.randn(1, T, H, D, device=dev).to(q.dtype)
    bucket, base = mod.shape_bucket(D), mod.config_for(D)
    rows = []

    def step():
        o = entry(q, k, v, g, beta, None, None, True, True)[0]
        return torch.autograd.grad(o, inputs, do)

    for cfg in configs:
        name = sweep_label(cfg) if cfg else "ours (default)"
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
            row = {"config": name, "fwd_bwd_wall_ms_median": round(statistics.median(walls), 3)}
            if cuda:
                o = entry(q, k, v, g, beta, None, None, True, True)[0]
                row["bwd_kernels"] = backward_breakdown(o, inputs, do)
                row["bwd_kernel_ms"] = round(sum(r["ms"] for r in row["bwd_kernels"]), 3)
                del o
        except Exception as exc:  # noqa: BLE001 - report and go on to the next config
            row = {"config": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            mod.set_config(None, bucket=bucket)
        rows.append(row)
        print(f"== {name}: fwd+bwd wall {row.get('fwd_bwd_wall_ms_median')} ms, backward kernels "
              f"{row.get('bwd_kernel_ms')} ms/step {row.get('error', '')}")
        for r in row.get("bwd_kernels", []):
            print(f"   {r['ms']:8.3f} ms  x{r['calls']:.0f}  {100 * r['share']:5.1f}%  {r['kernel'][:90]}")
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"T": T, "H": H, "D": D, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
