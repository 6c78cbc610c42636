"""The Inductor fallback against eager, per uncovered block: forward and forward + backward.

For each MODEL: parse its proxy (dispatch capture), map it, and for every distinct uncovered
block (blocks of one structure key once; a block inside another uncovered block is timed with
it) capture the block's inputs at (batch, seq) with a forward pre-hook during a forward of the
proxy, then time the block's own forward and ``torch.compile`` of it as the fallback compiles it
(`onboarding.generate.inductor.compiled`: static shapes, one graph for the forward, one for the
backward, each through the compile ladder; the row says which rung served it, with every
failure's traceback), median of `triton.testing.do_bench` (CUDA events) on a
GPU, of wall-clock repeats on a CPU. Models compile in parallel processes; a file lock makes
their timing phases take turns, so no two time at once. Written to DIR: ``blocks.json`` only.

    python -m onboarding.bench.blocks hf:xlstm hf:mamba2 --proxy small --seq 2048 --out DIR
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

TRACEBACK_CHARS = 12000  # the tail of each traceback kept in the row


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
                out: str, start: str = "default") -> None:
    from onboarding.align.core import as_dtype
    from onboarding.backend import kernel_device
    from onboarding.coverage import build_coverage
    from onboarding.generate.blockcheck import _flat, capture_block_inputs
    from onboarding.generate.inductor import compiled
    from onboarding.generate.tasks import structure_key, task_blocks
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.spec import ModelSpec
    from onboarding.testing.tolerance import rel_rms

    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def save() -> None:
        Path(out).write_text(json.dumps({"model": ref, "rows": rows,
                                         "seconds": round(time.perf_counter() - t0, 1)},
                                        indent=1, default=str))

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
            rows.append(row)  # saved as it goes: the ladder's failures too
            comp = None
            try:
                module = model.get_submodule(b.path)
                args, kwargs = capture_block_inputs(model, info.proxy_config, b.path, batch,
                                                    seq, seed=1)
                eager = module.forward
                c0 = time.perf_counter()
                comp = compiled(module, forward=eager, start=start,
                                on_failure=lambda _rec, row=row: (_ladder(row, comp), save()))

                def fwd(fn):
                    with torch.no_grad():
                        return fn(*args, **kwargs)

                a_g, k_g = _clone(args, True), _clone(kwargs, True)

                def fwd_bwd(fn):
                    outs = [o for o in _flat(fn(*a_g, **k_g))
                            if isinstance(o, torch.Tensor) and o.requires_grad]
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

                got = fwd(comp)
                fwd_bwd(comp)
                ref_out = fwd(eager)  # what is timed must compute the block: the error vs eager
                row["fwd_rel_rms"] = max((rel_rms(g.float(), r.float()) for g, r in
                                          zip(_flat(got), _flat(ref_out))
                                          if isinstance(g, torch.Tensor)
                                          and g.is_floating_point()), default=None)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - c0, 1)
                _ladder(row, comp)
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
                row["traceback"] = traceback.format_exc()[-TRACEBACK_CHARS:]
                if comp is not None:
                    _ladder(row, comp)
            save()  # a model stopped at its timeout keeps the rows it finished
    except Exception as exc:
        rows.append({"model": ref, "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                     "traceback": traceback.format_exc()[-TRACEBACK_CHARS:]})
    save()


def _ladder(row: dict[str, Any], comp: Any) -> None:
    """The compile ladder's record on the row: the rung, a summary, every failure's
    traceback (tail)."""
    from onboarding.generate.inductor import furthest_rung, ladder_summary

    graphs = comp.ladder.graphs
    row["rung"] = furthest_rung(graphs)
    row["ladder"] = ladder_summary(graphs)
    row["graphs"] = [{k: v for k, v in g.items() if k != "failures"}
                     | {"failures": [{**f, "traceback": f["traceback"][-TRACEBACK_CHARS:]}
                                     for f in g["failures"]]} for g in graphs]


def main(argv: list[str] | None = None) -> int:
    from onboarding.generate.inductor import RUNGS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--proxy", default="small", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default=".")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per model")
    ap.add_argument("--start", default="default", choices=RUNGS,
                    help="the compile ladder's first rung (onboarding.generate.inductor)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-blocks-"))  # per-model files and the lock
    ctx = mp.get_context("spawn")
    procs = []
    for ref in a.models:
        f = work / f"blocks_{ref.replace(':', '_').replace('/', '_')}.json"
        p = ctx.Process(target=bench_model, args=(ref, a.proxy, a.batch, a.seq, a.dtype,
                                                  str(work / ".lock"), str(f), a.start))
        p.start()
        procs.append((ref, p, f))
    t0 = time.perf_counter()
    rows = []
    for ref, p, f in procs:
        left = None if a.timeout is None else max(1.0, a.timeout - (time.perf_counter() - t0))
        p.join(left)
        if p.is_alive():
            p.terminate()
            done = json.loads(f.read_text())["rows"] if f.exists() else []
            rows += done + [{"model": ref, "error": f"timeout after {a.timeout:.0f} s"
                             + (f" ({len(done)} block(s) done)" if done else "")}]
        elif f.exists():
            rows += json.loads(f.read_text())["rows"]
        else:
            rows.append({"model": ref, "error": f"exit code {p.exitcode}, no result"})
    (out / "blocks.json").write_text(json.dumps(rows, indent=1, default=str))
    cols = ("model", "block", "kind", "same_as", "compile_s", "rung", "fwd_rel_rms", "eager_fwd_ms",
            "inductor_fwd_ms", "speedup_fwd", "eager_fwdbwd_ms", "inductor_fwdbwd_ms",
            "speedup_fwdbwd", "error")
    print("| " + " | ".join(cols) + " |")
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
