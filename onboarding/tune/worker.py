"""The tuner's trial worker: a subprocess that checks and times one tile config at a time.

`Worker` (parent side) runs `python -m onboarding.tune.worker` and speaks JSON lines with it.
Importing torch + triton costs seconds, so one child serves many trials; it is killed and
restarted after a timeout or a crash (`WorkerTimeout`, `WorkerDied`), and the study goes on.

A trial has two requests, so that compiling and checking can run in many workers at once while
timing runs alone on the GPU (the parent's `_objective.GpuGate` admits one `time` and no `check`):

- ``check``: load the module, pin the config, compare forward + every gradient with `reference`
  on the family's small `sample_inputs` (fresh random values, in the timing dtype against the
  fp32 reference: `_check_at`, emulated in the interpreter), then build the timing inputs
  (real shapes from ``dims`` on a GPU, see `timing_inputs`) and run one untimed step so that
  the Triton JIT compiles outside the timed region;
- ``time``: the median of forward + backward steps on the prepared inputs, replayed as a CUDA
  graph (``graph``, the default) or timed by CUDA events around launched steps.

``aot`` compiles the module for sm_90 on the host (no GPU), for the AOT gate. ``compile``
(a GPU host, before the check takes its place at the GPU gate) runs the check's and the timing
step's calls with every Triton launch turned into a compile-only warmup, the builds spread over
threads: the check that follows finds them built, so no study waits at the gate behind another
study's compile (`compile_ahead`).
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



class WorkerDied(RuntimeError):
    pass


class WorkerTimeout(RuntimeError):
    pass


class Cancelled(Exception):
    """The tuning run was interrupted (`WorkerPool.cancel`): a study on a thread of its own stops
    without recording its trials in flight."""


class Worker:
    """A long-lived child speaking JSON lines. Kernel prints go to stderr (kept in a temp file
    whose tail explains a crash); the protocol uses a duplicate of the child's original stdout."""

    def __init__(self, *, interpret: bool | None, startup_timeout_s: float):
        self.interpret, self.startup_timeout_s = interpret, startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        from onboarding.families import subprocess_env

        env = subprocess_env()  # the child finds the families this process was given
        if self.interpret is False:
            env.pop("TRITON_INTERPRET", None)  # AOT codegen fails once the interpreter is active
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "onboarding.tune.worker"],
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
        close_all([self])


def close_all(workers: list[Worker]) -> None:
    """Ends the workers' children: every kill first, then every wait, so that the children's
    exits (a CUDA context's teardown on a GPU host) overlap instead of queueing one by one at the
    end of a tuning run whose pool holds a dozen of them."""
    procs = [w.proc for w in workers if w.proc is not None]
    for w in workers:
        w.proc = None
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


class WorkerPool:
    """Idle workers kept for the next study of a tuning run (`search.shared_workers`): each start
    imports torch and, on a GPU, makes a CUDA context, seconds that a study's share of the run's
    budget would otherwise spend on it. On an H100 host the README's main command gave each of
    its 11 studies ~3.6 s of the 40 s budget, and each study started two workers of its own: one
    trial per study, or none (docs/LOG.md, forty-third session, call 5). Workers are kept by the
    interpreter mode they start in; one whose child died or was killed (a timeout) restarts on
    its next call, as within a study."""

    def __init__(self) -> None:
        self._idle: dict[bool | None, list[Worker]] = {}
        self._made: list[Worker] = []  # every worker this pool made, idle or taken
        self._lock = threading.Lock()
        self.started = 0  # workers this pool made (the rest of its takes were reuses)
        # set by `cancel` (an interrupt of the run): the studies that share the pool stop
        self.cancelled = threading.Event()

    def take(self, *, interpret: bool | None, startup_timeout_s: float) -> Worker:
        with self._lock:
            if self.cancelled.is_set():
                raise Cancelled("the tuning run was interrupted")
            idle = self._idle.get(interpret)
            if idle:
                w = idle.pop()
                w.startup_timeout_s = startup_timeout_s
                return w
            self.started += 1
            w = Worker(interpret=interpret, startup_timeout_s=startup_timeout_s)
            self._made.append(w)
        return w

    def cancel(self) -> None:
        """Ends every worker the pool made, taken ones too (their trials in flight die), and
        refuses new takes: an interrupt heard by one thread stops the studies of all the others."""
        with self._lock:
            self.cancelled.set()
            made, self._made, self._idle = self._made, [], {}
        close_all(made)

    def give(self, w: Worker) -> None:
        with self._lock:
            self._idle.setdefault(w.interpret, []).append(w)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = [w for ws in self._idle.values() for w in ws], {}
            self._made = [w for w in self._made if w not in idle]
        close_all(idle)


