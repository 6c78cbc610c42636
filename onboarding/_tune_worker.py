"""The tuner's trial worker: a subprocess that checks and times one tile config at a time.

`Worker` (parent side) runs `python -m onboarding._tune_worker` and speaks JSON lines with it.
Importing torch + triton costs seconds, so one child serves many trials; it is killed and
restarted after a timeout or a crash (`WorkerTimeout`, `WorkerDied`), and the study goes on.

A trial has two requests, so that compiling and checking can run in many workers at once while
timing runs alone on the GPU (the parent's `tune._GpuGate` admits one `time` and no `check`):

- ``check``: load the module, pin the config, compare forward + every gradient with `reference`
  on the family's small `sample_inputs` (fresh random values; on a GPU in the timing dtype
  against the fp32 reference, in the interpreter in fp32), then build the timing inputs
  (real shapes from ``dims`` on a GPU, see `timing_inputs`) and run one untimed step so that
  the Triton JIT compiles outside the timed region;
- ``time``: the median of event-timed forward + backward steps on the prepared inputs.

``aot`` compiles the module for sm_90 on the host (no GPU), for the AOT gate.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from onboarding.errors import InputError

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class WorkerDied(RuntimeError):
    pass


class WorkerTimeout(RuntimeError):
    pass


class Worker:
    """A long-lived child speaking JSON lines. Kernel prints go to stderr (kept in a temp file
    whose tail explains a crash); the protocol uses a duplicate of the child's original stdout."""

    def __init__(self, *, interpret: bool | None, startup_timeout_s: float):
        self.interpret, self.startup_timeout_s = interpret, startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = dict(os.environ)
        if self.interpret is False:
            env.pop("TRITON_INTERPRET", None)  # AOT codegen fails once the interpreter is active
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "onboarding._tune_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()
        self._read(self.startup_timeout_s)  # the "ready" line

    @staticmethod
    def _pump(proc: subprocess.Popen, q: queue.Queue) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            q.put(line)
        q.put(None)

    def _read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise WorkerTimeout(f"no answer within {timeout:g} s") from None
        if line is None:
            self.proc.wait()  # type: ignore[union-attr]
            rc = self.proc.returncode  # type: ignore[union-attr]
            self.err.seek(0)
            tail = self.err.read()[-1500:]
            self.proc = None
            raise WorkerDied(f"worker exited with rc={rc}: {tail.strip()[-800:]}")
        return json.loads(line)

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read(timeout)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def worker_main() -> int:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the kernels print goes to stderr, not into the protocol
    # Heavy imports before "ready": they count against the startup timeout, not a trial's.
    import torch  # noqa: F401

    import onboarding.generate  # noqa: F401
    import onboarding.patching  # noqa: F401
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        out = handle(json.loads(line))
        proto.write(json.dumps(out, default=str) + "\n")
        proto.flush()
    return 0


def handle(req: dict[str, Any]) -> dict[str, Any]:
    """Answer one request; an exception becomes an ``error`` result, never a dead worker."""
    ops = {"aot": aot_one, "check": check_one, "time": time_prepared, "trial": trial_one}
    try:
        return ops[req["op"]](**req.get("args", {}))
    except Exception as e:
        _PREPARED.clear()
        why = f"{type(e).__name__}: {e}"[:1500]
        if type(e).__name__ == "OutOfMemoryError":  # torch's; torch is imported lazily here
            why = ("out of GPU memory: every worker keeps its timing inputs and gradients on the "
                   "GPU between check and timing; rerun with fewer --workers. " + why)[:1500]
        return {"ok": False, "stage": "error", "reason": why}


def aot_one(path: str, config: dict, dtype: str, size: int) -> dict[str, Any]:
    from onboarding.aot import compile_module
    from onboarding.templating import load_module

    mod = load_module(path)
    mod.set_config(config)
    try:
        res = compile_module(mod, dtype=dtype, size=size)
    finally:
        mod.set_config(None)
    return {"ok": True, "kernels": [r.as_dict() for r in res]}


# ---- timing inputs at real shapes -------------------------------------------------------------

