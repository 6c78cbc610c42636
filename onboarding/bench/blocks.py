"""The Inductor fallback against eager, per uncovered block: forward and forward + backward.

For each MODEL: parse its proxy (dispatch capture), map it, and for every distinct uncovered
block (blocks of one structure key once; a block inside another uncovered block is timed with
it) capture the block's inputs at (batch, seq) with a forward pre-hook during a forward of the
proxy, then time the block's own forward and ``torch.compile`` of it (static shapes: one graph
for the forward, one for the backward), median of `triton.testing.do_bench` (CUDA events) on a
GPU, of wall-clock repeats on a CPU. Models compile in parallel processes; a file lock makes
their timing phases take turns, so no two time at once.

    python -m onboarding.bench.blocks hf:xlstm hf:mamba2 --proxy small --seq 2048 --out DIR
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _clone(x: Any, grad: bool) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(grad and y.is_floating_point())
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v, grad) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v, grad) for k, v in x.items()}
    return x


def _timer(device: str):
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")

    def wall(fn, n: int = 5) -> float:
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    return wall


def bench_model(ref: str, proxy: str, batch: int, seq: int, dtype: str, lock: str,
                out: str) -> None:
    from onboarding.align.core import as_dtype
    from onboarding.backend import kernel_device
    from onboarding.coverage import build_coverage
    from onboarding.generate.blockcheck import _flat, capture_block_inputs
    from onboarding.generate.tasks import task_blocks, structure_key
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.spec import ModelSpec

    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        spec = ModelSpec(ref=ref, proxy=proxy)
        info = load_stage(spec.load(), proxy)
        graph = parse_stage(info, batch=1, seq=64, try_export=False)
        picked = [b for b, *_ in task_blocks(graph, build_coverage(graph))]
        outer = [b for b in picked if not any(b.path.startswith(o.path + ".") for o in picked)]
        seen: dict[str, str] = {}
        device = str(kernel_device())
        model = info.loaded.build(info.proxy_config, seed=0).to(device, as_dtype(dtype)).eval()
        timer = _timer(device)
        for b in outer:
            key = structure_key(b)
            if key in seen:
                continue
            seen[key] = b.path
            row: dict[str, Any] = {"model": ref, "block": b.path, "kind": b.kind,
                                   "class": b.class_name, "proxy": proxy, "batch": batch,
                                   "seq": seq, "dtype": dtype, "device": device,
                                   "same_as": sum(structure_key(x) == key for x in outer) - 1}
            try:
                module = model.get_submodule(b.path)
                args, kwargs = capture_block_inputs(model, info.proxy_config, b.path, batch,
                                                    seq, seed=1)
                eager = module.forward
                c0 = time.perf_counter()
                comp = torch.compile(eager, dynamic=False)

                def fwd(fn):
                    with torch.no_grad():
                        return fn(*args, **kwargs)

                a_g, k_g = _clone(args, True), _clone(kwargs, True)

                def fwd_bwd(fn):
                    outs = [o for o in _flat(fn(*a_g, **k_g))
                            if isinstance(o, torch.Tensor) and o.requires_grad]
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

                fwd(comp)
                fwd_bwd(comp)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - c0, 1)
                with open(lock, "w") as fh:  # one model times at a time
                    fcntl.flock(fh, fcntl.LOCK_EX)
                    for name, fn in (("eager", eager), ("inductor", comp)):
                        row[f"{name}_fwd_ms"] = round(timer(lambda: fwd(fn)), 4)
                        row[f"{name}_fwdbwd_ms"] = round(timer(lambda: fwd_bwd(fn)), 4)
                row["speedup_fwd"] = round(row["eager_fwd_ms"] / row["inductor_fwd_ms"], 2)
                row["speedup_fwdbwd"] = round(row["eager_fwdbwd_ms"] / row["inductor_fwdbwd_ms"],
                                              2)
            except Exception as exc:  # one block's failure is its row, not the model's end
                lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                row["error"] = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
            rows.append(row)
    except Exception as exc:
        rows.append({"model": ref, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    Path(out).write_text(json.dumps({"model": ref, "rows": rows,
                                     "seconds": round(time.perf_counter() - t0, 1)}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--proxy", default="small", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default=".")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per model")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = []
    for ref in a.models:
        f = out / f"blocks_{ref.replace(':', '_').replace('/', '_')}.json"
        p = ctx.Process(target=bench_model, args=(ref, a.proxy, a.batch, a.seq, a.dtype,
                                                  str(out / ".lock"), str(f)))
        p.start()
        procs.append((ref, p, f))
    t0 = time.perf_counter()
    rows = []
    for ref, p, f in procs:
        left = None if a.timeout is None else max(1.0, a.timeout - (time.perf_counter() - t0))
        p.join(left)
        if p.is_alive():
            p.terminate()
            rows.append({"model": ref, "error": f"timeout after {a.timeout:.0f} s"})
        elif f.exists():
            rows += json.loads(f.read_text())["rows"]
        else:
            rows.append({"model": ref, "error": f"exit code {p.exitcode}, no result"})
    (out / "blocks.json").write_text(json.dumps(rows, indent=1))
    cols = ("model", "block", "kind", "same_as", "compile_s", "eager_fwd_ms",
            "inductor_fwd_ms", "speedup_fwd", "eager_fwdbwd_ms", "inductor_fwdbwd_ms",
            "speedup_fwdbwd", "error")
    print("| " + " | ".join(cols) + " |")
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