def worker_main() -> int:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the kernels print goes to stderr, not into the protocol
    # Heavy imports before "ready": they count against the startup timeout, not a trial's.
    import torch  # noqa: F401

    import onboarding.generate.candidates  # noqa: F401
    import onboarding.patching.core  # noqa: F401
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        out = handle(json.loads(line))
        proto.write(json.dumps(out, default=str) + "\n")
        proto.flush()
    return 0


def handle(req: dict[str, Any]) -> dict[str, Any]:
    """Answer one request; an exception becomes an ``error`` result, never a dead worker."""
    ops = {"aot": aot_one, "check": check_one, "compile": compile_ahead, "time": time_prepared,
           "trial": trial_one}
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
    from onboarding.generate.aot import compile_module
    from onboarding.generate.templating import load_module

    mod = load_module(path)
    mod.set_config(config)
    try:
        res = compile_module(mod, dtype=dtype, size=size)
    finally:
        mod.set_config(None)
    return {"ok": True, "kernels": [r.as_dict() for r in res]}


# ---- timing inputs at real shapes -------------------------------------------------------------

def randn(gen, *shape, dtype, scale: float = 1.0):
    """Normal samples made on `gen`'s device in `dtype`, for the families' `timing_inputs`: at
    real shapes an fp32 host copy per worker does not fit (DeepSeek-V3's experts: 30 GB of
    gate_up each, 8 workers OOM-killed)."""
    import torch

    x = torch.randn(shape, generator=gen, device=gen.device, dtype=dtype)
    return x.mul_(scale) if scale != 1.0 else x


def rows(shape: list[int]) -> int:
    """The rows of an input `[..., D]` (every dim but the last; 0 for a 1-D shape), for the
    families' `problem_dims`."""
    return math.prod(shape[:-1]) if len(shape) > 1 else 0


def timing_inputs(family: str, variant: str, params: dict, dims: dict[str, int], dtype,
                  device, gen) -> list:
    """Entry arguments at real shapes for timing, from the family's `timing_inputs` hook;
    InputError naming what is missing."""
    from onboarding.families import families, get_family

    spec = get_family(family)
    if spec.timing_inputs is None:
        known = sorted(n for n, s in families().items() if s.timing_inputs is not None)
        raise InputError(f"tune: no real-shape timing inputs for family {family}; known: {known}")
    need = spec.timing_dims
    missing = [k for k in need if k not in dims]
    if missing:
        raise InputError(f"tune: {family} timing needs dims {list(need)}; missing {missing}")
    # drawn on the device from a seed the host generator gives: nothing big lives on the host
    import torch

    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    dgen = torch.Generator(device=device).manual_seed(seed)
    return spec.timing_inputs(variant, params, dims, dtype, dgen)


def _sampled(path: str, family: str, variant: str, params: dict, shapes: list, seed: int):
    """What `check_one` and `compile_ahead` start from, alike so that the pass builds what the
    check launches: any prepared module released, the module loaded, the kernel device, the
    seeded host generator (the timing inputs draw from it next) and the family's sample inputs
    on that device."""
    import torch

    from onboarding.backend import kernel_device
    from onboarding.families import get_family
    from onboarding.generate.templating import load_module

    _release()
    mod = load_module(path)
    spec = get_family(family)
    if spec.sample_inputs is None:
        raise InputError(f"family {family} declares no sample_inputs")
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a
            for a in spec.sample_inputs(variant, params, shapes, gen)]
    return mod, device, gen, args


# ---- compile ahead ----------------------------------------------------------------------------