def _randn(gen, *shape, dtype, scale: float = 1.0):
    """Normal samples made on `gen`'s device in `dtype`: at real shapes an fp32 host copy per
    worker does not fit (DeepSeek-V3's experts: 30 GB of gate_up each, 8 workers OOM-killed)."""
    import torch

    x = torch.randn(shape, generator=gen, device=gen.device, dtype=dtype)
    return x.mul_(scale) if scale != 1.0 else x


def _moe_experts(dims: dict[str, int], dtype, gen, variant: str) -> list:
    """x [N, D], top-k indices of E experts with weights, gate_up [E, 2F, D] (`mlp`: up
    [E, F, D]), down [E, D, F]."""
    import torch

    n, d, e, k, f = (int(dims[x]) for x in ("N", "D", "E", "TOPK", "F"))
    x = _randn(gen, n, d, dtype=dtype)
    # balanced on average
    idx = torch.rand(n, e, generator=gen, device=gen.device).topk(k, dim=-1).indices
    w = torch.rand(n, k, generator=gen, device=gen.device).to(dtype)
    gate_up = _randn(gen, e, f if variant == "mlp" else 2 * f, d, dtype=dtype, scale=d ** -0.5)
    down = _randn(gen, e, d, f, dtype=dtype, scale=f ** -0.5)
    return [x, idx, w, gate_up, down]


def _grouped_linear(dims: dict[str, int], dtype, gen) -> list:
    """x [S, K] sorted by expert, counts [E] of a uniform split of the S rows, weight [E, N, K]."""
    import torch

    s, k, n, e = (int(dims[x]) for x in ("S", "K", "N", "E"))
    picks = torch.randint(0, e, (s,), generator=gen, device=gen.device)
    counts = torch.bincount(picks, minlength=e)
    return [_randn(gen, s, k, dtype=dtype), counts, _randn(gen, e, n, k, dtype=dtype, scale=k ** -0.5)]


def _delta_rule(dims: dict[str, int], dtype, gen, per_channel: bool) -> list:
    """q, k [B, T, HK, K], v [B, T, HV, V], fp32 log decay g [B, T, HV(, K)], beta [B, T, HV]."""
    import torch
    from torch.nn import functional as F

    b, t, hk = int(dims["B"]), int(dims["T"]), int(dims["HK"])
    hv, kd = int(dims.get("HV", hk)), int(dims["K"])
    vd = int(dims.get("V", kd))
    q, k = (_randn(gen, b, t, hk, kd, dtype=dtype) for _ in range(2))
    v = _randn(gen, b, t, hv, vd, dtype=dtype)
    # the models compute the log decay in fp32
    g = F.logsigmoid(_randn(gen, *((b, t, hv, kd) if per_channel else (b, t, hv)), dtype=torch.float32) + 3)
    beta = torch.sigmoid(_randn(gen, b, t, hv, dtype=torch.float32)).to(dtype)
    return [q, k, v, g, beta, None, None, False]  # training needs o only


def _rows(dims: dict[str, int], dtype, gen, family: str, variant: str, params: dict) -> list:
    n = int(dims["N"])
    if family == "swiglu":
        f = int(dims["F"])
        if variant == "fused":
            return [_randn(gen, n, 2 * f, dtype=dtype)]
        return [_randn(gen, n, f, dtype=dtype) for _ in range(2)]
    d = int(dims["D"])
    args = [_randn(gen, n, d, dtype=dtype)]
    if family == "layernorm":
        args.append(_randn(gen, d, dtype=dtype, scale=0.1).add_(1))
        if params.get("has_bias"):
            args.append(_randn(gen, d, dtype=dtype, scale=0.1))
        return [*args, params.get("eps", 1e-5)]
    if variant == "gated":
        args.append(_randn(gen, n, d, dtype=dtype))
    if variant != "l2norm" and params.get("has_weight", True):
        args.append(_randn(gen, d, dtype=dtype, scale=0.1).add_(1))
    return [*args, params.get("eps", 1e-6)]


