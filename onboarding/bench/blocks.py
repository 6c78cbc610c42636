"""The Inductor fallback against eager, per uncovered block, as `onboard bench` rows.

For each MODEL: parse its proxy (dispatch capture), map it, and for every distinct uncovered
block (blocks of one structure key once; a block inside another uncovered block is timed with
it) capture the block's inputs at (batch, seq) with a forward pre-hook during a forward of the
proxy, and compile the block as the fallback compiles it (`onboarding.generate.inductor.
compiled`: static shapes, one graph for the forward, one for the backward, each through the
compile ladder). Each block is a `BenchCase` of family ``inductor`` timed by the bench harness
(`onboarding.bench.harness.run_cases`): rows ``ours`` (Inductor, forward + backward),
``ours_fwd`` (Inductor, forward), ``eager`` and ``eager_fwd`` (the block's own code), the
ratios eager / Inductor from interleaved rounds in the same run. The case's check is the
compiled block's error against eager (forward output, same dtype; a failed compile fails it,
so the Inductor rows stay untimed with the reason while eager is still timed); it also carries
the ladder's rung and summary. Models compile in parallel processes; a file lock makes their
timing phases take turns, so no two time at once. Every failure's traceback (tail) is kept in
``blocks`` of the result.

    onboard bench --blocks hf:xlstm --blocks hf:mamba2 --proxy small --seq 2048 --out F.json
    python -m onboarding.bench.blocks hf:xlstm hf:mamba2 --proxy small --seq 2048 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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

from onboarding.bench.harness import BenchCase, Timing

TRACEBACK_CHARS = 12000  # the tail of each traceback kept in a block's record


def _clone(x: Any, grad: bool) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(grad and y.is_floating_point())
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v, grad) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v, grad) for k, v in x.items()}
    return x


def cpu_timer(step, n: int = 5) -> Timing:
    """Wall-clock medians for the CPU (tests; timings there mean little)."""
    step(0)
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        step(i)
        ts.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(ts, n=10) if len(ts) > 1 else [ts[0]] * 9
    return Timing(median_ms=statistics.median(ts), p20_ms=q[1], p80_ms=q[7], repeats=n)


def _nbytes(*xs: Any) -> int:
    from onboarding.generate.blockcheck import _flat

    return sum(t.numel() * t.element_size() for x in xs for t in _flat(x)
               if isinstance(t, torch.Tensor))


def _runnable(module: Any, args: tuple, kwargs: dict, rec: dict[str, Any]
              ) -> tuple[Any, tuple, dict]:
    """The block and its inputs as timed: where the block's own forward raises in a 16-bit
    dtype (xLSTM's chunkwise mLSTM multiplies fp32 initial states with bf16 keys), an fp32 copy
    and fp32 inputs, said in the record (``dtype``, ``note``); eager and Inductor alike."""
    from onboarding.generate.blockcheck import _cast

    try:
        with torch.no_grad():
            module(*args, **kwargs)
        return module, args, kwargs
    except Exception as exc:
        if rec["dtype"] in ("fp32", "float32"):
            raise
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        rec["note"] = f"the block's own {rec['dtype']} forward raises " \
            f"{type(exc).__name__}: {lines[-1][:160] if lines else ''}; timed in fp32"
        rec["dtype"] = "fp32"
        return (copy.deepcopy(module).float(), _cast(args, torch.float32),
                _cast(kwargs, torch.float32))


def _ladder(rec: dict[str, Any], comp: Any) -> None:
    """The compile ladder's record: the rung, a summary, every failure's traceback (tail)."""
    from onboarding.generate.inductor import furthest_rung, ladder_summary

    graphs = comp.ladder.graphs
    rec["rung"] = furthest_rung(graphs)
    rec["ladder"] = ladder_summary(graphs)
    rec["graphs"] = [{k: v for k, v in g.items() if k != "failures"}
                     | {"failures": [{**f, "traceback": f["traceback"][-TRACEBACK_CHARS:]}
                                     for f in g["failures"]]} for g in graphs]


def _error(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def split_ref(ref: str) -> tuple[str, list[str]]:
    """``MODEL@PATH[,PATH...]`` -> (MODEL, [PATH, ...]): those blocks, covered or not (a block a
    family serves timed as the fallback would serve it); plain MODEL -> (MODEL, [])."""
    model, at, tail = ref.rpartition("@")
    if not at or not model or "/" in tail:
        return ref, []
    return model, [p.strip() for p in tail.split(",") if p.strip()]


def block_cases(ref: str, proxy: str | None = "small", batch: int = 1, seq: int = 2048,
                dtype: str = "bf16", start: str = "default",
                save: Any = None) -> tuple[list[BenchCase], list[dict[str, Any]]]:
    """The bench cases of ``ref``'s distinct uncovered blocks, compiled (module docstring), and
    a record per block (rung, ladder, tracebacks, notes). ``ref``: a model reference or a run
    directory (its ``model.json``; ``proxy`` None keeps the run's proxy). ``save(records)`` is
    called as records change, so a process stopped at its timeout leaves what it learnt."""
    from onboarding.align.core import as_dtype
    from onboarding.backend import kernel_device
    from onboarding.coverage import build_coverage
    from onboarding.generate.blockcheck import _flat, capture_block_inputs
    from onboarding.generate.inductor import compiled
    from onboarding.generate.tasks import structure_key, task_blocks
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.spec import ModelSpec
    from onboarding.testing.tolerance import layer_tolerance, rel_rms

    save = save or (lambda recs: None)
    cases: list[BenchCase] = []
    recs: list[dict[str, Any]] = []
    ref, paths = split_ref(ref)
    if (Path(ref) / "model.json").is_file():  # a run directory: the model it was made from
        from onboarding.generate.tasks import spec_from_run

        spec = spec_from_run(Path(ref))
        spec = dataclasses.replace(spec, proxy=proxy or spec.proxy)
    else:
        spec = ModelSpec(ref=ref, proxy=proxy or "small")
    proxy = spec.proxy
    info = load_stage(spec.load(), proxy)
    graph = parse_stage(info, batch=1, seq=64, try_export=False)
    picked = [b for b, *_ in task_blocks(graph, build_coverage(graph))] if not paths else \
        [b for b in graph.blocks if b.path in paths]
    missing = sorted(set(paths) - {b.path for b in picked})
    if missing:
        raise ValueError(f"{ref}: no block {', '.join(missing)} in the proxy's op graph")
    outer = [b for b in picked if not any(b.path.startswith(o.path + ".") for o in picked)]
    device = kernel_device()
    model = info.loaded.build(info.proxy_config, seed=0).to(device, as_dtype(dtype)).eval()
    seen: set[str] = set()
    for b in outer:
        key = structure_key(b)
        if key in seen:
            continue
        seen.add(key)
        rec: dict[str, Any] = {"model": ref, "block": b.path, "kind": b.kind,
                               "class": b.class_name, "proxy": proxy, "batch": batch,
                               "seq": seq, "dtype": dtype, "device": str(device),
                               "same_as": sum(structure_key(x) == key for x in outer) - 1}
        recs.append(rec)
        comp = None
        try:
            module = model.get_submodule(b.path)
            args, kwargs = capture_block_inputs(model, info.proxy_config, b.path, batch, seq,
                                                seed=1)
            module, args, kwargs = _runnable(module, args, kwargs, rec)
            eager = module.forward
            a_g, k_g = _clone(args, True), _clone(kwargs, True)

            def fwd(fn, args=args, kwargs=kwargs):
                with torch.no_grad():
                    return fn(*args, **kwargs)

            def fwd_bwd(fn, a_g=a_g, k_g=k_g):
                outs = [o for o in _flat(fn(*a_g, **k_g))
                        if isinstance(o, torch.Tensor) and o.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            steps = {"eager": lambda i, f=eager: fwd_bwd(f),
                     "eager_fwd": lambda i, f=eager: fwd(f)}
            check: dict[str, Any] = {}
            c0 = time.perf_counter()
            try:
                comp = compiled(module, forward=eager, start=start,
                                on_failure=lambda _g, rec=rec: (_ladder(rec, comp), save(recs)))
                got = fwd(comp)
                fwd_bwd(comp)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rec["compile_s"] = round(time.perf_counter() - c0, 1)
                _ladder(rec, comp)
                err = max((rel_rms(g, r) for g, r in zip(_flat(got), _flat(fwd(eager)))
                           if isinstance(g, torch.Tensor) and g.is_floating_point()),
                          default=0.0)
                bar = layer_tolerance(rec["dtype"], b.kind).max_rel_rms
                rec["fwd_rel_rms"] = err
                check = {"ok": int(err <= bar), "fwd_rel_rms": err, "bar": bar,
                         "rung": rec["rung"]}
                steps = {"ours": lambda i, f=comp: fwd_bwd(f),
                         "ours_fwd": lambda i, f=comp: fwd(f), **steps}
            except Exception as exc:  # eager is still timed; the Inductor rows say why not
                rec["error"] = _error(exc)
                rec["traceback"] = traceback.format_exc()[-TRACEBACK_CHARS:]
                if comp is not None:
                    _ladder(rec, comp)
                check = {"error": rec["error"][:200]}
                failing = exc

                def failed(i, exc=failing):
                    raise RuntimeError(f"compile failed: {_error(exc)}")

                steps = {"ours": failed, "ours_fwd": failed, **steps}
            if rec.get("ladder"):
                check["ladder"] = rec["ladder"][:300]
            note = "; ".join(x for x in (rec.get("note", ""), rec.get("ladder", "")) if x)
            shape = {"batch": batch, "seq": seq, "same_as": rec["same_as"]}
            cases.append(BenchCase(
                family="inductor", name=f"{ref}:{b.path}", shape=shape,
                min_bytes=_nbytes(args, kwargs, fwd(eager),
                                  [p for p in module.parameters()]),
                flops=0, setup=lambda device, steps=steps: steps,
                check=lambda device, check=check: check, note=note))
        except Exception as exc:  # the block could not even be set up: its record says why
            rec["error"] = _error(exc)
            rec["traceback"] = traceback.format_exc()[-TRACEBACK_CHARS:]
        save(recs)
    return cases, recs


def _model_worker(ref: str, opts: dict[str, Any], lock: str, out: str) -> None:
    """One model in its own process: compile its blocks, then time them holding the lock."""
    from onboarding.bench.harness import Row, run_cases

    t0 = time.perf_counter()
    state: dict[str, Any] = {"model": ref, "blocks": [], "result": None}

    def save(recs: list[dict[str, Any]] | None = None) -> None:
        if recs is not None:
            state["blocks"] = recs
        state["seconds"] = round(time.perf_counter() - t0, 1)
        Path(out).write_text(json.dumps(state, indent=1, default=str))

    try:
        cases, _ = block_cases(ref, opts["proxy"], opts["batch"], opts["seq"], opts["dtype"],
                               opts["start"], save=save)
        on_gpu = torch.cuda.is_available()
        with open(lock, "w") as fh:  # one model times at a time
            fcntl.flock(fh, fcntl.LOCK_EX)
            kw: dict[str, Any] = {} if on_gpu else {
                "timer": cpu_timer, "round_timer": lambda s: cpu_timer(s, 3).median_ms,
                "graph_timer": None, "ceilings": {"copy_tb_s": 1.0}}
            state["result"] = run_cases(cases, torch.device("cuda" if on_gpu else "cpu"),
                                        log=lambda s: None, **kw)
    except Exception as exc:
        state["error"] = _error(exc)
        state["traceback"] = traceback.format_exc()[-TRACEBACK_CHARS:]
        state["result"] = state["result"] or {"rows": []}
        state["result"]["rows"].append(Row(family="inductor", case=ref, shape={}, impl="setup",
                                           timing=None, status="error",
                                           error=state["error"]).__dict__)
    save()


def bench_blocks(models: list[str], *, proxy: str | None = "small", batch: int = 1, seq: int = 2048,
                 dtype: str = "bf16", start: str = "default", timeout: float | None = None,
                 log: Any = print) -> dict[str, Any]:
    """Every model's uncovered blocks, one process per model (module docstring); the harness's
    result (environment, ceilings, rows) with ``blocks``: each block's record. A model past
    ``timeout`` seconds (from the start) keeps the records it wrote and gets an error row."""
    from dataclasses import asdict

    from onboarding.bench.harness import Row, environment

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-blocks-"))  # per-model files and the lock
    ctx = mp.get_context("spawn")
    opts = {"proxy": proxy, "batch": batch, "seq": seq, "dtype": dtype, "start": start}
    procs = []
    for ref in models:
        f = work / f"{len(procs)}.json"
        p = ctx.Process(target=_model_worker, args=(ref, opts, str(work / ".lock"), str(f)))
        p.start()
        procs.append((ref, p, f))
    rows: list[dict[str, Any]] = []
    blocks: list[dict[str, Any]] = []
    ceilings: dict[str, Any] = {}
    for ref, p, f in procs:
        left = None if timeout is None else max(1.0, timeout - (time.perf_counter() - t0))
        p.join(left)
        alive = p.is_alive()
        if alive:
            p.terminate()
            p.join(5)
        state = json.loads(f.read_text()) if f.exists() else {}
        blocks += state.get("blocks") or []
        res = state.get("result") or {}
        rows += res.get("rows") or []
        ceilings = ceilings or res.get("ceilings") or {}
        if alive or not res:
            why = f"timeout after {timeout:.0f} s" if alive else \
                state.get("error") or f"exit code {p.exitcode}, no result"
            rows.append(asdict(Row(family="inductor", case=ref, shape={}, impl="setup",
                                   timing=None, status="error", error=why)))
            log(f"{ref}: {why}")
    return {"environment": environment(), "ceilings": ceilings, "rows": rows,
            "blocks": blocks, "complete": True,
            "options": {**opts, "models": models, "timeout": timeout,
                        "seconds": round(time.perf_counter() - t0, 1)}}


def summary_table(result: dict[str, Any]) -> str:
    """One line per block: dtype, rung, compile time, error vs eager, eager and Inductor times
    (forward, forward + backward) and the interleaved ratios eager / Inductor."""
    by = {(r["case"], r["impl"]): r for r in result["rows"]}
    cols = ("block", "same as", "dtype", "rung", "compile s", "rel_rms", "eager fwd ms",
            "inductor fwd ms", "fwd ratio", "eager fwd+bwd ms", "inductor fwd+bwd ms",
            "fwd+bwd ratio", "note")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def ms(case: str, impl: str) -> str:
        r = by.get((case, impl))
        return f"{r['timing']['median_ms']:.3f}" if r and r.get("timing") else "-"

    def ratio(case: str, impl: str, anchor: str) -> str:
        r = by.get((case, impl))
        v = (r or {}).get("ratios", {}).get(anchor)
        return f"{v:.2f}x" if v else "-"

    for b in result.get("blocks", []):
        case = f"{b['model']}:{b['block']}"
        note = "; ".join(x for x in (b.get("error", ""), b.get("note", ""),
                                     b.get("ladder", "")) if x)
        err = f"{b['fwd_rel_rms']:.1e}" if b.get("fwd_rel_rms") is not None else "-"
        lines.append("| " + " | ".join(str(x) for x in (
            case, b.get("same_as", ""), b.get("dtype", ""), b.get("rung", "-"),
            b.get("compile_s", "-"), err, ms(case, "eager_fwd"), ms(case, "ours_fwd"),
            ratio(case, "ours_fwd", "eager_fwd"), ms(case, "eager"), ms(case, "ours"),
            ratio(case, "ours", "eager"), note[:300].replace("|", "/"))) + " |")
    for r in result["rows"]:
        if r["impl"] == "setup":
            lines.append(f"| {r['case']} | | | | | | | | | | | | {r['error'][:200]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from onboarding.generate.inductor import RUNGS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--proxy", default="small", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default=".", help="a folder: blocks.json is written there")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds from the start after which models still running are stopped")
    ap.add_argument("--start", default="default", choices=RUNGS,
                    help="the compile ladder's first rung (onboarding.generate.inductor)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = bench_blocks(a.models, proxy=a.proxy, batch=a.batch, seq=a.seq, dtype=a.dtype,
                          start=a.start, timeout=a.timeout)
    (out / "blocks.json").write_text(json.dumps(result, indent=1, default=str))
    print(summary_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