@contextlib.contextmanager
def compile_only(threads: int = 1, jit_cls=None):
    """Within it, every `kernel[grid](...)` of a `jit_cls` kernel (Triton's JITFunction) compiles
    its build, if not built yet, and launches nothing: Triton's own warmup path, forced. With
    `threads` > 1 the builds run on that many threads (Triton's AsyncCompileMode, where this
    Triton has it) and are all done when the block ends. Yields a dict whose "calls" counts the
    launches turned into warmups. Kernels write nothing in the block, so whatever the host code
    computes from their outputs there is garbage: run only code whose builds are wanted."""
    from concurrent.futures import ThreadPoolExecutor

    if jit_cls is None:
        from triton.runtime.jit import JITFunction as jit_cls
    seen = {"calls": 0, "threads": 1}
    orig = jit_cls.run

    def run(self, *args, grid, warmup, **kwargs):
        seen["calls"] += 1
        return orig(self, *args, grid=grid, warmup=True, **kwargs)

    mode, pool = contextlib.nullcontext(), None
    if threads > 1:
        try:
            from triton.runtime._async_compile import AsyncCompileMode
        except ImportError:  # an older Triton: the builds run one after another
            AsyncCompileMode = None
        if AsyncCompileMode is not None:
            pool = ThreadPoolExecutor(threads, thread_name_prefix="compile-ahead")
            mode, seen["threads"] = AsyncCompileMode(pool, ignore_errors=True), threads
    jit_cls.run = run
    try:
        with mode:  # its exit waits for the builds submitted
            yield seen
    finally:
        jit_cls.run = orig
        if pool is not None:
            pool.shutdown(wait=True)


def compile_ahead(path: str, config: dict, family: str, variant: str, params: dict,
                  shapes: list, seed: int, dtype: str, dims: dict | None = None,
                  threads: int = 0) -> dict[str, Any]:
    """Build (JIT-compile) the kernels `check_one` and the timing step will launch for `config`,
    launching none of them (`compile_only`): forward + backward on the family's sample inputs
    and on the timing inputs at `dims`, in the tuned dtype. The builds land in this process's
    kernel caches and Triton's cache directory. Not a verdict: whatever fails here (host code
    fed by kernels that did not run, a build that does not compile) is left to the check,
    which meets it again and says why. `threads`: build threads (0: up to 8, the cores')."""
    import torch

    from onboarding.backend import on_gpu
    from onboarding.dtypes import as_dtype
    from onboarding.patching.core import entry_function

    if not on_gpu():  # the interpreter builds nothing (and would run every kernel here)
        return {"ok": True, "stage": "compiled", "calls": 0, "skipped": "no GPU"}
    mod, device, gen, args = _sampled(path, family, variant, params, shapes, seed)
    tdt = as_dtype(dtype)
    # the check's inputs as it makes them: its sample rounded to the tuned dtype, the timing
    # inputs in the dtypes `timing_inputs` gives (a GDN gate or state stays fp32 there: casting
    # it too built other specializations, and the check built two kernels more on an H100)
    sets = [[a.detach().to(tdt) if _is_float(a) else a for a in args]]
    errors: list[str] = []
    t0 = time.monotonic()
    mod.set_config(config)
    try:
        if dims:
            sets.append(timing_inputs(family, variant, params, dims, tdt, device, gen))
        entry = entry_function(mod)
        with compile_only(threads or min(8, os.cpu_count() or 1)) as seen:
            for xs in sets:
                xs = [a.detach().requires_grad_(True) if _is_float(a) else a for a in xs]
                try:  # as `_forward_backward` and `_step`: every float input a leaf
                    ys = _grad_outputs(entry(*xs))
                    leaves = [a for a in xs if _is_float(a)]
                    if ys and leaves:
                        torch.autograd.grad(ys, leaves, [torch.randn_like(y) for y in ys],
                                            allow_unused=True)
                except Exception as e:  # noqa: BLE001 (the check meets it again)
                    errors.append(f"{type(e).__name__}: {e}"[:300])
    finally:
        mod.set_config(None)
        del sets
    out = {"ok": True, "stage": "compiled", "calls": seen["calls"], "threads": seen["threads"],
           "seconds": round(time.monotonic() - t0, 3)}
    if errors:
        out["errors"] = errors
    return out


# ---- check and time ---------------------------------------------------------------------------

_PREPARED: dict[str, Any] = {}  # the checked config's module, entry, inputs and cotangents