TIMING_DIMS = {  # dims each family's timing inputs need (the bucketed one may come from size)
    "moe_experts": ("N", "D", "E", "TOPK", "F"),
    "grouped_linear": ("S", "K", "N", "E"),
    "gated_delta": ("B", "T", "HK", "K"),
    "kimi_delta": ("B", "T", "HK", "K"),
    "rmsnorm": ("N", "D"),
    "layernorm": ("N", "D"),
    "swiglu": ("N", "F"),
}


def timing_inputs(family: str, variant: str, params: dict, dims: dict[str, int], dtype,
                  device, gen) -> list:
    """Entry arguments at real shapes for timing; InputError naming what is missing."""
    need = TIMING_DIMS.get(family)
    if need is None:
        raise InputError(f"tune: no real-shape timing inputs for family {family}; known: "
                         f"{sorted(TIMING_DIMS)}")
    missing = [k for k in need if k not in dims]
    if missing:
        raise InputError(f"tune: {family} timing needs dims {list(need)}; missing {missing}")
    # drawn on the device from a seed the host generator gives: nothing big lives on the host
    import torch

    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    dgen = torch.Generator(device=device).manual_seed(seed)
    if family == "moe_experts":
        return _moe_experts(dims, dtype, dgen, variant)
    if family == "grouped_linear":
        return _grouped_linear(dims, dtype, dgen)
    if family in ("gated_delta", "kimi_delta"):
        return _delta_rule(dims, dtype, dgen, per_channel=family == "kimi_delta")
    return _rows(dims, dtype, dgen, family, variant, params)


# ---- check and time ---------------------------------------------------------------------------

_PREPARED: dict[str, Any] = {}  # the checked config's module, entry, inputs and cotangents


def check_one(path: str, config: dict, family: str, variant: str, params: dict,
              shapes: list, seed: int, dtype: str, dims: dict | None = None,
              default: dict | None = None) -> dict[str, Any]:
    """Correctness on sample inputs, then prepare (and JIT-compile) the timing step.
    `default`: the bucket's default config, the yardstick of a 16-bit check (`_check_at`)."""
    import torch

    from onboarding.backend import kernel_device
    from onboarding.generate import _check_one
    from onboarding.patching import entry_function
    from onboarding.templating import get_family, load_module

    _release()
    mod = load_module(path)
    spec = get_family(family)
    if spec.sample_inputs is None:
        raise InputError(f"family {family} declares no sample_inputs")
    device = kernel_device()
    mod.set_config(config)
    _PREPARED["module"] = mod  # pinned until `time` or the next check releases it
    gen = torch.Generator().manual_seed(seed)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a
            for a in spec.sample_inputs(variant, params, shapes, gen)]
    entry = entry_function(mod)
    on_gpu = device.type == "cuda"
    tdt = getattr(torch, _TORCH_DTYPES.get(dtype, "float32")) if on_gpu else torch.float32
    # On a GPU the config is checked at the precision it is tuned for (a tf32 dot is right for
    # bf16 inputs, not at fp32 tolerance); the interpreter's bf16 is broken, so fp32 there.
    @contextlib.contextmanager
    def under_default():
        mod.set_config(default)
        try:
            yield
        finally:
            mod.set_config(config)

    is_default = default is not None and default == {**mod.DEFAULT_CONFIG, **config}
    yardstick = under_default if default is not None and not is_default else None
    checks = _check_at(entry, mod.reference, args, tdt, yardstick, is_default) \
        if on_gpu and tdt != torch.float32 else _check_one(entry, mod.reference, tuple(args), "tune")
    bad = [c for c in checks if not c["passed"]]
    if not checks or bad:
        _release()
        why = "; ".join(f"{c['name']}: {c.get('message', '')}"[:200] for c in bad) or "no checks"
        return {"ok": False, "stage": "correctness", "reason": why, "checks": checks}
    if on_gpu and dims:
        xs, shapes_note = timing_inputs(family, variant, params, dims, tdt, device, gen), "dims"
    else:  # the interpreter: keep the small sample shapes (its timings mean nothing anyway)
        xs, shapes_note = [a.detach().to(tdt) if isinstance(a, torch.Tensor) and
                           a.is_floating_point() else a for a in args], "sample"
    xs = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and
          a.is_floating_point() else a for a in xs]
    outs = _grad_outputs(entry(*xs))
    cot = [torch.randn_like(o) for o in outs]
    _PREPARED.update(entry=entry, xs=xs, cot=cot, device=device)
    _step(entry, xs, cot)  # compile the timed shapes outside the timed region
    if on_gpu:
        torch.cuda.synchronize()
    return {"ok": True, "stage": "checked", "checks": len(checks), "timing_shapes": shapes_note}


# A 16-bit result outside the family's bound still passes when the bucket's default config, run
# on the same inputs, is nearly as far off: tile configs only reorder the same arithmetic, so a
# config is wrong when it is much worse than the default, not when the sample is ill-conditioned
# (tiny sample shapes of a chunked recurrence put single bf16 elements 2-3% off in every config).
NO_WORSE_RMS, NO_WORSE_MAX = 2.0, 3.0


def _check_at(entry, ref, args: list, tdt, default: Callable[[], Any] | None = None,
              is_default: bool = False) -> list[dict[str, Any]]:
    """The kernel in `tdt` against the fp32 reference on the same `tdt`-rounded values: every
    output and input gradient at `tdt`'s "reduction" tolerance, atol in units of the reference's
    RMS (`compare_scaled`: a chunked recurrence's or grouped GEMM's outputs have arbitrary scale,
    and a config that is wrong is off by O(1) of it).

    `default`: a context manager that runs `entry` under the bucket's default config. Given, a
    tensor that fails its bound is re-judged against the default's error on the same inputs
    (within NO_WORSE_RMS x its relative RMS and NO_WORSE_MAX x its largest error).
    `is_default`: the config is that default, the yardstick itself: only its RMS error is
    judged, not single elements. Without this the H200 grid at K=64 pruned the bucket default
    on one of 74 dbeta elements (docs/LOG.md, fifth session)."""
    import torch

    from onboarding.testing.tolerance import compare_scaled, tolerance_for

    tol = tolerance_for(tdt, "reduction")
    rounded = [a.detach().to(tdt) if _is_float(a) else a for a in args]
    exps, ref_grads, grad_idx, cot = _forward_backward(
        ref, [a.float() if _is_float(a) else a for a in rounded])
    expected = _named(exps, ref_grads)

    def judge():
        outs, grads, _, _ = _forward_backward(entry, rounded, grad_idx, cot)
        got = _named(outs, grads)
        res = {}
        for name, e in expected.items():
            o = got.get(name)
            if o is None:
                res[name] = {"name": name, "passed": False, "message": "missing on the kernel side"}
            elif not o.is_floating_point():
                res[name] = {"name": name, "passed": torch.equal(o, e),
                             "message": "integer output differs"}
            else:
                res[name] = compare_scaled(o.float(), e.float(), tol, name).as_dict()
        for name in got.keys() - expected.keys():  # a gradient only the kernel returns
            res[name] = {"name": name, "passed": False, "message": "missing on the reference side"}
        return res

    res = judge()
    if is_default:
        # compare_scaled's atol is in units of the expected RMS: an RMS floor like max_rel_rms
        rms_bound = max(tol.max_rel_rms, tol.atol)
        for name, r in res.items():
            if not r["passed"] and r.get("rel_rms", math.inf) <= rms_bound:
                r.update(passed=True, relative_to_default=True, message=(
                    f"{name}: the bucket default (the yardstick) within the RMS bound, rel_rms "
                    f"{r['rel_rms']:.2e} <= {rms_bound:.1e}; single elements: {r['message']}"))
        return list(res.values())
    if default is None or all(r["passed"] for r in res.values()):
        return list(res.values())
    with default():
        base = judge()
    for name, r in res.items():
        d = base[name]
        if r["passed"] or "rel_rms" not in r or "rel_rms" not in d:
            continue
        if (r["rel_rms"] <= max(tol.max_rel_rms, NO_WORSE_RMS * d["rel_rms"])
                and r["max_abs"] <= NO_WORSE_MAX * d["max_abs"]):
            r.update(passed=True, relative_to_default=True, message=(
                f"{name}: no worse than the default config on the same inputs (rel_rms "
                f"{r['rel_rms']:.2e} vs {d['rel_rms']:.2e}, max {r['max_abs']:.2e} vs "
                f"{d['max_abs']:.2e}); alone: {r['message']}"))
        else:
            r["message"] += (f"; the default config on the same inputs: rel_rms "
                             f"{d['rel_rms']:.2e}, max {d['max_abs']:.2e}")
    return list(res.values())