def check_one(path: str, config: dict, family: str, variant: str, params: dict,
              shapes: list, seed: int, dtype: str, dims: dict | None = None,
              default: dict | None = None) -> dict[str, Any]:
    """Correctness on sample inputs, then prepare (and JIT-compile) the timing step.
    `default`: the bucket's default config, the yardstick of a 16-bit check (`_check_at`)."""
    import torch

    from onboarding.generate.candidates import _check_one
    from onboarding.patching.core import entry_function

    mod, device, gen, args = _sampled(path, family, variant, params, shapes, seed)
    mod.set_config(config)
    _PREPARED["module"] = mod  # pinned until `time` or the next check releases it
    entry = entry_function(mod)
    on_gpu = device.type == "cuda"
    # The config is checked at the precision it is tuned for (a tf32 dot is right for bf16
    # inputs, not at fp32 tolerance), by the same 16-bit gate on a GPU and in the interpreter.
    # The interpreter's bf16 is broken, so there the kernel computes in fp32 on the 16-bit
    # inputs and its outputs and gradients are rounded to the 16-bit dtype (`_emulated`): the
    # gate's bounds are the tuned dtype's in CI too. fp32 tuning keeps generate's fp32 check.
    from onboarding.dtypes import as_dtype

    gate_dt = as_dtype(dtype)
    tdt = gate_dt if on_gpu else torch.float32  # the timing step's dtype

    @contextlib.contextmanager
    def under_default():
        mod.set_config(default)
        try:
            yield
        finally:
            mod.set_config(config)

    is_default = default is not None and default == {**mod.DEFAULT_CONFIG, **config}
    yardstick = under_default if default is not None and not is_default else None
    checks = _check_at(entry, mod.reference, args, gate_dt, yardstick, is_default,
                       emulate=not on_gpu) if gate_dt != torch.float32 else \
        _check_one(entry, mod.reference, tuple(args), "tune")
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
    out = {"ok": True, "stage": "checked", "checks": len(checks), "timing_shapes": shapes_note}
    if on_gpu:
        torch.cuda.synchronize()
        try:  # usage is a record, not a verdict: a Triton that keeps its builds elsewhere gives none
            out["kernels"] = jit_usage(mod, device)
        except Exception as e:  # noqa: BLE001
            out["kernels_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def jit_kernels(mod):
    """(name, JITFunction) of each Triton kernel the module holds, by itself or inside an
    autotuner / heuristics wrapper (as its `fn`)."""
    import triton

    jit = triton.runtime.jit.JITFunction
    for name, fn in vars(mod).items():
        if not isinstance(fn, jit):
            fn = getattr(fn, "fn", None)
        if isinstance(fn, jit):
            yield name, fn


def jit_usage(mod, device) -> list[dict[str, Any]]:
    """Registers, local memory and shared memory of every build the module's Triton kernels made
    on `device` (this GPU's own builds, the ones that ran), in `aot_one`'s per-kernel form; the
    largest of each when a kernel has several builds. `n_spills` is the driver's local memory per
    thread (spilled registers and any stack), not ptxas's spill count. Empty when this Triton keeps
    its builds where this does not look (`JITFunction.device_caches`)."""
    out: dict[str, dict[str, Any]] = {}
    for name, fn in jit_kernels(mod):
        caches = getattr(fn, "device_caches", None)  # .get: a defaultdict must not make one
        entry = caches.get(device.index or 0) if isinstance(caches, dict) else None
        builds = list(entry[0].values()) if isinstance(entry, tuple) and isinstance(entry[0], dict) else []
        for k in builds:
            regs, spills = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
            shared = getattr(getattr(k, "metadata", None), "shared", None)
            if regs is None:
                continue
            cur = out.setdefault(name, {"kernel": name, "ok": True, "n_regs": 0, "n_spills": 0,
                                        "shared_bytes": 0, "source": "jit"})
            cur["n_regs"] = max(cur["n_regs"], int(regs))
            cur["n_spills"] = max(cur["n_spills"], int(spills or 0))
            cur["shared_bytes"] = max(cur["shared_bytes"], int(shared or 0))
    return list(out.values())


# The 16-bit gate (`_check_at`). Its bound is `tolerance_for(dtype, "reduction")`
# (onboarding/testing/tolerance.py; relative RMS error bf16 1e-2, fp16 2e-3), with atol in units
# of the reference's RMS (`compare_scaled`). Until issue 36 the bucket default passed at rel_rms
# <= atol (bf16 5e-2) and any config within 2x of an off default passed with it, so a kernel
# whose every config was 2%, 5% or 8% off, or had a gradient's sign wrong, passed. Now:
# - the relative-RMS bound holds unless the sample itself is ill-conditioned, which is measured
#   without the kernel: the noise floor (`_noise_floor`) is how far the fp32 reference's result
#   moves when its 16-bit inputs move by about one rounding. The H200 needs this for chunked
#   recurrences: on the tiny GDN / KDA samples every config, the default included, is off by
#   1-5e-2 in bf16 on some seeds, under 2x those samples' floors (1.6-6.4e-2); every other
#   family stays at <= 4.6e-3 bf16 / 8.2e-4 fp16, under the bound (docs/LOG.md, issue 36).
#   A tensor over the bound passes only within NOISE_FACTOR x its floor and, for a config other
#   than the default, only when the default on the same inputs is over the bound too (or not
#   finite) and the config within NO_WORSE_RMS x its error: a config that is wrong where the
#   default is right fails at the documented bound. The floors of those GDN / KDA samples are
#   far above what the kernels reach (3.3e-2 where every config is at <= 5.2e-3), so there
#   the default's own check cannot resolve a kernel-wide error of a few percent.
# - single elements outside the elementwise bound (the RMS within it) pass when the largest
#   error is within NO_WORSE_MAX x the default's on the same inputs: the tiny samples put single
#   bf16 elements 2-3% off in every config. The default itself, the yardstick, is not judged on
#   single elements (the H200 grid at K=64 pruned it on one of 74 dbeta elements: docs/LOG.md,
#   fifth session).
NOISE_FACTOR, NOISE_REPS = 2.0, 8
NO_WORSE_RMS, NO_WORSE_MAX = 2.0, 3.0


def _emulated(entry, tdt):
    """`entry` as a GPU kernel runs at `tdt`, for the CPU (the interpreter cannot compute in
    bf16): the kernel computes in fp32 on the `tdt`-rounded inputs it is given, its outputs are
    rounded to `tdt` (a GPU kernel stores them there), and through that cast its backward gets
    `tdt`-rounded cotangents and its gradients are rounded to the `tdt` leaves."""
    def run(*xs):
        outs = entry(*[x.float() if _is_float(x) else x for x in xs])

        def cast(o):
            return o.to(tdt) if _is_float(o) else o

        return tuple(cast(o) for o in outs) if isinstance(outs, tuple) else cast(outs)

    return run


def _noise_floor(ref, rounded: list, grad_idx: list[int], cot: list, expected: dict, tdt
                 ) -> dict[str, float]:
    """Per output and gradient, the relative RMS change of the fp32 reference when its
    `tdt`-rounded inputs are each multiplied by 1 + eps * u (eps of `tdt`, u uniform in
    [-1/2, 1/2]: about one rounding), as the RMS over NOISE_REPS draws of a fixed seed: how far
    a right `tdt` result can be off on these inputs, whatever the kernel does. One draw alone
    is unsteady on an ill-conditioned sample (GDN's: 5e-3 to 8e-2 for one gradient over 16
    draws, RMS 3-4e-2)."""
    import torch

    from onboarding.testing.tolerance import rel_rms

    eps = torch.finfo(tdt).eps
    dev = next((a.device for a in rounded if _is_float(a)), torch.device("cpu"))
    gen = torch.Generator(device=dev).manual_seed(7)
    sq: dict[str, float] = {}
    for _ in range(NOISE_REPS):
        moved = [a.float() * (1 + eps * (torch.rand(a.shape, generator=gen, device=dev) - 0.5))
                 if _is_float(a) else a for a in rounded]
        outs, grads, _, _ = _forward_backward(ref, moved, grad_idx, cot)
        for name, v in _named(outs, grads).items():
            e = expected.get(name)
            if e is not None and e.is_floating_point() and v.is_floating_point():
                sq[name] = sq.get(name, 0.0) + rel_rms(v, e) ** 2 / NOISE_REPS
    return {name: math.sqrt(v) for name, v in sq.items()}


def _check_at(entry, ref, args: list, tdt, default: Callable[[], Any] | None = None,
              is_default: bool = False, *, emulate: bool = False) -> list[dict[str, Any]]:
    """The kernel in `tdt` against the fp32 reference on the same `tdt`-rounded values: every
    output and input gradient at `tdt`'s "reduction" tolerance, atol in units of the reference's
    RMS (`compare_scaled`: a chunked recurrence's or grouped GEMM's outputs have arbitrary scale,
    and a config that is wrong is off by O(1) of it). The rules are above NOISE_FACTOR.

    `default`: a context manager that runs `entry` under the bucket's default config: the
    yardstick of a tensor that fails (the default's error on the same inputs).
    `is_default`: the config is that default, the yardstick itself: its relative RMS is
    judged (against the bound, or its noise floor), not its single elements.
    `emulate`: run `entry` as `_emulated` (the CPU's way to apply the 16-bit gate)."""
    import torch

    from onboarding.testing.tolerance import compare_scaled, tolerance_for

    tol = tolerance_for(tdt, "reduction")
    bound = tol.max_rel_rms
    run = _emulated(entry, tdt) if emulate else entry
    rounded = [a.detach().to(tdt) if _is_float(a) else a for a in args]
    exps, ref_grads, grad_idx, cot = _forward_backward(
        ref, [a.float() if _is_float(a) else a for a in rounded])
    expected = _named(exps, ref_grads)
    floors: dict[str, float] = {}

    def floor(name: str) -> float:  # measured once, only when a tensor is over the bound
        if not floors:
            floors.update(_noise_floor(ref, rounded, grad_idx, cot, expected, tdt) or {"": 0})
        return floors.get(name, 0.0)

    def judge():
        outs, grads, _, _ = _forward_backward(run, rounded, grad_idx, cot)
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

    def excuse(r, why: str) -> None:
        r.update(passed=True, relative_to_default=True, message=f"{r['name']}: {why}; alone: "
                 f"{r['message']}")

    res = judge()
    failed = [r for r in res.values() if not r["passed"] and "rel_rms" in r]
    if is_default:
        for r in failed:
            e = r["rel_rms"]
            if e <= bound:
                excuse(r, f"the bucket default (the yardstick) within the relative-RMS bound, "
                          f"rel_rms {e:.2e} <= {bound:.1e}; single elements are not judged")
            elif e <= NOISE_FACTOR * floor(r["name"]):
                excuse(r, f"the bucket default (the yardstick) on an ill-conditioned sample: "
                          f"rel_rms {e:.2e} within {NOISE_FACTOR:g}x its noise floor "
                          f"{floor(r['name']):.2e}")
            else:
                r["message"] += f"; the inputs' noise floor {floor(r['name']):.2e}"
        return list(res.values())
    if default is None or not failed:
        return list(res.values())
    with default():  # also for a hard failure: its error tells a wrong config from a wrong kernel
        base = judge()
    for r in failed:
        d = base.get(r["name"], {})
        if "rel_rms" not in d:
            continue
        e, de, m, dm = r["rel_rms"], d["rel_rms"], r["max_abs"], d["max_abs"]
        same = (f"the default config on the same inputs: rel_rms {de:.2e}, max {dm:.2e}")
        if not (math.isfinite(de) and math.isfinite(dm)):  # a broken default: as far off as any
            de = dm = math.inf
        if e <= bound and m <= NO_WORSE_MAX * dm:
            excuse(r, f"single elements no worse than the default config on the same inputs "
                      f"(max {m:.2e} vs {dm:.2e}, within {NO_WORSE_MAX:g}x; rel_rms {e:.2e} "
                      f"<= {bound:.1e})")
        elif e > bound and de > bound and e <= NO_WORSE_RMS * de and m <= NO_WORSE_MAX * dm \
                and e <= NOISE_FACTOR * floor(r["name"]):
            excuse(r, f"an ill-conditioned sample: rel_rms {e:.2e} within {NO_WORSE_RMS:g}x of "
                      f"the default config's {de:.2e} on the same inputs (also over the bound "
                      f"{bound:.1e}) and within {NOISE_FACTOR:g}x the inputs' noise floor "
                      f"{floor(r['name']):.2e}")
        else:
            r["message"] += f"; {same}" + (f"; the inputs' noise floor {floor(r['name']):.2e}"
                                           if e > bound else "")
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


def time_prepared(repeats: int, graph: bool = False) -> dict[str, Any]:
    """Median ms of forward + backward on the prepared inputs: CUDA events on a GPU, wall clock
    (meaningless, kept short) in the interpreter. `graph`: on a GPU, the step replayed as a CUDA
    graph (kernels only: no Python or launch time, which other studies' builds on the host's
    cores move); a step that cannot be captured is timed by events and `graph_error` says why."""
    import statistics

    if "entry" not in _PREPARED:
        raise RuntimeError("time before a successful check")
    entry, xs, cot, device = (_PREPARED[k] for k in ("entry", "xs", "cot", "device"))
    try:
        if device.type == "cuda":
            from onboarding.bench.harness import graph_time, time_fn

            def step(i):
                _step(entry, xs, cot)

            why = None
            if graph:
                try:
                    ms = graph_time(step, repeats=repeats).median_ms
                    return {"ok": True, "stage": "timed", "time_ms": ms, "timing": "cuda-graph"}
                except Exception as e:  # noqa: BLE001 (a host sync, or GPU values steering the host)
                    why = f"{type(e).__name__}: {e}"[:300]
            ms = time_fn(step, warmup=3, repeats=repeats, n_sets=1).median_ms
            out = {"ok": True, "stage": "timed", "time_ms": ms, "timing": "cuda-events"}
            if why:
                out["graph_error"] = why
            return out
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