def _is_float(a) -> bool:
    import torch

    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _forward_backward(fn, args: list, grad_idx: list[int] | None = None,
                      cot: list | None = None) -> tuple[list, list, list[int], list]:
    """Outputs and input gradients of `fn` on fresh leaves of `args`, back-propagating
    cotangents `cot` from outputs `grad_idx`. None: from every differentiable output, with
    cotangents drawn from a fixed seed (the reference's call; the kernel's reuses them)."""
    import torch

    leaves = [a.clone().requires_grad_(True) if _is_float(a) else a for a in args]
    outs = fn(*leaves)
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
    if grad_idx is None:
        grad_idx = [i for i, o in enumerate(outs) if o.requires_grad]
        gen = torch.Generator(device=outs[0].device if outs else "cpu").manual_seed(1)
        cot = [torch.randn(outs[i].shape, device=outs[i].device, generator=gen) for i in grad_idx]
    live = [j for j, i in enumerate(grad_idx) if i < len(outs) and outs[i].requires_grad]
    if live:
        torch.autograd.backward([outs[grad_idx[j]] for j in live],
                                [cot[j].to(outs[grad_idx[j]].dtype) for j in live])
    grads = [a.grad if _is_float(a) else None for a in leaves]
    return outs, grads, grad_idx, cot


def _named(outs: list, grads: list) -> dict[str, Any]:
    named = {f"tune.out{i}": o for i, o in enumerate(outs)}
    named.update({f"tune.grad{i}": g for i, g in enumerate(grads) if g is not None})
    return named


def _grad_outputs(out) -> list:
    import torch

    return [o for o in (out if isinstance(out, tuple) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]


def _step(entry, xs: list, cot: list) -> None:
    """Forward + backward. Gradients come back from `autograd.grad`, so a step does not also
    pay for accumulating them into `.grad` (as the benchmark harness does)."""
    import torch

    ys = _grad_outputs(entry(*xs))
    leaves = [a for a in xs if isinstance(a, torch.Tensor) and a.requires_grad]
    if ys and leaves:
        torch.autograd.grad(ys, leaves, cot[: len(ys)], allow_unused=True)


def time_prepared(repeats: int) -> dict[str, Any]:
    """Median ms of forward + backward on the prepared inputs: CUDA events on a GPU, wall clock
    (meaningless, kept short) in the interpreter."""
    import statistics

    if "entry" not in _PREPARED:
        raise RuntimeError("time before a successful check")
    entry, xs, cot, device = (_PREPARED[k] for k in ("entry", "xs", "cot", "device"))
    try:
        if device.type == "cuda":
            from onboarding.bench.harness import time_fn

            ms = time_fn(lambda i: _step(entry, xs, cot), warmup=3, repeats=repeats,
                         n_sets=1).median_ms
            return {"ok": True, "stage": "timed", "time_ms": ms, "timing": "cuda-events"}
        times = []
        for _ in range(min(repeats, 2)):
            t0 = time.perf_counter()
            _step(entry, xs, cot)
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ok": True, "stage": "timed", "time_ms": statistics.median(times),
                "timing": "cpu-wallclock"}
    finally:
        _release()


def _release() -> None:
    mod = _PREPARED.get("module")
    if mod is not None:
        mod.set_config(None)
    _PREPARED.clear()


def trial_one(repeats: int, **check_args) -> dict[str, Any]:
    """check + time in one request (in-process trials)."""
    res = check_one(**check_args)
    if not res["ok"]:
        return res
    return {**time_prepared(repeats), "checks": res["checks"],
            "timing_shapes": res["timing_shapes"]}


if __name__ == "__main__":
    sys.exit(worker_main())
